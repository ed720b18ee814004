"""A run and its ledger: the runner that plans and executes units, its configuration, the
hash-chained rows.jsonl and its one-writer lock, worker threads, the recorded
environment and the locks it is rebuilt from, the derived CSVs, the rows' consistency
checks, and the run summary."""
