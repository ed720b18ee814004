"""Issue 49, item 1: one output writer. Every output option of every command is found from
the command line itself (its type is an ``OutputPath``, so a new output option is walked
here without a line changed), pointed at an input of the command, a symbolic link, a
dangling link, a device node and a FIFO, and each is refused in one sentence naming the
option before any work, its target untouched. A check's ``engine.log`` (the one file
appended to) is refused the same way when a link, a hard link or a FIFO was planted
under its name, and ``check --trainer`` keeps the engine's log off the terminal too."""

from __future__ import annotations

import itertools
import json
import os
import stat
from pathlib import Path

import click
import pytest
from helpers import GOOD, assert_one_sentence, cli_commands, cli_params, invoke, jsonl

from kvreplay.report.commands import OutputPath, UserPath

TINY = ["--plan", "short", "--dtypes", "fp32", "--n", "1"]


def output_options() -> list[tuple[tuple[str, ...], str, str]]:
    """(command words, flag, file or folder) of every output option."""
    return [
        (words, max(param.opts, key=len), param.type.kind)
        for words, command in cli_commands()
        for param in cli_params(command)
        if isinstance(param.type, OutputPath)
    ]


OUTPUTS = output_options()


def names(words: tuple[str, ...], flag: str) -> list[str]:
    """Every name of the option ``flag`` of the command ``words`` (``-o``, ``--output``)."""
    command = dict(cli_commands())[words]
    return next(p.opts for p in cli_params(command) if flag in p.opts)


def test_every_path_a_command_takes_is_an_input_or_an_output() -> None:
    """A path option typed neither way would escape the walk below."""
    for words, command in cli_commands():
        for param in cli_params(command):
            if isinstance(param.type, click.Path):
                assert isinstance(param.type, UserPath), (words, param.name)
    found = {(words[0], flag) for words, flag, _ in OUTPUTS}
    assert {("run", "--out"), ("check", "--json"), ("check", "--repro"), ("mismatch", "--json"),
            ("analyze", "--output"), ("report", "--out-dir"), ("items", "--out"), ("env", "--venv"),
            ("demo", "--out")} <= found  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, built: Path, tiny_dirs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("writer-inputs")
    logged = {"id": "r0", "prompt_ids": [1, 2], "response_ids": [3, 4],
              "rollout_logprobs": [-0.5, -0.25], "trainer_logprobs": [-0.5, -0.3]}  # fmt: skip
    return {
        "model": tiny_dirs["qwen2"],
        "items": jsonl(root / "items.jsonl", [json.dumps(i) for i in GOOD]),
        "logged": jsonl(root / "logged.jsonl", [json.dumps(logged)]),
        "run": built,
    }


def bases(words: tuple[str, ...], flag: str, ins: dict[str, Path], tmp: Path) -> list[list[object]]:
    """Command lines that would otherwise work (every required option given, a fresh run
    folder where the flag under test is not ``--out``): a check both as a live vs
    prefill check and as a ``--trainer`` check."""
    model, items, run = ins["model"], ins["items"], ins["run"]
    out = [] if flag == "--out" else ["--out", tmp / "fresh"]
    lines: dict[str, list[object]] = {
        "run": [*words, "--model", model, "--items", items, *TINY, *out],
        "check": ["check", "--model", model, "--items", items, *TINY, *out],
        "mismatch": ["mismatch", ins["logged"]],
        "analyze": ["analyze", run],
        "report": ["report", run],
        "items": [*words, "--model", model, "--from", items, "--sources", 1, "--cuts", 2,
                  "--tokens", 8, *([] if flag == "--out" else ["--out", tmp / "cut.jsonl"])],
        "env": ["env", run],
        "demo": ["demo", "--n", 1, *out],
    }  # fmt: skip
    assert words[0] in lines, f"{' '.join(words)} has an output option and no base line here"
    trainer = ["--trainer", "hf:fp32", "--max-tokens", 4]
    return [lines[words[0]], *([[*lines["check"], *trainer]] if words[0] == "check" else [])]


