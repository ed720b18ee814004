"""Core-engine speed on the embedded smollm2-135m: decode, load, memory-bandwidth floor.

Usage: .venv/bin/python bench/decode_speed.py [--new-tokens N] [--repeat R]

Prints, in one run on the same model and prompt tokens:
1. cold load from the packaged GGUF (conversion into a temporary KVREPLAY_CACHE) vs load
   from that cache, each in a fresh interpreter (goal: cached <= 3 s);
2. for fp32 and bf16, greedy decoding of N tokens by kvreplay (prefill the prompt with
   ``build``, then ``continue_from`` through a one-stage plan) vs ``model.generate`` with
   ``min_new_tokens = max_new_tokens = N``, interleaved, median of R runs each
   (goal: ratio kvreplay/generate <= 1.0);
3. the memory-bandwidth floor of fp32 decode: weight bytes / measured copy bandwidth
   (STREAM-style: read + write bytes of a 512 MiB tensor copy, median), and the ratio of
   kvreplay's measured fp32 decode ms/token to it.

The user's own cache is never touched: everything loads from a temporary cache.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from load_time import probe  # this folder is on sys.path when a script in it runs

MODEL = "smollm2-135m"
COPY_BYTES = 512 << 20
SRC = Path(__file__).resolve().parent.parent / "src"


def probe_load(cache: Path) -> dict[str, float]:
    """Import torch and transformers, then load the model in fp32, in a fresh interpreter."""
    return probe(SRC, "fp32", cache)


def copy_bandwidth(repeat: int) -> float:
    """Bytes moved per second (read + write) by a large tensor copy, median of ``repeat``."""
    import torch

    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * COPY_BYTES / statistics.median(times)


def time_decode(dtype: str, new_tokens: int, repeat: int) -> dict[str, float | int | bool]:
    """kvreplay vs generate on the same prompt, interleaved; medians of ``repeat`` runs."""
    import torch

    import kvreplay
    from kvreplay.core.stages import Stage, StagePlan
    from kvreplay.core.trajectory import Prefix

    lm = kvreplay.load_model(MODEL, dtype)
    item = kvreplay.arith_items()[0]
    prompt = kvreplay.encode_prompt(lm.tokenizer, item.prompt)
    plan = StagePlan("bench", (Stage("prompt", 0), Stage("decode", new_tokens)))
    prefix = Prefix(token_ids=list(prompt), prompt_len=len(prompt))
    input_ids = torch.tensor([prompt])

    def run_kvreplay() -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        state = kvreplay.build(lm, prefix, "prefill")
        built = time.perf_counter()
        tokens = kvreplay.continue_from(lm, state, plan).token_ids
        end = time.perf_counter()
        return end - start, end - built, tokens

    def run_generate() -> tuple[float, list[int]]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = lm.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=lm.tokenizer.eos_token_id,
            )
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    run_kvreplay(), run_generate()  # warm-up, not timed
    totals, decodes, generates = [], [], []
    for _ in range(repeat):
        total, decode, ours = run_kvreplay()
        generated_s, theirs = run_generate()
        totals.append(total)
        decodes.append(decode)
        generates.append(generated_s)
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    return {
        "prompt_tokens": len(prompt),
        "kvreplay_tokens": len(ours),
        "generate_tokens": len(theirs),
        "same_tokens": ours == theirs,
        "kvreplay_ms_per_token": 1000 * statistics.median(totals) / len(ours),
        "kvreplay_decode_ms_per_token": 1000 * statistics.median(decodes) / (len(ours) - 1),
        "generate_ms_per_token": 1000 * statistics.median(generates) / len(theirs),
        "weight_bytes": weight_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch

    load_before = os.getloadavg()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"load average {load_before[0]:.1f} at start (other jobs share these CPUs)"
    )
    with tempfile.TemporaryDirectory(prefix="kvreplay-bench-") as tmp:
        cache = Path(tmp)
        cold = probe_load(cache)
        cached = [probe_load(cache) for _ in range(args.repeat)]
        cached_load = statistics.median(c["load_s"] for c in cached)
        cached_import = statistics.median(c["imports_s"] for c in cached)
        print(f"\nload {MODEL} (fresh interpreter each; import torch/transformers + load_model):")
        print(
            f"  cold from GGUF (convert + cache): {cold['total_s']:.2f} s "
            f"(import {cold['imports_s']:.2f} s + load {cold['load_s']:.2f} s)"
        )
        total = cached_import + cached_load
        print(
            f"  from cache, median of {args.repeat}: {total:.2f} s "
            f"(import {cached_import:.2f} s + load {cached_load:.2f} s); "
            f"goal <= 3 s: {'met' if total <= 3 else 'missed'}"
        )

        os.environ["KVREPLAY_CACHE"] = str(cache)
        os.environ["HF_HUB_OFFLINE"] = "1"
        results = {}
        for dtype in ("fp32", "bf16"):
            r = results[dtype] = time_decode(dtype, args.new_tokens, args.repeat)
            ratio = r["kvreplay_ms_per_token"] / r["generate_ms_per_token"]
            print(
                f"\ngreedy decode, {dtype}: prompt {r['prompt_tokens']} tokens, "
                f"{r['kvreplay_tokens']} new tokens (generate: {r['generate_tokens']}), "
                f"same tokens: {r['same_tokens']}; median of {args.repeat}, interleaved"
            )
            print(
                f"  kvreplay  {r['kvreplay_ms_per_token']:7.2f} ms/token (prefill + decode; "
                f"decode steps alone {r['kvreplay_decode_ms_per_token']:.2f} ms/token)"
            )
            print(f"  generate  {r['generate_ms_per_token']:7.2f} ms/token (prefill + decode)")
            print(f"  ratio kvreplay/generate {ratio:.3f} (goal <= 1.0)")

    bandwidth = copy_bandwidth(max(5, args.repeat))
    weight_bytes = results["fp32"]["weight_bytes"]
    floor_ms = 1000 * weight_bytes / bandwidth
    measured = results["fp32"]["kvreplay_decode_ms_per_token"]
    print(
        f"\nmemory-bandwidth floor, fp32: weights {weight_bytes / 2**20:.0f} MiB, copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (read + write of a {COPY_BYTES >> 20} MiB copy, median)"
    )
    print(
        f"  floor {floor_ms:.2f} ms/token; kvreplay fp32 decode {measured:.2f} ms/token = "
        f"{measured / floor_ms:.2f}x the floor"
    )
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
