"""The hostile-input probe of issue 34, items 1-4, of issue 45 (``hostile_round3.py``) and
of issue 49 (``hostile_round4.py``),
as an adversary would try it: a forged
run folder's environment and ``--venv`` targets given to ``kvreplay env``, addresses and
credentials given to ``probe``/``run``, servers that redirect, stream without end,
trickle or echo the key, and every field a server's answer holds replaced by a value
of the wrong type or range, on the probe's answers and on completions from the second
row of a run on (then audited against the same server).

Usage: python bench/hostile_probe.py [--quick] [--round2-only | --round4-only]

Prints, per family, the cases tried, how many ended clean and the ones left. A case is
clean when it ends in one sentence on stderr and exit 2 with every completed row kept
(and nothing installed, nothing sent elsewhere, no key shown), or when the changed
field is one kvreplay does not read and the run's rows are exactly the honest run's.
An audit against the hostile server is clean when it refuses so or FAILs naming the
fields that differ on re-execution. Anything else (a traceback, a hang past --timeout,
other rows recorded, exit 0 or 1 on an impossible answer) is left, and named; a value
in range (a logprob of -1 for -0.01) is a well-formed lie only re-execution elsewhere
can catch, and stays listed as left. Servers are loopback sockets in this
process (``tests/loopback.py``); the served model is the tiny Qwen2 of ``tests/tiny.py``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from click.testing import Result  # noqa: E402
from helpers import invoke, run_args  # noqa: E402
from hostile_cases import KEY_ENV, SECRET, WRONG, Family, made, refusal  # noqa: E402
from loopback import Loopback, Reply, Sent, TinyVllm  # noqa: E402
from tiny import save_tiny  # noqa: E402

LEAVE_OUT = object()


def leaks(result: Result, *secrets: str) -> str | None:
    shown = [s for s in secrets if s in result.output]
    return f"shows {shown[0][:12]!r}" if shown else None


# Family 1: what a run folder's recorded environment may make kvreplay env install.
PINS = [
    ("torch", "@ file:///{w}"), ("evil @ file:///{w}", "0"), ("{w}", "0"), ("./evil", "0"),
    ("--extra-index-url", "http://127.0.0.1:9/simple"), ("--index-url http://x", "1"),
    ("--find-links", "{d}"), ("-f {d} numpy", "1"), ("-e git+file://{d}#egg=e", "0"),
    ("-r /etc/passwd", "0"), ("-c {d}/c.txt", "0"), ("numpy", "1.0\n{w}"),
    ("numpy", "1.0\r\n--pre"), ("numpy", "1.0; python_version>'0'"), ("numpy[evil]", "1.0"),
    ("numpy", "1.0 --no-binary :all:"), ("numpy", ">=0"), ("numpy", "*"), ("numpy", "1.*"),
    ("numpy", "~=1.0"), ("numpy", "1.0#x"), ("numpy", "http://127.0.0.1:9/n.whl"),
    ("numpy", ""), ("", "1.0"), ("numpy", 1.0), ("numpy", ["1.0"]), ("numpy", None),
    ("n\x00umpy", "1"), ("numpy", "1." * 400 + "1"), ("nümpy", "1.0"), ("numpy", "1.0+cpu x"),
]  # fmt: skip
VENVS = ["", " ", "-", "--help", "--upgrade-deps", "-v", "a\nb", "a\rb", "a\tb", "a\x1bb",
         "/proc/self/v", "/proc", "/sys/v", "/dev/v", "/dev/null", "{f}", "{full}", ".", "/",
         "v" * 300, "x/" + "y" * 300]  # fmt: skip


def env_family(run: Path, scratch: Path) -> Family:
    family = Family("env: forged pins")
    wheels = scratch / "wheels"
    wheels.mkdir()
    marker = scratch / "marker"
    original = (run / "manifest.json").read_text()
    for name, version in PINS:
        fill = {"w": str(wheels / "evil-0-py3-none-any.whl"), "d": str(wheels)}
        name = name.format(**fill)
        version = version.format(**fill) if isinstance(version, str) else version
        data = json.loads(original)
        data["environment"]["distributions"][name] = version
        (run / "manifest.json").write_text(json.dumps(data))
        for command in (["env", run], ["env", run, "--venv", scratch / "venv"]):
            problem = refusal(invoke(*command))
            if (scratch / "venv").exists() or marker.exists():
                problem = "a venv was built"
            family.record(f"{name!r}=={version!r} {command[2:3]}", problem)
        problem = None if invoke("audit", run, "--sample", 0).exit_code in (1, 2) else "passed"
        family.record(f"audit {name!r}=={version!r}", problem)
    (run / "manifest.json").write_text(original)
    return family


def venv_family(run: Path, scratch: Path) -> Family:
    family = Family("env: --venv targets")
    (scratch / "a-file").write_text("x")
    (scratch / "full").mkdir()
    (scratch / "full" / "x").write_text("x")
    os.chdir(scratch)
    before = sorted(p.name for p in scratch.iterdir())
    for venv in VENVS:
        venv = venv.format(f=scratch / "a-file", full=scratch / "full")
        problem = refusal(invoke("env", run, "--venv", venv))
        if sorted(p.name for p in scratch.iterdir()) != before:
            problem = "something was written"
        family.record(repr(venv[:30]), problem)
    return family


# Family 2: addresses, redirects and the key.
URLS = ["file:///etc/passwd", "ftp://127.0.0.1/", "gopher://127.0.0.1/", "127.0.0.1:9",
        "//127.0.0.1:9", "http://user:pw-secret@127.0.0.1:9", "http://:pw-secret@127.0.0.1:9",
        "http://u@127.0.0.1:9", "http://127.0.0.1:9/ a", "http://127.0.0.1:9/\r\nX: 1",
        "http://127.0.0.1:9/\x00", "http://", "http://:9", "http://127.0.0.1:99999",
        "http://127.0.0.1:-1", "http://[::1", "http://127.0.0.1:9/?k=pw-secret",
        "http://127.0.0.1:9/#pw-secret", "http://h/" + "a" * 5000, " http://127.0.0.1:9",
        "javascript:alert(1)", "data:text/plain,x"]  # fmt: skip


def address_family(model: Path, scratch: Path) -> Family:
    family = Family("http: addresses")
    for url in URLS:
        result = invoke("probe", "--url", url)
        family.record(f"probe {url[:40]!r}", refusal(result) or leaks(result, "pw-secret"))
        args, out = run_args("matched", scratch, model)
        result = invoke(*args, "--backend", "http", "--url", url)
        problem = refusal(result) or leaks(result, "pw-secret")
        family.record(f"run {url[:40]!r}", problem or ("manifest" if out.exists() else None))
    return family


def key_family(tiny: TinyVllm, model: Path, scratch: Path) -> Family:
    family = Family("http: redirects, key")
    os.environ[KEY_ENV] = SECRET
    with Loopback(lambda sent: Reply.json({"version": "1"})) as elsewhere:
        for status, path in itertools.product((301, 302, 303, 307, 308), ("/version", "/v1")):

            def moved(sent: Sent, status: int = status) -> Reply:
                return Reply(status, headers={"Location": elsewhere.url + sent.path})

            with Loopback(moved) as server:
                result = invoke("probe", "--url", server.url + path, "--api-key-env", KEY_ENV)
            problem = refusal(result) or ("followed" if elsewhere.sent else None)
            family.record(f"redirect {status} {path}", problem)
    echoes = [f"Bearer {SECRET}", f"token={SECRET}", SECRET, json.dumps({"key": SECRET})]
    for status, echo in itertools.product((400, 401, 403, 500), echoes):
        with Loopback(lambda sent, e=echo, s=status: Reply.json({"error": e}, s)) as server:
            result = invoke("probe", "--url", server.url, "--api-key-env", KEY_ENV)
        family.record(f"echo {status} {echo[:20]!r}", refusal(result) or leaks(result, SECRET))
    args, out = run_args("matched", made(scratch / "keyed"), model)
    result = invoke(*args, "--backend", "http", "--url", tiny.url, "--dtypes", "fp32",
                    "--companions", "0", "--n", "1", "--api-key-env", KEY_ENV)  # fmt: skip
    written = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    problem = f"exit {result.exit_code}" if result.exit_code else leaks(result, SECRET)
    family.record("key kept out of the run folder", problem or (str(written) if written else None))
    del os.environ[KEY_ENV]
    return family


# Family 3: size and time.
def _stream(head: bytes, fill: bytes, count: int | None, tail: bytes = b"") -> Iterator[bytes]:
    yield head
    yield from itertools.repeat(fill) if count is None else itertools.repeat(fill, count)
    yield tail


EXHAUSTION: dict[str, Callable[[], Reply]] = {
    "100 MB declared": lambda: Reply(200, _stream(b"", b" " * 65536, 1600),
                                     {"Content-Length": str(100 << 20)}),
    "100 MB undeclared": lambda: Reply(200, _stream(b"", b" " * 65536, 1600)),
    "endless": lambda: Reply(200, _stream(b"", b" " * 65536, None)),
    "endless chunked": lambda: Reply(200, _stream(b"", b"10000\r\n" + b" " * 65536 + b"\r\n",
                                                  None), {"Transfer-Encoding": "chunked"}),
    "huge chunk size": lambda: Reply(200, _stream(b"f" * 100000 + b"\r\n", b"", 0),
                                     {"Transfer-Encoding": "chunked"}),
    "lying length": lambda: Reply(200, b'{"version": "1"}', {"Content-Length": "99999999"}),
    "100 MB identity": lambda: Reply(200, _stream(b'{"version": "', b"x" * 65536, 1600, b'"}')),
    "1 MB identity": lambda: Reply(200, _stream(b'{"version": "', b"x" * 65536, 16, b'"}')),
    "deep identity": lambda: Reply(200, b'{"version": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
    "10k headers": lambda: Reply(200, b"{}", {f"X-{i}": "y" for i in range(10000)}),
    "1 MB header": lambda: Reply(200, b"{}", {"X-Big": "y" * (1 << 20)}),
    "slow body": lambda: Reply(200, _stream(b"", b" ", None), {"Content-Length": "100"},
                               pause=0.2),
    "slow endless": lambda: Reply(200, _stream(b"", b" ", None), pause=0.2),
    "slow headers": lambda: Reply(body=_stream(b"HTTP/1.1 200 OK\r\n", b"X", None), pause=0.2,
                                  raw=True),
    "silence": lambda: Reply(body=_stream(b"", b"", None), pause=30, raw=True),
    "garbage status": lambda: Reply(body=_stream(b"\x00" * 70000, b"", 0), raw=True),
}  # fmt: skip


def exhaustion_family() -> Family:
    family = Family("http: size and time")
    for name, reply in EXHAUSTION.items():
        with Loopback(lambda sent, r=reply: r()) as server:
            result = invoke("probe", "--url", server.url, "--server", "vllm", "--timeout", 2)
        problem = refusal(result)
        if problem is None and len(result.output) > 2000:
            problem = f"printed {len(result.output)} characters"
        family.record(name, problem)
    return family


# Family 4: every field of every answer, of the wrong type or range.
def leaves(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON value, containers included; a key that names a token
    (``token_id:N``) is addressed by its place, so the path fits every answer."""
    yield path
    if isinstance(value, dict):
        for place, (key, child) in enumerate(value.items()):
            yield from leaves(child, (*path, ("#", place) if key.startswith("token_id:") else key))
    elif isinstance(value, list):
        for index, child in enumerate(value[:2]):  # the first two of a list stand for all
            yield from leaves(child, (*path, index))


