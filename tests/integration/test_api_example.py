"""The Python API example of docs/python-api.md runs as written (on a tiny model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
BLOCK = re.compile(
    r"<!-- api-example -->\s*```python\n(?P<code>.*?)```\s*<!-- /api-example -->", re.DOTALL
)


def api_example() -> str:
    """The example's code, between the page's api-example markers."""
    match = BLOCK.search(PAGE.read_text(encoding="utf-8"))
    if match is None:
        pytest.fail(f"no api-example block in {PAGE}")
    return match["code"]


def test_api_example_runs(tiny_dirs, monkeypatch, capsys) -> None:
    code = api_example()
    monkeypatch.setenv("KVREPLAY_EXAMPLE_MODEL", str(tiny_dirs["gemma3"]))
    exec(compile(code, "python-api.md:api-example", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert "suffixes match:" in printed
    assert "transplant recovers live: True" in printed
