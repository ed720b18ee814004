"""The run's contract, header and items as the audit reads them: the contract against its
own hash and against the one this machine builds; the header's recorded environment;
the frozen items against their digest."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from kvreplay.audit.platform import Platform, meet
from kvreplay.contract.build import build_contract
from kvreplay.contract.config import RunConfig
from kvreplay.contract.environment import KERNELS
from kvreplay.contract.lock import valid_pin
from kvreplay.contract.upgrade import current
from kvreplay.core.canonical import canonical
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import BUILTIN_ITEMS, Item, items_digest, load_jsonl
from kvreplay.ledger import (
    ITEMS,
    MANIFEST_TYPES,
    RunLedger,
    contract_scheme,
    diff_fields,
)

# Environment fields that describe the machine rather than the software stack: an audit
# elsewhere announces them (a bf16 mismatch that follows is then no surprise). The thread
# count is not one of them: the audit runs on the count the run recorded or refuses.
MACHINE_FIELDS = (
    "platform",
    "machine",
    "system",
    "libc",
    "cpu_capability",
    "cpu_vendor",
    "cpu_features",
    KERNELS,
    "device_name",
)


# The manifest's header: recorded, never compared by a resume, so checked here for shape.
HEADER: dict[str, Callable[[Any], bool]] = {
    "platform": lambda v: isinstance(v, str),
    "kvreplay_version": lambda v: isinstance(v, str) and re.fullmatch(r"[0-9]+(\.[0-9]+)*\S*", v),
    "git_commit": lambda v: v is None or (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{40}", v)),
    "created": lambda v: (
        isinstance(v, str)
        and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z", v)
    ),
    "command": lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
    "snapshots": lambda v: v in ("saved", "fingerprints only"),
    "environment": lambda v: (
        isinstance(v, dict)
        and isinstance(v.get("python"), str)
        and isinstance(v.get("distributions"), dict)
        and all(valid_pin(name, version) for name, version in v["distributions"].items())
    ),
}


def check_contract(
    ledger: RunLedger, config: RunConfig, items: list[Item] | None, tokenizer: Any
) -> tuple[list[str], Platform]:
    """The recorded contract against its own hash and against the contract this machine
    builds from the recorded run settings, model files and items.jsonl.

    Returns the problems and the recorder's platform as this machine meets it (machine
    fields that differ are a note, not a problem).
    """
    problems: list[str] = []
    contract = ledger.manifest["contract"]
    recorded_items = contract.get("items")
    source = recorded_items.get("source", "") if isinstance(recorded_items, dict) else ""
    scheme = contract_scheme(contract)
    info = config.backend.describe_model(config.model, scheme, tokenizer)
    built = json.loads(canonical(build_contract(config, info, source, items or [], scheme)))
    if items is None:
        built["items"] = recorded_items  # already named as unreadable
    noted = []
    for path in diff_fields(current(contract), built):
        field_name = path.removeprefix("environment.")
        if path.startswith("environment.") and field_name in MACHINE_FIELDS:
            noted.append(field_name)
        elif path.startswith("items"):
            problems.append(
                f"items.jsonl: does not match the contract's record of the items (field "
                f"contract.{path}): an item was edited, added or removed"
            )
        else:
            problems.append(
                f"manifest.json: field contract.{path} differs from what this machine builds "
                "from the run's settings and files"
            )
    recorded = contract.get("environment")
    platform = meet(
        recorded if isinstance(recorded, dict) else {}, built["environment"], noted, scheme
    )
    return problems, platform


def check_header(ledger: RunLedger, holding: str | None) -> list[str]:
    """Header fields of the right shape, none unknown, and a snapshot setting the rows
    bear out (``holding``: the first row that holds a snapshot). A header is not hashed:
    its content beyond that is the run's word."""
    manifest = ledger.manifest
    problems = [
        f"manifest.json: field {name} is not one a kvreplay run writes"
        for name in manifest
        if name not in HEADER and name not in MANIFEST_TYPES
    ]
    problems += [
        f"manifest.json: field {name} is malformed"
        for name, valid in HEADER.items()
        if name in manifest and not valid(manifest[name])
    ]
    if manifest.get("snapshots") == "fingerprints only" and holding is not None:
        problems.append(
            f"manifest.json: field snapshots says fingerprints only, but row {holding} "
            "holds a snapshot"
        )
    return problems


def load_audited_items(ledger: RunLedger) -> tuple[list[Item] | None, list[str]]:
    """The run's items: a built-in set as this kvreplay builds it (items.jsonl must be
    exactly that), a user's set from items.jsonl (checked against the contract's digest
    by :func:`check_contract`)."""
    recorded = ledger.manifest["contract"].get("items")
    source = recorded.get("source") if isinstance(recorded, dict) else None
    try:
        frozen: list[Item] | None = load_jsonl(ledger.run_dir / ITEMS)
    except KvreplayError as exc:
        return None, [f"items.jsonl: missing or unreadable ({exc})"]
    if source not in BUILTIN_ITEMS:
        return frozen, []
    built = BUILTIN_ITEMS[source]()
    if frozen is not None and items_digest(frozen) != items_digest(built):
        return built, [
            f"items.jsonl: is not the built-in item set {source!r} that the contract names, "
            "as this kvreplay builds it (an item was replaced, added or removed)"
        ]
    return built, []
