"""Silence transformers before kvreplay loads or converts a model through it: a model
load and an embedded model's one-time conversion both call this one function."""

from __future__ import annotations


def quiet_transformers() -> None:
    """Progress bars and load warnings would drown the run's own progress output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
