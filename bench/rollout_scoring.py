"""Scoring overhead of the rollout experiment's trainer scorer on the embedded smollm2-135m.

Usage: .venv/bin/python bench/rollout_scoring.py [--dtype bf16] [--sequences 16]
       [--tokens 128] [--repeat 5]

The trainer's scorer (``kvreplay.backends.hf.rollout.HfPrefill``) runs one plain forward
of transformers over each sequence and then turns the logits into what a row records:
the log-softmax in fp32, each sampled token's log-probability, the top-1/top-2 gap and
where the argmax differs. The baseline is that forward alone, on the same batch of
sequences (each one prompt of the arith items and ``--tokens`` token ids after it):
what a trainer computes anyway. Both are timed interleaved, median of ``--repeat`` runs
each, on one thread (``OMP_NUM_THREADS``); the goal is scoring / forward <= 1.1.

Prints one line per run and a JSON summary. Timings are the machine's: run it on a quiet
box.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch

    from kvreplay.backends.hf.loading import load_model
    from kvreplay.backends.hf.rollout import HfPrefill
    from kvreplay.core.items import encode_prompt, load_items

    lm = load_model("smollm2-135m", args.dtype)
    generator = torch.Generator().manual_seed(0)
    batch = []
    for item in load_items("arith")[: args.sequences]:
        prompt = encode_prompt(lm.tokenizer, item.prompt)
        tokens = torch.randint(0, len(lm.tokenizer), (args.tokens,), generator=generator)
        batch.append((prompt, tokens.tolist()))
    scorer = HfPrefill(lm, f"hf:{args.dtype} prefill")

    @torch.inference_mode()
    def forward() -> None:
        for prompt, tokens in batch:
            ids = torch.tensor([[*prompt, *tokens]], dtype=torch.long)
            lm.model(input_ids=ids).logits  # noqa: B018 - the trainer's forward, timed

    def score() -> None:
        for prompt, tokens in batch:
            scorer.score(prompt, tokens)

    forward(), score()  # warm up
    times: dict[str, list[float]] = {"forward": [], "score": []}
    for run in range(args.repeat):
        for name, work in (("forward", forward), ("score", score)):
            start = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - start)
        print(f"run {run}: forward {times['forward'][-1]:.3f} s, score {times['score'][-1]:.3f} s")
    forward_s, score_s = (statistics.median(times[k]) for k in ("forward", "score"))
    print(
        json.dumps(
            {
                "machine": platform.machine(),
                "threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "sequences": args.sequences,
                "tokens": args.tokens,
                "forward_s": forward_s,
                "score_s": score_s,
                "ratio": score_s / forward_s,
                "goal": 1.1,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
