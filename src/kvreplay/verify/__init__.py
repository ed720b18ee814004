"""What a user gates on and what proves a run: the check (its verdict at two levels, with
its power) and the audit that re-executes a run folder."""