def read_of(words: tuple[str, ...], ins: dict[str, Path]) -> Path:
    """An input file the command reads."""
    reads = {"mismatch": ins["logged"], "analyze": ins["run"] / "rows.jsonl",
             "report": ins["run"] / "matched_live_prefill.csv",
             "env": ins["run"] / "manifest.json"}  # fmt: skip
    return reads.get(words[0], ins["items"])


def device(path: Path) -> Path:
    """A character device node (the null device's numbers) outside /dev; /dev/null where
    this process may not make one."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        return Path("/dev/null")
    return path


def snapshot(path: Path) -> tuple:
    """What must not change at a target: its kind and identity, and a file's bytes."""
    found = path.lstat()
    data = path.read_bytes() if stat.S_ISREG(found.st_mode) else None
    return found.st_mode, found.st_ino, data


@pytest.mark.parametrize(("words", "flag", "kind"), OUTPUTS, ids=[
    f"{' '.join(w)} {f}" for w, f, _ in OUTPUTS])  # fmt: skip
def test_an_output_onto_an_input_a_link_or_a_device_is_refused_before_any_work(
    words: tuple[str, ...], flag: str, kind: str, inputs: dict[str, Path], tmp_path: Path
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.symlink(victim, tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    targets = {
        "an input": read_of(words, inputs),
        "a link": tmp_path / "link",
        "a dangling link": tmp_path / "dangling",
        "a device node": device(tmp_path / "null"),
        "a FIFO": fifo,
    }
    for (what, target), line in itertools.product(
        targets.items(), bases(words, flag, inputs, tmp_path)
    ):
        before = snapshot(target)
        result = invoke(*line, flag, target)
        assert result.exit_code == 2, (what, result.output, result.exception)
        assert_one_sentence(result.stderr, "")
        assert any(name in result.stderr for name in names(words, flag)), result.stderr
        assert snapshot(target) == before, what
        assert victim.read_text() == "keep\n" and not (tmp_path / "nowhere").exists(), what
        assert not (tmp_path / "fresh").exists(), f"{what}: the work started"


@pytest.mark.parametrize("planted", ["symlink", "hard link", "dangling symlink", "FIFO"])
@pytest.mark.parametrize("trainer", [False, True])
def test_a_planted_engine_log_is_refused_before_the_check_runs(
    planted: str, trainer: bool, inputs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "check"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    log = out / "engine.log"
    if planted == "symlink":
        os.symlink(victim, log)
    elif planted == "hard link":
        os.link(victim, log)
    elif planted == "dangling symlink":
        os.symlink(tmp_path / "outside.log", log)
    else:
        os.mkfifo(log)
    extra = ["--trainer", "hf:fp32", "--max-tokens", 4] if trainer else []
    result = invoke("check", "--model", inputs["model"], "--items", inputs["items"], *TINY,
                    "--out", out, *extra)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, "engine.log is a")
    assert victim.read_text() == "keep\n" and not (tmp_path / "outside.log").exists()
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("trainer", [False, True])
def test_a_check_keeps_the_engines_own_log_off_the_terminal(
    trainer: bool, inputs: dict[str, Path], tmp_path: Path,
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """What the engine writes to the process's standard error while the rows run (vLLM
    logs from C and Python) goes to the run folder's engine.log, for a ``--trainer``
    check as for a live vs prefill one; here the hf backend's model loading writes a line
    to file descriptor 2 as an engine would."""
    from kvreplay.backends.hf import HfBackend

    said = b"ENGINE-LOG-LINE\n"
    real = HfBackend.load_model

    def loud(self: HfBackend, *args: object, **kwargs: object) -> object:
        os.write(2, said)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HfBackend, "load_model", loud)
    out = tmp_path / "check"
    extra = ["--trainer", "hf:fp32", "--max-tokens", 4, "--max-k3-kl", 1] if trainer else []
    result = invoke("check", "--model", inputs["model"], "--items", inputs["items"], *TINY,
                    "--out", out, *extra)  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    shown = capfd.readouterr()
    assert said.decode() not in shown.err + shown.out + result.output
    assert said in (out / "engine.log").read_bytes()
