"""Verdicts (design: check, verdict, expectation, level, power): a run's rows judged
against what should hold, at two levels. The *tokens* level asks whether the compared
continuations agree (suffix, answer, label); the *bits* level asks whether their
numerics do (boundary logits, every step's logits or top-k logprobs, K/V where the
backend has K/V access). A verdict always names the level it holds at, says what the
other level gives, and states its power: the 95% upper bound on the divergence rate its
items rule out.

Expectations: ``exact`` (every suffix equal), ``max-divergent`` (at most K items
part), ``bitwise`` (every compared step bit-equal: what a deterministic mode promises)
and ``faithful`` (the resample certificate within a margin, temperature > 0).
``kvreplay check`` and every ``kvreplay run`` end with a verdict's sentence; JSON
(schema ``kvreplay-check-v3``; v1 and v2 stay readable through :func:`read_json`) and
JUnit XML carry the rest. Where a panel has an arm that runs under traffic (``history``
under ``--traffic N``), that arm is compared too: the hit under traffic against the hit
alone, at both levels, so a continuation that depends on what else the server was doing
fails the check like one that depends on the cache.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from xml.etree import ElementTree

from kvreplay.core.comparison import first_divergence
from kvreplay.core.errors import KvreplayError
from kvreplay.core.power import items_needed, percent, rate_upper_bound
from kvreplay.core.trajectory import numeric_divergence
from kvreplay.harness.experiment import Experiment
from kvreplay.ledger import Record

if TYPE_CHECKING:
    from kvreplay.harness.rows import ArmResult

SCHEMA = "kvreplay-check-v3"
READABLE = ("kvreplay-check-v1", "kvreplay-check-v2", SCHEMA)
EXPECTATIONS = ("exact", "max-divergent", "bitwise", "faithful")
DEFAULT_MARGIN = 0.05
NEAR_TIE = 0.5  # top-1/top-2 margin under which a divergence counts as a near-tie
HOLDS, FAILS = 0, 1  # exit codes; a refusal is 2
# What a verdict reports of the server's load under traffic (backends.traffic.Load).
LOAD_FIGURES = (
    "in_flight_max", "server_running_max", "server_waiting_max", "kv_cache_usage_max",
    "preemptions",
)  # fmt: skip

Bits = Literal["equal", "differ", "unknown"]


@dataclass(frozen=True)
class Expectation:
    """What the stack should do: ``exact`` (every suffix equal), ``max-divergent`` (at
    most ``max_divergent`` items differ), ``bitwise`` (every compared step bit-equal),
    or ``faithful`` (the resample certificate at ``margin``, temperature > 0).
    ``max_rate``: run until a pass bounds the divergence rate under it."""

    kind: str
    max_divergent: int = 0
    margin: float = DEFAULT_MARGIN
    max_rate: float | None = None

    @property
    def level(self) -> str:
        """The level the verdict holds at: tokens, bits, or the certificate's."""
        return {"bitwise": "bits", "faithful": "certificate"}.get(self.kind, "tokens")

    @property
    def allowed(self) -> int:
        """Items that may part at the expectation's level."""
        return self.max_divergent if self.kind == "max-divergent" else 0

    def describe(self) -> str:
        if self.kind == "exact":
            return "every suffix equal"
        if self.kind == "max-divergent":
            return f"at most {self.max_divergent} item(s) divergent"
        if self.kind == "bitwise":
            return "every compared step bit-equal"
        return f"faithful within the margin {self.margin:g}"

    def items_needed(self) -> int | None:
        """How many items a pass must hold over to bound the rate under ``max_rate``."""
        return None if self.max_rate is None else items_needed(self.max_rate, self.allowed)


