"""``rollout``: does a trainer's teacher-forced prefill score the tokens a rollout stack
sampled the way the sampler did (design: rollout stack, scorer, mismatch)?

Per item and precision of the rollout stack (``--backend``, ``--dtypes``), ``--samples``
rollouts at ``--temperature`` (seeds ``--seed``, ``--seed`` + 1, ...; ``--top-p``,
``--top-k``), each ``--turns`` turns long (a later turn re-sends the earlier answer and
a follow-up token for token, so its prompt is a prefix-cache hit over blocks the
earlier decode wrote). Every turn is scored by the stack's own one-shot prefill
(``engine``, where the backend can score) and by each of ``--scorers`` (the trainers:
``hf:fp32``, ``hf:bf16:replay``, ...), and controlled by a miss (later turns) and a
batch (the first turn, with ``--companions`` other items, on a backend that batches).
The CSV and the section are :mod:`kvreplay.experiments.rollout.table` and
:mod:`kvreplay.experiments.rollout.section`; the per-rollout routine is
:func:`kvreplay.experiments.rollout.roll.roll`. Torch loads only when a unit runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvreplay.backends import ModelRef, make_backend
from kvreplay.backends.rollout import LOADS, ScorerSpec, parse_scorers, scorer_digest, scorer_load
from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item, chat_messages, encode_prompt
from kvreplay.core.options import option
from kvreplay.core.rollout import LOGPROB_MODES, Conversation, Sampling
from kvreplay.experiments.rollout.claims import SECTION, plain
from kvreplay.experiments.rollout.roll import Bench, roll
from kvreplay.experiments.rollout.schema import MAX_SAMPLES, MAX_TOKENS, MAX_TOP_K, MAX_TURNS
from kvreplay.experiments.rollout.section import rollout_claims, summary_lines
from kvreplay.experiments.rollout.table import RolloutRow
from kvreplay.harness.experiment import Experiment, planned_keys
from kvreplay.harness.panel import Panel
from kvreplay.harness.rows import PanelRow
from kvreplay.harness.scope import Scope, Selection, own_options
from kvreplay.harness.section import Reading
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

FOLLOWUP = "Check your answer, then state it again."
MARK = "\u2063kvreplay-answer\u2063"  # stands for an answer while a chat template renders


@dataclass(frozen=True)
class RolloutOptions:
    """``rollout``'s own options (``kvreplay check --trainer`` takes them too)."""

    scorers: str = field(
        default="hf:fp32",
        metadata=option(
            "--scorers",
            "Comma-separated scorers besides the rollout stack's own prefill: "
            "BACKEND:PRECISION[:SCHEDULE][@MODEL] (schedule prefill, a trainer's one "
            "shot, or replay, the live schedule), or engine:replay.",
        ),
    )
    top_k: int = field(
        default=0,
        metadata=option(
            "--top-k", "Sample from the k likeliest tokens (0: off).", minimum=0, maximum=MAX_TOP_K
        ),
    )
    logprobs: str = field(
        default="raw",
        metadata=option(
            "--logprobs",
            "Which log-probability the rollout stack reports: raw (before temperature and "
            "truncation) or processed (of the distribution sampled from).",
            choices=LOGPROB_MODES,
        ),
    )
    max_tokens: int = field(
        default=128,
        metadata=option(
            "--max-tokens",
            "Tokens a turn samples at most (every turn's within the model's context window).",
            minimum=1,
            maximum=MAX_TOKENS,
        ),
    )
    ignore_eos: bool = field(
        default=False,
        metadata=option("--ignore-eos", "Sample every turn to --max-tokens, past EOS."),
    )
    samples: int = field(
        default=1,
        metadata=option(
            "--samples",
            "Rollouts per item (seeds --seed, --seed+1, ...).",
            minimum=1,
            maximum=MAX_SAMPLES,
        ),
    )
    turns: int = field(
        default=1,
        metadata=option(
            "--turns",
            "Turns per rollout; each later one re-sends the earlier answer and --followup.",
            minimum=1,
            maximum=MAX_TURNS,
        ),
    )
    followup: str = field(
        default=FOLLOWUP, metadata=option("--followup", "The user message of every later turn.")
    )
    trainer_load: str = field(
        default="pretrained",
        metadata=option(
            "--trainer-load",
            "How a scorer whose backend has a choice (hf) loads its precision: pretrained "
            "(as from_pretrained(dtype=...) leaves the model, the buffers it keeps in fp32 "
            "kept: as a trainer loads it) or cast (every floating tensor cast to the "
            "precision, the rotary inv_freq too: as kvreplay's runs load).",
            choices=LOADS,
        ),
    )

    def sampling(self, scope: Scope) -> Sampling:
        sampler = scope.config.sampler
        return Sampling(
            sampler.temperature, sampler.top_p, self.top_k, sampler.seed, self.logprobs,
            self.max_tokens, self.ignore_eos,
        )  # fmt: skip


