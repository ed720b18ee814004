"""Compare a vllm-backend matched run with a transformers (hf) matched run of the same
items, plan and precisions (issue 13): does the engine reach the same prefix P as the
transformers live generation, and from P does a prefix-cache hit (or miss) continue as
the transformers live state (or one-shot prefill) does?

Usage: .venv/bin/python bench/cross_backend.py SERVED_RUN HF_RUN [--out FILE.json]

Rows are paired by item and precision; suffixes are compared only where both stacks
reached the same P (token for token), since a different P makes any later comparison
moot. Prints a Markdown table and writes the counts as JSON (default:
results/comparisons/<served run's name>.json; never inside a run folder, whose audit names
every file a run did not write).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvreplay.ledger import RunLedger, parse_rows

PAIRS = (
    ("hit_vs_hf_live", "left", "left"),
    ("miss_vs_hf_prefill", "prefill", "prefill"),
    ("hit_vs_hf_prefill", "left", "prefill"),
    ("miss_vs_hf_live", "prefill", "left"),
)


def rows(run: Path) -> dict[tuple[str, str], dict]:
    ledger = RunLedger.open_existing(run)
    records, problems = parse_rows(ledger.rows_path, ledger.contract_hash)
    if problems:
        raise SystemExit(f"{run}: {problems[0]}")
    return {
        (r.data["item_id"], r.data["precision"]): r.data
        for r in records
        if r.experiment == "matched" and r.data.get("status") == "ok"
    }


def compare(served: dict, hf: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for precision in sorted({p for _, p in served}):
        keys = [k for k in served if k[1] == precision and k in hf]
        same = [k for k in keys if served[k]["prefix_sha256"] == hf[k]["prefix_sha256"]]
        block = {"paired_rows": len(keys), "same_prefix": len(same)}
        for name, mine, theirs in PAIRS:
            differ = sum(
                served[k]["arms"][mine]["suffix_sha256"] != hf[k]["arms"][theirs]["suffix_sha256"]
                for k in same
            )
            block[name] = {"differ": differ, "n": len(same)}
        out[precision] = block
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("served", type=Path)
    parser.add_argument("hf", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = compare(rows(args.served), rows(args.hf))
    path = args.out or Path("results/comparisons") / f"{args.served.name}.json"
    path.write_text(json.dumps({"served": str(args.served), "hf": str(args.hf), **result},
                               indent=2, sort_keys=True) + "\n")  # fmt: skip
    print("| precision | same P as transformers | " + " | ".join(n for n, _, _ in PAIRS) + " |")
    print("|---" * (2 + len(PAIRS)) + "|")
    for precision, b in result.items():
        cells = [f"{b[n]['differ']}/{b[n]['n']} differ" for n, _, _ in PAIRS]
        print(
            f"| {precision} | {b['same_prefix']}/{b['paired_rows']} | " + " | ".join(cells) + " |"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
