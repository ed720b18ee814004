"""The four-arm matrix that matched and fixed-prefix share: its panel (``panel``: the
left arm, prefill, and a replica of each), its CSVs (``table``: matched_live_prefill.csv,
its served form, fixed_prefix_2x2.csv) and its section of the analysis and report
(``section``). Each experiment is a package of its own that declares itself with these."""
