"""``kvreplay check``: a verdict on a stack in a minute, for people and for CI.

A check is a small ``matched`` run (or ``resample`` at temperature > 0): live vs prefill
on the hf backend, a prefix-cache hit vs a miss on a served one, each with its replica,
judged against an expectation (:mod:`kvreplay.verify.verdict`). It is itself a run folder, so
``kvreplay audit`` re-executes it and rerunning it resumes it. Its outputs: the verdict
on screen, ``--json``, ``--junit``, and a repro pack for the first divergent item.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import load_jsonl
from kvreplay.core.outputs import Inputs, check_targets
from kvreplay.core.paths import replace_file
from kvreplay.experiments.experiment import Experiment
from kvreplay.run.ledger import ITEMS, Record
from kvreplay.verify.verdict import SCHEMA, Expectation, StopRule, Verdict, judge, parse_expectation

# The experiments a check runs: live vs prefill greedily, or the resample certificate
# under --expect faithful (whose options, --select and --screen, a check takes too), or
# history under --traffic N (the hit under traffic beside the hit alone and the miss).
GREEDY, FAITHFUL, UNDER_TRAFFIC = "matched", "resample", "history"

DEFAULT_ITEMS = 4


def repro_pack(
    folder: Path,
    verdict: Verdict,
    run_dir: Path,
    rows: list[Record],
    experiment: Experiment,
    command: list[str],
) -> Path | None:
    """For the first item that fails the expectation (its suffixes, or under
    ``bitwise`` its numerics, part): its item line, P, both suffixes, where tokens and
    numerics part, the margins and first-step logprobs, the environment, and the one
    command that reproduces it (this check on that item alone)."""
    first = next((o for o in verdict.items if o.reached and not verdict.passes(o)), None)
    if first is None:
        return None
    record = next(
        r for r in rows if r.data.get("item_id") == first.item_id
        and r.data.get("precision") == first.precision and r.data.get("kind") != "prefix"
    )  # fmt: skip
    row = experiment.read_row(record.data)
    left, right = row.pairs[0]
    folder.mkdir(parents=True, exist_ok=True)
    item_line = folder / "item.jsonl"
    item = next(i for i in load_jsonl(run_dir / ITEMS) if i.id == first.item_id)
    replace_file(item_line, (json.dumps(item.to_dict(), sort_keys=True) + "\n").encode())
    rerun = _rerun_command(command, item_line, folder / "rerun", first.precision)
    prefix = row.prefix
    pack = {
        "schema": SCHEMA + "-repro",
        "item_id": first.item_id,
        "precision": first.precision,
        "prompt_token_ids": prefix["prefix_token_ids"][: prefix["prompt_token_count"]],
        "prefix_token_ids": prefix["prefix_token_ids"],
        "compared": list(verdict.compared),
        "suffixes": {
            verdict.compared[0]: left.suffix_token_ids,
            verdict.compared[1]: right.suffix_token_ids,
        },  # fmt: skip
        "first_divergence": first.first_divergence,
        "numeric_divergence": first.numeric_step,
        "bits": first.bits,
        "margins_at_divergence": {
            verdict.compared[0]: first.left_margin,
            verdict.compared[1]: first.right_margin,
        },  # fmt: skip
        "first_step_logprobs": {
            name: arm.served.first_logprobs
            for name, arm in zip(verdict.compared, (left, right), strict=True)
            if arm.served is not None
        },
        "environment": verdict.environment,
        "command": shlex.join(rerun),
    }
    replace_file(
        folder / "repro.json", (json.dumps(pack, indent=2, sort_keys=True) + "\n").encode()
    )
    return folder


def _rerun_command(command: list[str], items: Path, out: Path, precision: str) -> list[str]:
    """The check's own command line (as :func:`kvreplay.cli.command_line` gives it),
    narrowed to one item and precision and a new folder."""
    drop = {
        "--items",
        "--n",
        "--max-rate",
        "--select",
        "--screen",
        "--dtypes",
        "--out",
        "--json",
        "--junit",
        "--repro",
    }
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return [*kept, "--items", str(items), "--n", "1", "--dtypes", precision, "--out", str(out)]


def write_outputs(verdict: Verdict, json_path: Path | None, junit_path: Path | None) -> None:
    for path, text in (
        (json_path, json.dumps(verdict.to_json(), indent=2, sort_keys=True) + "\n"),
        (junit_path, verdict.junit()),
    ):
        if path is None:
            continue
        try:
            replace_file(path, text.encode("utf-8"))
        except OSError as exc:
            raise KvreplayError(f"Cannot write {path} ({exc.strerror or exc}).") from exc


def check_outputs(out: Path, json_path: Path | None, junit_path: Path | None, repro: Path) -> None:
    """Refuse, before the run writes anything, outputs that would overwrite the run or
    each other, or that cannot be written: a path inside the run folder (its ledger,
    items, manifest), the same path twice, a folder where a file goes (or a file where
    the repro pack's folder goes), or a folder that does not exist or is not writable."""
    run = out.resolve()
    named = {"--json": json_path, "--junit": junit_path, "--repro": repro}
    seen: dict[Path, str] = {}
    for flag, path in named.items():
        if path is None:
            continue
        where = path.resolve()
        if where == run or run in where.parents or (flag == "--repro" and where in run.parents):
            raise KvreplayError(
                f"{flag} {path} lies inside the check's run folder {out} (or holds it); "
                "name a path outside it."
            )
        if where in seen:
            raise KvreplayError(f"{flag} and {seen[where]} name the same path {path}.")
        seen[where] = flag
        if flag == "--repro":
            _check_folder_target(path)
        else:
            _check_file_target(flag, path)


def _check_file_target(flag: str, path: Path) -> None:
    if path.exists() and not path.is_file():
        raise KvreplayError(f"{flag} {path} exists and is not a regular file.")
    if path.exists() and not os.access(path, os.W_OK):
        raise KvreplayError(f"{flag} {path} is not writable.")
    parent = path.parent
    if not parent.is_dir():
        raise KvreplayError(f"Cannot write {path}: the folder {parent} does not exist.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvreplayError(f"Cannot write {path}: the folder {parent} is not writable.")


def _check_folder_target(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise KvreplayError(f"--repro {path} exists and is not a folder.")
    existing = path if path.exists() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise KvreplayError(f"Cannot write the repro pack {path}: {existing} is not writable.")


def default_out(options: dict[str, Any]) -> Path:
    """One folder per model, backend, precisions and temperature, so a rerun resumes."""
    model = Path(str(options["model"])).name or "model"
    dtypes = "-".join(options["dtypes"])
    name = f"{model}-{options['backend']}-{dtypes}-t{options['temperature']:g}"
    return Path("kvreplay-check") / re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def _environment(manifest: dict[str, Any]) -> dict[str, Any]:
    contract = manifest["contract"]
    model = contract["model_info"]
    return {
        "kvreplay_version": manifest.get("kvreplay_version"),
        "model": {"spec": model["spec"], "model_digest": model["model_digest"]},
        "backend": contract["run"].get("backend") or {"name": "hf"},
        **contract["environment"],
    }


def run_check(
    options: dict[str, Any],
    make_request: Callable[[str, Path, dict[str, Any]], Any],
    echo: Callable[[str], None],
    command: list[str],
) -> Verdict:
    """Run (or resume) the check the CLI options ask for, print its verdict, write its
    outputs, and return the verdict. Every refusal comes before the run writes. The run
    stops once its verdict is decided (:func:`~kvreplay.verify.verdict.decided`)."""
    from kvreplay.experiments import get_experiment
    from kvreplay.run.ledger import RunLedger, parse_rows
    from kvreplay.run.runner import run

    options = dict(options)
    take = options.pop
    out, json_path, junit_path, repro = (
        take(k) for k in ("out", "json_path", "junit_path", "repro")
    )
    expectation = parse_expectation(
        take("expect"), take("max_divergent"), take("margin"), options["temperature"],
        take("max_rate"),
    )  # fmt: skip
    samples = take("samples")
    name = FAITHFUL if expectation.kind == "faithful" else GREEDY
    if samples is not None and name != FAITHFUL:
        raise KvreplayError("--samples applies at --temperature above 0 only.")
    if options.get("traffic") and name == FAITHFUL:
        raise KvreplayError("--traffic applies to greedy checks only.")
    if options.get("traffic"):  # the hit under traffic beside the hit alone and the miss
        name = UNDER_TRAFFIC
    if name == FAITHFUL:
        if options["select"] is not None or options["screen"] is not None:
            raise KvreplayError("--select and --screen apply to greedy checks only.")
        options |= {"samples": samples or 8, "margin": expectation.margin}
    options["n"] = _item_count(options, expectation)
    out = out or default_out(options)
    repro = repro or out.with_name(out.name + ".repro")
    check_outputs(out, json_path, junit_path, repro)
    check_targets(
        {"--json": json_path, "--junit": junit_path},
        {"--repro": repro},
        Inputs.of((out, options["items_source"], options["model"], options["plan"])),
    )
    request = make_request(name, out, options)
    _check_numerics(request.backend, expectation)
    experiment = get_experiment(name, request.backend, require_engine=False)
    run(request, quiet=True, stop=StopRule(experiment, expectation))
    ledger = RunLedger.open_existing(out)
    records, _ = parse_rows(ledger.rows_path, ledger.contract_hash)
    rows = [r for r in records if r.experiment == name]
    planned = len(options["dtypes"]) * options["n"]
    verdict = judge(experiment, rows, expectation, _environment(ledger.manifest), planned)
    echo(verdict.screen())
    write_outputs(verdict, json_path, junit_path)
    pack = repro_pack(repro, verdict, out, rows, experiment, command)
    if pack is not None:
        command = json.loads((pack / "repro.json").read_text())["command"]
        echo(f"repro pack: {pack}; reproduce the first divergence with: {command}")
    echo(f"check run: {out} (kvreplay audit {out} re-executes it)")
    return verdict


def _item_count(options: dict[str, Any], expectation: Expectation) -> int:
    """How many items the check runs: ``--n`` (4 by default), or under ``--max-rate``
    as many as a pass needs to bound the rate under it, which the item set must hold."""
    from kvreplay.core.items import load_items

    needed = expectation.items_needed()
    if needed is None:
        return options["n"] if options["n"] is not None else DEFAULT_ITEMS
    if options["n"] is not None:
        raise KvreplayError(
            f"--max-rate {expectation.max_rate:g} sets how many items run ({needed}); "
            "leave out --n."
        )
    total = len(load_items(options["items_source"]))
    if total < needed:
        raise KvreplayError(
            f"--max-rate {expectation.max_rate:g} needs {needed} items for a pass to bound "
            f"the divergence rate under it, but the item set {options['items_source']} holds "
            f"{total}; give a larger --items set or a higher --max-rate."
        )
    return needed


def _check_numerics(backend: Any, expectation: Expectation) -> None:
    """A bitwise check compares numerics, which a backend reports through its logits
    (K/V access) or its top-k logprobs; one that reports neither is refused."""
    capabilities = backend.capabilities
    if expectation.kind == "bitwise" and not (capabilities.kv_access or capabilities.top_logprobs):
        raise KvreplayError(
            f"--expect bitwise compares numerics, but the {backend.name} backend reports "
            "neither logits nor top-k logprobs; use --expect exact."
        )
