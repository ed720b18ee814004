"""A pytest helper for other projects' suites: run ``kvreplay check`` in the test's own
process and fail the test with the verdict sentence when the expectation does not hold.

    from kvreplay.testing import assert_check_holds

    def test_prefix_cache_hit_is_exact(tmp_path):
        assert_check_holds("--dtypes", "fp32", out=tmp_path / "check")

The arguments are ``kvreplay check``'s own (see ``kvreplay check --help``).
"""

from __future__ import annotations

from pathlib import Path

from kvreplay.harness.gate import Judged
from kvreplay.run.check import run_check


def check(*args: str, out: Path | str | None = None, quiet: bool = True) -> Judged:
    """Run ``kvreplay check ARGS`` here and return its verdict with its sentence
    (``.verdict``: the live vs prefill verdict, or with ``--trainer`` the mismatch
    verdict; a refusal raises :class:`~kvreplay.core.errors.KvreplayError` or click's
    usage error)."""
    from kvreplay.cli import check_request, main

    command = main.get_command(None, "check")  # type: ignore[arg-type]
    arguments = [str(a) for a in args] + (["--out", str(out)] if out is not None else [])
    with main.make_context("kvreplay", ["check"]) as parent:
        context = command.make_context("check", arguments, parent=parent)
    echo = (lambda _: None) if quiet else print
    return run_check(check_request(context.params), echo)


def assert_check_holds(*args: str, out: Path | str | None = None) -> Judged:
    """Run the check; fail the calling test with its verdict sentence unless it holds."""
    import pytest

    judged = check(*args, out=out)
    if not judged.holds:
        pytest.fail(judged.sentence, pytrace=False)
    return judged
