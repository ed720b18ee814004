"""Cut-and-refeed items: long greedy generations cut at seeded random points and fed back
as token-id prompts (the shape of SGLang's cache-consistency test; our own generator).

One generation gives a check many boundaries that share its prefix: on a server, every
cut after the first finds the blocks the earlier cuts wrote in the prefix cache, and each
item's continuation starts mid-generation rather than right after a prompt. The items are
written as JSONL (each prompt the token ids up to its cut, template included, so they are
fed as they are); a run freezes them into its items.jsonl, so an audit re-executes the same
ids on any backend. The generation itself runs on transformers, greedily, at ``--dtype``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item, encode_prompt, id_problem, load_items
from kvreplay.core.options import SEEDS, bounds, check_bounds, option
from kvreplay.core.outputs import Inputs, check_file_target, write_output
from kvreplay.core.stages import load_plan, plan_budget
from kvreplay.model.embedded import DEFAULT_MODEL
from kvreplay.model.precision import DTYPES

# Bounds: a workload for a check, not a corpus.
MAX_SOURCES = 64
MAX_CUTS = 64
MAX_TOKENS = 4096


@dataclass(frozen=True)
class RefeedPlan:
    """Which generations and cuts: ``sources`` items of ``items_source`` (their first),
    each continued greedily by ``model`` at ``dtype`` for up to ``tokens`` tokens, cut at
    ``cuts`` distinct seeded points inside its generation, each leaving the model's context
    window room for the stage plan ``run_plan`` of the runs that take the items."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata=option(
            "--model", "The model whose greedy generations are cut (transformers, in process)."
        ),
    )
    dtype: str = field(
        default="fp32",
        metadata=option("--dtype", "Precision of the generations.", choices=DTYPES),
    )
    items_source: str = field(
        default="arith",
        metadata=option(
            "--from", "The items whose prompts start the generations (a built-in set or JSONL)."
        ),
    )
    sources: int = field(
        default=4,
        metadata=option(
            "--sources", "Generations: the first N items of --from.", minimum=1, maximum=MAX_SOURCES
        ),
    )
    cuts: int = field(
        default=6,
        metadata=option(
            "--cuts",
            "Seeded cut points per generation; each is one item.",
            minimum=1,
            maximum=MAX_CUTS,
        ),
    )
    tokens: int = field(
        default=256,
        metadata=option(
            "--tokens",
            "The most tokens each generation runs (it ends early at EOS).",
            minimum=1,
            maximum=MAX_TOKENS,
        ),
    )
    seed: int = field(
        default=0, metadata=option("--seed", "Seed of the cut points.", **bounds(SEEDS))
    )
    run_plan: str = field(
        default="instruct",
        metadata=option(
            "--plan",
            "The stage plan of the runs that take the items: every cut leaves it room in the "
            "model's context window.",
        ),
    )

    def check(self) -> None:
        check_bounds(self)
        if self.tokens <= self.cuts:
            raise KvreplayError(
                f"--tokens ({self.tokens}) must exceed --cuts ({self.cuts}): each cut is a "
                "distinct point inside a generation."
            )


def cut_points(
    rng: random.Random, prompt_len: int, total: int, cuts: int, longest: int
) -> list[int]:
    """Distinct cut points, ascending, each leaving at least one generated token before
    it and one after it (so every item starts mid-generation), none past ``longest``."""
    inside = range(prompt_len + 1, min(total, longest + 1))
    return sorted(rng.sample(inside, min(cuts, len(inside))))


