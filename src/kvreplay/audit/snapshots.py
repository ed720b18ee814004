"""Snapshots a run saved (``--save-snapshots``): each row's snapshot files read from their
bytes and held to what the row records, the model's cache layout and every other row's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.core.errors import KvreplayError
from kvreplay.ledger import Record
from kvreplay.model.identity import file_digests

if TYPE_CHECKING:
    from kvreplay.model.state import SavedState, SnapshotContents

Layout = tuple[list[str], list[int]]


def row_snapshots(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(arm name, arm record, snapshot entry) of every arm and seeded sample of a row:
    where a run records snapshots (a snapshot named anywhere else names no file this
    run wrote, and check_files says so)."""
    arms = data.get("arms")
    samples = data.get("samples")
    found = [
        (name, arm, arm["snapshot"])
        for name, arm in (arms.items() if isinstance(arms, dict) else ())
        if isinstance(arm, dict) and isinstance(arm.get("snapshot"), dict)
    ]
    for name, seeds in samples.items() if isinstance(samples, dict) else ():
        found += [
            (name, arm, arm["snapshot"])
            for arm in (seeds if isinstance(seeds, list) else ())
            if isinstance(arm, dict) and isinstance(arm.get("snapshot"), dict)
        ]
    return found


def _neutral_lengths(lengths: list[int], tokens: int, layers: int) -> list[int]:
    """The lengths a snapshot's layers may have where the backend cannot say: the
    model's layer count, none past the prefix (a sliding layer may hold fewer), the
    longest over all of it. Its own lengths where they are such, else the prefix's."""
    fits = (
        len(lengths) == layers
        and all(isinstance(n, int) and 0 <= n <= tokens for n in lengths)
        and max(lengths, default=0) == tokens
    )
    return lengths if fits else [tokens] * layers


class SnapshotCheck:
    """Every snapshot a row names, a row at a time: inside the run's snapshots/ folder,
    its bytes' sha256, the fingerprints of the tensors it holds (computed, not read from
    its metadata) against the row's, and everything else it holds against the row and
    the run: exactly the tensors and metadata a snapshot has for a model of ``layers``
    layers, the arm's construction, the row and arm it was saved for, the prefix's token
    ids, and its cache layout: ``layout(tokens)`` where the backend can say it from the
    model's config, else one layout for every snapshot of a precision, no layer past
    the prefix and the longest over all of it."""

    def __init__(self, run_dir: Path, layout: Callable[[int], Layout | None], layers: int):
        self.run_dir, self.layout, self.layers = run_dir, layout, layers
        self.folder = (run_dir / "snapshots").resolve()
        self.seen: dict[Any, str] = {}  # each precision's layer kinds (JSON), where no layout

    def __call__(self, record: Record) -> list[str]:
        problems = []
        for arm_name, arm, entry in row_snapshots(record.data):
            name = entry.get("file")
            where = f"row {record.key} snapshot {name}"
            path = self.run_dir / str(name)
            if not isinstance(name, str) or path.resolve().parent != self.folder:
                problems.append(f"{where}: field file does not name a file in snapshots/")
                continue
            if not path.is_file():
                problems.append(f"{where}: missing")
                continue
            if file_digests(path.parent, [path])[path.name] != entry.get("sha256"):
                problems.append(f"{where}: field sha256 does not match the file")
                continue
            from kvreplay.model.state import read_snapshot, read_state_metadata  # torch

            try:
                meta = read_state_metadata(path)
                held = read_snapshot(path)
            except KvreplayError as exc:
                problems.append(f"{where}: {exc}")
                continue
            for key in FINGERPRINTS:
                if getattr(held, key) != arm.get(key):
                    problems.append(f"{where}: its tensors' {key} differs from the row's")
                elif getattr(meta, key) != arm.get(key):
                    problems.append(f"{where}: field {key} of its metadata differs from the row's")
            prefix = record.data.get("prefix_token_ids")
            tokens = len(prefix) if isinstance(prefix, list) else 0
            known = self.layout(tokens)
            if known is None:
                precision = record.data.get("precision")
                kinds = self.seen.setdefault(precision, held.metadata.get("layer_kinds", ""))
                known = (kinds, _neutral_lengths(meta.layer_lengths, tokens, self.layers))
            else:
                known = (json.dumps(known[0]), known[1])
            problems += [
                f"{where}: {p}"
                for p in _snapshot_problems(record, arm_name, arm, meta, held, known)
            ]
        return problems


def _snapshot_problems(
    record: Record,
    arm_name: str,
    arm: dict[str, Any],
    meta: SavedState,
    held: SnapshotContents,
    layout: tuple[str, list[int]],
) -> list[str]:
    """What a snapshot holds besides its fingerprints, against its row (see check_snapshots)."""
    from kvreplay.model.state import SNAPSHOT_EXTRA_TENSORS, SNAPSHOT_METADATA, cache_tensor_names

    kinds, lengths = layout  # kinds as the JSON the metadata holds
    prefix = record.data.get("prefix_token_ids")
    tensors = {*cache_tensor_names(len(lengths)), *SNAPSHOT_EXTRA_TENSORS}
    problems = []
    if held.tensors != tensors:
        odd = sorted(held.tensors ^ tensors)
        problems.append(f"holds other tensors than a snapshot of this model ({odd[0]}, ...)")
    if set(held.metadata) != SNAPSHOT_METADATA:
        odd = sorted(set(held.metadata) ^ SNAPSHOT_METADATA)
        problems.append(f"holds other metadata than a snapshot ({odd[0]}, ...)")
    expected = {
        "construction": (meta.construction, arm.get("construction")),
        "layer_kinds": (held.metadata.get("layer_kinds"), kinds),
        "layer_lengths": (meta.layer_lengths, lengths),
        "extra": (meta.extra, {"arm": arm_name, "row": record.key}),
    }
    problems += [
        f"field {field_name} of its metadata is not the row's"
        for field_name, (value, wanted) in expected.items()
        if value != wanted
    ]
    if held.token_ids != prefix:
        problems.append("its token_ids tensor is not the row's prefix_token_ids")
    return problems


FINGERPRINTS = ("cache_fingerprint", "logits_fingerprint")
