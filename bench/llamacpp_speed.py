"""llama.cpp vs transformers on the same model, prompt and tokens: one live generation.

Loads the embedded SmolLM2 through a backend (``hf``: the dequantized weights in torch;
``llamacpp``: the GGUF as shipped, Q4_1), prefills the first ``arith`` prompt in one chunk
and decodes ``--tokens`` greedy tokens one at a time through kvreplay's own boundary
state (the path every experiment takes), on one thread. Prints one JSON line: load,
prefill and decode seconds, and decode tokens per second. Time whole runs with
``farm-bench --vs 'python bench/llamacpp_speed.py --backend hf' -- python
bench/llamacpp_speed.py --backend llamacpp`` (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvreplay.backends import ModelRef, make_backend
from kvreplay.core.items import arith_items, encode_prompt
from kvreplay.model.reading import describe_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("hf", "llamacpp"), required=True)
    parser.add_argument("--dtype", default="fp32", help="hf dtype, or llamacpp KV-cache type")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = ModelRef("smollm2-135m", describe_source("smollm2-135m")["model_digest"])
    start = time.perf_counter()
    lm = make_backend(args.backend).load_model(model, args.dtype)
    loaded = time.perf_counter()
    ids = encode_prompt(lm.tokenizer, arith_items()[0].prompt)
    state = lm.empty_state("live")
    state.advance(lm.model, ids)
    prefilled = time.perf_counter()
    for _ in range(args.tokens):
        state.advance(lm.model, [state.argmax()])
    decoded = time.perf_counter()
    print(
        json.dumps(
            {
                "backend": args.backend,
                "dtype": args.dtype,
                "prompt_tokens": len(ids),
                "decode_tokens": args.tokens,
                "load_s": round(loaded - start, 3),
                "prefill_s": round(prefilled - loaded, 4),
                "decode_s": round(decoded - prefilled, 3),
                "decode_tokens_per_s": round(args.tokens / (decoded - prefilled), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
