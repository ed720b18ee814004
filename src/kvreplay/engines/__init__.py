"""Engines run units of work and yield their rows in the order given."""
