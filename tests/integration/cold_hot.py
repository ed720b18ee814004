"""vLLM's own prefix-caching determinism method, as its test suite states it (not its
code): prompts that share a prefix spanning several cache blocks and end in unique
questions; reset the prefix cache; a cold batch; a hot rerun of the same batch that reads
the cached prefix; each prompt's per-step logprobs compared bit for bit.

Run by tests/integration/test_check_served.py in a fresh process (one vLLM engine per
process) with the engine settings of kvreplay's vllm backend:

    python cold_hot.py SPEC.json   # {"model", "dtype", "block_size", "prompts": [[ids]], ...}

prints one JSON line: per prompt, whether cold and hot agree bit for bit, the first step
where they part, and the cached tokens each run read.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    engine = LLM(
        model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
        block_size=spec["block_size"], enable_prefix_caching=True,
        max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], enforce_eager=True, seed=0,
        distributed_executor_backend="uni",
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=2)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    def batch() -> tuple[list[list[list[tuple[int, str]]]], list[int]]:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        steps = [
            [
                sorted((t, float(lp.logprob).hex()) for t, lp in step.items())
                for step in o.outputs[0].logprobs
            ]
            for o in outputs
        ]
        return steps, [int(o.num_cached_tokens or 0) for o in outputs]

    assert engine.reset_prefix_cache()
    cold, cold_cached = batch()
    hot, hot_cached = batch()
    result = []
    for a, b, c, h in zip(cold, hot, cold_cached, hot_cached, strict=True):
        parted = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        result.append(
            {"bit_equal": a == b, "first_step": parted, "cold_cached": c, "hot_cached": h}
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
