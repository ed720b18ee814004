"""Both levels of ``kvreplay check`` on every backend (issue 33): the default check (4
items of arith, the instruct plan, the embedded SmolLM2) per backend and precision, with
its token-level and bitwise verdicts, as one Markdown table.

Each check runs cold in a fresh process and folder; the servers of the http rows (a
``vllm serve`` per precision, a ``llama-server`` per KV-cache type) are started here on
free loopback ports and stopped after. ``VLLM_BATCH_INVARIANT=1`` is tried as a control
on the in-process vllm engine. Run from the repository root (about 20 minutes on 2 cores):

    .venv/bin/python bench/check_levels.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HF = REPO / ".venv" / "bin" / "kvreplay"
VLLM = REPO / ".venv-vllm" / "bin" / "kvreplay"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LLAMA_SERVER = REPO / "build" / "llamacpp" / "cmake" / "bin" / "llama-server"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_up(url: str, process: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError("the server did not come up")


@contextmanager
def server(command: list[str], log: Path, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_up(url, process)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=60)


def check(label: str, precision: str, kvreplay: Path, out: Path, *extra: str, env=None) -> dict:
    """One cold default check; its verdict JSON, or the sentence it refused with. A check
    already in ``levels.json`` (an interrupted run of this script) is not run again."""
    done_before = out / "levels.json"
    for earlier in json.loads(done_before.read_text()) if done_before.is_file() else []:
        if (earlier["label"], earlier["precision"]) == (label, precision):
            return earlier
    folder = out / f"{label}-{precision}".replace(" ", "-")
    began = time.monotonic()
    done = subprocess.run(
        [str(kvreplay), "check", "--dtypes", precision, "--out", str(folder),
         "--json", str(folder) + ".json", *extra],
        capture_output=True, text=True, env=env or ENV, timeout=3600,
    )  # fmt: skip
    seconds = time.monotonic() - began
    verdict_file = Path(str(folder) + ".json")
    if done.returncode not in (0, 1) or not verdict_file.is_file():  # a refusal or a crash
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        result = {"label": label, "precision": precision, "error": last}
    else:
        verdict = json.loads(verdict_file.read_text())
        result = {"label": label, "precision": precision, "seconds": seconds, "verdict": verdict}
    recorded = json.loads(done_before.read_text()) if done_before.is_file() else []
    done_before.write_text(json.dumps([*recorded, result], indent=2) + "\n")
    return result


def row(result: dict) -> str:
    if "error" in result:
        return f"| {result['label']} | {result['precision']} | refused: {result['error']} | | |"
    levels = result["verdict"]["levels"]
    tokens, bits = levels["tokens"], levels["bits"]
    word = "HOLDS" if tokens["holds"] else "FAILS"
    token_text = f"{word} ({tokens['differ']} of {tokens['items']} differ)"
    if bits["holds"]:
        bit_text = f"HOLDS ({bits['items']} of {bits['items']} bit-equal)"
    else:
        first = bits["first"] or {}
        where = f", first {first.get('item_id')} step {first.get('step')}" if first else ""
        bit_text = f"FAILS ({bits['differ']} of {bits['items']} part{where})"
    return (
        f"| {result['label']} | {result['precision']} | {token_text} | {bit_text} "
        f"| {result['seconds']:.0f} |"
    )


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for precision in ("bf16", "fp32"):
        results.append(check("hf", precision, HF, out))
    for precision in ("fp16", "fp32"):
        results.append(check("llamacpp", precision, HF, out, "--backend", "llamacpp"))
    results.append(
        check("llamacpp --flash-attn on", "q8_0", HF, out, "--backend", "llamacpp",
              "--flash-attn", "on")
    )  # fmt: skip
    for precision in ("bf16", "fp32"):
        results.append(check("vllm", precision, VLLM, out, "--backend", "vllm"))
    invariant = {**ENV, "VLLM_BATCH_INVARIANT": "1"}
    results.append(
        check("vllm VLLM_BATCH_INVARIANT=1", "bf16", VLLM, out, "--backend", "vllm", env=invariant)
    )
    folder = subprocess.run(
        [str(VLLM_PYTHON), "-c", "from kvreplay.model.sources import resolve_source; "
         "print(resolve_source('smollm2-135m')[0])"],
        capture_output=True, text=True, check=True, env=ENV,
    ).stdout.strip()  # fmt: skip
    served = {**ENV, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    for precision, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                   "--dtype", dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details",
                   "--max-model-len", "4096", "--block-size", "32"]  # fmt: skip
        with server(command, out / f"vllm-serve-{precision}.log", served) as url:
            results.append(check("http (vllm serve)", precision, HF, out, "--backend", "http",
                                 "--url", url))  # fmt: skip
    gguf = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), "-c",
         "from kvreplay.model.embedded import EMBEDDED; "
         "print(EMBEDDED['smollm2-135m'].part_paths()[0])"],
        capture_output=True, text=True, check=True, env=ENV,
    ).stdout.strip()  # fmt: skip
    for precision, cache in (("fp16", "f16"), ("fp32", "f32")):
        command = [str(LLAMA_SERVER), "-m", gguf, "--threads", "1", "--ctx-size", "4096",
                   "--parallel", "4", "--cache-type-k", cache, "--cache-type-v", cache]  # fmt: skip
        with server(command, out / f"llama-server-{precision}.log", ENV) as url:
            results.append(check("http (llama-server)", precision, HF, out, "--backend", "http",
                                 "--url", url))  # fmt: skip
    print("| backend | precision | token level | bitwise | s (cold) |")
    print("|---|---|---|---|---|")
    for result in results:
        print(row(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
