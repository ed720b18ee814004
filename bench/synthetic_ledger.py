"""Write a synthetic run of N matched rows, made from a committed run's matched rows, for
timing ``audit --sample 0`` and measuring ``analyze``'s memory at scale.

Row i is template row i mod T (its tokens, fingerprints and scores as recorded) for a
new item that copies the template row's item (prompt and answer) under a new id, so
every check an audit makes without re-executing passes: the items, the contract, the
experiment's config and the hash chain are recomputed with kvreplay's own encoders, and
the CSV is derived from the rows. No claims or report are written (analyze writes them).

Usage: python bench/synthetic_ledger.py OUT --rows N [--from RUN] (default: results/smollm2-n24)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvreplay.core.canonical import sha256_json
from kvreplay.core.items import Item, items_digest, load_jsonl
from kvreplay.experiments.registry import recorded_table
from kvreplay.ledger import GENESIS, Record, RunRows

TEMPLATE = Path(__file__).resolve().parents[1] / "results" / "smollm2-n24"
EXPERIMENT = "matched"


def synthesize(template: Path, out: Path, rows: int) -> None:
    manifest = json.loads((template / "manifest.json").read_text())
    entry = manifest["experiments"][EXPERIMENT]
    dtypes = entry["config"]["dtypes"]
    source = [
        json.loads(line)
        for line in (template / "rows.jsonl").read_text().splitlines()
        if json.loads(line)["experiment"] == EXPERIMENT
    ]
    by_key = {(r["data"]["item_id"], r["data"]["precision"]): r for r in source}
    template_items = {i.id: i for i in load_jsonl(template / "items.jsonl")}
    template_ids = entry["config"]["item_ids"]
    count = -(-rows // len(dtypes))  # items, so that items x dtypes >= rows
    copies = [template_items[template_ids[i % len(template_ids)]] for i in range(count)]
    items = [Item(f"s{i:06d}", c.prompt, c.answer, c.meta) for i, c in enumerate(copies)]
    out.mkdir(parents=True)
    with (out / "items.jsonl").open("w", encoding="utf-8") as handle:
        for item in items:
            handle.write(json.dumps(item.to_dict(), sort_keys=True) + "\n")
    config = {**entry["config"], "item_ids": [i.id for i in items]}
    contract = manifest["contract"]
    contract["items"] = {"source": "items.jsonl", "digest": items_digest(items), "count": count}
    manifest.update(
        contract=contract,
        contract_sha256=sha256_json(contract),
        experiments={EXPERIMENT: {**entry, "config": config, "config_sha256": sha256_json(config)}},
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    previous = GENESIS
    with (out / "rows.jsonl").open("w", encoding="utf-8") as handle:
        for seq, (dtype, index) in enumerate((d, i) for d in dtypes for i in range(count)):
            if seq == rows:
                break
            row = by_key[(template_ids[index % len(template_ids)], dtype)]
            data = {**row["data"], "item_id": items[index].id}
            record = Record(
                key=f"{EXPERIMENT}/{items[index].id}/{dtype}", experiment=EXPERIMENT,
                data=data, worker=row["worker"], timing=row["timing"], seq=seq,
                prev=previous, contract=manifest["contract_sha256"], hash="",
            )  # fmt: skip
            record.hash = record.expected_hash()
            previous = record.hash
            handle.write(record.to_line())
    # The CSV from the rows as written, read back a row at a time (any N fits in memory).
    written, problems = RunRows.checked(out / "rows.jsonl", manifest["contract_sha256"])
    assert not problems, problems[0]
    table = recorded_table(EXPERIMENT, manifest)
    assert table is not None
    with (out / table.csv_name(config)).open("w", encoding="utf-8", newline="") as handle:
        handle.writelines(table.csv_lines(written, config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--from", dest="template", type=Path, default=TEMPLATE)
    args = parser.parse_args()
    synthesize(args.template, args.out, args.rows)


if __name__ == "__main__":
    main()
