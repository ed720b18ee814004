"""The hostile-input probe of issue 45 (the third round), run by ``hostile_probe.py`` after
its own families: a server that echoes a secret; a folder shipped beside a run for
``kvreplay env --venv``; "exact pins" that are not ASCII; outputs onto inputs by other
routes; the readers of a run folder and the model checks (tracebacks); an audit that
passes what it should name; runs that are vacuous or read another model's run; an honest
user's sequence of checks; the items ``cut-refeed`` writes.

Each case is judged by what it must end in, checked independently of the code it probes:
one sentence on stderr and exit 2 with every protected file's bytes unchanged and no
manifest left (a refusal), an audit that exits 1 naming the file at fault, or, for the
honest cases, a command that succeeds and a folder the audit passes. A case that hangs
is cut at 120 seconds and left. ``kvreplay env`` never runs a command here: the probe
records what it would run instead (nothing is installed, no index is reached).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import random
import shutil
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from click.testing import Result
from helpers import GOOD, run_args
from hostile_cases import (
    KEY_ENV,
    SECRET,
    WRONG,
    Family,
    digests,
    made,
    named,
    refusal,
    refused,
    timed,
)
from loopback import Loopback, Reply, Sent, TinyVllm
from tiny import save_tiny


def check_of(run: list[Any], model: Path, out: Path, n: int) -> list[Any]:
    """A short-plan ``kvreplay check`` of ``n`` items on the items a run's arguments name."""
    items = run[run.index("--items") + 1]
    return ["check", "--model", model, "--items", items, "--plan", "short", "--n", n, "--out", out]


# Family: a secret that comes back.
def _windows(text: str, width: int = 10) -> set[str]:
    return {text[i : i + width] for i in range(max(len(text) - width + 1, 1))}


def secret_forms(secret: str) -> set[str]:
    """Pieces of every form an echo of ``secret`` may take, as the probe looks for them
    in what kvreplay printed or wrote (independently of kvreplay's own check)."""
    raw = secret.encode()
    forms = {secret.lower(), raw.hex(), urllib.parse.quote(secret).lower()}
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + raw + b"\0\0").decode()[4:-4]
        forms.add(encoded.lower())
    return {w for form in forms for w in _windows(form)}


def shows(text: str, forms: set[str]) -> bool:
    lowered = text.lower()
    letters = "".join(c for c in lowered if c.isascii() and c.isalnum())
    return any(form in lowered or form in letters for form in forms)


ECHOES: dict[str, Callable[[str], str]] = {
    "header": lambda h: h,
    "key": lambda h: h.removeprefix("Bearer "),
    "upper": lambda h: h.upper(),
    "piece": lambda h: "build " + h[10:24],
    "spaced": lambda h: " ".join(h.removeprefix("Bearer ")),
    "dashed": lambda h: "-".join(h.removeprefix("Bearer ")),
    "hex": lambda h: h.removeprefix("Bearer ").encode().hex()[:48],
    "base64": lambda h: base64.b64encode(h.encode()).decode(),
    "url": lambda h: urllib.parse.quote(h),
    "full_width": lambda h: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in h),
    "zero_width": lambda h: "\u200b".join(h.removeprefix("Bearer ")),
    "in_json": lambda h: json.dumps({"authorization": h}),
}
VLLM_FIELDS = (
    "version",
    "model",
    "dtype",
    "cache_dtype",
    "seed",
    "mode",
    "cudagraph_mode",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "tensor_parallel_size",
)
LLAMA_FIELDS = ("build_info", "model_path", "model_ftype")


def _vllm_answers(field: str, said: str) -> dict[str, Any]:
    config = {
        "model_config": {"dtype": "torch.float32", "max_model_len": 1024, "seed": 0},
        "cache_config": {"block_size": 16, "enable_prefix_caching": True, "cache_dtype": "auto"},
        "scheduler_config": {"enable_chunked_prefill": True},
        "compilation_config": {"mode": 0, "cudagraph_mode": "NONE"},
        "parallel_config": {"tensor_parallel_size": 1},
    }
    for section in config.values():
        if field in section:
            section[field] = said
    return {
        "/version": {"version": said if field == "version" else "0.32.0"},
        "/v1/models": {"data": [{"id": said if field == "model" else "m", "max_model_len": 1024}]},
        "/server_info": {"vllm_config": config},
        "/v1/completions": {
            "choices": [{"token_ids": [1]}],
            "usage": {"prompt_tokens_details": {"cached_tokens": 0}},
        },
        "/tokenize": {"tokens": [1]},
    }


def _echo_server(dialect: str, field: str, echo: Callable[[str], str]) -> Callable[[Sent], Reply]:
    def route(sent: Sent) -> Reply:
        said = echo(sent.headers.get("Authorization", "Bearer none"))
        path = sent.path.split("?")[0]
        if dialect == "llamacpp":
            props = {
                "build_info": "b1",
                "model_path": "/m/x.gguf",
                "total_slots": 4,
                "model_ftype": "F16",
                "default_generation_settings": {"n_ctx": 8192},
            }
            props[field] = f"/m/{said}.gguf" if field == "model_path" else said
            answers = {
                "/props": props,
                "/completion": {"timings": {"cache_n": 0}},
                "/tokenize": {"tokens": [1]},
            }
        else:
            answers = _vllm_answers(field, said)
        if path == "/reset_prefix_cache":
            return Reply(200)
        return Reply.json(answers.get(path, {"error": "no"}), 200 if path in answers else 404)

    return route


