"""Markdown and self-contained HTML report of a run, set beside the paper's figures.

The report is built from the run's ledgers and claims alone, so it works on a kvreplay
run directory and on a bare folder of CSVs (such as the paper's release) alike. Figures
are drawn with matplotlib's Agg renderer and embedded in the HTML as base64 PNG, so the
page needs no network and no scripts.

One concept a module: build (the report's files), sections (the run's facts, the
headline and each analysis section's blocks, in reading order), commands (the ``analyze``
and ``report`` click commands). The blocks and figures it is made of live below, in
:mod:`kvreplay.render`; only figures loads matplotlib, and only ``build`` imports it:
callers import ``build`` when a report is asked for.
"""