def _key(parent: Any, step: Any) -> Any:
    return list(parent)[step[1]] if isinstance(step, tuple) else step


def replaced(value: Any, path: tuple, new: Any) -> Any:
    """``value`` with the field at ``path`` set to ``new`` (left out, or its key renamed);
    unchanged where the answer has no such field."""
    if not path:
        return new
    value = copy.deepcopy(value)
    parent = value
    try:
        for step in path[:-1]:
            parent = parent[_key(parent, step)]
        key = _key(parent, path[-1])
        if new is LEAVE_OUT or new is RENAME:
            held = parent.pop(key)
            if new is RENAME:
                parent[f"x{key}"] = held
        else:
            parent[key] = new
    except (IndexError, KeyError, TypeError):
        pass
    return value


RENAME = object()


def mutations(answer: Any) -> Iterator[tuple[str, tuple, Any]]:
    for path in leaves(answer):
        kept = (LEAVE_OUT, RENAME) if path and not isinstance(path[-1], int) else ()
        for new in (*WRONG, *kept):
            label = {id(LEAVE_OUT): "out", id(RENAME): "renamed"}.get(id(new), repr(new)[:12])
            yield f"{'.'.join(map(str, path)) or '<answer>'}={label}", path, new


def _raw(answer: Any) -> Reply:
    return Reply(200, json.dumps(answer).encode())  # json writes NaN and Infinity as given