def parse_expectation(
    kind: str | None,
    max_divergent: int | None,
    margin: float | None,
    temperature: float,
    max_rate: float | None = None,
) -> Expectation:
    """The expectation a check runs against; the default is ``exact`` when greedy and
    ``faithful`` at temperature > 0. Bad combinations are refused in one sentence."""
    if kind is None:
        kind = "max-divergent" if max_divergent is not None else None
        kind = kind or ("faithful" if temperature > 0 else "exact")
    if kind not in EXPECTATIONS:
        raise KvreplayError(f"Unknown expectation {kind!r}; choose {', '.join(EXPECTATIONS)}.")
    if kind == "faithful" and temperature <= 0:
        raise KvreplayError(
            "--expect faithful compares sampled outcomes; give --temperature above 0."
        )
    if kind != "faithful" and temperature > 0:
        raise KvreplayError(
            f"--expect {kind} compares greedy continuations; at --temperature above 0 use "
            "--expect faithful."
        )
    if margin is not None and not 0 < margin < 1:
        raise KvreplayError(f"--margin must lie in (0, 1); got {margin:g}.")
    if margin is not None and kind != "faithful":
        raise KvreplayError("--margin applies to --expect faithful only.")
    if max_divergent is not None and kind != "max-divergent":
        raise KvreplayError("--max-divergent applies to --expect max-divergent only.")
    if max_rate is not None:
        if not (math.isfinite(max_rate) and 0 < max_rate < 1):
            raise KvreplayError(
                f"--max-rate is a divergence rate strictly between 0 and 1 (e.g. 0.05); "
                f"got {max_rate:g}."
            )
        if kind == "faithful":
            raise KvreplayError(
                "--max-rate bounds a greedy check's divergence rate; --expect faithful "
                "is judged by its certificate instead."
            )
    return Expectation(
        kind, max_divergent or 0, DEFAULT_MARGIN if margin is None else margin, max_rate
    )


@dataclass(frozen=True)
class ItemOutcome:
    """One item at one precision, at both levels: do the compared continuations agree,
    where and how narrowly do they part (the top-1/top-2 margins at the first divergence;
    a flip on a near-tie has a margin near 0), and do their numerics agree bit for bit
    (``numeric_divergence``: the first step where they part, even when tokens never do;
    step 0 is the boundary logits)."""

    item_id: str
    precision: str
    reached: bool
    replicas_ok: bool
    suffix_differs: bool = False
    answer_differs: bool = False
    label_flips: bool = False
    first_divergence: int | None = None
    left_margin: float | None = None
    right_margin: float | None = None
    seeds_changed: int | None = None  # resample: seeds whose sampled tokens changed
    seeds: int | None = None
    cache_hit_tokens: int | None = None  # served: cached tokens of P the hit read
    logits_equal: bool | None = None  # boundary logits (served: first-step logprobs)
    kv_equal: bool | None = None  # boundary K/V, where the backend has K/V access
    numerics_recorded: bool = False  # both continuations hold every step's digest
    numeric_divergence: int | None = None
    # The arm under traffic (None: the panel has none, or it did not run) against the
    # compared pair's left arm (the hit alone) and right arm (the miss).
    traffic_differs: bool | None = None
    traffic_differs_from_right: bool | None = None
    traffic_numerics_differ: bool | None = None
    traffic_load: dict[str, Any] | None = None  # what the server reported meanwhile

    @property
    def pair_diverges(self) -> bool:
        """The compared pair's continuations part (a seed's, for a sampled row)."""
        return self.suffix_differs or bool(self.seeds_changed)

    @property
    def diverges(self) -> bool:
        return self.pair_diverges or bool(self.traffic_differs)

    @property
    def bits(self) -> Bits:
        """The bits level: equal, differ, or unknown (a row without step digests whose
        boundary numerics agree)."""
        if not self.reached:
            return "unknown"
        if self.logits_equal is False or self.kv_equal is False or self.traffic_numerics_differ:
            return "differ"
        if not self.numerics_recorded:
            return "unknown"
        return "equal" if self.numeric_divergence is None else "differ"

    @property
    def numeric_step(self) -> int | None:
        """Where numerics part: the recorded step, else 0 when the boundary differs."""
        if self.numerics_recorded and self.numeric_divergence is not None:
            return self.numeric_divergence
        return 0 if self.bits == "differ" else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bits": self.bits}


def _under_traffic(traffic: ArmResult | None, left: ArmResult, right: ArmResult) -> dict[str, Any]:
    """The arm under traffic against the hit alone (``left``) and the miss (``right``)."""
    if traffic is None:
        return {}
    numerics = numeric_divergence(traffic.suffix, left.suffix)
    return {
        "traffic_differs": traffic.suffix_sha256 != left.suffix_sha256,
        "traffic_differs_from_right": traffic.suffix_sha256 != right.suffix_sha256,
        "traffic_numerics_differ": traffic.logits_fingerprint != left.logits_fingerprint
        or numerics.parts,
        "traffic_load": traffic.served.load if traffic.served is not None else None,
    }