def greedy_generation(lm: Any, prompt_ids: list[int], tokens: int) -> list[int]:
    """The model's greedy continuation of ``prompt_ids``: up to ``tokens`` ids, ending
    early at an end-of-sequence token."""
    import torch

    from kvreplay.core.stages import eos_ids

    eos = sorted(eos_ids(lm.tokenizer, lm.model.generation_config))
    with torch.inference_mode():
        out = lm.model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def source_prompts(plan: RefeedPlan) -> tuple[list[tuple[Item, list[int]]], int]:
    """The source items and their prompts' token ids, checked as a run checks its items
    before any model work: every token id in the model's vocabulary, a generation that
    fits the model's context window (prompt and ``--tokens``), room in it for a cut and
    the run's plan, and ids of the items cut from it that a run accepts
    (``{id}-cut{N}``); and the longest cut a run with the plan takes."""
    from kvreplay.model.reading import load_tokenizer, text_config, vocabulary_size

    model = plan.model
    sources = load_items(plan.items_source)[: plan.sources]
    tokenizer = load_tokenizer(model)
    config = text_config(model)
    vocabulary = vocabulary_size(config, tokenizer)
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    budget = plan_budget(load_plan(plan.run_plan), tokenizer)
    longest = context - budget if context else 2**63  # no window known: no bound
    found = []
    for source in sources:
        if source.prompt is None:
            raise KvreplayError(f"Item {source.id} of {plan.items_source!r} has no prompt.")
        prompt = encode_prompt(tokenizer, source.prompt)
        outside = [t for t in prompt if t >= vocabulary]
        if outside:
            raise KvreplayError(
                f"Item {source.id} has token id {str(outside[0])[:30]} in its prompt, outside "
                f"the model's vocabulary of {vocabulary}."
            )
        if context and len(prompt) + plan.tokens > context:
            raise KvreplayError(
                f"Item {source.id}'s prompt is {len(prompt)} tokens, so a generation of "
                f"--tokens {plan.tokens} would run past the model's context window of "
                f"{context}; give --tokens of at most {context - len(prompt)}."
            )
        if context and len(prompt) + 1 > longest:
            raise KvreplayError(
                f"Item {source.id}'s prompt is {len(prompt)} tokens and --plan "
                f"{plan.run_plan} adds up to {budget}, so no cut of its generation leaves "
                f"room in the model's context window of {context}."
            )
        last_id = f"{source.id}-cut{len(prompt) + plan.tokens}"
        problem = id_problem(last_id)
        if problem:
            raise KvreplayError(
                f"Item {source.id[:40]!r} would give cut items ids such as "
                f"{last_id[:40]!r}..., which {problem}; give the source a shorter id."
            )
        found.append((source, prompt))
    return found, longest


def refeed_items(plan: RefeedPlan) -> list[Item]:
    """The cut-and-refeed items of ``plan`` (see the module docstring)."""
    from kvreplay.backends.hf.loading import load_model

    plan.check()
    sources, longest = source_prompts(plan)
    model, dtype = plan.model, plan.dtype
    lm = load_model(model, dtype)
    rng = random.Random(plan.seed)
    items = []
    for source, prompt in sources:
        whole = prompt + greedy_generation(lm, prompt, plan.tokens)
        for cut in cut_points(rng, len(prompt), len(whole), plan.cuts, longest):
            meta = {
                "set": "cut-refeed", "source": source.id, "cut": cut,
                "generated": len(whole) - len(prompt), "prompt_tokens": len(prompt),
                "seed": plan.seed, "model": model, "dtype": dtype,
            }  # fmt: skip
            items.append(Item(f"{source.id}-cut{cut}", whole[:cut], source.answer, meta))
    if not items:
        raise KvreplayError(
            f"No generation of {model!r} ran past its first token, so there is nowhere to cut; "
            "give more --tokens or other --from items."
        )
    return items


def check_out(out: Path, inputs: tuple[str, str]) -> None:
    """``out`` must be a new file in an existing folder kvreplay can write to, and in no
    input's folder (the model's, ``inputs``), checked before any generation."""
    _still_new(out)
    check_file_target("--out", out, Inputs.of(inputs))


def _still_new(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise KvreplayError(f"{out} already exists; choose another --out.")


def write_items(items: list[Item], out: Path) -> None:
    """The items as JSONL at ``out`` (written whole, then renamed into place)."""
    _still_new(out)  # nothing took the name while the generations ran
    text = "".join(json.dumps(i.to_dict(), ensure_ascii=False) + "\n" for i in items)
    write_output(out, text.encode("utf-8"))
