"""``weight-update``: what a rollout engine serves once an RL step has updated its weights
(design: weight update arm).

Per item and precision, on a backend that updates its weights mid-run through its own
path (vLLM in process: the workers' ``reload_weights``; ``vllm serve``: its reload route):

1. ``before``: the item's prompt sampled under the run's own weights, the prefix cache
   filled with its blocks;
2. the weights synced to ``--update`` (loaded, then the prefix cache reset, as a correct
   RL sync does) and the same request sent again (``after``): with a correct sync a miss;
   a sync that forgot the reset serves it from blocks the old weights wrote (the
   stale-cache bug, prime-rl PR #1650);
3. ``miss``: the same request after a reset, the reference, and the engine's own prefill
   of its tokens under the new weights (its engine term);
4. ``inflight`` (an engine that can): back on the run's weights, a rollout whose weights
   are updated once it has sampled ``--update-at`` tokens, its later tokens decoded over
   the K/V the old weights wrote (asynchronous RL), and the engine's prefill of its
   tokens under the new weights (the in-flight term);

then the run's own weights synced back. Every request draws the same seed. The CSV is
:mod:`kvreplay.experiments.weight_update.table`, the section
:mod:`kvreplay.experiments.weight_update.section`. Torch loads only when a unit runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvreplay.backends import ModelRef, make_backend
from kvreplay.backends.rollout import ScorerSpec, parse_scorers, scorer_digest
from kvreplay.core.errors import KvreplayError
from kvreplay.core.extras import missing
from kvreplay.core.items import Item, encode_prompt
from kvreplay.core.options import option
from kvreplay.core.rollout import Conversation, Sampling
from kvreplay.experiments.weight_update.schema import MAX_TOKENS
from kvreplay.experiments.weight_update.section import (
    SECTION,
    plain,
    summary_lines,
    update_claims,
)
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Panel
from kvreplay.harness.rows import PanelRow
from kvreplay.harness.scope import Scope, Selection, own_options
from kvreplay.harness.section import Reading
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record
from kvreplay.model.update import WeightUpdate


@dataclass(frozen=True)
class UpdateOptions:
    """``weight-update``'s own options (``kvreplay check --update`` takes them too)."""

    update: str | None = field(
        default=None,
        metadata=option(
            "--update",
            "The weights the engine is updated to mid-run: perturb:SCALE[:SEED] (the run's "
            "own weights moved by seeded noise of SCALE standard deviations per tensor) or "
            "a model folder of the same architecture and tokenizer.",
        ),
    )
    max_tokens: int = field(
        default=48,
        metadata=option(
            "--max-tokens",
            "Tokens a request samples (past EOS).",
            minimum=2,
            maximum=MAX_TOKENS,
        ),
    )
    scorers: str = field(
        default="",
        metadata=option(
            "--scorers",
            "Comma-separated trainers (BACKEND:PRECISION of a backend that loads the model in "
            "process, e.g. hf:bf16) that score the in-flight rollout's tokens under the new "
            "weights: the cross term beside the in-flight one (none: no cross term).",
        ),
    )
    update_at: int | None = field(
        default=None,
        metadata=option(
            "--update-at",
            "After how many sampled tokens an in-flight rollout's weights are updated "
            "(default: half of --max-tokens).",
            minimum=1,
            maximum=MAX_TOKENS - 1,
        ),
    )

    def sampling(self, scope: Scope) -> Sampling:
        sampler = scope.config.sampler
        return Sampling(sampler.temperature, sampler.top_p, 0, sampler.seed, "raw",
                        self.max_tokens, ignore_eos=True)  # fmt: skip

    def at(self) -> int:
        at = self.update_at if self.update_at is not None else self.max_tokens // 2
        if not 0 < at < self.max_tokens:
            raise KvreplayError(
                f"--update-at {at} must lie between 1 and --max-tokens ({self.max_tokens}) less 1."
            )
        return at


def weights_of(options: UpdateOptions) -> WeightUpdate:
    if options.update is None:
        raise KvreplayError("weight-update needs --update (perturb:SCALE[:SEED] or a folder).")
    return WeightUpdate.parse(options.update)


def trainers_of(options: UpdateOptions) -> list[ScorerSpec]:
    return parse_scorers(options.scorers) if options.scorers else []


def spec_entry(spec: ScorerSpec, model: str) -> dict[str, Any]:
    """A trainer as the config records it: its spec, its model's digest, its loading."""
    assert spec.backend is not None
    return {"label": spec.label, **spec.to_dict(), "model_digest": scorer_digest(spec, model),
            "load": "pretrained"}  # fmt: skip


_TRAINERS: dict[tuple[str, str, str], Any] = {}


def trainer(entry: dict[str, Any], run: Any, weights: WeightUpdate, folder: Any) -> Any:
    """A trainer's scorer at the new weights: its precision loaded as a trainer loads it,
    then moved to the update in place; once per process."""
    key = (entry["label"], entry["model_digest"], weights.spec)
    if key not in _TRAINERS:
        backend = make_backend(entry["backend"])
        model = ModelRef(run.model, entry["model_digest"], run.device)
        lm = backend.load_trainer(model, entry["precision"], entry["load"])
        weights.apply(lm.model, folder)
        _TRAINERS[key] = backend.scorer(lm, "prefill")
    return _TRAINERS[key]


