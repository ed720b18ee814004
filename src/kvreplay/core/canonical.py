"""Canonical JSON and its SHA-256: the one encoding every digest in kvreplay commits to
(sorted keys, ASCII, no spaces; the paper release's convention)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any


def canonical(data: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, ASCII, no spaces. A number JSON cannot hold
    (NaN, an infinity) raises ValueError: nothing kvreplay commits to may hold one."""
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def sha256_json(data: Any) -> str:
    return hashlib.sha256(canonical(data)).hexdigest()


def sha256_tokens(token_ids: Sequence[int]) -> str:
    """Commit a token sequence as SHA-256 of its canonical JSON."""
    return sha256_json([int(t) for t in token_ids])
