"""The weight-update section (design: weight update arm), from ``weight_update.csv``,
read a line at a time: per precision, the **stale cache** (is the request sent right
after each sync the miss it must be, bit for bit: tokens and log-probabilities, and no
cached token?), and the terms the update adds to a rollout's log-probabilities, each a
mean per token with its 95% interval over resampled items: **in-flight** (the tokens an
in-flight rollout decoded after the update, over K/V the old weights wrote, against the
engine's own prefill of them under the new weights), beside the **engine** term (a
rollout sampled wholly under the new weights against its own prefill) and the
**policy** term (the tokens sampled before the update, old weights against new: the
change an importance ratio corrects, no bug). No torch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvreplay.core.claims import decode, encode, key
from kvreplay.experiments.rollout import ChainTally, count, decomposition_claims, number, stream_of
from kvreplay.experiments.rollout.claims import Decomposition
from kvreplay.experiments.weight_update.table import TRAINED, UPDATE_TABLE
from kvreplay.harness.section import Page, Reading, Section
from kvreplay.harness.table import LedgerError
from kvreplay.measure.rates import Json
from kvreplay.render.document import Block, Heading, Paragraph
from kvreplay.render.document import Table as Grid

SECTION = "weight_update"
TERMS = ("inflight", "engine", "policy")
SHOWN = 10  # items that part named in the claims


def rows(file: str, lines: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Mapping[str, Any]]]:
    """The CSV's lines grouped by row (a row's arms are consecutive lines)."""
    done: set[tuple[str, str]] = set()
    current: tuple[str, str] | None = None
    arms: dict[str, Mapping[str, Any]] = {}
    for line in lines:
        key = (str(line["precision"]), str(line["row_id"]))
        if key != current:
            if arms:
                yield arms
            if key in done:
                raise LedgerError(file, "a row's lines are not together", key[1], "row_id")
            done.add(key)
            current, arms = key, {}
        arms[str(line["arm"])] = line
    if arms:
        yield arms


class PrecisionTally:
    """One precision's rows, one at a time."""

    def __init__(self, precision: str):
        self.precision = precision
        self.items = 0
        self.equal = 0
        self.cached_max = 0
        self.parted: list[Json] = []
        self.chains = {term: ChainTally(1) for term in TERMS}
        self.cross: dict[str, ChainTally] = {}
        self.temperature = 0.0

    def add(self, arms: dict[str, Mapping[str, Any]]) -> None:
        after, miss = arms["after"], arms["miss"]
        self.items += 1
        self.temperature = float(after["temperature"])
        cached = 0 if np.isnan(after["cached_tokens"]) else int(after["cached_tokens"])
        self.cached_max = max(self.cached_max, cached)
        same = after["tokens_sha256"] == miss["tokens_sha256"]
        if same and after["logprobs"] == miss["logprobs"] and cached == 0:
            self.equal += 1
        elif len(self.parted) < SHOWN:
            differs = [i for i, (a, b) in enumerate(zip(after["logprobs"], miss["logprobs"],
                                                        strict=False)) if a != b]  # fmt: skip
            self.parted.append({"item": str(after["row_id"]), "cached_tokens": cached,
                                "tokens_equal": same,
                                "first_differs": differs[0] if differs else None})  # fmt: skip
        key = str(after["row_id"])
        if "miss:engine" in arms:
            self.chains["engine"].add(
                [np.asarray(miss["logprobs"]), np.asarray(arms["miss:engine"]["logprobs"])], key
            )
        if "inflight" in arms and "inflight:engine" in arms:
            decoded = np.asarray(arms["inflight"]["logprobs"])
            prefill = np.asarray(arms["inflight:engine"]["logprobs"])
            at = int(arms["inflight"]["update_at"])
            self.chains["inflight"].add([decoded[at:], prefill[at:]], key)
            self.chains["policy"].add([decoded[:at], prefill[:at]], key)
            for arm in (a for a in arms if a.startswith(TRAINED)):
                trained = np.asarray(arms[arm]["logprobs"])
                chain = self.cross.setdefault(arm[len(TRAINED) :], ChainTally(2))
                chain.add([decoded[at:], prefill[at:], trained[at:]], key)

    def claims(self) -> Json:
        found: Json = {
            "temperature": self.temperature,
            "items": self.items,
            "stale_cache": {
                "items": self.items,
                "after_is_miss": self.equal,
                "after_cached_tokens_max": self.cached_max,
                "parted": self.parted,
            },
        }
        for term, chain in self.chains.items():
            chain.finish()
            if chain.tokens:
                found[term] = decomposition_claims(chain, [term], stream_of(self.precision, term))
        found["cross"] = {
            label: decomposition_claims(
                chain.finish(), ["inflight", "cross"], stream_of(self.precision, "cross", label)
            )
            for label, chain in sorted(self.cross.items())
            if chain.finish().tokens
        }
        return found


@dataclass(frozen=True)
class Parted:
    """An item whose request after the sync was not the miss it must be."""

    item: str
    cached_tokens: int
    tokens_equal: bool
    first_differs: int | None


