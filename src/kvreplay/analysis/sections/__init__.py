"""Each experiment's section of the analysis (design: experiments): what its ledgers add
to claims.json, the ``analyze`` summary and the report, one module an experiment; the
registry (``registry.py``) puts them in reading order. No torch, no matplotlib: a
section draws its figures through the report's ``Figures``."""