def followup_ids(tokenizer: Any, text: str, chat: bool | None) -> list[int]:
    """The ids that follow an answer and start the next turn: through the chat template
    where the run uses one (what the template puts between an assistant message and the
    start of the next assistant message, with ``text`` as the user message between),
    else a newline and ``text``."""
    if chat_messages(tokenizer, "", chat) is None:
        return [int(t) for t in tokenizer.encode("\n" + text, add_special_tokens=False)]
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": MARK},
        {"role": "user", "content": text},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if MARK not in rendered:
        raise KvreplayError(
            "The chat template drops an assistant message, so --turns needs --no-chat."
        )
    tail = rendered.split(MARK, 1)[1]
    return [int(t) for t in tokenizer.encode(tail, add_special_tokens=False)]


def check_scorers(specs: list[ScorerSpec], scope: Scope) -> None:
    """Refuse (one sentence) scorers that cannot run here or would score other tokens
    than those sampled: a backend not installed, or a model whose tokenizer maps ids to
    other strings than the rollout model's."""
    from kvreplay.model.reading import load_tokenizer

    config = scope.config
    seen: dict[tuple[Any, ...], str] = {}
    for spec in specs:
        model = spec.model or config.model
        same = (spec.backend, spec.precision, spec.schedule, os.path.realpath(model)
                if os.path.exists(model) else model)  # fmt: skip
        if same in seen:
            raise KvreplayError(
                f"--scorers names one scorer twice, as {seen[same]} and {spec.label} (the same "
                "backend, precision, schedule and model files); list each scorer once."
            )
        seen[same] = spec.label
    ours = None
    for spec in specs:
        if spec.backend is None:
            continue  # the stack's own: installed with it
        make_backend(spec.backend).check_installed()
        if spec.model is None or spec.model == config.model:
            continue
        ours = ours or load_tokenizer(config.model, config.backend.trusts_remote_code)
        theirs = load_tokenizer(spec.model, config.backend.trusts_remote_code)
        if theirs.get_vocab() != ours.get_vocab() or theirs.eos_token_id != ours.eos_token_id:
            raise KvreplayError(
                f"The scorer {spec.label} has a tokenizer whose ids are not the rollout "
                f"model's ({config.model}), so it would score other tokens than those sampled."
            )


def check_context(options: RolloutOptions, items: list[Item], scope: Scope) -> None:
    """Refuse (one sentence, before anything runs) rollouts whose last turn would run
    past the model's context window: the prompt, every turn at ``--max-tokens`` and every
    follow-up between them."""
    from kvreplay.model.reading import load_tokenizer, text_config

    run = scope.config
    trusts = run.backend.trusts_remote_code
    window = run.backend.context_window(
        int(getattr(text_config(run.model, trusts), "max_position_embeddings", 0) or 0)
    )
    if not window:
        return
    tokenizer = load_tokenizer(run.model, trusts)
    followup = followup_ids(tokenizer, options.followup, run.chat) if options.turns > 1 else []
    added = options.turns * options.max_tokens + (options.turns - 1) * len(followup)
    for item in items:
        prompt = len(encode_prompt(tokenizer, item.prompt, run.chat))
        if prompt + added > window:
            raise KvreplayError(
                f"Item {item.id}'s rollout would span {prompt + added} tokens (its prompt, "
                f"{options.turns} turn(s) of --max-tokens {options.max_tokens} and the "
                f"follow-ups), past the model's context window of {window}; give fewer "
                "--turns or --max-tokens."
            )


