"""The audit's check that the files a run writes in one exact form still have it, byte
for byte, and are files: ``manifest.json`` as the ledger writes its content,
``items.jsonl`` one line per item as a run freezes them. Their readers accept more (a
byte-order mark, CRLF line endings, other spacing), so a byte-only change would
otherwise pass unnamed. The other files are held to their bytes where they are read:
each row of ``rows.jsonl`` by the ledger's reader, the CSVs, claims, report and figures
by their re-derivation."""

from __future__ import annotations

from kvreplay.core.items import Item, frozen_text
from kvreplay.core.paths import read_regular
from kvreplay.ledger import ITEMS, MANIFEST, RunLedger, manifest_bytes

DIFFERS = (
    "differs byte for byte from what a run writes for its content (a byte-order mark, "
    "CRLF line endings or other spacing)"
)


def byte_problems(ledger: RunLedger, items: list[Item] | None) -> list[str]:
    """manifest.json against its content as the ledger writes it, items.jsonl against
    the items it holds (``items``: as read from it, None when unreadable), and no
    symbolic link anywhere in the folder (a run writes files: a link's target is no
    file of the run, and may be none at all)."""
    problems = [
        f"{path.relative_to(ledger.run_dir)}: a symbolic link, which no run writes"
        for folder in (ledger.run_dir, ledger.run_dir / "snapshots", ledger.run_dir / "figures")
        if folder.is_dir() and not folder.is_symlink()
        for path in sorted(folder.iterdir())
        if path.is_symlink()
    ]
    files = [(MANIFEST, manifest_bytes(ledger.manifest))]
    if items is not None:
        files.append((ITEMS, frozen_text(items).encode("utf-8")))
    for name, expected in files:
        try:
            held = read_regular(ledger.run_dir / name)
        except OSError:
            continue  # named where it is read
        if held != expected:
            problems.append(f"{name}: {DIFFERS}")
    return problems
