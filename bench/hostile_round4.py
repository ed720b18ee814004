"""The hostile-input probe of issue 49 (the fourth round), run by ``hostile_probe.py`` after
the third round's families: the surfaces added last (``kvreplay mismatch``, ``run
rollout``, ``check --trainer``, ``engine.log``, the Python API) tried as the earlier
rounds tried the earlier ones.

The families: every output option of every command (found from the command line, as
``tests/integration/test_output_writer.py`` finds them) pointed at each input of the
command by every route, at links, device nodes, FIFOs and folders that take no file;
files planted under the names a check appends to; rollout manifests and rows a forger
rewrote and rehashed (every field of the wrong type or value, every relation to the
config broken), panel rows with a field added anywhere, an environment key no run
writes; every number option past its bound and the products that exhaust memory; the
Python API handed what no stack returns; and what ``mismatch`` writes of hostile ids
and numbers.

Each case is judged by what it must end in, checked apart from the code it probes: one
sentence on stderr and exit 2 with every protected file's bytes unchanged and no
manifest left (a refusal), an audit that exits 1 naming the field at fault, a
``KvreplayError`` of one line (the API), or outputs a strict parser reads. A case that
hangs is cut at :data:`~hostile_cases.CASE_SECONDS` and left.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from forgery import read_rows, rechain
from helpers import GOOD, cli_commands, cli_params, jsonl
from hostile_cases import WRONG, Family, digests, made, named, refusal, refused, timed

from kvreplay.core.canonical import sha256_json
from kvreplay.core.errors import KvreplayError
from kvreplay.report.commands import OutputPath

TOKENS = 6


def _check(model: Path, items: Path, *extra: object) -> list[object]:
    return ["check", "--model", model, "--items", items, "--plan", "short", "--n", 1,
            "--dtypes", "fp32", *extra]  # fmt: skip


# Family: every output option of every command, pointed at inputs and at what is no file.
def _targets(inputs: dict[str, Path], scratch: Path, counter: Iterator[int]) -> dict[str, Path]:
    """Each target, made afresh: an input by its own name, a symlink, a hard link and a
    path through ``..``; a link elsewhere, a dangling link, a device node, ``/dev/full``,
    a FIFO, a socket, a folder, a missing folder, and a kernel folder."""
    base = made(scratch / f"t{next(counter)}")
    victim = base / "victim.txt"
    victim.write_text("keep\n")
    found: dict[str, Path] = {}
    for name, path in inputs.items():
        found[f"{name}"] = path
        os.symlink(path, base / f"{name}.symlink")
        found[f"symlink to {name}"] = base / f"{name}.symlink"
        if path.is_file():
            os.link(path, base / f"{name}.hardlink")
            found[f"hard link of {name}"] = base / f"{name}.hardlink"
        found[f"{name} through .."] = path.parent / ".." / path.parent.name / path.name
    os.symlink(victim, base / "link")
    os.symlink(base / "nowhere", base / "dangling")
    os.mkfifo(base / "fifo")
    with contextlib.suppress(PermissionError):
        os.mknod(base / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    found |= {
        "a link elsewhere": base / "link",
        "a dangling link": base / "dangling",
        "a device node": base / "null" if (base / "null").exists() else Path("/dev/null"),
        "/dev/full": Path("/dev/full"),
        "a FIFO": base / "fifo",
        "a folder": made(base / "folder"),
        "a missing folder": base / "missing" / "x",
        "/proc": Path("/proc/kvreplay-out"),
        "/sys": Path("/sys/kvreplay-out"),
    }
    return found


def _lines(words: tuple[str, ...], flag: str, ins: dict[str, Path], fresh: Path) -> list[list]:
    """Command lines that would otherwise work, as the output writer's test makes them."""
    model, items, run = ins["model"], ins["items"], ins["run"]
    out = [] if flag == "--out" else ["--out", fresh]
    check = _check(model, items, *out)
    lines: dict[str, list[list]] = {
        "run": [[*words, "--model", model, "--items", items, "--plan", "short", "--n", 1,
                 "--dtypes", "fp32", *out]],
        "check": [check, [*check, "--trainer", "hf:fp32", "--max-tokens", 4]],
        "mismatch": [["mismatch", ins["logged"]], ["mismatch", ins["logged"], "--max-k3-kl", 1]],
        "analyze": [["analyze", run]],
        "report": [["report", run]],
        "items": [[*words, "--model", model, "--from", items, "--sources", 1, "--cuts", 2,
                   "--tokens", 8, *([] if flag == "--out" else ["--out", fresh / "c.jsonl"])]],
        "env": [["env", run]],
        "demo": [["demo", "--n", 1, *out]],
    }  # fmt: skip
    return lines[words[0]]