class WeightUpdateExperiment(Experiment):
    """The weight-update experiment on a served engine (vLLM in process, ``vllm serve``)."""

    panel: Panel[Any] = Panel(())  # no arms of a panel: requests around a weight sync
    served = True

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        options = own_options(UpdateOptions, scope, "weight-update's")
        backend = scope.config.backend
        if not backend.capabilities.weight_update:
            raise KvreplayError(
                f"The {backend.name} backend cannot update its weights mid-run, so it cannot "
                "run weight-update (--backend vllm can)."
            )
        if weights_of(options).folder is None and missing("torch"):
            raise KvreplayError(
                "--update perturb computes the new weights with torch, which this install "
                "lacks (pip install 'kvreplay[hf]'); give a model folder instead."
            )
        options.at()
        options.sampling(scope).check(backend.rollout_logprobs(), backend.name)
        for spec in trainers_of(options):
            trainer = make_backend(spec.backend or "")
            if spec.model is not None or spec.schedule != "prefill" or not trainer.trainer_loads:
                raise KvreplayError(
                    f"--scorers {spec.label}: weight-update's trainers are a backend that loads "
                    "the run's model in process (hf:PRECISION), moved to the new weights."
                )
            trainer.check_installed()
        return super().select(scope, rows)

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        options = own_options(UpdateOptions, scope, "weight-update's")
        weights = weights_of(options)
        trainers = [spec_entry(spec, scope.config.model) for spec in trainers_of(options)]
        digest = None
        if weights.folder is not None:
            from kvreplay.model.reading import source_identity

            digest = source_identity(weights.folder).describe()["model_digest"]
        return {
            "item_ids": [item.id for item in selection.items],
            "dtypes": list(scope.dtypes),
            "sampling": options.sampling(scope).to_dict(),
            "update": {**weights.to_dict(), "model_digest": digest},
            "update_at": options.at(),
            "scorers": trainers,
        }

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        config = self.config(scope, selection)
        shared = {k: config[k] for k in ("sampling", "update", "update_at", "scorers")}
        return [
            Unit(UnitKey(self.name, item.id, dtype), item, dtype, shared)
            for dtype in scope.dtypes
            for item in selection.items
        ]

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def read_row(self, data: dict[str, Any]) -> PanelRow:
        """A row of requests around a sync, no panel: read as one with no arms."""
        for arm in ("before", "after", "miss"):
            if not isinstance(data.get(arm), dict):
                raise KvreplayError(f"a weight-update row has no {arm!r} turn")
        return PanelRow(data["item_id"], data["precision"], {}, {}, {}, None, None, None, ("", ""))

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        from kvreplay.model.sources import resolve_source

        run = worker.config
        backend = run.backend
        opened = worker.served(unit.precision)
        folder, _ = resolve_source(run.model, backend.trusts_remote_code)
        stack = backend.rollout_stack(opened)
        updater = backend.weight_updater(opened, str(folder))
        engine = backend.scorer(opened, "prefill")
        inputs = unit.inputs
        recorded = {k: v for k, v in inputs["update"].items() if k != "model_digest"}
        weights = WeightUpdate(**recorded)
        prompt = encode_prompt(opened.tokenizer, unit.item.prompt, run.chat)
        conversation = Conversation(tuple(prompt), (), Sampling(**inputs["sampling"]))
        row: dict[str, Any] = {
            "item_id": unit.item.id,
            "precision": unit.precision,
            "status": "ok",
            "temperature": conversation.sampling.temperature,
            "prompt_token_ids": prompt,
            "update_at": inputs["update_at"],
        }
        with clock.model():
            try:
                stack.reset_cache()
                row["before"] = stack.sample([conversation], reuse=True)[0][0].to_dict()
                updater.sync(weights)
                row["after"] = stack.sample([conversation], reuse=True)[0][0].to_dict()
                stack.reset_cache()
                miss = stack.sample([conversation], reuse=True)[0][0]
                row["miss"] = miss.to_dict()
                row["miss_prefill"] = engine.score(prompt, miss.token_ids).to_dict()
                if updater.inflight:
                    updater.sync(None)
                    inflight = updater.sample_inflight(conversation, inputs["update_at"], weights)
                    row["inflight"] = inflight.to_dict()
                    scored = engine.score(prompt, inflight.token_ids)
                    row["inflight_prefill"] = scored.to_dict()
                    row["inflight_scores"] = {
                        entry["label"]: trainer(entry, run, weights, folder)
                        .score(prompt, inflight.token_ids)
                        .to_dict()
                        for entry in inputs.get("scorers", [])
                    }
            finally:
                updater.sync(None)  # the run's own weights for the next unit
        return row

    def run_summary(
        self, rows: list[Record], config: dict[str, Any]
    ) -> tuple[dict[str, Any], str] | None:
        done = [r for r in rows if r.data.get("status") == "ok"]
        if not done:
            return {"experiment": self.name, "rows": 0}, "weight-update: no row completed"
        ledger = self.table.ledger(done, config)
        claims = update_claims(Reading({ledger.file: ledger}, done))
        return {"experiment": self.name, SECTION: plain(claims)}, "\n".join(summary_lines(claims))
