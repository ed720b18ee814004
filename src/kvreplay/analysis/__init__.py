"""Ledger analysis: read the paper-named CSVs as their tables and compute the paper's
claims (``claims.py``), each experiment's section from its own module (``sections/``)."""
