"""A re-executed row judged on a machine whose kernels are not known to be the recorder's
(design: evidence across CPUs).

Bits do not cross CPU families: torch's vector kernels, oneDNN, MKL, ggml and vLLM's CPU
extension each pick code paths by the CPU, and a bf16 (even an fp32) result may differ in
its last bits. So on another platform a re-executed row is judged at the level that does
cross it, and nothing else is called a forgery:

- **Exact**, whatever the platform: every field not computed by the model's arithmetic
  (items, inputs, constructions, stages, settings, counts), and every token-level field
  (token ids, answers, labels, lengths, hashes of tokens) of an arm whose trajectories
  did not part.
- **Tokens at a near tie**: a greedy trajectory (a dict holding ``token_ids`` and their
  top-1/top-2 ``margins``) may part from the recorded one only at a step where both
  machines' margins are under the backend's near-tie bound for the precision
  (:meth:`~kvreplay.backends.base.Backend.near_tie`): two
  tokens the model all but tied on, which another platform's rounding can swap. What
  follows such a step in the same arm (or, for a step of the prefix, in the whole row)
  is a different continuation, counted as not comparable here. A trajectory that parts
  where this machine's margin is wide is a problem: no rounding explains it.
- **Not compared across platforms**: the model's numerics themselves (fingerprints,
  norms and differences of K/V and logits, margins, log-probabilities, bit-equality
  flags), counted.
- A **sampled** trajectory (an experiment whose temperature is above 0) that parts is
  counted as not comparable: a seeded draw lands on another token wherever the
  probabilities moved across it, near tie or not.

A forged token where the model was sure (an answer, a label, a suffix) is still caught; a
forged choice between two tokens the model all but tied on cannot be told from the
platform's own rounding, and the audit says how many near ties it met.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Fields the model's arithmetic computes bit by bit: compared only on the same platform.
NUMERIC_FIELDS = frozenset(
    {
        "margins", "margin", "logprobs", "first_logprobs", "delta_l2_norm",
        "left_l2_norm", "right_l2_norm", "max_abs_diff", "mean_abs_diff",
        "relative_l2_diff", "exact", "cache_exact", "logits_exact",
        "functional_state_equal", "kv_cache_usage_max", "digests",
    }
)  # fmt: skip
FINGERPRINT = "_fingerprint"  # every field ending so is a digest of tensors
WRAPPERS = ("suffix",)  # a trajectory's list sits in these inside the arm that owns it
_STEP = re.compile(r"\[(\d+)\]$")


@dataclass(frozen=True)
class Trajectory:
    """A greedy or sampled sequence a row records: its token ids and, per step, the
    top-1/top-2 margin; ``owner`` is what depends on it (an arm, a sample, a rollout, or
    the whole row for a prefix)."""

    path: str
    owner: str
    token_ids: list[Any]
    margins: list[Any]


@dataclass
class Crossing:
    """One re-executed row judged across platforms."""

    problems: list[str] = field(default_factory=list)
    near_ties: list[str] = field(default_factory=list)  # where a trajectory parted at a tie
    sampled: list[str] = field(default_factory=list)  # where a sampled trajectory parted
    numerics: int = 0  # differing fields of the model's arithmetic, not compared here
    after: int = 0  # differing fields after a trajectory parted, not comparable here


@dataclass
class Tally:
    """What an audit on another platform found, over its re-executed rows."""

    bitwise: int = 0  # rows equal bit for bit all the same
    tokens: int = 0  # rows whose trajectories all agree, numerics aside
    parted: int = 0  # rows with a trajectory parting at a near tie (or sampled)
    near_ties: list[str] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)
    numerics: int = 0
    after: int = 0

    def add(self, key: str, found: Crossing | None) -> None:
        """Count one row: ``None`` when it was equal bit for bit."""
        if found is None:
            self.bitwise += 1
            return
        if found.near_ties or found.sampled:
            self.parted += 1
        elif not found.problems:
            self.tokens += 1
        self.near_ties += [f"{key} {where}" for where in found.near_ties]
        self.sampled += [f"{key} {where}" for where in found.sampled]
        self.numerics += found.numerics
        self.after += found.after

    def lines(self) -> list[str]:
        """What the audit's report says of the rows it compared across platforms."""
        lines = [
            f"across platforms: {self.bitwise} row(s) equal bit for bit, {self.tokens} equal "
            f"at the token level ({self.numerics} numeric field(s) of the model's arithmetic "
            f"not compared), {self.parted} parting at a near tie or a sampled draw "
            f"({self.after} field(s) after it not comparable here)"
        ]
        lines += [f"  near tie: {where}" for where in self.near_ties[:MAX_LISTED]]
        lines += [f"  sampled draw: {where}" for where in self.sampled[:MAX_LISTED]]
        hidden = sum(max(0, len(listed) - MAX_LISTED) for listed in (self.near_ties, self.sampled))
        if hidden:
            lines.append(f"  ... {hidden} more")
        return lines


