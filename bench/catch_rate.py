"""How often a small check catches a divergent stack: random items vs the most fragile
of a screened pool (issue 33, item 4), measured on committed n = 200 runs without a model.

A check of k items catches a stack when at least one of them diverges (its suffix, the
token level, differs between the compared arms). With k items drawn at random from n of
which d diverge, the catch probability is exactly 1 - C(n-d, k) / C(n, k). The fragile
selection screens a pool of m candidate items (each one live generation: the same
trajectory the matched row's live arm records) and checks the k whose first 32 decoded
suffix steps hold the smallest top-1/top-2 margin (the flip predictor's primary score,
fixed before any run was scored); its catch probability is averaged over 20,000 seeded
random pools. A stack that diverges rarely is the hard case, so each run is also thinned
to a 5% divergence rate (all its exact rows, a random 5% share of divergent ones, drawn
anew for every pool). Prints one Markdown table per run and precision.

    .venv/bin/python bench/catch_rate.py [RUN ...]   (default: the committed n = 200 runs)
"""

from __future__ import annotations

import json
import random
import sys
from math import comb
from pathlib import Path

WINDOW = 32
POOLS = 20_000
SEED = 20261205
CHECK = 4
SCREENS = (8, 16, 32)
RUNS = ("results/smollm2-easy-n200", "results/llamacpp-smollm2-easy-n200")


def matched_rows(run: Path) -> dict[str, list[tuple[float, bool]]]:
    """Per precision, each matched row's risk (minus its smallest early live margin) and
    whether its suffix diverged."""
    found: dict[str, list[tuple[float, bool]]] = {}
    for line in (run / "rows.jsonl").read_text().splitlines():
        record = json.loads(line)
        data = record["data"]
        if record["experiment"] != "matched" or data.get("status") != "ok":
            continue
        left, right = data["arms"]["left"], data["arms"]["prefill"]
        margins = [m for s in left["suffix"]["segments"] for m in s["margins"]][:WINDOW]
        risk = -min(margins) if margins else float("-inf")
        found.setdefault(data["precision"], []).append(
            (risk, left["suffix_sha256"] != right["suffix_sha256"])
        )
    return found


def random_catch(n: int, divergent: int, k: int) -> float:
    return 1 - comb(n - divergent, k) / comb(n, k)


def thinned(rows: list[tuple[float, bool]], rate: float, rng: random.Random) -> list:
    """Every exact row and just enough random divergent rows for ``rate``."""
    exact = [r for r in rows if not r[1]]
    divergent = [r for r in rows if r[1]]
    keep = max(1, round(rate * len(exact) / (1 - rate)))
    return exact + rng.sample(divergent, min(keep, len(divergent)))


def fragile_catch(
    rows: list[tuple[float, bool]], pool: int, k: int, rng: random.Random, rate: float | None
) -> float:
    """Screen ``pool`` random rows, check the ``k`` riskiest (ties broken at random)."""
    caught = 0
    for _ in range(POOLS):
        population = thinned(rows, rate, rng) if rate else rows
        screened = rng.sample(population, min(pool, len(population)))
        screened.sort(key=lambda row: (-row[0], rng.random()))
        caught += any(diverged for _, diverged in screened[:k])
    return caught / POOLS


def table(rows: list[tuple[float, bool]], rate: float | None, rng: random.Random) -> None:
    n, d = len(rows), sum(diverged for _, diverged in rows)
    if rate:
        d = max(1, round(rate * (n - d) / (1 - rate)))
        n = n - sum(diverged for _, diverged in rows) + d
    print(f"\n| {CHECK}-item check | items run (screened + checked) | catch |")
    print("|---|---|---|")
    print(f"| random | {CHECK} | {random_catch(n, d, CHECK):.1%} |")
    for pool in (p for p in SCREENS if p < n):
        share = fragile_catch(rows, pool, CHECK, rng, rate)
        print(f"| fragile of {pool} screened | {pool} + {CHECK} | {share:.1%} |")


def main(runs: list[str]) -> None:
    rng = random.Random(SEED)
    for run in runs:
        for precision, rows in matched_rows(Path(run)).items():
            n, d = len(rows), sum(diverged for _, diverged in rows)
            print(f"\n{run} {precision}: {d} of {n} suffixes differ")
            if d == 0:
                continue
            table(rows, None, rng)
            print(f"\nthinned to a 5% divergence rate ({n - d} exact rows kept):")
            table(rows, 0.05, rng)


if __name__ == "__main__":
    main(sys.argv[1:] or list(RUNS))