def secrets_family(tiny: TinyVllm, model: Path, scratch: Path) -> Family:
    family = Family("secrets echoed back")
    os.environ[KEY_ENV] = SECRET
    forms = secret_forms(SECRET)
    cases = [("vllm", f) for f in VLLM_FIELDS] + [("llamacpp", f) for f in LLAMA_FIELDS]
    for (dialect, field), (name, echo) in itertools.product(cases, ECHOES.items()):
        with Loopback(_echo_server(dialect, field, echo)) as server:
            result = timed(
                "probe",
                "--url",
                server.url,
                "--server",
                dialect,
                "--api-key-env",
                KEY_ENV,
                "--timeout",
                5,
            )
        problem = "shows the key" if shows(result.output, forms) else None
        if problem is None and result.exit_code not in (0, 2):
            problem = refusal(result)
        family.record(f"probe {dialect} {field} {name}", problem)
    for name, echo in ECHOES.items():  # a run: nothing written, nothing shown
        tiny.tamper, tiny.completions = None, 0
        tiny.hostile("/version", lambda _, a, e=echo: {"version": e(f"Bearer {SECRET}")}, -1)
        args, out = run_args("matched", made(scratch / f"run-{name}"), model)
        result = timed(
            *args,
            "--backend",
            "http",
            "--url",
            tiny.url,
            "--dtypes",
            "fp32",
            "--companions",
            "0",
            "--api-key-env",
            KEY_ENV,
        )
        written = [
            p for p in out.rglob("*") if p.is_file() and shows(p.read_text("latin-1"), forms)
        ]
        problem = "shows the key" if shows(result.output, forms) else refusal(result)
        family.record(
            f"run, version {name}", problem or (f"wrote {written[0].name}" if written else None)
        )
    tiny.tamper = None
    del os.environ[KEY_ENV]
    token = "hf_probeTOKEN0123456789"
    os.environ["HF_TOKEN"] = token
    for field in ("version", "model", "cache_dtype"):
        with Loopback(_echo_server("vllm", field, lambda h: f"x-{token}")) as server:
            result = timed("probe", "--url", server.url, "--timeout", 5)
        problem = "shows HF_TOKEN" if shows(result.output, secret_forms(token)) else None
        family.record(
            f"HF_TOKEN in {field}", problem or (refusal(result) if result.exit_code else None)
        )
    del os.environ["HF_TOKEN"]
    return family


