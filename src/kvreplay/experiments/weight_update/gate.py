"""The weight-update experiment's gate (design: check, weight update arm): ``kvreplay
check --update WEIGHTS`` runs a small weight-update run (``--n`` items) on the backend
under test and holds when, after each sync, the request sent again was the miss it must
be, bit for bit: the same tokens, the same log-probabilities, no cached token read. A
sync that forgot to reset the prefix cache fails it (exit 1), named as the stale cache
it is. The check reaches it through the experiment's declaration."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from xml.etree import ElementTree

from kvreplay.core.errors import KvreplayError
from kvreplay.core.junit import xml_document
from kvreplay.core.power import percent, rate_upper_bound
from kvreplay.experiments.weight_update.section import (
    UpdateClaims,
    plain,
    stale_sentence,
    update_claims,
)
from kvreplay.experiments.weight_update.table import UPDATE_TABLE, WEIGHT_UPDATE
from kvreplay.harness.gate import GateRequest, GateRun, Judged
from kvreplay.harness.section import Reading
from kvreplay.ledger import Record
from kvreplay.measure.rates import Json
from kvreplay.model.update import WeightUpdate

SCHEMA = "kvreplay-update-v1"
TAKEN = ("update_at",)
"""The experiment's options a check takes (``--update`` is the check's own; its requests
sample the experiment's default number of tokens)."""


@dataclass(frozen=True)
class UpdateVerdict:
    """Whether every sync left no stale cache: the items compared and those that parted,
    per precision, with the section's claims and where the check ran."""

    weights: str
    stack: str
    items: int
    stale: int
    claims: UpdateClaims
    environment: Json

    @property
    def holds(self) -> bool:
        return self.items > 0 and self.stale == 0

    @property
    def exit_code(self) -> int:
        return 0 if self.holds else 1


def sentence(v: UpdateVerdict) -> str:
    head = "HOLDS" if v.holds else "FAILS"
    what = f"{v.stack} updated to {v.weights}"
    if not v.items:
        return f"{head}: {what}: no item ran, so nothing was compared."
    found = "; ".join(f"{p}: {stale_sentence(c)}" for p, c in sorted(v.claims.precisions.items()))
    bound = percent(rate_upper_bound(v.stale, v.items))
    power = (
        "" if v.stale else f"; the rate of stale syncs may still be up to {bound} (95% upper bound)"
    )
    return f"{head} (no stale prefix cache after a weight sync): {what}: {found}{power}."


def to_json(v: UpdateVerdict) -> Json:
    return {
        "schema": SCHEMA,
        "verdict": "holds" if v.holds else "fails",
        "exit_code": v.exit_code,
        "sentence": sentence(v),
        "weights": v.weights,
        "stack": v.stack,
        "items": v.items,
        "stale": v.stale,
        "rate_upper_95": rate_upper_bound(v.stale, v.items),
        "claims": plain(v.claims),
        "environment": v.environment,
    }


def junit(v: UpdateVerdict) -> str:
    """One test case per precision: its syncs left no stale cache."""
    suite = ElementTree.Element(
        "testsuite", name="kvreplay check --update", tests=str(len(v.claims.precisions)),
        failures=str(int(not v.holds)),
    )  # fmt: skip
    for precision, c in sorted(v.claims.precisions.items()):
        case = ElementTree.SubElement(
            suite, "testcase", classname="kvreplay.update", name=f"stale_cache.{precision}"
        )
        if not c.stale_cache.holds:
            failure = ElementTree.SubElement(case, "failure", message=stale_sentence(c))
            parted = [asdict(p) for p in c.stale_cache.parted]
            failure.text = json.dumps(parted, sort_keys=True)
    ElementTree.SubElement(suite, "system-out").text = sentence(v)
    return xml_document(suite)


class UpdateGate:
    """The update gate: the stale-cache verdict of a weight-update run's rows."""

    options = None
    takes = TAKEN

    def plan(self, request: GateRequest) -> GateRun:
        weights = WeightUpdate.parse(request.spec)
        if request.expect is not None:
            raise KvreplayError(
                f"--expect {request.expect} does not apply to --update: a sync either leaves "
                "the cache stale or not, judged bit for bit."
            )
        taken = {k: v for k, v in request.own.items() if k in TAKEN}
        reads = (weights.folder,) if weights.folder is not None else ()
        return GateRun({**taken, "update": weights.spec}, "-update", reads)

    def judge(
        self,
        request: GateRequest,
        rows: list[Record],
        config: Json,
        stack: str,
        environment: Json,
    ) -> Judged:
        done = [r for r in rows if r.experiment == WEIGHT_UPDATE and r.data["status"] == "ok"]
        claims = UpdateClaims({})
        if done:
            ledger = UPDATE_TABLE.ledger(done, config)
            claims = update_claims(Reading({ledger.file: ledger}, done))
        items = sum(c.stale_cache.items for c in claims.precisions.values())
        fine = sum(c.stale_cache.after_is_miss for c in claims.precisions.values())
        verdict = UpdateVerdict(request.spec, f"{stack}:{','.join(config['dtypes'])}", items,
                                items - fine, claims, environment)  # fmt: skip
        text = sentence(verdict)
        return Judged(verdict, text, text, to_json(verdict), junit(verdict))


GATE = UpdateGate()