SHARED_INPUTS = ("sampling", "seeds", "turns", "followup_token_ids", "engine", "scorers")


def unit_inputs(config: dict[str, Any], items: list[Item]) -> dict[str, dict[str, Any]]:
    """Each item's unit inputs, by item id: the config's sampling, seeds, turns,
    follow-up, scorers, and the prompts of the items after it as its batch's companions."""
    shared = {k: config[k] for k in SHARED_INPUTS}
    found = {}
    for index, item in enumerate(items):
        others = [items[(index + k) % len(items)] for k in range(1, len(items))]
        found[item.id] = {
            **shared,
            "companions": [o.prompt for o in others[: config["companions"]]],
        }
    return found


class Rollout(Experiment):
    """The rollout experiment, on a backend that runs in process (hf, llamacpp)."""

    panel: Panel[Any] = Panel(())  # no arms: a rollout is sampled and scored, not continued

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        return items[:n]  # every rollout samples from its item's prompt

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        options = own_options(RolloutOptions, scope, "rollout's")
        backend = scope.config.backend
        if not backend.capabilities.rollout:
            raise KvreplayError(
                f"The {backend.name} backend cannot sample with per-token log-probabilities, "
                "so it cannot be a rollout stack."
            )
        options.sampling(scope).check(backend.rollout_logprobs(), backend.name)
        specs = parse_scorers(options.scorers)
        if any(s.backend is None and s.schedule == "prefill" for s in specs):
            raise KvreplayError(
                "The rollout stack's own prefill is always scored (engine); --scorers names "
                "the others."
            )
        if not specs and not backend.capabilities.scoring:
            raise KvreplayError(
                f"The {backend.name} backend cannot score its own rollouts, so --scorers must "
                "name at least one scorer."
            )
        check_scorers(specs, scope)
        selection = super().select(scope, rows)
        check_context(options, selection.items, scope)
        return selection

    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        from kvreplay.model.reading import load_tokenizer

        options = own_options(RolloutOptions, scope, "rollout's")
        run = scope.config
        sampling = options.sampling(scope)
        followup: list[int] = []
        if options.turns > 1:
            tokenizer = load_tokenizer(run.model, run.backend.trusts_remote_code)
            followup = followup_ids(tokenizer, options.followup, run.chat)
        batches = run.backend.capabilities.batch_control
        return {
            "item_ids": [item.id for item in selection.items],
            "dtypes": list(scope.dtypes),
            "sampling": sampling.to_dict(),
            "seeds": [sampling.seed + i for i in range(options.samples)],
            "turns": options.turns,
            "followup": options.followup if options.turns > 1 else None,
            "followup_token_ids": followup,
            "engine": run.backend.capabilities.scoring,
            "scorers": [
                {
                    "label": spec.label,
                    **spec.to_dict(),
                    "model_digest": run.model_digest
                    if spec.backend is None
                    else scorer_digest(spec, run.model),
                    **(
                        {"load": scorer_load(spec.backend, options.trainer_load)}
                        if spec.backend is not None
                        else {}
                    ),
                }
                for spec in parse_scorers(options.scorers)
            ],
            "companions": int(getattr(run.backend, "companions", 0)) if batches else 0,
        }

    def row_values(self, scope: Scope) -> tuple[int, str]:
        """Per sample and turn, each token's id, log-probability and margin on every side
        (the decode, the engine's prefill, each scorer, a control) and its argmax pair."""
        options = own_options(RolloutOptions, scope, "rollout's")
        sides = 3 + len(parse_scorers(options.scorers))
        tokens = options.samples * options.turns * options.max_tokens
        return tokens * sides * 4, "--samples, --turns, --max-tokens or --scorers"

    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]:
        inputs = unit_inputs(self.config(scope, selection), selection.items)
        return [
            Unit(UnitKey(self.name, item.id, dtype), item, dtype, inputs[item.id])
            for dtype in scope.dtypes
            for item in selection.items
        ]

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        """Every row's inputs are its config's sampling, seeds, turns, follow-up (its ids
        the run's tokenizer makes of its text), scorers and companions: a config edited
        with its hash recomputed contradicts its rows."""
        if config["turns"] > 1 and run is not None:
            from kvreplay.model.reading import load_tokenizer

            tokenizer = load_tokenizer(run.model, run.backend.trusts_remote_code)
            ids = followup_ids(tokenizer, config["followup"], run.chat)
            config = {**config, "followup_token_ids": ids}
        inputs = unit_inputs(config, [items[i] for i in config["item_ids"]])
        return {
            str(UnitKey(self.name, item_id, dtype)): inputs[item_id]
            for dtype in config["dtypes"]
            for item_id in config["item_ids"]
        }

    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        return planned_keys(self.name, config["item_ids"], config["dtypes"], rows)

    def read_row(self, data: dict[str, Any]) -> PanelRow:
        """A rollout row has no arms: it is read as one (a row that does not read is
        refused here), and the audit's panel checks find nothing to check in it."""
        row = RolloutRow.from_dict(data)
        return PanelRow(row.item_id, row.precision, {}, {}, {}, None, None, None, ("", ""))

    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]:
        from kvreplay.backends.rollout import open_scorer

        run = worker.config
        backend = run.backend
        opened = worker.served(unit.precision) if self.served else worker.model(unit.precision)
        inputs = unit.inputs
        scorers: list[tuple[str, Any]] = []
        if inputs["engine"]:
            scorers.append(("engine", backend.scorer(opened, "prefill")))
        for entry in inputs["scorers"]:
            spec = ScorerSpec(*(entry[k] for k in ("backend", "precision", "schedule", "model")))
            if spec.backend is None:  # the stack's own, in another schedule (engine:replay)
                scorers.append((entry["label"], backend.scorer(opened, spec.schedule)))
            else:
                model = ModelRef(spec.model or run.model, entry["model_digest"], run.device)
                # a run recorded before scorers chose how to load cast every tensor
                load = entry.get("load", "cast")
                scorers.append((entry["label"], open_scorer(spec, model, load)))
        sampling = Sampling(**inputs["sampling"])
        tokenizer = opened.tokenizer
        followups = (tuple(inputs["followup_token_ids"]),) * (inputs["turns"] - 1)
        companions = [
            Conversation(tuple(encode_prompt(tokenizer, prompt, run.chat)), (), sampling)
            for prompt in inputs["companions"]
        ]
        bench = Bench(backend.rollout_stack(opened), scorers, companions)
        prompt = encode_prompt(tokenizer, unit.item.prompt, run.chat)
        rollouts = [
            roll(bench, Conversation(tuple(prompt), followups, sampling.seeded(seed)), clock)
            for seed in inputs["seeds"]
        ]
        return {
            "item_id": unit.item.id,
            "precision": unit.precision,
            "status": "ok",
            "temperature": sampling.temperature,
            "prompt_token_ids": prompt,
            "rollouts": rollouts,
        }

    def run_summary(
        self, rows: list[Record], config: dict[str, Any]
    ) -> tuple[dict[str, Any], str] | None:
        """The section's summary lines of the run's rows: a rollout row is no panel."""
        done = [r for r in rows if r.data.get("status") == "ok"]
        if not done:
            return {"experiment": self.name, "rows": 0}, "rollout: no row completed"
        ledger = self.table.ledger(done, config)
        groups = rollout_claims(Reading({ledger.file: ledger}, done)).precisions
        summary = "\n".join(summary_lines(groups))
        return {"experiment": self.name, SECTION: plain(groups)}, summary


class ServedRollout(Rollout):
    """The rollout experiment on a serving backend (vllm in process, http)."""

    served = True
