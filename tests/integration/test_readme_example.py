"""The README's Python API example runs as written (on a tiny model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(
    r"<!-- api-example -->\s*```python\n(?P<code>.*?)```\s*<!-- /api-example -->", re.DOTALL
)


def api_example() -> tuple[str, str]:
    """The example's code and where it came from: README.md once it holds the markers."""
    for path in (REPO / "README.md", REPO / "docs" / "api_example.md"):
        if path.is_file() and (match := BLOCK.search(path.read_text(encoding="utf-8"))):
            return match["code"], path.name
    pytest.fail("no api-example block in README.md or docs/api_example.md")


def test_readme_api_example_runs(tiny_dirs, monkeypatch, capsys) -> None:
    code, source = api_example()
    monkeypatch.setenv("KVREPLAY_EXAMPLE_MODEL", str(tiny_dirs["gemma3"]))
    exec(compile(code, f"{source}:api-example", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert "suffixes match:" in printed
    assert "transplant recovers live: True" in printed