def _most_load(loads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The most the server reported in flight over the items' traffic arms: each of
    :data:`LOAD_FIGURES`' maximum (None: no row recorded a load)."""
    if not loads:
        return None
    return {
        k: max((v for load in loads if (v := load.get(k)) is not None), default=None)
        for k in LOAD_FIGURES
    }


def outcomes(experiment: Experiment, rows: Iterable[Record]) -> list[ItemOutcome]:
    """Each compared row's outcome, in ledger order."""
    under_traffic = next(iter(experiment.panel.under_traffic), None)
    found = []
    for record in rows:
        data = record.data
        if data.get("kind") == "prefix":
            continue
        if data["status"] != "ok":
            found.append(ItemOutcome(data["item_id"], data["precision"], False, True))
            continue
        row = experiment.read_row(data)
        pairs = row.pairs
        changed = [a.suffix_sha256 != b.suffix_sha256 for a, b in pairs]
        left, right = pairs[0]
        index = first_divergence(left.suffix_token_ids, right.suffix_token_ids)
        numerics = [numeric_divergence(a.suffix, b.suffix) for a, b in pairs]
        parted = [n.index for n in numerics if n.parts and n.index is not None]
        found.append(
            ItemOutcome(
                item_id=data["item_id"],
                precision=data["precision"],
                reached=True,
                replicas_ok=row.replicas_exact,
                suffix_differs=len(pairs) == 1 and changed[0],
                answer_differs=any(a.answer != b.answer for a, b in pairs),
                label_flips=any(a.correct != b.correct for a, b in pairs),
                first_divergence=index,
                left_margin=left.margin_at(index),
                right_margin=right.margin_at(index),
                seeds_changed=sum(changed) if len(pairs) > 1 else None,
                seeds=len(pairs) if len(pairs) > 1 else None,
                cache_hit_tokens=left.served.cached_tokens[0] if left.served else None,
                logits_equal=all(a.logits_fingerprint == b.logits_fingerprint for a, b in pairs),
                kv_equal=row.comparison.cache_exact if row.comparison is not None else None,
                numerics_recorded=all(n.recorded for n in numerics),
                numeric_divergence=min(parted) if parted else None,
                **_under_traffic(
                    row.arms.get(under_traffic) if under_traffic else None, left, right
                ),
            )
        )
    return found


@dataclass
class Verdict:
    """A check's outcome against its expectation, with everything a CI system or a person
    needs: the sentence, both levels, the power, each item, and the certificate when
    sampled. ``planned`` is how many item rows the check meant to run (it stops early
    once the verdict is decided)."""

    expectation: Expectation
    compared: tuple[str, str]
    items: list[ItemOutcome]
    certificate: dict[str, Any] | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    planned: int | None = None

    @property
    def reached(self) -> list[ItemOutcome]:
        return [o for o in self.items if o.reached]

    @property
    def divergent(self) -> list[ItemOutcome]:
        return [o for o in self.items if o.diverges]

    @property
    def broken(self) -> list[ItemOutcome]:
        """Items whose replicas disagreed: the stack is not deterministic there."""
        return [o for o in self.items if o.reached and not o.replicas_ok]

    @property
    def uncached(self) -> list[ItemOutcome]:
        """Served items whose hit read no cached token of P (P shorter than one cache
        block): there the hit was a second miss, and the item tests no caching."""
        return [o for o in self.items if o.reached and o.cache_hit_tokens == 0]

    @property
    def judged(self) -> list[ItemOutcome]:
        """The items that test the stack: reached, and (served) read the cache."""
        return [o for o in self.reached if o.cache_hit_tokens != 0]

    @property
    def bits_differ(self) -> list[ItemOutcome]:
        return [o for o in self.judged if o.bits == "differ"]

    @property
    def bits_unknown(self) -> list[ItemOutcome]:
        return [o for o in self.judged if o.bits == "unknown"]

    @property
    def tokens_hold(self) -> bool:
        return len(self.divergent) <= self.expectation.allowed

    @property
    def bits_hold(self) -> bool:
        return not self.bits_differ and not self.bits_unknown

    @property
    def holds(self) -> bool:
        if self.broken or not self.judged:
            return False
        if self.expectation.kind == "faithful":
            return self.certificate is not None and self.certificate["verdict"] == "faithful"
        return self.bits_hold if self.expectation.kind == "bitwise" else self.tokens_hold

    @property
    def exit_code(self) -> int:
        return HOLDS if self.holds else FAILS

    def rate_bound(self, level: str) -> float | None:
        """The 95% upper bound on the rate of items that part at ``level`` (tokens or
        bits), over the items that test the stack; None for the certificate."""
        if level == "tokens":
            return rate_upper_bound(len([o for o in self.judged if o.diverges]), len(self.judged))
        if level == "bits":
            parted = len(self.bits_differ) + len(self.bits_unknown)
            return rate_upper_bound(parted, len(self.judged))
        return None

    @property
    def stopped_early(self) -> bool:
        return self.planned is not None and len(self.items) < self.planned

    def sentence(self) -> str:
        level = self.expectation.level
        verdict = "HOLDS" if self.holds else "FAILS"
        where = {"tokens": " at token level", "bits": " bitwise"}.get(level, "")
        head = f"{verdict}{where} ({self.expectation.describe()}): "
        if not self.reached:
            return head + "no item reached its boundary, so nothing was compared."
        if self.broken:
            return head + (
                f"replicas disagreed on {len(self.broken)} of {len(self.reached)} item(s), so "
                "this stack is not deterministic even under the same state."
            )
        if not self.judged:
            return head + (
                "no prefix-cache hit read a cached token of P on any item (P is shorter than "
                "one of the server's cache blocks), so hit and miss were the same computation; "
                "check longer prefixes or a smaller block size."
            )
        uncached = (
            f" ({len(self.uncached)} item(s) read no cached token of P: there hit and miss "
            "were the same computation)"
            if self.uncached
            else ""
        )
        if self.certificate is not None:
            return head + self.certificate["sentence"] + uncached + "; " + self._bits_clause()
        if level == "bits":
            body = self._bits_clause(leading=True) + "; at token level " + self._tokens_clause()
        else:
            body = self._tokens_clause() + "; " + self._bits_clause()
        return head + body + uncached + self._stop_clause() + "."

    def _tokens_clause(self) -> str:
        left, right = self.compared
        parts = []
        for precision in dict.fromkeys(o.precision for o in self.reached):
            these = [o for o in self.reached if o.precision == precision]
            parts.append(
                f"{sum(o.pair_diverges for o in these)} of {len(these)} item(s) in {precision}"
            )
        pair = [o for o in self.reached if o.pair_diverges]
        near = [o for o in pair if o.left_margin is not None and o.left_margin < NEAR_TIE]
        tie = (
            f", {len(near)} of those at a near-tie (top-1/top-2 margin under {NEAR_TIE:g})"
            if pair
            else ""
        )
        clause = f"{left} and {right} continuations differ on {' and '.join(parts)}{tie}"
        if self.traffic is not None:
            differ = self.traffic["suffix_differs_from"]
            clause += (
                f"; under traffic the {left} continuation differs from the {left} alone on "
                f"{differ[left]} of {self.traffic['items']} item(s) and from the {right} on "
                f"{differ[right]}"
            )
        if not self.divergent and self.expectation.level == "tokens":
            clause += self._power("tokens")
        return clause

    def _bits_clause(self, leading: bool = False) -> str:
        left, right = self.compared
        judged = len(self.judged)
        if self.bits_differ:
            first = self.bits_differ[0]
            step = first.numeric_step
            at = f"from step {step}" + (" (the boundary logits)" if step == 0 else "")
            logits = sum(o.logits_equal is False for o in self.bits_differ)
            kv = sum(o.kv_equal is False for o in self.bits_differ)
            detail = f"; boundary logits differ on {logits}" + (
                f" and K/V on {kv}" if any(o.kv_equal is not None for o in self.judged) else ""
            )
            lead = "" if leading else "NOT bitwise: "
            return (
                f"{lead}{left} and {right} numerics differ on {len(self.bits_differ)} of "
                f"{judged} item(s), first at item {first.item_id} ({first.precision}) {at}"
                f"{detail}"
            )
        if self.bits_unknown:
            return (
                f"bitwise unknown: {len(self.bits_unknown)} of {judged} item(s) hold no step "
                "digests (rows written before kvreplay recorded them), so their numerics "
                "after the boundary were not compared"
            )
        what = (
            "K/V, boundary logits and every step's logits"
            if any(o.kv_equal is not None for o in self.judged)
            else "every step's reported logprobs"
        )
        clause = f"{'' if leading else 'bitwise too: '}{left} and {right} agree bit for bit "
        clause += f"({what}) on {judged} of {judged} item(s)"
        return clause + (self._power("bits") if self.expectation.level == "bits" else "")

    @property
    def traffic(self) -> dict[str, Any] | None:
        """The arm under traffic against the compared pair, over the items where it ran,
        with the most the server reported in flight (None: no arm ran under traffic)."""
        ran = [o for o in self.judged if o.traffic_differs is not None]
        if not ran:
            return None
        left, right = self.compared
        return {
            "items": len(ran),
            "suffix_differs_from": {
                left: sum(bool(o.traffic_differs) for o in ran),
                right: sum(bool(o.traffic_differs_from_right) for o in ran),
            },
            "numerics_differ_from": {left: sum(bool(o.traffic_numerics_differ) for o in ran)},
            "load": _most_load([o.traffic_load for o in ran if o.traffic_load]),
        }

    def _power(self, level: str) -> str:
        bound = self.rate_bound(level)
        assert bound is not None
        unit = "divergence rate" if level == "tokens" else "rate of items whose numerics part"
        return f", so the {unit} may still be up to {percent(bound)} (95% upper bound)"

    def _stop_clause(self) -> str:
        if not self.stopped_early:
            return ""
        return (
            f"; stopped after {len(self.items)} of {self.planned} planned item row(s), "
            "once the verdict was decided"
        )

    def counts(self) -> dict[str, int]:
        reached = self.reached
        return {
            "items": len(self.items),
            "reached": len(reached),
            "suffixes_differ": len(self.divergent),
            "answers_differ": sum(o.answer_differs for o in reached),
            "labels_flip": sum(o.label_flips for o in reached),
            "replicas_disagree": len(self.broken),
            "numerics_differ": len(self.bits_differ),
            "numerics_unrecorded": len(self.bits_unknown),
            "boundary_logits_differ": sum(o.logits_equal is False for o in reached),
        }

    def levels(self) -> dict[str, Any]:
        """Both levels, each with what parts, what was judged and its power."""
        judged = len(self.judged)
        first = self.bits_differ[0] if self.bits_differ else None
        return {
            "tokens": {
                "holds": not [o for o in self.judged if o.diverges],
                "items": judged,
                "differ": len([o for o in self.judged if o.diverges]),
                "rate_upper_95": self.rate_bound("tokens"),
            },
            "bits": {
                "holds": self.bits_hold if judged else None,
                "items": judged,
                "differ": len(self.bits_differ),
                "unrecorded": len(self.bits_unknown),
                "first": None
                if first is None
                else {
                    "item_id": first.item_id,
                    "precision": first.precision,
                    "step": first.numeric_step,
                },
                "rate_upper_95": self.rate_bound("bits"),
            },
        }

    def to_json(self) -> dict[str, Any]:
        near = [o for o in self.divergent if o.left_margin is not None]
        return {
            "schema": SCHEMA,
            "verdict": "holds" if self.holds else "fails",
            "exit_code": self.exit_code,
            "sentence": self.sentence(),
            "level": self.expectation.level,
            "levels": self.levels(),
            "power": {
                "level": self.expectation.level,
                "items": len(self.judged),
                "rate_upper_95": self.rate_bound(self.expectation.level),
                "max_rate": self.expectation.max_rate,
                "items_needed": self.expectation.items_needed(),
            },
            "planned": self.planned,
            "stopped_early": self.stopped_early,
            "near_ties": {
                "threshold": NEAR_TIE,
                "divergent": len(self.divergent),
                "at_near_tie": sum(o.left_margin < NEAR_TIE for o in near),  # type: ignore[operator]
            },
            "expectation": asdict(self.expectation),
            "compared": list(self.compared),
            "counts": self.counts(),
            "items": [o.to_json() for o in self.items],
            "certificate": self.certificate,
            "environment": self.environment,
            "traffic": self.traffic,
        }

    def junit(self) -> str:
        """JUnit XML: one test case per item and precision, failed where it parts at the
        expectation's level; both levels as properties of the suite and of each case."""
        suite = ElementTree.Element(
            "testsuite",
            name="kvreplay check",
            tests=str(len(self.items)),
            failures=str(sum(not self.passes(o) for o in self.items)),
        )
        properties = ElementTree.SubElement(suite, "properties")
        for name, value in (
            ("verdict", "holds" if self.holds else "fails"),
            ("level", self.expectation.level),
            ("tokens", "holds" if self.levels()["tokens"]["holds"] else "fails"),
            ("bits", "holds" if self.bits_hold and self.judged else "fails"),
            ("rate_upper_95", f"{self.rate_bound(self.expectation.level) or 0:.6g}"),
            *(
                (f"traffic_suffix_differs_from_{arm}", str(count))
                for arm, count in (self.traffic or {}).get("suffix_differs_from", {}).items()
            ),
        ):
            ElementTree.SubElement(properties, "property", name=name, value=value)
        for outcome in self.items:
            case = ElementTree.SubElement(
                suite,
                "testcase",
                classname=f"kvreplay.check.{outcome.precision}",
                name=outcome.item_id,
            )
            props = ElementTree.SubElement(case, "properties")
            ElementTree.SubElement(props, "property", name="tokens", value=_tokens_word(outcome))
            ElementTree.SubElement(props, "property", name="bits", value=outcome.bits)
            if not self.passes(outcome):
                failure = ElementTree.SubElement(case, "failure", message=_why(outcome))
                failure.text = json.dumps(outcome.to_json(), sort_keys=True)
        ElementTree.SubElement(suite, "system-out").text = self.sentence()
        return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"

    def passes(self, outcome: ItemOutcome) -> bool:
        """Whether one item meets the expectation at its level."""
        if not (outcome.reached and outcome.replicas_ok):
            return False
        if self.expectation.kind == "bitwise":
            return outcome.bits == "equal" or outcome.cache_hit_tokens == 0
        return not outcome.diverges

    def screen(self) -> str:
        """The one-screen report: the sentence first, then both levels, the counts and
        the items."""
        lines = [self.sentence(), ""]
        levels = self.levels()
        for name in ("tokens", "bits"):
            level = levels[name]
            word = {True: "equal", False: "differ", None: "not judged"}[level["holds"]]
            bound = (
                f"; the rate may be up to {percent(level['rate_upper_95'])} at 95%"
                if level["holds"]
                else ""
            )
            lines.append(f"  {name}: {word} ({level['differ']} of {level['items']} differ{bound})")
        lines += [f"  {name.replace('_', ' ')}: {value}" for name, value in self.counts().items()]
        if self.traffic is not None and self.traffic["load"]:
            reported = ", ".join(
                f"{name.replace('_', ' ')} {value:g}"
                for name, value in self.traffic["load"].items()
                if value is not None
            )
            lines.append(f"  under traffic the server reported at most: {reported or 'nothing'}")
        for o in [o for o in self.items if not self.passes(o)][:10]:
            lines.append(f"  {o.item_id} ({o.precision}): {_why(o)}")
        return "\n".join(lines)


def _tokens_word(outcome: ItemOutcome) -> str:
    if not outcome.reached:
        return "unreached"
    return "differ" if outcome.diverges else "equal"


def _why(outcome: ItemOutcome) -> str:
    if not outcome.reached:
        return "the prefix did not reach its boundary"
    if not outcome.replicas_ok:
        return "its replicas disagreed"
    if outcome.seeds_changed:
        return f"{outcome.seeds_changed} of {outcome.seeds} seeds changed"
    numerics = {
        "equal": "numerics bit-equal",
        "unknown": "numerics not recorded after the boundary",
        "differ": f"numerics part from step {outcome.numeric_step}",
    }[outcome.bits]
    traffic = "; under traffic the continuation differs from the one alone" * bool(
        outcome.traffic_differs
    )
    if not outcome.pair_diverges:
        return f"suffixes equal{traffic}; {numerics}"
    margins = (
        f"margins {outcome.left_margin:.3g} / {outcome.right_margin:.3g}"
        if (outcome.left_margin is not None and outcome.right_margin is not None)
        else "margins not recorded"
    )
    return f"suffixes part at token {outcome.first_divergence} ({margins}){traffic}; {numerics}"


def judge(
    experiment: Experiment,
    rows: Iterable[Record],
    expectation: Expectation,
    environment: dict[str, Any] | None = None,
    planned: int | None = None,
) -> Verdict:
    """The verdict of a run's rows (read once, twice for a sampled run, which is judged
    by its certificate)."""
    items = outcomes(experiment, rows)
    certificate = None
    if any(o.seeds for o in items):
        certificate = _certificate(experiment, rows, expectation.margin)
    arms = experiment.panel.arms
    compared = (arms[0].construction, arms[1].construction)
    return Verdict(expectation, compared, items, certificate, environment or {}, planned)


def decided(experiment: Experiment, expectation: Expectation, rows: list[Record]) -> bool:
    """Whether the rows so far already decide a FAIL, so a check stops running items:
    replicas that disagreed; under ``bitwise``, the first item whose numerics part (or
    cannot be compared); under ``--max-rate``, more parted items than it allows."""
    items = outcomes(experiment, rows)
    if any(o.reached and not o.replicas_ok for o in items):
        return True
    judged = [o for o in items if o.reached and o.cache_hit_tokens != 0]
    if expectation.kind == "bitwise":
        return any(o.bits != "equal" for o in judged)
    if expectation.max_rate is not None and expectation.kind != "faithful":
        return sum(o.diverges for o in judged) > expectation.allowed
    return False


@dataclass(frozen=True)
class StopRule:
    """:func:`decided` as a run's stop rule (:class:`~kvreplay.run.runner.Stop`): the
    manifest records its expectation, from which an audit re-derives the stop."""

    experiment: Experiment
    expectation: Expectation

    def __call__(self, rows: list[Record]) -> bool:
        return decided(self.experiment, self.expectation, rows)

    def to_json(self) -> dict[str, Any]:
        return {"expectation": asdict(self.expectation)}

    @classmethod
    def from_json(cls, experiment: Experiment, data: dict[str, Any]) -> StopRule:
        return cls(experiment, Expectation(**data["expectation"]))


def _certificate(experiment: Experiment, rows: Iterable[Record], margin: float) -> dict[str, Any]:
    from kvreplay.measure.certificate import PairedSamples, certify

    samples = []
    for record in rows:
        if record.data.get("kind") == "prefix" or record.data["status"] != "ok":
            continue
        pairs = experiment.read_row(record.data).pairs
        samples.append(
            PairedSamples(
                item=record.data["item_id"],
                live=tuple(a.answer for a, _ in pairs),
                prefill=tuple(b.answer for _, b in pairs),
                live_correct=tuple(a.correct for a, _ in pairs),
                prefill_correct=tuple(b.correct for _, b in pairs),
                changed=tuple(a.suffix_sha256 != b.suffix_sha256 for a, b in pairs),
            )
        )
    return certify(samples, margin).to_json()


def verdict_sentence(experiment: Experiment, rows: Iterable[Record], margin: float | None) -> str:
    """The sentence a ``kvreplay run`` ends with: its rows judged against the default
    expectation (every suffix equal; the certificate when sampled), with the bits level,
    the near-ties and the power beside it."""
    sampled = any(r.data.get("samples") for r in rows)
    kind = "faithful" if sampled else "exact"
    expectation = Expectation(kind, 0, margin or DEFAULT_MARGIN)
    if not sampled:
        return judge(experiment, rows, expectation).sentence()
    precisions = dict.fromkeys(r.data["precision"] for r in rows)
    return " ".join(
        f"{p}: "
        + judge(experiment, [r for r in rows if r.data["precision"] == p], expectation).sentence()
        for p in precisions
    )


@dataclass(frozen=True)
class VerdictRecord:
    """A verdict JSON as a reader needs it, whichever schema wrote it: a v1 file has no
    bits level (``levels['bits']`` is None) and no power."""

    schema: str
    verdict: str
    exit_code: int
    sentence: str
    levels: dict[str, Any]


def read_json(data: Any) -> VerdictRecord:
    """Read a verdict JSON of any readable schema; anything else is refused."""
    if not isinstance(data, dict) or data.get("schema") not in READABLE:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise KvreplayError(
            f"Not a kvreplay verdict (schema {schema!r}; readable: {', '.join(READABLE)})."
        )
    if data["schema"] != "kvreplay-check-v1":  # v2 and v3 have both levels
        levels = data["levels"]
    else:
        counts = data["counts"]
        levels = {
            "tokens": {
                "holds": counts["suffixes_differ"] == 0,
                "items": counts["reached"],
                "differ": counts["suffixes_differ"],
                "rate_upper_95": rate_upper_bound(counts["suffixes_differ"], counts["reached"]),
            },
            "bits": None,
        }
    return VerdictRecord(
        data["schema"], data["verdict"], data["exit_code"], data["sentence"], levels
    )