# What each command reads, of the inputs the family protects (demo reads only what kvreplay
# ships; analyze, report and env read the run folder).
READS = {"run": ("items", "config"), "check": ("items", "config", "rows"), "demo": (),
         "mismatch": ("logged",), "analyze": ("rows",), "report": ("rows",), "env": ("rows",),
         "items": ("items", "config")}  # fmt: skip
# A new or empty folder is what a folder output is for, and its parents are made.
FOLDER_TARGETS = ("a folder", "a missing folder")


def outputs_family(ins: dict[str, Path], scratch: Path) -> Family:
    family = Family("outputs: every option")
    counter = itertools.count()
    inputs = {
        "items": ins["items"],
        "logged": ins["logged"],
        "rows": ins["run"] / "rows.jsonl",
        "config": ins["model"] / "config.json",
    }
    options = [
        (words, max(param.opts, key=len), param.type.kind)
        for words, command in cli_commands()
        for param in cli_params(command)
        if isinstance(param.type, OutputPath)
    ]
    for (words, flag, kind), line_index in itertools.product(options, range(2)):
        fresh = scratch / f"fresh{next(counter)}"
        lines = _lines(words, flag, ins, fresh)
        if line_index >= len(lines):
            continue
        reads = {name: inputs[name] for name in READS[words[0]]}
        for what, target in _targets(reads, scratch, counter).items():
            if kind == "folder" and what in FOLDER_TARGETS:
                continue
            before = digests(ins["items"], ins["logged"], ins["run"], ins["model"])
            result = timed(*lines[line_index], flag, target)
            problem = refused(result, before)
            if problem is None and fresh.exists():
                problem = "the work started"
            label = f"{' '.join(words)}{' (gate)' if line_index else ''} {flag} {what}"
            family.record(label, problem)
    return family


# Family: what a check appends to, planted in its run folder.
PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "engine.log symlink": lambda out, v: os.symlink(v, out / "engine.log"),
    "engine.log hard link": lambda out, v: os.link(v, out / "engine.log"),
    "engine.log dangling": lambda out, v: os.symlink(v.parent / "outside.log", out / "engine.log"),
    "engine.log FIFO": lambda out, v: os.mkfifo(out / "engine.log"),
    "engine.log folder": lambda out, v: (out / "engine.log").mkdir(),
    "engine.log device": lambda out, v: os.mknod(
        out / "engine.log", 0o666 | stat.S_IFCHR, os.makedev(1, 3)
    ),
    ".kvreplay.lock dangling": lambda out, v: os.symlink(
        v.parent / "outside.lock", out / ".kvreplay.lock"
    ),
    ".kvreplay.lock FIFO": lambda out, v: os.mkfifo(out / ".kvreplay.lock"),
    ".kvreplay.lock symlink": lambda out, v: os.symlink(v, out / ".kvreplay.lock"),
}


def planted_family(ins: dict[str, Path], scratch: Path) -> Family:
    family = Family("outputs: planted in --out")
    counter = itertools.count()
    for (name, plant), trainer in itertools.product(PLANTS.items(), (False, True)):
        base = made(scratch / f"p{next(counter)}")
        victim = base / "victim.txt"
        victim.write_text("keep\n")
        out = made(base / "check")
        try:
            plant(out, victim)
        except PermissionError:
            continue  # no device node without root
        extra = ["--trainer", "hf:fp32", "--max-tokens", 4] if trainer else []
        result = timed(*_check(ins["model"], ins["items"], "--out", out, *extra))
        problem = refused(result, {victim: digests(victim)[victim]}, out)
        outside = [p.name for p in base.iterdir() if p.name.startswith("outside")]
        if problem is None and outside:
            problem = f"created {outside[0]} outside the run folder"
        family.record(f"{name}{' --trainer' if trainer else ''}", problem)
    return family


