"""Probes for phase 2 of issue 43: request shapes a check could add, measured against the
fault suite before any of them is built into ``kvreplay check``.

One in-process vLLM engine (fp32, prefix caching, block size 32, a pool of 96 blocks so
that an eviction takes a few requests); each probe serves P (an item's chat prompt, cut
to the shape the probe names) after some history and compares the continuation (8 greedy
tokens, or 8 seeded sampled ones, and every step's top-2 logprobs, bit for bit) with a
miss of the same P (a reset cache, one prefill):

- ``warm``: P's blocks written by a one-token prefill of P (vLLM's own cold/hot shape);
- ``aligned``: the same with P cut to a whole number of blocks (the last one recomputed);
- ``interloper``: a warm P, then an unrelated request that takes the freed tail block;
- ``second``: a warm P hit twice; the second hit against the first;
- ``companion``: a prompt that agrees with P up to half a block past a block boundary and
  then differs, cached first;
- ``concurrent``: the hit of a warm P in one batch with an unrelated prompt (its tokens
  only: a batch of two moves the numerics of a clean engine too);
- ``evicted``: a warm P, then unrelated prompts that fill the pool;
- ``sampled``: the warm hit and the miss sampled at T = 0.7 with one seed.

A fault is caught when a probe's continuation differs from its reference; a false alarm
is a probe that differs on the clean engine. Faults are planted in this process
(:func:`kvreplay.faults.planted`), the engine is shared.

    VPY bench/phase2_probes.py OUT.json [--items N] [--faults a,b] [--model SPEC]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvreplay.faults import FAULTS, planted  # noqa: E402

BLOCK = 32
NEW = 8
POOL_BLOCKS = 96

Outcome = tuple[list[int], list[list[tuple[int, str]]]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path", type=Path)
    parser.add_argument("--items", type=int, default=4)
    parser.add_argument("--faults", default=",".join(f.name for f in FAULTS if f.engine == "vllm"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--table", action="store_true", help="print PATH's results as Markdown")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.path.read_text())), end="")
        return

    from vllm import LLM, SamplingParams

    from kvreplay.core.items import arith_items, encode_prompt
    from kvreplay.model.reading import load_tokenizer
    from kvreplay.model.sources import resolve_source

    folder, _ = resolve_source(args.model)
    tokenizer = load_tokenizer(args.model)
    config = json.loads((folder / "config.json").read_text())
    length = min(2048, int(config.get("max_position_embeddings") or 2048))
    began = time.monotonic()
    llm = LLM(model=str(folder), dtype="float32", block_size=BLOCK, enable_prefix_caching=True,
              enforce_eager=True, max_model_len=length, max_num_batched_tokens=length,
              distributed_executor_backend="uni", seed=0,
              num_gpu_blocks_override=POOL_BLOCKS)  # fmt: skip
    start_seconds = time.monotonic() - began
    vocabulary = llm.llm_engine.model_config.get_vocab_size()
    greedy = SamplingParams(temperature=0, max_tokens=NEW, logprobs=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, max_tokens=NEW, logprobs=2, seed=7, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1)

    def serve(prompts: list[list[int]], params: SamplingParams = greedy) -> list[Outcome]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            (
                list(o.outputs[0].token_ids),
                [
                    sorted((t, float(lp.logprob).hex()) for t, lp in s.items())
                    for s in o.outputs[0].logprobs or []
                ],
            )  # fmt: skip
            for o in outputs
        ]

    def miss(p: list[int], params: SamplingParams = greedy) -> Outcome:
        llm.reset_prefix_cache()
        return serve([p], params)[0]

    def warm(p: list[int]) -> None:
        llm.reset_prefix_cache()
        serve([p], one)

    def unrelated(seed: int, length: int) -> list[int]:
        return [(seed * 7919 + i * 104729) % (vocabulary - 1) for i in range(length)]

    def probes(p: list[int]) -> dict[str, Callable[[], bool]]:
        aligned = p[: len(p) // BLOCK * BLOCK]
        cut = (len(p) // BLOCK - 1) * BLOCK + BLOCK // 2
        companion = p[:cut] + unrelated(3, len(p) - cut)

        def hit_after(history: Callable[[], None], shape: list[int] = p) -> bool:
            reference = miss(shape)
            warm(shape)
            history()
            return serve([shape])[0] != reference

        def second() -> bool:
            warm(p)
            first = serve([p])[0]
            return serve([p])[0] != first

        def with_companion() -> bool:
            reference = miss(p)
            llm.reset_prefix_cache()
            serve([companion], one)
            return serve([p])[0] != reference

        def concurrent() -> bool:  # tokens only: batching alone moves the numerics
            reference = miss(p)
            warm(p)
            return serve([p, unrelated(5, 200)])[0][0] != reference[0]

        def evicted() -> bool:
            reference = miss(p)
            warm(p)
            for seed in range(POOL_BLOCKS * BLOCK // (length // 2) + 1):
                serve([unrelated(11 + seed, length // 2)], one)
            return serve([p])[0] != reference

        def sampled_hit() -> bool:
            reference = miss(p, sampled)
            warm(p)
            return serve([p], sampled)[0] != reference

        return {
            "warm": lambda: hit_after(lambda: None),
            "aligned": lambda: hit_after(lambda: None, aligned),
            "interloper": lambda: hit_after(lambda: serve([unrelated(1, 40)], one)),
            "second": second,
            "companion": with_companion,
            "concurrent": concurrent,
            "evicted": evicted,
            "sampled": sampled_hit,
        }

    items = [encode_prompt(tokenizer, i.prompt, None) for i in arith_items()[: args.items]]
    results = []
    for name in [None, *args.faults.split(",")]:
        for index, p in enumerate(items):
            context = planted(name) if name else nullcontext()
            with context:
                for probe, run in probes(p).items():
                    began = time.monotonic()
                    differs = run()
                    results.append({"fault": name, "item": index, "probe": probe,
                                    "differs": differs,
                                    "seconds": round(time.monotonic() - began, 2)})  # fmt: skip
        summary = {
            probe: sum(r["differs"] for r in results if (r["fault"], r["probe"]) == (name, probe))
            for probe in probes(items[0])
        }
        print(name or "clean", summary, flush=True)
    args.path.write_text(
        json.dumps(
            {
                "engine_start_seconds": round(start_seconds, 1),
                "items": args.items,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


def table(data: dict) -> str:
    """Per fault (and clean), on how many items each probe's continuation differed."""
    results = data["results"]
    probes = list(dict.fromkeys(r["probe"] for r in results))
    faults = list(dict.fromkeys(r["fault"] for r in results))
    lines = [
        "| fault | " + " | ".join(probes) + " | mean s per item (all probes) |",
        "|---|" + "---|" * (len(probes) + 1),
    ]
    for fault in faults:
        mine = [r for r in results if r["fault"] == fault]
        items = {r["item"] for r in mine}
        cells = [
            f"{sum(r['differs'] for r in mine if r['probe'] == p)}/{len(items)}" for p in probes
        ]
        seconds = sum(r["seconds"] for r in mine) / len(items)
        lines.append(f"| {fault or 'clean'} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
