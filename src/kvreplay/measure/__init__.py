"""The statistics every layer above computes with: intervals and exact tests
(``stats``), rates as claims.json states them (``rates``) and the resample
equivalence certificate with its TV distance (``certificate``). Pure numbers: no ledger,
no experiment, no report is imported here, so experiments, analysis and report all stand
on it without an arrow back up."""