# Families: rollout manifests and rows a forger rewrote, rehashed and rechained.
def _forge(run: Path, scratch: Path, counter: Iterator[int]) -> Path:
    folder = scratch / f"f{next(counter)}"
    shutil.copytree(run, folder)
    return folder


def _write_config(folder: Path, change: Callable[[dict], None]) -> None:
    data = json.loads((folder / "manifest.json").read_text())
    entry = data["experiments"]["rollout"]
    change(entry["config"])
    entry["config_sha256"] = sha256_json(entry["config"])
    (folder / "manifest.json").write_text(json.dumps(data, indent=2))


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def change(data: dict) -> None:
        target = data
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value

    return change


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON value (the first item of a list standing for all)."""
    if path:
        yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*path, key))
    elif isinstance(value, list) and value:
        yield from _paths(value[0], (*path, 0))


def _audited(folder: Path, family: Family, case: str) -> str | None:
    """None when ``audit --sample 0`` exits 1 naming a problem, or refuses plainly; a
    forgery it passes is audited again with every row re-executed, and one named there
    is clean but noted (a well-formed lie: in range and consistent, which only
    re-execution can tell from the truth)."""
    result = timed("audit", folder, "--sample", 0)
    if result.exit_code == 1 and "  - " in result.stdout:
        return None
    if result.exit_code != 0:
        return refusal(result)
    full = timed("audit", folder)
    if full.exit_code == 1 and "  - " in full.stdout:
        family.reexecuted.append(case)
        return None
    return refusal(full) if full.exit_code != 0 else "passed, re-executed too"


def rollout_config_family(run: Path, scratch: Path) -> Family:
    family = Family("schema: rollout config")
    counter = itertools.count()
    config = json.loads((run / "manifest.json").read_text())["experiments"]["rollout"]["config"]
    for path, value in itertools.product(_paths(config), WRONG):
        if value != value or value in (math.inf, -math.inf):
            continue  # not JSON: the strict reader refuses the file (round 3's family)
        if _get(config, path) == value:
            continue
        folder = _forge(run, scratch, counter)
        _write_config(folder, _set(path, value))
        case = f"config.{'.'.join(map(str, path))}={repr(value)[:12]}"
        family.record(case, _audited(folder, family, case))
    for key in ("verdict", "passed", "fault", "x"):
        folder = _forge(run, scratch, counter)
        _write_config(folder, _set((key,), "pass"))
        family.record(f"config.{key} added", named(timed("audit", folder, "--sample", 0), key))
    return family


def _get(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


def rollout_rows_family(run: Path, scratch: Path, quick: bool) -> Family:
    family = Family("schema: rollout rows")
    counter = itertools.count()
    rows = read_rows(run)
    data = rows[0]["data"]
    paths = [p for p in _paths(data) if p[0] != "inputs"]
    cases = [(p, v) for p, v in itertools.product(paths, WRONG) if v == v and abs(_num(v)) < 1e308]
    for path, value in cases[::5] if quick else cases:
        if _get(data, path) == value:
            continue
        edited = copy.deepcopy(rows)
        _set(path, value)(edited[0]["data"])
        folder = _forge(run, scratch, counter)
        rechain(folder, edited, derive_csv=False, experiment="rollout")
        case = f"row.{'.'.join(map(str, path))}={repr(value)[:12]}"
        family.record(case, _audited(folder, family, case))
    for where in ((), ("rollouts", 0), ("rollouts", 0, "turns", 0),
                  ("rollouts", 0, "turns", 0, "scores", "hf:fp32")):  # fmt: skip
        edited = copy.deepcopy(rows)
        _set((*where, "verdict"), "pass")(edited[0]["data"])
        folder = _forge(run, scratch, counter)
        _rechain(folder, edited, "rollout")
        family.record(f"verdict added at {'.'.join(map(str, where)) or 'the row'}",
                      named(timed("audit", folder, "--sample", 0), "verdict"))  # fmt: skip
    return family


def _rechain(folder: Path, rows: list[dict], experiment: str) -> None:
    """The rows rechained and, where the forged row still reads, the CSV re-derived, as
    a forger would (a field added inside a record leaves the row no CSV line)."""
    try:
        rechain(folder, rows, experiment=experiment)
    except (TypeError, KeyError, AttributeError, KvreplayError):
        rechain(folder, rows, derive_csv=False, experiment=experiment)


def _num(value: Any) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def panel_rows_family(matched: Path, scratch: Path) -> Family:
    family = Family("schema: panel rows")
    counter = itertools.count()
    rows = read_rows(matched)
    data = rows[0]["data"]
    for path in _paths(data):
        if path[0] == "inputs" or not isinstance(_get(data, path), dict):
            continue
        edited = copy.deepcopy(rows)
        _set((*path, "verdict"), "pass")(edited[0]["data"])
        folder = scratch / f"m{next(counter)}"
        shutil.copytree(matched, folder)
        _rechain(folder, edited, "matched")
        family.record(f"verdict added at {'.'.join(map(str, path))}",
                      named(timed("audit", folder, "--sample", 0), rows[0]["key"]))  # fmt: skip
    for key, value in (("verdict", "pass"), ("status", "skipped"), ("status", "done"),
                       ("precision", "fp16"), ("kind", "matrix")):  # fmt: skip
        edited = copy.deepcopy(rows)
        edited[0]["data"][key] = value
        folder = scratch / f"m{next(counter)}"
        shutil.copytree(matched, folder)
        rechain(folder, edited, derive_csv=False)
        family.record(f"row {key}={value}", _audited(folder, family, f"row {key}={value}"))
    return family


ENVIRONMENT_KEYS = ("PYTHONPATH", "VLLM_PLUGINS", "LD_PRELOAD", "KVREPLAY_FAULT", "x")


def environment_family(matched: Path, model: Path, items: Path, scratch: Path) -> Family:
    family = Family("schema: environment keys")
    for key, command in itertools.product(ENVIRONMENT_KEYS, ("audit", "env", "report", "resume")):
        folder = scratch / f"e-{key}-{command}"
        shutil.copytree(matched, folder)
        data = json.loads((folder / "manifest.json").read_text())
        data["environment"][key] = "/tmp/elsewhere"
        (folder / "manifest.json").write_text(json.dumps(data, indent=2))
        args = {
            "audit": ["audit", folder, "--sample", 0],
            "env": ["env", folder],
            "report": ["report", folder],
            "resume": ["run", "matched", "--model", model, "--items", items, "--plan", "short",
                       "--dtypes", "bf16,fp32", "--out", folder],
        }[command]  # fmt: skip
        family.record(f"environment.{key} {command}", refusal(timed(*args)))
    return family


# Family: numbers past their bounds.
def bounds_family(model: Path, items: Path, scratch: Path) -> Family:
    family = Family("bounds: numbers")
    counter = itertools.count()
    commands = {("run", name): ["run", name] for name in ("rollout", "matched", "resample")} | {
        ("check",): ["check"],
        ("check", "--trainer"): ["check", "--trainer", "hf:fp32"],
    }
    for words, head in commands.items():
        command = dict(cli_commands())[tuple(head[:2]) if head[0] == "run" else ("check",)]
        numbers = [p for p in cli_params(command) if hasattr(p.type, "min") and p.type.max]
        for param, value in itertools.product(numbers, ("huge", -1, 10**11, "nan", "inf", "-inf")):
            flag = max(param.opts, key=len)
            if words == ("check", "--trainer") and flag in ("--samples", "--margin", "--max-rate",
                                                            "--max-divergent"):  # fmt: skip
                continue  # the live vs prefill check's, refused beside --trainer anyway
            given = param.type.max + 1 if value == "huge" else value
            if isinstance(given, int) and param.type.min is not None and given >= param.type.min \
                    and given <= param.type.max:  # fmt: skip
                continue
            out = scratch / f"b{next(counter)}"
            temperature = ["--temperature", 1] if head[-1] in ("rollout", "resample") else []
            args = [*head, "--model", model, "--items", items, "--plan", "short", "--n", 1,
                    "--dtypes", "fp32", *temperature, "--out", out, flag, given]  # fmt: skip
            family.record(f"{' '.join(words)} {flag} {given}", refused(timed(*args), {}, out))
    rollout = ["run", "rollout", "--model", model, "--items", items, "--n", 1, "--dtypes", "fp32"]
    spelled = ",".join(f"hf:fp32@{model}{'/.' * i}" for i in range(1, 4))
    for label, extra in {
        "temperature 1e-300": ["--temperature", 1e-300],
        "temperature 5e-5": ["--temperature", 5e-5],
        "past the context window": ["--max-tokens", 1020],
        "turns past the context window": ["--max-tokens", 400, "--turns", 3],
        "200 scorers": ["--scorers", ",".join(["hf:fp32"] * 200)],
        "one model spelled three ways": ["--scorers", spelled],
        "rows past a ledger line": ["--samples", 1024, "--max-tokens", 900],
        "rows past a ledger line, 4 scorers": ["--samples", 1024, "--max-tokens", 600, "--scorers",
                                               "hf:fp32,hf:bf16,hf:fp32:replay,hf:bf16:replay"],
    }.items():  # fmt: skip
        out = scratch / f"b{next(counter)}"
        family.record(label, refused(timed(*rollout, "--out", out, *extra), {}, out))
    return family


# Family: the Python API handed what no stack returns.
def _api_cases() -> Iterator[tuple[str, dict[str, Any]]]:
    bad_tokens = {"no token": [], "a float id": [3.7], "a negative id": [-1], "a flag id": [True],
                  "a text id": ["3"], "None": None, "a nested id": [[1]], "five ids": [1] * 5,
                  "a number": 5, "a text": "abc"}  # fmt: skip
    bad_logprobs = {"text": ["-0.1"], "NaN": [math.nan], "inf": [-math.inf], "positive": [0.5],
                    "past float32": [-1e300], "empty": [], "None": None, "a number": -0.1,
                    "nested": [[-0.1]]}  # fmt: skip
    for (t, tokens), (name, logprobs) in itertools.product(
        bad_tokens.items(), {"one": [-0.1], **bad_logprobs}.items()
    ):
        yield f"sample ids {t}, logprobs {name}", {"sample": _constant((tokens, logprobs))}
    for name, logprobs in {**bad_logprobs, "two for one id": [-0.1, -0.2]}.items():
        yield f"sample logprobs {name}", {"sample": _constant(([3], logprobs))}
    for name, logprobs in {**bad_logprobs, "three for two ids": [-0.1] * 3}.items():
        yield f"score {name}", {"score": _constant(logprobs)}
        yield f"engine_score {name}", {"engine_score": _constant(logprobs)}
    for name, returned in {"None": None, "a triple": ([3], [-0.1], 0), "a dict": {"a": 1},
                           "a text": "x", "a number": 1}.items():  # fmt: skip
        yield f"sample returns {name}", {"sample": _constant(returned)}
    for name, prompts in {"no prompt": [], "an empty prompt": [[]], "a float": [[1, 2.5]],
                          "text": ["hi"], "None": None, "a flag": [[True]]}.items():  # fmt: skip
        yield f"prompts {name}", {"prompts": prompts}
    for reports in ((), ("logits",), "raw", None, ("raw", "x")):
        yield f"reports {reports!r}", {"reports": reports}
    for trainer in ("engine", "rollout", "miss", "batched", "", None, 5):
        yield f"trainer {trainer!r}", {"trainer": trainer}
    for samples in (0, -1, True, 1.5, 10**9):
        yield f"samples {samples!r}", {"samples": samples}
    for bound in (math.nan, math.inf, -1.0, "0.1", True):
        yield f"expectation max_k3_kl {bound!r}", {"max_k3_kl": bound}


def _constant(value: Any) -> Callable[..., Any]:
    return lambda *args: value


def api_family() -> Family:
    from kvreplay.core.rollout import Sampling
    from kvreplay.experiments.rollout import MismatchExpectation, audit_own_stack

    family = Family("api: audit_own_stack")
    for label, given in _api_cases():
        arguments: dict[str, Any] = {
            "prompts": [[1, 2, 3]], "sample": _constant(([5, 6], [-0.5, -0.25])),
            "score": lambda p, t: [-0.5] * len(t), "sampling": Sampling(max_tokens=4),
        }  # fmt: skip
        try:
            if "max_k3_kl" in given:
                given = {"expectation": MismatchExpectation(max_k3_kl=given["max_k3_kl"])}
            audit_own_stack(**arguments | given)
            problem: str | None = "accepted"
        except KvreplayError as exc:
            problem = None if "\n" not in str(exc) else "more than one line"
        except Exception as exc:  # noqa: BLE001 - the family looks for any other ending
            problem = f"{type(exc).__name__} (a traceback)"
        family.record(label, problem)
    return family


# Family: what mismatch writes of hostile ids and numbers.
def _logged_line(ident: str, rollout: float) -> dict[str, Any]:
    return {"id": ident, "prompt_ids": [1, 2], "response_ids": [3, 4],
            "rollout_logprobs": [rollout, -0.5], "trainer_logprobs": [-0.5, -0.5]}  # fmt: skip


def mismatch_family(scratch: Path) -> Family:
    family = Family("mismatch outputs")
    characters = [chr(c) for c in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029, 0xFEFF, 0xFFFE)]
    for index, (character, rollout) in enumerate(
        itertools.product(characters, (-0.5, -1000.0, -1e300, -1.7e308))
    ):
        folder = made(scratch / f"x{index}")
        lines = [_logged_line(f"a{character}b", rollout), _logged_line("plain", -0.5)]
        logged = folder / "logged.jsonl"
        logged.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
        label = f"id U+{ord(character):04X}, log p {rollout:g}"
        for gate in ([], ["--max-k3-kl", 1]):
            out_json, out_xml = folder / "v.json", folder / "v.xml"
            result = timed("mismatch", logged, *gate, "--json", out_json, "--junit", out_xml)
            problem = _valid_outputs(result, out_json, out_xml)
            family.record(f"{label}{' gate' if gate else ''}", problem)
    return family


def _valid_outputs(result: Any, out_json: Path, out_xml: Path) -> str | None:
    if result.exit_code not in (0, 1):
        return refusal(result)  # an id no output carries as given: refused as its line
    if "Warning" in result.stderr:
        return "a warning on the terminal"

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    try:
        json.loads(out_json.read_text(encoding="utf-8"), parse_constant=refuse)
        ElementTree.parse(out_xml)
    except (ValueError, ElementTree.ParseError) as exc:
        return f"not valid: {exc}"[:80]
    return None


def families(scratch: Path, model: Path, quick: bool) -> list[Family]:
    """Every round-4 family, on the tiny qwen2 (``model``)."""
    items = jsonl(made(scratch) / "items.jsonl", [json.dumps(i) for i in GOOD[:2]])
    rollout = scratch / "rollout"
    result = timed("run", "rollout", "--model", model, "--items", items, "--dtypes", "fp32",
                   "--max-tokens", TOKENS, "--turns", 2, "--samples", 2,
                   "--out", rollout)  # fmt: skip
    assert result.exit_code == 0, result.output
    matched = scratch / "matched"
    result = timed("run", "matched", "--model", model, "--items", items, "--plan", "short",
                   "--dtypes", "bf16,fp32", "--out", matched)  # fmt: skip
    assert result.exit_code == 0, result.output
    logged = jsonl(scratch / "logged.jsonl", [json.dumps(_logged_line("r0", -0.5))])
    inputs = {"model": model, "items": items, "logged": logged, "run": matched}
    return [
        outputs_family(inputs, made(scratch / "outputs")),
        planted_family(inputs, made(scratch / "planted")),
        rollout_config_family(rollout, made(scratch / "config")),
        rollout_rows_family(rollout, made(scratch / "rows"), quick),
        panel_rows_family(matched, made(scratch / "panel")),
        environment_family(matched, model, items, made(scratch / "environment")),
        bounds_family(model, items, made(scratch / "bounds")),
        api_family(),
        mismatch_family(made(scratch / "mismatch")),
    ]