MAX_LISTED = 10  # near ties listed by name in a report


def trajectories(data: Any, path: str = "") -> Iterator[Trajectory]:
    """Every dict of ``data`` holding ``token_ids`` and ``margins`` lists, in row order
    (:func:`cross` judges those the whole row depends on first: a prefix before arms)."""
    if isinstance(data, dict):
        if isinstance(data.get("token_ids"), list) and isinstance(data.get("margins"), list):
            yield Trajectory(path, owner_of(path), data["token_ids"], data["margins"])
        for key, value in data.items():
            yield from trajectories(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from trajectories(value, f"{path}[{index}]")


def owner_of(path: str) -> str:
    """What a trajectory at ``path`` (an element of a list) feeds: the object holding
    the list, past a ``suffix`` wrapper (``arms.left.suffix.segments[0]`` feeds
    ``arms.left``; ``prefix_stages[0]`` the whole row, ``"``)."""
    holder = _STEP.sub("", path).rpartition(".")[0]
    parent, _, last = holder.rpartition(".")
    return parent if last in WRAPPERS else holder


def parted(recorded: Trajectory, fresh: Trajectory) -> int | None:
    """The first step where two trajectories hold different tokens (or one ends)."""
    for step, (a, b) in enumerate(zip(recorded.token_ids, fresh.token_ids, strict=False)):
        if a != b:
            return step
    if len(recorded.token_ids) != len(fresh.token_ids):
        return min(len(recorded.token_ids), len(fresh.token_ids))
    return None


def numeric(path: str) -> bool:
    """Whether a dotted field path names the model's arithmetic (see NUMERIC_FIELDS)."""
    keys = [_STEP.sub("", part) for part in re.split(r"\.|(?=\[)", path)]
    return any(k in NUMERIC_FIELDS or k.endswith(FINGERPRINT) for k in keys if k)


def _margin(margins: list[Any], step: int) -> float | None:
    value = margins[step] if step < len(margins) else None
    return float(value) if isinstance(value, int | float) else None


def cross(
    key: str,
    recorded: dict[str, Any],
    fresh: dict[str, Any],
    differing: list[str],
    bound: float,
    sampled: bool,
) -> Crossing:
    """Judge a fresh row against the recorded one (both as the re-execution compares
    them; ``differing``: the fields where they differ) at the level that crosses
    platforms (``bound``: the near-tie bound of the row's backend and precision); see
    the module docstring."""
    found = Crossing()
    theirs = {t.path: t for t in trajectories(fresh)}
    apart: list[str] = []  # owners whose trajectories parted where the platform may
    failed: list[str] = []  # owners whose trajectories parted where it cannot
    for ours in sorted(trajectories(recorded), key=lambda t: t.owner.count(".") + bool(t.owner)):
        other = theirs.get(ours.path)
        if other is None or any(within(ours.owner, a) for a in apart + failed):
            continue
        step = parted(ours, other)
        if step is None:
            continue
        mine, here = _margin(ours.margins, step), _margin(other.margins, step)
        where = f"{ours.path or '<row>'} at step {step}"
        if sampled:
            found.sampled.append(where)
        elif mine is not None and here is not None and mine <= bound and here <= bound:
            found.near_ties.append(f"{where} (margins {mine:g} recorded, {here:g} here)")
        else:
            margin = "none" if here is None else f"{here:g}"
            found.problems.append(
                f"row {key}: field {ours.path}.token_ids[{step}] differs on re-execution "
                f"where this machine's top-1/top-2 margin is {margin} (over the near-tie "
                f"bound {bound:g}): not the platform's rounding"
            )
            failed.append(ours.owner)
            continue
        apart.append(ours.owner)
    owners = {t.owner for t in trajectories(recorded)}
    for path in differing:
        owner = max((o for o in owners if within(path, o)), key=len, default="")
        if any(within(path, f) for f in failed):
            continue  # named with the trajectory that failed
        if any(within(path, a) for a in apart) or (apart and owner == ""):
            found.after += 1
        elif numeric(path):
            found.numerics += 1
        else:
            found.problems.append(
                f"row {key}: field {path} differs on re-execution, and no near tie before "
                "it explains the difference"
            )
    return found


def within(path: str, prefix: str) -> bool:
    """Whether a dotted path lies in (or is) the object at ``prefix`` (``""``: the row)."""
    return prefix == "" or path == prefix or path.startswith((f"{prefix}.", f"{prefix}["))