# Family: a folder shipped beside the run.
@contextlib.contextmanager
def recorded_commands() -> Iterator[list[list[str]]]:
    """kvreplay env's commands recorded instead of run (each 'fails', so none follows)."""
    import kvreplay.run.env as env

    ran: list[list[str]] = []
    real = env.subprocess.run

    def record(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        ran.append(list(command))
        return subprocess.CompletedProcess(command, 1)

    env.subprocess.run = record  # type: ignore[assignment]
    try:
        yield ran
    finally:
        env.subprocess.run = real  # type: ignore[assignment]


def _venv(folder: Path, marker: Path, parts: tuple[str, ...]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    site = folder / "lib" / "python3.11" / "site-packages"
    if "cfg" in parts:
        (folder / "pyvenv.cfg").write_text("home = /usr/bin\n")
    if "pth" in parts:
        site.mkdir(parents=True, exist_ok=True)
        (site / "evil.pth").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    if "pip" in parts:
        (folder / "bin").mkdir(exist_ok=True)
        (folder / "bin" / "pip").write_text(f"#!/bin/sh\ntouch {marker}\n")
        (folder / "bin" / "pip").chmod(0o755)
    if "top_pth" in parts:
        (folder / "evil.pth").write_text("import os\n")
    if "hidden" in parts:
        (folder / ".keep").write_text("")
    if "subdir" in parts:
        (folder / "lib").mkdir(exist_ok=True)
    return folder


SHIPPED: dict[str, tuple[str, ...]] = {
    "venv_pth_pip": ("cfg", "pth", "pip"),
    "venv_pth": ("cfg", "pth"),
    "cfg_only": ("cfg",),
    "pth_no_cfg": ("pth",),
    "pip_only": ("pip",),
    "top_pth": ("top_pth",),
    "hidden_file": ("hidden",),
    "empty_subfolder": ("subdir",),
}


def shipped_env_family(run: Path, scratch: Path) -> Family:
    family = Family("env: shipped folders")
    marker = scratch / "marker"
    os.chdir(scratch)
    default = f".venv-{run.name}"
    targets: list[tuple[str, Callable[[Path], str]]] = []
    for name, parts in SHIPPED.items():
        targets.append((name, lambda base, p=parts: str(_venv(base / "v", marker, p))))
        targets.append(
            (
                f"{name} default name",
                lambda base, p=parts: str(_venv(base / default, marker, p).relative_to(base)),
            )
        )
    links: dict[str, Callable[[Path], str]] = {
        "link_to_venv": lambda base: _link(base / "v", _venv(base / "t", marker, ("cfg", "pth"))),
        "link_to_empty": lambda base: _link(base / "v", made(base / "t")),
        "dangling_link": lambda base: _link(base / "v", base / "nowhere"),
        "trailing_slash": lambda base: str(_venv(base / "v", marker, ("cfg", "pth"))) + "/",
        "dot_dot": lambda base: str(_venv(base / "v", marker, ("cfg",))) + "/../v",
        "linked_parent": lambda base: (
            _link(base / "p", made(base / "real")) + "/v"
            if _venv(base / "real" / "v", marker, ("cfg", "pth"))
            else ""
        ),
    }
    targets += list(links.items())
    for index, (name, make) in enumerate(targets):
        base = made(scratch / f"t{index}")
        os.chdir(base)
        target = make(base)
        with recorded_commands() as ran:
            result = timed("env", run, "--venv", target)
        problem = refusal(result)
        if ran:
            problem = f"ran {ran[0][:3]}"
        if marker.exists():
            problem, _ = "the shipped .pth ran", marker.unlink()
        family.record(name, problem)
    for name, make in {
        "new": lambda b: str(b / "fresh"),
        "empty": lambda b: str(made(b / "e")),
    }.items():
        base = made(scratch / f"honest-{name}")
        target = make(base)
        with recorded_commands() as ran:
            timed("env", run, "--venv", target)
        creates = (
            ran[:1] and ran[0][1:3] == ["-m", "venv"] and ran[0][3] == str(Path(target).absolute())
        )
        family.record(f"honest {name} folder", None if creates else f"ran {ran[:1]}")
    return family


def _link(path: Path, target: Path) -> str:
    os.symlink(target, path)
    return str(path)


# Family: "exact pins" that are not ASCII.
DIGITS = {  # each set's zero (its digits follow it)
    "full_width": 0xFF10,
    "arabic_indic": 0x0660,
    "extended_arabic_indic": 0x06F0,
    "devanagari": 0x0966,
    "bengali": 0x09E6,
    "gurmukhi": 0x0A66,
    "thai": 0x0E50,
    "tibetan": 0x0F20,
    "myanmar": 0x1040,
    "nko": 0x07C0,
    "math_bold": 0x1D7CE,
    "math_double_struck": 0x1D7D8,
    "superscript": None,
    "circled": None,
}
SPECIAL_DIGITS = {"superscript": "\u2070\u00b9\u00b2", "circled": "\u24ea\u2460\u2461"}
POSITIONS = {
    "release_major": "{2}.0.1",
    "release_minor": "2.{0}.1",
    "epoch": "{1}!2.0",
    "pre_release": "2.0rc{1}",
    "post_release": "2.0.post{1}",
    "dev_release": "2.0.dev{1}",
    "local_label": "2.0+cpu{1}",
}
LETTERS = {
    "kelvin_local": "2.0+\u212a1",
    "long_s_post": "2.0.po\u017ft1",
    "dotless_i": "2.0b\u0131",
    "dotted_capital_i_local": "2.0+\u0130",
    "full_width_rc": "2.0\uff52\uff43\uff11",
    "ligature_fi_local": "2.0+\ufb01",
    "cyrillic_a_alpha": "2.0\u0430lpha1",
    "greek_rho_rc": "2.0\u03c1c1",
}
HONEST = {
    "upper_rc": "2.0RC1",
    "upper_post": "2.0.POST1",
    "upper_local": "2.0+CPU",
    "plain": "2.0.1",
}
NAMES = {
    "cyrillic_u": "nump\u0443",
    "full_width_name": "\uff4e\uff55\uff4d\uff50\uff59",
    "kelvin_name": "\u212aeras",
    "arabic_digit_name": "py\u0663",
}


def _digit(kind: str, value: int) -> str:
    zero = DIGITS[kind]
    return SPECIAL_DIGITS[kind][value] if zero is None else chr(zero + value)


def pins_family(run: Path, scratch: Path) -> Family:
    family = Family("env: pins not ASCII")
    original = (run / "manifest.json").read_text()
    cases = {
        f"{kind} {where}": (("numpy", template.format(*(_digit(kind, i) for i in range(3)))))
        for kind in DIGITS
        for where, template in POSITIONS.items()
    }
    cases |= {name: ("numpy", version) for name, version in LETTERS.items()}
    cases |= {name: (bad, "2.0") for name, bad in NAMES.items()}
    os.chdir(made(scratch))
    for label, (name, version) in [*cases.items(), *((k, ("numpy", v)) for k, v in HONEST.items())]:
        data = json.loads(original)
        data["environment"]["distributions"][name] = version
        (run / "manifest.json").write_text(json.dumps(data, indent=2))
        honest = label in HONEST
        with recorded_commands() as ran:
            for command in (["env", run], ["env", run, "--venv", scratch / "v"]):
                result = timed(*command)
                if honest:
                    ok = result.exit_code == 0 if len(command) == 2 else bool(ran)
                    family.record(f"{label} {command[2:3]}", None if ok else refusal(result))
                else:
                    problem = refusal(result) or (f"ran {ran[0][:3]}" if ran else None)
                    family.record(f"{label} {command[2:3]}", problem)
        audited = timed("audit", run, "--sample", 0)
        if not honest:
            family.record(f"{label} audit", named(audited, "field environment"))
    (run / "manifest.json").write_text(original)
    return family


# Family: outputs onto inputs, by other routes.
@dataclass(frozen=True)
class Link:
    """A hard link or symlink to ``target``, made when its case runs."""

    target: Path
    how: str  # "hard link" or "symlink"


def outputs_family(model: Path, scratch: Path) -> Family:
    family = Family("outputs onto inputs")
    items = scratch / "items.jsonl"
    items.write_text("".join(json.dumps(i) + "\n" for i in GOOD))
    plan = scratch / "plan.json"
    plan.write_text(
        json.dumps(
            {
                "stages": [
                    {"name": "think", "max_new_tokens": 6},
                    {"name": "answer", "max_new_tokens": 3},
                ]
            }
        )
    )
    own = scratch / "model"
    shutil.copytree(model, own)
    out = scratch / "check"
    base = [
        "check",
        "--model",
        own,
        "--items",
        items,
        "--plan",
        plan,
        "--dtypes",
        "fp32",
        "--n",
        1,
        "--out",
        out,
    ]
    assert timed(*base).exit_code in (0, 1)
    pristine = scratch / "check-pristine"
    shutil.copytree(out, pristine)
    protected = (out, items, plan, own)
    links = made(scratch / "links")
    counter = itertools.count()

    def alias(target: Path, how: str) -> Path:
        path = links / f"{next(counter)}-{target.name}"
        (os.link if how == "hard link" else os.symlink)(target, path)
        return path

    def made_now(arg: object) -> object:
        return alias(arg.target, arg.how) if isinstance(arg, Link) else arg

    def case(label: str, command: list[object], keep: tuple[Path, ...] = protected) -> None:
        """The command refused, ``keep`` unchanged; each case meets the check's folder as
        the check wrote it (a :class:`Link` in the command is made afresh to it)."""
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
        args = [made_now(arg) for arg in command]
        before = digests(*keep)
        family.record(label, refused(timed(*args), before))

    run_files = [
        "manifest.json",
        "rows.jsonl",
        "items.jsonl",
        "matched_live_prefill.csv",
        ".kvreplay.lock",
    ]
    model_files = sorted(p.name for p in own.iterdir() if p.is_file())
    for flag in ("--json", "--junit"):
        for name, how in itertools.product(run_files, ("hard link", "symlink")):
            case(f"{flag} {how} of the run's {name}", [*base, flag, Link(out / name, how)])
        for target in (items, plan, *(own / n for n in model_files)):
            case(f"{flag} = {target.name}", [*base, flag, target])
            case(
                f"{flag} hard link of {target.name}",
                [*base, flag, Link(target, "hard link")],
            )
        case(f"{flag} new file in the model folder", [*base, flag, own / "verdict.json"])
        case(f"{flag} new file in the run folder", [*base, flag, out / "verdict.json"])
    for flag, where in itertools.product(
        ("--json", "--junit", "--repro"),
        (
            "/proc/kv-out",
            "/proc/self/kv-out",
            "/proc/sys/vm/kv-out",
            "/sys/kv-out",
            "/sys/kernel/kv-out",
            "/dev/kv-out",
            "/dev/shm/kv-out",
        ),
    ):
        case(f"{flag} {where}", [*base, flag, where])
    for flag, where in (("--json", "/proc/self/comm"), ("--junit", "/dev/null")):
        case(f"{flag} {where}", [*base, flag, where])
    for label, repro in {
        "the run folder": out,
        "inside the run": out / "r",
        "the model folder": own,
        "inside the model": own / "r",
        "a link to the run": Link(out, "symlink"),
        "a link to the model": Link(own, "symlink"),
    }.items():
        case(f"--repro {label}", [*base, "--repro", repro])
    for shape in ("item", "pack", "both"):
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
        repro = made(scratch / f"repro-{shape}")
        for name, target in (("item.jsonl", "items.jsonl"), ("repro.json", "rows.jsonl")):
            if shape == "both" or name.startswith(shape[:4]):
                os.symlink(out / target, repro / name)
        kept = (out / "items.jsonl", out / "rows.jsonl", items, plan, own)  # not the manifest:
        before = digests(*kept)  # a bitwise check notes its stop there
        result = timed(*base, "--expect", "bitwise", "--repro", repro)
        problem = None if digests(*kept) == before else "wrote through the repro folder"
        family.record(
            f"existing repro folder linking {shape}",
            problem or (refusal(result) if result.exit_code not in (0, 1) else None),
        )
    for name in ("manifest.json", "rows.jsonl", "items.jsonl", "matched_live_prefill.csv"):
        for how in ("by name", "hard link", "symlink"):
            target = out / name if how == "by name" else Link(out / name, how)
            case(f"analyze -o {how} {name}", ["analyze", out, "-o", target], (out,))
    for where in ("/proc/kv-claims.json", "/sys/kv-claims.json", "/dev/kv-claims.json"):
        case(f"analyze -o {where}", ["analyze", out, "-o", where], (out,))
    for where in ("/proc/kv-report", "/sys/kv-report", "/dev/kv-report"):
        case(f"report --out-dir {where}", ["report", out, "--out-dir", where], (out,))
    victim = scratch / "victim.txt"
    victim.write_text("keep\n")
    for planted in ("figures", "report.md", "report.html"):
        folder = scratch / f"planted-{planted}"
        shutil.copytree(out, folder)
        shutil.rmtree(folder / planted, ignore_errors=True)
        (folder / planted).unlink(missing_ok=True)
        os.symlink(scratch if planted == "figures" else victim, folder / planted)
        before = digests(victim, *(p for p in scratch.iterdir() if p.suffix == ".png"))
        result = timed("report", folder)
        changed = digests(*before) != before or list(scratch.glob("*.png"))
        family.record(
            f"report with a planted {planted} link",
            "wrote through it"
            if changed
            else (refusal(result) if result.exit_code not in (0, 2) else None),
        )
    for planted in (
        ".write-probe",
        "manifest.json.tmp",
        "items.jsonl.tmp",
        "matched_live_prefill.csv",
        "matched_live_prefill.csv.tmp",
    ):
        args, run = run_args("matched", made(scratch / f"plant{next(counter)}"), model)
        made(run)
        os.symlink(victim, run / planted)
        result = timed(*args, "--n", 1, "--dtypes", "fp32")
        changed = victim.read_text() != "keep\n"
        family.record(
            f"run folder with a planted {planted} link",
            "wrote through it" if changed else (refusal(result) if result.exit_code else None),
        )
    args, run = run_args("matched", made(scratch / "rows-link"), model)
    assert timed(*args, "--n", 1, "--dtypes", "fp32").exit_code == 0
    (run / "rows.jsonl").rename(scratch / "rows-elsewhere.jsonl")
    os.symlink(scratch / "rows-elsewhere.jsonl", run / "rows.jsonl")
    case(
        "resume through a rows.jsonl link",
        [*args, "--n", 2, "--dtypes", "fp32"],
        (scratch / "rows-elsewhere.jsonl",),
    )
    for where in ("/proc/kv.jsonl", "/sys/kv.jsonl", "/dev/kv.jsonl", str(own / "cut.jsonl")):
        case(
            f"cut-refeed --out {where}",
            [
                "items",
                "cut-refeed",
                "--model",
                own,
                "--sources",
                1,
                "--cuts",
                2,
                "--tokens",
                8,
                "--out",
                where,
            ],
        )
    return family


# Family: tracebacks in the readers of a run folder and in the model checks.
def _write_run_file(run: Path, name: str, shape: str) -> None:
    path = run / name
    data = path.read_bytes() if path.is_file() else b""
    if shape in ("fifo", "dev_zero", "folder", "dangling_link", "missing"):
        path.unlink(missing_ok=True)
    if shape == "fifo":
        os.mkfifo(path)
    elif shape == "dev_zero":
        os.symlink("/dev/zero", path)
    elif shape == "folder":
        path.mkdir()
    elif shape == "dangling_link":
        os.symlink(run / "nowhere", path)
    elif shape == "empty":
        path.write_bytes(b"")
    elif shape == "line_of_100_mb":
        path.write_bytes(data + b"x" * (100 << 20) + b"\n")
    elif shape == "cr_only":
        path.write_bytes(data.replace(b"\n", b"\r"))
    elif shape == "nul_bytes":
        path.write_bytes(data.replace(b",", b",\0", 2))
    elif shape == "not_utf8":
        path.write_bytes(b"\xff\xfe" + data)
    elif shape == "json_array":
        path.write_bytes(b"[1, 2, 3]\n" + data)
    elif shape == "deep":
        path.write_bytes(b"[" * 100000 + b"]" * 100000 + b"\n" + data)
    elif shape == "torn":
        path.write_bytes(data + b'{"seq": 9')


SHAPES = (
    "fifo",
    "dev_zero",
    "folder",
    "dangling_link",
    "empty",
    "line_of_100_mb",
    "cr_only",
    "nul_bytes",
    "not_utf8",
    "json_array",
    "deep",
    "torn",
    "missing",
)


def _clean_end(result: Result) -> str | None:
    """None for any end but a traceback or a hang: exit 0, 1 or one sentence and 2."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"{type(result.exception).__name__} (a traceback)"
    return refusal(result) if result.exit_code == 2 else None


def _wrong(value: Any) -> str:
    return repr(value)[:14]


def tracebacks_family(run: Path, model: Path, scratch: Path) -> Family:
    family = Family("tracebacks")
    counter = itertools.count()

    def copy() -> Path:
        target = scratch / f"r{next(counter)}"
        shutil.copytree(run, target, symlinks=True)
        return target

    assert timed("analyze", run).exit_code == 0 and timed("report", run).exit_code == 0
    files = (
        "rows.jsonl",
        "matched_live_prefill.csv",
        "items.jsonl",
        "manifest.json",
        "claims.json",
    )
    for name, shape in itertools.product(files, SHAPES):
        folder = copy()
        _write_run_file(folder, name, shape)
        for command in (["audit", folder, "--sample", 0], ["analyze", folder], ["report", folder]):
            result = timed(*command)
            problem = _clean_end(result)
            optional = name == "claims.json" and shape == "missing"  # a run never analysed
            if problem is None and result.exit_code == 0 and command[0] == "audit" and not optional:
                problem = "passed"
            family.record(f"{name} {shape} {command[0]}", problem)
    manifest = json.loads((run / "manifest.json").read_text())
    from kvreplay.core.canonical import sha256_json

    for key, value in itertools.product(
        ("item_ids", "dtypes", "fragile", "schema_version", "n"), WRONG
    ):
        folder = copy()
        data = json.loads(json.dumps(manifest))
        block = data["experiments"]["matched"]
        block["config"][key] = value if value == value and value not in (float("inf"),) else None
        block["config_sha256"] = sha256_json(block["config"])
        (folder / "manifest.json").write_text(json.dumps(data, indent=2))
        family.record(
            f"config.{key}={_wrong(value)} audit",
            named(timed("audit", folder, "--sample", 0), "experiments.matched"),
        )
    from forgery import read_rows, rechain

    rows = read_rows(run)
    fields = [
        ("arms",),
        ("arms", "left"),
        ("arms", "prefill"),
        ("status",),
        ("item_id",),
        ("precision",),
        ("prefix_token_ids",),
        ("inputs",),
        ("replicas",),
        ("labels",),
        ("comparison",),
        ("prefix_token_count",),
    ]
    for path, value in itertools.product(fields, ("x", 7, [], {}, None, [1, "a"])):
        folder = copy()
        edited = json.loads(json.dumps(rows))
        target = edited[0]["data"]
        for step in path[:-1]:
            target = target.get(step, {}) if isinstance(target, dict) else {}
        if not isinstance(target, dict) or target.get(path[-1], object()) == value:
            continue  # no such field, or no change: nothing to catch
        target[path[-1]] = value
        rechain(folder, edited, derive_csv=False)
        for command in (["audit", folder, "--sample", 0], ["analyze", folder]):
            result = timed(*command)
            problem = _clean_end(result) or (
                "passed" if result.exit_code == 0 and command[0] == "audit" else None
            )
            family.record(f"row {'.'.join(path)}={_wrong(value)} {command[0]}", problem)
    from safetensors.torch import load_file, save_file

    weights = {
        "all_nan": lambda n, t: t * float("nan"),
        "all_inf": lambda n, t: t * 0 + float("inf"),
        "one_nan_norm": lambda n, t: t * float("nan") if n == "model.norm.weight" else t,
        "nan_embedding_row": lambda n, t: (
            t.index_fill(0, t.new_zeros(1, dtype=int), float("nan")) if "embed" in n else t
        ),
        "overflowing_head": lambda n, t: (
            t.clamp(min=0) * 3e38 + 3e38 if n == "lm_head.weight" else t
        ),
        "negative_overflow": lambda n, t: -(t.abs() * 3e38 + 3e38) if n == "lm_head.weight" else t,
    }
    for name, change in weights.items():
        bad = scratch / f"model-{name}"
        shutil.copytree(model, bad)
        tensors = load_file(bad / "model.safetensors")
        save_file(
            {n: change(n, t) for n, t in tensors.items()},
            bad / "model.safetensors",
            metadata={"format": "pt"},
        )
        for command in ("run", "check"):
            args, out = run_args("matched", made(scratch / f"{name}-{command}"), bad)
            if command == "check":
                args = [*check_of(args, bad, out, 1), "--dtypes", "fp32"]
            else:
                args += ["--n", 1, "--dtypes", "fp32"]
            family.record(f"weights {name} {command}", refused(timed(*args), {}, out))
    family_gguf(family, scratch)
    return family


GGUF_PATCHES = [
    ("llama.attention.head_count", 7),
    ("llama.attention.head_count", 0),
    ("llama.attention.head_count", 2**31),
    ("llama.attention.head_count_kv", 4),
    ("llama.attention.head_count_kv", 0),
    ("llama.embedding_length", 577),
    ("tokenizer.ggml.bos_token_id", 49152),
    ("tokenizer.ggml.eos_token_id", 2**32 - 1),
    ("tokenizer.ggml.unknown_token_id", 60000),
    ("tokenizer.ggml.padding_token_id", 10**6),
]


def family_gguf(family: Family, scratch: Path) -> None:
    """GGUF metadata llama.cpp or transformers' conversion rejects, on hf and llamacpp."""
    from gguf import GGUFReader

    from kvreplay.backends.llamacpp import LlamaCppBackend
    from kvreplay.model.embedded import EMBEDDED

    backends = ["hf", "llamacpp"] if LlamaCppBackend().installed() else ["hf"]
    for key, value in GGUF_PATCHES:
        model = scratch / "patched.gguf"
        shutil.copy(EMBEDDED["smollm2-135m"].part_paths()[0], model)
        fields = GGUFReader(str(model), "r+").fields
        fields[key].parts[fields[key].data[0]][0] = value
        del fields
        for backend in backends:
            out = scratch / f"gguf-{backend}"
            shutil.rmtree(out, ignore_errors=True)
            result = timed(
                "run",
                "matched",
                "--backend",
                backend,
                "--model",
                model,
                "--n",
                1,
                "--dtypes",
                "fp16" if backend == "llamacpp" else "fp32",
                "--plan",
                "short",
                "--out",
                out,
            )
            family.record(f"gguf {key}={value} {backend}", refused(result, {}, out))
        model.unlink()


# Family: an audit that passes what it should name.
def audit_passes_family(run: Path, scratch: Path) -> Family:
    family = Family("audit passes forgeries")
    from forgery import read_rows, rechain

    from kvreplay.core.canonical import sha256_json

    counter = itertools.count()

    def copy() -> Path:
        target = scratch / f"a{next(counter)}"
        shutil.copytree(run, target)
        return target

    def manifest_edit(label: str, edit: Callable[[dict], None], needle: str) -> None:
        folder = copy()
        data = json.loads((folder / "manifest.json").read_text())
        edit(data)
        block = data["experiments"]["matched"]
        if "config_sha256" not in label:  # a forger recomputes the hash
            block["config_sha256"] = sha256_json(block["config"])
        (folder / "manifest.json").write_text(json.dumps(data, indent=2))
        family.record(label, named(timed("audit", folder, "--sample", 0), needle))

    for key in ("verdict", "passed", "notes", "expectation", "x"):
        manifest_edit(
            f"entry.{key} added",
            lambda d, k=key: d["experiments"]["matched"].__setitem__(k, "pass"),
            f"experiments.matched.{key}",
        )
        manifest_edit(
            f"config.{key} added",
            lambda d, k=key: d["experiments"]["matched"]["config"].__setitem__(k, "pass"),
            f"config.{key}",
        )
    for key, value in (
        ("engine", "local"),
        ("engine", []),
        ("stopped", "yes"),
        ("config_sha256", 5),
    ):
        manifest_edit(
            f"entry.{key}={_wrong(value)}",
            lambda d, k=key, v=value: d["experiments"]["matched"].__setitem__(k, v),
            f"experiments.matched.{key}",
        )

    def text_edit(label: str, name: str, edit: Callable[[bytes], bytes], needle: str) -> None:
        folder = copy()
        (folder / name).write_bytes(edit((folder / name).read_bytes()))
        family.record(label, named(timed("audit", folder, "--sample", 0), needle))

    def twice(key: str, value: str) -> Callable[[bytes], bytes]:
        def edit(data: bytes) -> bytes:
            lines = data.split(b"\n")
            at = lines[0].index(f'"{key}":'.encode())
            lines[0] = lines[0][:at] + f'"{key}":{value},'.encode() + lines[0][at:]
            return b"\n".join(lines)

        return edit

    for key in ("seq", "key", "experiment", "worker", "timing", "prev", "hash", "contract"):
        text_edit(f"rows: {key} twice", "rows.jsonl", twice(key, '"x"'), "twice")
    for key in ("item_id", "status", "precision", "prefix_sha256"):
        text_edit(f"rows: data.{key} twice", "rows.jsonl", twice(key, '"x"'), "twice")
    for key in ("id", "answer", "prompt", "meta"):
        text_edit(f"items: {key} twice", "items.jsonl", twice(key, '"x"'), "items.jsonl")
    for key in ("format", "contract_sha256", "created"):
        folder = copy()
        text = (
            (folder / "manifest.json")
            .read_text()
            .replace(f'"{key}":', f'"{key}": "x",\n  "{key}":', 1)
        )
        (folder / "manifest.json").write_text(text)
        family.record(
            f"manifest: {key} twice", named(timed("audit", folder, "--sample", 0), "manifest")
        )
    edits: dict[str, Callable[[bytes], bytes]] = {
        "bom": lambda b: b"\xef\xbb\xbf" + b,
        "crlf": lambda b: b.replace(b"\n", b"\r\n"),
        "final_blank_line": lambda b: b + b"\n",
        "trailing_space": lambda b: b.replace(b"\n", b" \n", 1),
        "tab_after_separator": lambda b: (
            b.replace(b": ", b":\t", 1) if b": " in b else b.replace(b",", b",\t", 1)
        ),
    }
    for name, (label, edit) in itertools.product(
        ("manifest.json", "items.jsonl", "rows.jsonl", "matched_live_prefill.csv"), edits.items()
    ):
        text_edit(f"{name} {label}", name, edit, "line " if name == "rows.jsonl" else name)
    text_edit(
        "manifest.json reindented",
        "manifest.json",
        lambda b: json.dumps(json.loads(b), indent=4).encode(),
        "manifest",
    )
    text_edit(
        "items.jsonl keys unsorted",
        "items.jsonl",
        lambda b: b"".join(
            json.dumps(dict(reversed(json.loads(line).items()))).encode() + b"\n"
            for line in b.splitlines()
        ),
        "items",
    )
    for label, edit in {
        "a float respelled": lambda b: b.replace(b".0,", b".00,", 1),
        "a character escaped": lambda b: b.replace(b'"matched"', b'"m\\u0061tched"', 1),
        "keys reordered": lambda b: b"".join(
            json.dumps(dict(reversed(json.loads(line).items())), separators=(",", ":")).encode()
            + b"\n"
            for line in b.splitlines()
        ),
    }.items():
        text_edit(f"rows.jsonl {label}", "rows.jsonl", edit, "canonical JSON")
    for digits in ("\u0661\u0662", "\uff11\uff12", "\u0967"):
        folder = copy()
        (folder / f"rows.torn-{digits}.jsonl").write_text("x")
        family.record(
            f"planted rows.torn-{digits}.jsonl",
            named(timed("audit", folder, "--sample", 0), "rows.torn"),
        )
    rows = read_rows(run)
    folder = copy()
    edited = json.loads(json.dumps(rows))
    edited[0]["data"]["verdict"] = "pass"
    rechain(folder, edited, derive_csv=True)
    for sample in ("0", "4"):  # the structure alone, and every row re-executed
        family.record(
            f"a row with a verdict field, --sample {sample}",
            named(timed("audit", folder, "--sample", sample), rows[0]["key"]),
        )
    return family


# Family: runs that are vacuous or read another model's run, and exit 0.
def _hits_read(out: Path) -> bool:
    """Whether some arm of the run's rows read a cached token (a hit that was one)."""
    for line in (out / "rows.jsonl").read_text().splitlines():
        for arm in json.loads(line)["data"].get("arms", {}).values():
            served = arm.get("served") if isinstance(arm, dict) else None
            if isinstance(served, dict) and any(n > 0 for n in served.get("cached_tokens", [])):
                return True
    return False


def vacuous_family(tiny: TinyVllm, models: dict[str, Path], run: Path, scratch: Path) -> Family:
    family = Family("vacuous runs")
    counter = itertools.count()
    for size, command in itertools.product(
        (2**31, 10**9, 65536, 4096, 512, 128, 64, 32, 16, 8, 4), ("run", "check")
    ):
        tiny.tamper, tiny.completions = None, 0

        def block(path: str, answer: dict, size: int = size) -> dict:
            answer["vllm_config"]["cache_config"]["block_size"] = size
            return answer

        tiny.hostile("/server_info", block, -1)
        args, out = run_args("matched", made(scratch / f"v{next(counter)}"), models["qwen2"])
        served = ["--backend", "http", "--url", tiny.url, "--companions", "0", "--dtypes", "fp32"]
        if command == "check":
            args = check_of(args, models["qwen2"], out, 2)
        result = timed(*args, *served)
        if result.exit_code == 2:
            problem = refused(result, {}, out)
        elif result.exit_code in (0, 1) and (out / "rows.jsonl").exists():
            problem = None if _hits_read(out) else f"exit {result.exit_code}, no hit read a token"
        else:
            problem = refusal(result)
        family.record(f"block {size} {command}", problem)
    tiny.tamper = None
    source = json.loads((run / "manifest.json").read_text())["contract"]["items"]["source"]
    for experiment, other in itertools.product(
        ("fixed-prefix", "bridge", "transplant", "localize"), ("llama", "gemma3", "drift_qwen2")
    ):
        out = scratch / f"from{next(counter)}"
        result = timed(
            "run",
            experiment,
            "--model",
            models[other],
            "--items",
            source,
            "--plan",
            "short",
            "--dtypes",
            "bf16",
            "--from",
            run,
            "--out",
            out,
        )
        family.record(f"{experiment} --from a qwen2 run on {other}", refused(result, {}, out))
    return family


# Family: an honest user's sequence of checks, each step audited.
CHOICES = (
    ["--expect", "exact"],
    ["--expect", "bitwise"],
    ["--expect", "max-divergent", "--max-divergent", "0"],
    ["--expect", "max-divergent", "--max-divergent", "1"],
    ["--expect", "max-divergent", "--max-divergent", "9"],
)


def honest_family(model: Path, scratch: Path, sequences: int) -> Family:
    family = Family("honest sequences")
    rng = random.Random(45)
    for index in range(sequences):
        args, out = run_args("matched", made(scratch / f"h{index}"), model)
        base = [*check_of(args, model, out, 3), "--dtypes", "fp32"]
        steps = [rng.choice(CHOICES) for _ in range(3)]
        for step, expect in enumerate(steps):
            result = timed(*base, *expect)
            audited = timed("audit", out)
            problem = None if result.exit_code in (0, 1) else refusal(result)
            if problem is None and audited.exit_code != 0:
                problem = f"audit exit {audited.exit_code}: {audited.output[-120:]!r}"
            family.record(f"sequence {index} step {step} {' '.join(expect)}", problem)
        ends = [timed("analyze", out), timed("report", out), timed("audit", out)]
        bad = [r for r in ends if r.exit_code != 0]
        family.record(
            f"sequence {index} analyze, report, audit",
            f"exit {bad[0].exit_code}: {bad[0].output[-120:]!r}" if bad else None,
        )
    return family


# Family: items cut-refeed writes that no run accepts.
def refeed_family(model: Path, scratch: Path) -> Family:
    family = Family("cut-refeed items")
    vocabulary, context = 320, 1024  # the tiny qwen2's (tests/tiny.py)
    sources: dict[str, tuple[dict[str, Any], list[object]]] = {
        **{
            f"id of {n} characters": ({"id": "i" * n, "prompt": "hi", "answer": "1"}, [])
            for n in (180, 189, 190, 192, 193, 195, 198, 200)
        },
        **{
            f"token id {t}": ({"id": "t", "prompt": [5, t], "answer": "1"}, [])
            for t in (vocabulary - 1, vocabulary, 10**6, 2**31, 2**63 - 1, 2**63, 2**64, 10**63)
        },
        **{
            f"prompt of {n} with --tokens 8": ({"id": "p", "prompt": [7] * n, "answer": "1"}, [])
            for n in (context - 9, context - 8, context - 7, context)
        },
        "--tokens 4096": ({"id": "g", "prompt": "hi", "answer": "1"}, ["--tokens", 4096]),
        "--tokens 1020": ({"id": "g", "prompt": "hi", "answer": "1"}, ["--tokens", 1020]),
        "chat prompt": (
            {"id": "c", "prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            [],
        ),
    }
    for index, (label, (source, extra)) in enumerate(sources.items()):
        items = scratch / f"s{index}.jsonl"
        items.write_text(json.dumps(source) + "\n")
        out = scratch / f"cut{index}.jsonl"
        made_items = timed(
            "items",
            "cut-refeed",
            "--model",
            model,
            "--from",
            items,
            "--sources",
            1,
            "--cuts",
            2,
            "--tokens",
            8,
            *extra,
            "--out",
            out,
        )
        if made_items.exit_code != 0:
            problem = refusal(made_items) or ("wrote items" if out.exists() else None)
        else:
            args, _ = run_args("matched", made(scratch / f"cr{index}"), model)
            accepted = timed(*args, "--items", out, "--dtypes", "fp32")
            problem = (
                None
                if accepted.exit_code == 0
                else f"a run refused them: {accepted.stderr[-140:]!r}"
            )
        family.record(label, problem)
    return family


def families(scratch: Path, tiny: TinyVllm, model: Path, quick: bool) -> list[Family]:
    """Every round-3 family, on the tiny qwen2 (``model``) and a run of it with snapshots."""
    models = {
        arch: save_tiny(scratch / f"model-{arch}", arch)
        for arch in ("qwen2", "llama", "gemma3", "drift_qwen2")
    }
    models["qwen2"] = model
    items = scratch / "good.jsonl"
    items.write_text("".join(json.dumps(i) + "\n" for i in GOOD[:2]))
    run = scratch / "run"
    result = timed(
        "run",
        "matched",
        "--model",
        model,
        "--items",
        items,
        "--plan",
        "short",
        "--dtypes",
        "bf16,fp32",
        "--save-snapshots",
        "--out",
        run,
    )
    assert result.exit_code == 0, result.output
    return [
        secrets_family(tiny, model, made(scratch / "secrets")),
        shipped_env_family(run, made(scratch / "shipped")),
        pins_family(run, made(scratch / "pins")),
        outputs_family(model, made(scratch / "outputs")),
        tracebacks_family(run, model, made(scratch / "tracebacks")),
        audit_passes_family(run, made(scratch / "forgeries")),
        vacuous_family(tiny, models, run, made(scratch / "vacuous")),
        honest_family(models["drift_qwen2"], made(scratch / "honest"), 3 if quick else 8),
        refeed_family(model, made(scratch / "refeed")),
    ]
