"""vllm backend vs hf backend (issue 13), or the http backend against a running server
(issue 26), on the same model, prompts and token budget.

Usage: .venv-vllm/bin/python bench/serve_speed.py --backend vllm|hf|http [--url URL]
       [--dtype bf16] [--tokens 120] [--prompts 4]

Both backends run in the vLLM environment, so they share torch and the model folder.
Prints one JSON line: the fixed start-up cost (engine start for vllm, model load for hf),
and greedy decode throughput: ``--prompts`` arith prompts, each continued alone (one
request at a time, as kvreplay's arms are) for up to ``--tokens`` tokens, from a
one-shot prefill of the prompt. Throughput counts generated tokens over the time of the
requests (prefill included), so a stop at EOS does not flatter either side.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("vllm", "hf", "http"), required=True)
    parser.add_argument("--url", default="", help="the server (http backend)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()

    from kvreplay.backends import make_backend
    from kvreplay.backends.served import Request
    from kvreplay.contract.config import RunConfig
    from kvreplay.core.items import encode_prompt, load_items
    from kvreplay.core.sampler import Sampler
    from kvreplay.core.stages import Stage, StagePlan
    from kvreplay.model.reading import describe_source

    stage = Stage("decode", args.tokens)
    plan = StagePlan("bench", (Stage("prompt", 1), stage))
    info = describe_source(args.model)
    config = RunConfig(
        model=args.model,
        model_digest=info["model_digest"],
        plan=plan,
        backend=make_backend(args.backend, **({"url": args.url} if args.url else {})),
    )
    items = load_items("arith")[: args.prompts]
    began = time.perf_counter()
    if args.backend in ("vllm", "http"):
        served = config.backend.open_served(config.model_ref, args.dtype)
        start_s = time.perf_counter() - began
        prompts = [encode_prompt(served.tokenizer, i.prompt) for i in items]

        def decode(ids: list[int]) -> int:
            served.reset_cache()
            return len(served.serve([Request(ids, stage, Sampler())])[0].segment.token_ids)
    else:
        from kvreplay.backends.hf.loading import load_model
        from kvreplay.core.trajectory import Prefix
        from kvreplay.model.construct import build
        from kvreplay.model.decode import continue_from

        lm = load_model(args.model, args.dtype)
        start_s = time.perf_counter() - began
        prompts = [encode_prompt(lm.tokenizer, i.prompt) for i in items]

        def decode(ids: list[int]) -> int:
            state = build(lm, Prefix(ids, len(ids)), "prefill")
            return len(continue_from(lm, state, plan).token_ids)

    decode(prompts[0])  # warm-up, not counted
    began = time.perf_counter()
    tokens = sum(decode(ids) for ids in prompts)
    seconds = time.perf_counter() - began
    print(json.dumps({
        "backend": args.backend, "dtype": args.dtype, "start_s": round(start_s, 2),
        "tokens": tokens, "decode_s": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