@dataclass(frozen=True)
class StaleCache:
    """After each sync, was the request sent again the miss it must be, bit for bit?"""

    items: int
    after_is_miss: int
    after_cached_tokens_max: int
    parted: list[Parted]  # the first SHOWN of them

    @property
    def holds(self) -> bool:
        return self.after_is_miss == self.items


@dataclass(frozen=True)
class PrecisionClaims:
    """One precision's claims: the stale cache and the terms the update adds (each
    absent where no arm measured it), and the in-flight term against each trainer."""

    temperature: float
    items: int
    stale_cache: StaleCache
    cross: dict[str, Decomposition]
    inflight: Decomposition | None = field(default=None, metadata=key(omit=True))
    engine: Decomposition | None = field(default=None, metadata=key(omit=True))
    policy: Decomposition | None = field(default=None, metadata=key(omit=True))

    def terms(self) -> list[tuple[str, Decomposition | None]]:
        """The terms in :data:`TERMS` order."""
        return [("inflight", self.inflight), ("engine", self.engine), ("policy", self.policy)]


@dataclass(frozen=True)
class UpdateClaims:
    """The section's claims by precision."""

    precisions: dict[str, PrecisionClaims] = field(metadata=key(SECTION))


def update_claims(reading: Reading) -> UpdateClaims:
    """The section's claims by precision, the CSV read once, a line at a time."""
    (ledger,) = reading.ledgers.values()
    tallies: dict[str, PrecisionTally] = {}
    for arms in rows(ledger.file, ledger.lines()):
        precision = str(arms["after"]["precision"])
        tallies.setdefault(precision, PrecisionTally(precision)).add(arms)
    found = decode(UpdateClaims, {SECTION: {p: t.claims() for p, t in tallies.items()}})
    return found or UpdateClaims({})


def plain(claims: UpdateClaims) -> Json:
    """The claims by precision as claims.json writes them (a check's --json too)."""
    return encode(claims)[SECTION]


def _term(term: str, found: Decomposition | None) -> str:
    if found is None:
        return f"{term} —"
    t = found.split.terms[term]
    ci = t.abs_ci95
    interval = "" if ci is None else f" [{number(ci[0])}, {number(ci[1])}]"
    return f"{term} {number(t.abs_mean)}{interval} over {found.tokens} tokens"


def stale_sentence(claims: PrecisionClaims) -> str:
    """What the stale-cache comparison found, as a line says it."""
    s = claims.stale_cache
    if s.holds:
        return (
            f"after each sync the request was a miss, bit for bit, on {s.items} of "
            f"{s.items} items (no cached token read)"
        )
    first = s.parted[0]
    return (
        f"STALE CACHE: after the sync {s.items - s.after_is_miss} of {s.items} items "
        f"were not the miss they must be; first {first.item}, which read "
        f"{first.cached_tokens} cached tokens and parted from the miss at token "
        f"{first.first_differs}"
    )


def summary_lines(claims: UpdateClaims) -> list[str]:
    lines = []
    for precision, c in sorted(claims.precisions.items()):
        lines.append(f"weight-update {precision}: {stale_sentence(c)}")
        lines.append(
            f"weight-update {precision}: mean |delta log p| "
            + ", ".join(_term(term, found) for term, found in c.terms())
        )
        for label, d in sorted(c.cross.items()):
            inflight, cross = d.split.terms["inflight"], d.split.terms["cross"]
            lines.append(
                f"weight-update {precision} -> {label}: after the update, mean |term| in-flight "
                f"{number(inflight.abs_mean)}, cross {number(cross.abs_mean)}"
            )
    return lines


METHOD = (
    "Method. Each item's prompt is sampled under the run's own weights (filling the prefix "
    "cache), the engine's weights are synced to the update through its own path (loaded, "
    "then the prefix cache reset), and the same request is sent again: a correct sync "
    "serves it as a miss, bit for bit; a sync that forgot to reset serves it from blocks "
    "the old weights wrote. An in-flight rollout has its weights updated once it has "
    "sampled update_at tokens; its later tokens, decoded over the K/V the old weights "
    "wrote, are compared with the engine's own prefill of them under the new weights (the "
    "in-flight term), beside the engine term of a rollout sampled wholly under the new "
    "weights and the policy term of the tokens sampled before the update. Every request "
    "draws the same seed; intervals are 95% bootstraps over resampled items."
)


def _report(page: Page[UpdateClaims]) -> list[Block]:
    section = page.claims.precisions
    if not section:
        return []
    blocks: list[Block] = [
        Heading("Weight update: what the engine serves after an RL step syncs new weights"),
        Paragraph(METHOD),
    ]
    for precision, c in sorted(section.items()):
        blocks.append(Paragraph(f"{precision}: {stale_sentence(c)}."))
        rows_ = []
        for term, found in c.terms():
            if found is not None:
                t = found.split.terms[term]
                rows_.append((term, number(t.mean), number(t.abs_mean),
                              number(t.max_abs), count(found.tokens)))  # fmt: skip
        if rows_:
            blocks.append(
                Grid(("term", "mean delta", "mean |delta|", "max |delta|", "tokens"), rows_)
            )
    return blocks


UPDATE_SECTION = Section(
    SECTION,
    (UPDATE_TABLE,),
    UpdateClaims,
    update_claims,
    summary_lines,
    report=_report,
)