def probe_answers_family(tiny: TinyVllm) -> Family:
    """The vLLM adapter's probe answers (the tiny server's) and llama-server's /props."""
    family = Family("answers: probe")
    for where in ("/version", "/v1/models", "/server_info"):
        for label, path, new in mutations(tiny.answer(where, None)):
            tiny.hostile(where, lambda _, a, p=path, n=new: _raw(replaced(a, p, n)))
            result = invoke("probe", "--url", tiny.url, "--server", "vllm", "--timeout", 5)
            ok = result.exit_code == 0 and "kvreplay can audit" in result.output
            family.record(f"{where} {label}", None if ok else refusal(result))
    tiny.tamper = None
    props = {"build_info": "b1", "model_path": "/m/x.gguf", "total_slots": 4, "model_ftype": "F16",
             "default_generation_settings": {"n_ctx": 8192}}  # fmt: skip
    for label, path, new in mutations(props):
        answer = replaced(props, path, new)
        with Loopback(lambda sent, a=answer: _raw(a)) as server:
            result = invoke("probe", "--url", server.url, "--server", "llamacpp", "--timeout", 5)
        family.record(f"/props {label}", refusal(result) if result.exit_code else None)
    return family


def strip(row: dict) -> dict:
    """A row without what differs between two honest runs (times, the run's own hashes)."""
    return {k: v for k, v in row.items() if k not in ("timing", "hash", "prev", "worker",
                                                       "contract")}  # fmt: skip


