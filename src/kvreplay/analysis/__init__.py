"""Ledger analysis: read the paper-named CSVs as their tables (``ledgers``) and compute
the paper's claims (``claims.py``) from each experiment's section (``sections/``). It sits
above experiments (whose tables and sections it reads) and below report; its statistics
live in :mod:`kvreplay.measure`."""
