"""The docs site without MkDocs: every page is in mkdocs.yml's nav and every nav entry is a
page, the generated blocks (CSV columns, backends, options) say what the code declares
now, and every repository file a page links exists. ``make docs`` checks the same and
more (links, anchors) with a strict build; these run in the fast suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _hooks() -> Any:
    spec = importlib.util.spec_from_file_location(
        "kvreplay_docs", DOCS / "_hooks" / "kvreplay_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()
PAGES = sorted(
    p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_hooks" not in p.parts
)


def _nav_pages(entries: list[Any]) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_and_every_entry_is_a_page() -> None:
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    assert sorted(nav) == PAGES
    assert len(set(nav)) == len(nav)


@pytest.mark.parametrize("page", PAGES)
def test_generated_blocks_match_the_code(page: str) -> None:
    stale = HOOKS.stale_blocks((DOCS / page).read_text(encoding="utf-8"))
    assert not stale, f"{page}: {stale} differ; run python docs/_hooks/kvreplay_docs.py --write"


def test_generated_blocks_cover_every_experiment_and_backend() -> None:
    from kvreplay.backends import BACKENDS
    from kvreplay.experiments.registry import experiment_tables

    text = "".join((DOCS / page).read_text(encoding="utf-8") for page in PAGES)
    specs = {m["spec"] for m in HOOKS.GENERATED.finditer(text)}
    for name, (_, served) in experiment_tables().items():
        assert {f"columns {name}", f"options {name}"} <= specs
        assert (f"columns {name} served" in specs) == (served is not None)
    assert {f"settings {name}" for name in BACKENDS.names()} <= specs


def test_a_changed_declaration_makes_its_block_stale() -> None:
    page = (DOCS / "experiments" / "matched.md").read_text(encoding="utf-8")
    edited = page.replace("| `prefix_sha256` | sha256 |", "| `prefix_sha256` | text |", 1)
    assert edited != page
    assert HOOKS.stale_blocks(edited) == ["columns matched"]
    assert HOOKS.refresh_blocks(edited) == page


@pytest.mark.parametrize("page", PAGES)
def test_repository_links_name_files_that_exist(page: str) -> None:
    links = HOOKS.repository_links(page, (DOCS / page).read_text(encoding="utf-8"))
    missing = [path for _, path in links if not (REPO / path).is_file()]
    assert not missing, f"{page} links {missing}"
