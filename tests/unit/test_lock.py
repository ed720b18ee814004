"""Locks: the built environment holds exactly what its lock pins, and a run records the
environment it was made in and gives it back (``kvreplay env``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvreplay.contract.lock import (
    installed,
    library_differences,
    lock_differences,
    parse_lock,
    rebuild_sentence,
    run_environment,
    valid_pin,
)

REPO = Path(__file__).resolve().parents[2]
# Which lock pins the environment this interpreter belongs to (make setup, setup-vllm).
LOCKS = {REPO / ".venv": "lock-hf.txt", REPO / ".venv-vllm": "lock-vllm.txt"}


def _lock_of_this_environment() -> Path:
    prefix = Path(sys.prefix).resolve()
    for venv, name in LOCKS.items():
        if prefix == venv.resolve():
            return REPO / "requirements" / name
    pytest.skip(f"{sys.prefix} is not an environment this checkout builds from a lock")


@pytest.mark.parametrize("env", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_the_built_environment_is_exactly_its_lock(env: str) -> None:
    lock = _lock_of_this_environment()
    assert lock.name == f"lock-{env}.txt"
    pins = parse_lock(lock.read_text(), lock.name)
    assert lock_differences(pins, installed()) == []


def test_lock_differences_name_unpinned_missing_and_other_versions() -> None:
    pins = parse_lock("# c\nA_b==1.0\nc==2\n", "lock")
    assert pins == {"a-b": "1.0", "c": "2"}
    found = lock_differences(pins, {"a-b": "1.1", "d": "3"})
    assert found == [
        "d 3 is installed but not in the lock",
        "a-b is 1.1, the lock pins 1.0",
        "c==2 is in the lock but not installed",
    ]


def test_a_lock_line_that_is_not_a_pin_is_refused() -> None:
    from kvreplay.core.errors import KvreplayError

    with pytest.raises(KvreplayError, match="line 2 is not an exact pin"):
        parse_lock("a==1\nb>=2\n", "lock")


def test_library_differences_name_recorded_and_installed_versions(tmp_path: Path) -> None:
    here = installed()
    contract = {"environment": {"torch": here["torch"], "transformers": "0.0.1"}}
    differences = library_differences(contract)
    assert differences == [("transformers", "0.0.1", here["transformers"])]
    sentence = rebuild_sentence(tmp_path / "my run", differences)
    assert "transformers 0.0.1 (here " in sentence
    assert f"kvreplay env '{tmp_path / 'my run'}' --venv .venv-my-run" in sentence
    assert "\n" not in sentence


def test_an_old_run_is_rebuilt_from_the_checkout_lock_that_agrees_with_it() -> None:
    """Runs made before runs recorded every distribution get the exact lock whose pins
    agree with every library they recorded, or only those libraries pinned."""
    hf = {"contract": {"environment": {"torch": "2.13.0+cpu", "transformers": "5.24.0",
                                       "numpy": "2.4.6", "python": "3.11.7"}}}  # fmt: skip
    environment = run_environment(hf)
    assert environment.exact and "lock-hf.txt" in environment.origin
    assert environment.pins["transformers"] == "5.24.0"
    old = {"contract": {"environment": {"torch": "2.13.0+cpu", "transformers": "5.1.0"}}}
    environment = run_environment(old)
    assert not environment.exact
    assert environment.pins == {"torch": "2.13.0+cpu", "transformers": "5.1.0"}
    assert "--no-deps" not in environment.commands(Path("v"))[-2]
    numpy_only = {"contract": {"environment": {"numpy": "2.4.6"}}}  # the docs lock pins it too
    assert "lock-docs.txt" not in run_environment(numpy_only).origin


def test_a_new_run_records_every_distribution(tmp_path: Path) -> None:
    manifest = {"environment": {"python": "3.11.7", "distributions": {"Foo_Bar": "1"}}}
    environment = run_environment(manifest)
    assert environment.exact and environment.pins == {"foo-bar": "1"}
    text = environment.requirements()
    assert "foo-bar==1" in text.splitlines()
    commands = environment.commands(tmp_path / "v")
    assert commands[-2][-2:] == ["--no-deps", "foo-bar==1"]  # pins as arguments, never -r
    assert not any("-r" in command for command in commands)
    assert commands[-1][-2:] == ["-e", str(REPO)]


@pytest.mark.parametrize(
    ("name", "version", "valid"),
    [
        ("torch", "2.13.0+cpu", True),
        ("Foo_Bar.baz", "1!2.0rc1.post3.dev4", True),
        ("llama_cpp_python", "0.3.36", True),
        ("torch", "@ file:///w.whl", False),
        ("numpy", "2.0; python_version > '0'", False),
        ("numpy[x]", "2.0", False),
        ("--find-links", "x", False),
        ("numpy", "2.0\nevil", False),
        ("numpy", "2.0 ", False),
        ("-numpy", "2.0", False),
        ("numpy", "", False),
    ],
)
def test_only_exact_pins_of_names_and_versions_are_valid(
    name: str, version: str, valid: bool
) -> None:
    assert valid_pin(name, version) is valid


def test_every_committed_run_and_lock_records_valid_pins() -> None:
    """The check refuses forgeries, never a real environment."""
    import json

    for path in sorted(REPO.glob("results/*/manifest.json")):
        run_environment(json.loads(path.read_text()))
    for path in sorted(REPO.glob("requirements/lock-*.txt")):
        assert parse_lock(path.read_text(), path.name)