def completion_family(tiny: TinyVllm, model: Path, scratch: Path, quick: bool) -> Family:
    """Completions from the second row on, each field replaced; then the honest run
    audited against a server answering so from its first re-executed row."""
    family = Family("answers: completions")
    runs = itertools.count()

    def run(n: int | None = None) -> tuple[Result, Path]:
        args, out = run_args("matched", made(scratch / f"run{next(runs)}"), model)
        extra = ["--n", str(n)] if n else []
        return invoke(*args, "--backend", "http", "--url", tiny.url, "--dtypes", "fp32",
                      "--companions", "0", "--timeout", "120", *extra), out  # fmt: skip

    def rows(out: Path) -> list[dict]:
        path = out / "rows.jsonl"
        return [strip(json.loads(line)) for line in path.open()] if path.exists() else []

    tiny.tamper, tiny.completions = None, 0
    run(1)
    first = tiny.completions
    result, honest = run()
    assert result.exit_code == 0, result.output
    honest_rows = rows(honest)
    sample = tiny.complete({"prompt": [5, 6, 7], "max_tokens": 3, "stop_token_ids": []})
    cases = list(mutations(sample))
    for label, path, new in cases[::7] if quick else cases:
        tamper = lambda _, a, p=path, n=new: _raw(replaced(a, p, n))  # noqa: E731
        tiny.completions = 0
        tiny.hostile("/v1/completions", tamper, first)
        result, out = run()
        kept = rows(out)
        if result.exit_code == 0 and kept == honest_rows:
            family.record(label, None)  # a field kvreplay does not read
            continue
        problem = refusal(result)
        if problem is None and kept != honest_rows[: len(kept)]:
            problem = "rows other than the honest run's were recorded"
        family.record(label, problem or (None if kept else "the first row was lost"))
        tiny.completions = 0
        tiny.hostile("/v1/completions", tamper, 1)  # the probe's own completion is honest
        audited = invoke("audit", honest, "--url", tiny.url)
        failed = audited.exit_code == 1 and "differs on re-execution" in audited.stdout
        family.record(f"audit {label}", None if failed else refusal(audited))
    tiny.tamper = None
    return family


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="every 7th completion mutation")
    parser.add_argument("--round2-only", action="store_true", help="issue 34's families alone")
    parser.add_argument("--round4-only", action="store_true", help="issue 49's families alone")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hostile-probe-"))
    model = save_tiny(scratch / "model", "qwen2")
    tiny = TinyVllm(model)
    os.environ.setdefault("KVREPLAY_CACHE", str(scratch / "cache"))
    try:
        args_, run = run_args("matched", made(scratch / "base"), model)
        assert invoke(*args_, "--n", "1", "--dtypes", "fp32").exit_code == 0
        families = (
            []
            if args.round4_only
            else [
                env_family(run, made(scratch / "env")),
                venv_family(run, made(scratch / "venv")),
                address_family(model, made(scratch / "addresses")),
                key_family(tiny, model, scratch / "key"),
                exhaustion_family(),
                probe_answers_family(tiny),
                completion_family(tiny, model, scratch / "completions", args.quick),
            ]
        )
        if not args.round2_only and not args.round4_only:
            from hostile_round3 import families as round3  # issue 45's families

            families += round3(made(scratch / "round3"), tiny, model, args.quick)
        if not args.round2_only:
            from hostile_round4 import families as round4  # issue 49's families

            families += round4(made(scratch / "round4"), model, args.quick)
    finally:
        tiny.close()
    for family in families:
        print(family.line())
        for case in family.left:
            print(f"    left: {case}")
        for case in family.reexecuted:
            print(f"    named on re-execution: {case}")
    tried = sum(f.tried for f in families)
    left = sum(len(f.left) for f in families)
    print(f"{'all':<24} tried {tried:>4}  clean {tried - left:>4}  left {left}")


if __name__ == "__main__":
    main()
