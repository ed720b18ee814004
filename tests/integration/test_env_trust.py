"""Issue 34, class 1: a run folder cannot make ``kvreplay env`` install or run anything.

A forged manifest whose recorded environment holds something pip would read as a URL, a
path, an option, a marker, extras or a second line is refused in one sentence naming the
entry, and nothing is installed: a wheel whose ``.pth`` would write a marker on the next
interpreter start is never reached. ``audit`` fails or refuses such a folder and never
advises rebuilding it. ``--venv`` targets that are not a folder to build are refused."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from forgery import audit, manifest, problems, read_rows, rechain, write_manifest
from helpers import assert_one_sentence, invoke

from kvreplay.contract.lock import run_environment
from kvreplay.core.canonical import sha256_json


def evil_wheel(folder: Path, marker: Path) -> Path:
    """A wheel whose ``.pth`` file writes ``marker`` when Python starts in its venv."""
    wheel = folder / "evil-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("evil.pth", f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
        archive.writestr("evil-0.dist-info/METADATA", "Metadata-Version: 2.1\nName: evil\n"
                         "Version: 0\n")  # fmt: skip
        archive.writestr("evil-0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n")  # fmt: skip
        archive.writestr("evil-0.dist-info/RECORD", "")
    return wheel


# (recorded name, recorded version) as a forger writes them into the manifest's header;
# {wheel} and {dir} are the evil wheel and its folder.
FORGED: dict[str, tuple[object, object]] = {
    "url_as_version": ("torch", "@ file://{wheel}"),
    "direct_reference": ("evil @ file://{wheel}", "0"),
    "wheel_path_as_name": ("{wheel}", "0"),
    "extra_index_url": ("--extra-index-url file://{dir}", "0"),
    "find_links": ("numpy", "1.0\n--find-links {dir}"),
    "editable": ("-e git+file://{dir}#egg=evil", "0"),
    "newline_splits_an_entry": ("numpy", "2.0\n{wheel}"),
    "marker": ("numpy", "2.0; python_version > '0'"),
    "extras": ("numpy[evil]", "2.0"),
    "space_and_option": ("numpy", "2.0 --pre"),
    "relative_path": ("../evil", "0"),
    "not_a_string": ("numpy", ["2.0"]),
    "long_version": ("numpy", "1." * 500 + "0"),
}


def forge(run: Path, case: str, wheel: Path) -> str:
    """Put the case's entry into the run's recorded environment; what the refusal names."""
    name, version = FORGED[case]
    fill = {"wheel": str(wheel), "dir": str(wheel.parent)}
    name = name.format(**fill) if isinstance(name, str) else name
    version = version.format(**fill) if isinstance(version, str) else version
    data = manifest(run)
    data["environment"]["distributions"][name] = version
    write_manifest(run, data)
    return f"records {repr(f'{name}=={version}')[:9]}"


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    (tmp_path / "wheels").mkdir()
    return evil_wheel(tmp_path / "wheels", tmp_path / "marker")


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_environment_is_refused_and_nothing_is_installed(
    case: str, run: Path, wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    named = forge(run, case, wheel)
    printed = invoke("env", run)
    assert printed.exit_code == 2 and printed.stdout == "", printed.output
    assert_one_sentence(printed.stderr, "is not an exact pin of a package on the index")
    assert named in printed.stderr
    venv = tmp_path / "venv"
    built = invoke("env", run, "--venv", venv)
    assert built.exit_code == 2, built.output
    assert_one_sentence(built.stderr, named)
    assert "$ " not in built.output  # no command was run
    assert not venv.exists() and not (tmp_path / "marker").exists()
    assert not (tmp_path / "pyvenv.cfg").exists()


def test_audit_fails_a_forged_environment(run: Path, wheel: Path) -> None:
    forge(run, "url_as_version", wheel)
    result = audit(run, "--sample", 0)
    assert result.exit_code == 1, result.output
    assert "manifest.json: field environment is malformed" in problems(result)
    assert "kvreplay env" not in result.output


def test_audit_never_advises_rebuilding_a_forged_environment(run: Path, wheel: Path) -> None:
    """With other library versions recorded, audit would advise ``kvreplay env``: for a
    forged environment it refuses for the forgery instead."""
    named = forge(run, "extra_index_url", wheel)
    data = manifest(run)
    data["contract"]["environment"]["transformers"] = "0.0.1"
    data["contract_sha256"] = sha256_json(data["contract"])
    write_manifest(run, data)
    rechain(run, read_rows(run), data["contract_sha256"])
    result = audit(run, "--sample", 0)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, named)
    assert "kvreplay env" not in result.output


def test_a_forged_library_version_in_the_contract_is_refused(run: Path) -> None:
    """An older run's rebuild pins the contract's libraries: they are pins too."""
    data = manifest(run)
    del data["environment"]
    data["contract"]["environment"]["transformers"] = "5.0 ; os_name == 'posix'"
    write_manifest(run, data)
    result = invoke("env", run)
    assert result.exit_code == 2
    assert_one_sentence(result.stderr, "manifest.json's contract records \"transformers==5.0 ;")


def test_a_recorded_environment_is_printed_as_pins(run: Path) -> None:
    result = invoke("env", run)
    assert result.exit_code == 0, result.output
    pins = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert pins and all("==" in line and " " not in line for line in pins)
    assert run_environment(manifest(run)).pinned() == pins


VENVS: dict[str, tuple[str, str]] = {
    "empty": ("", "--venv is empty"),
    "blank": ("   ", "--venv is empty"),
    "an_option": ("--help", "starts with '-', which would reach python -m venv as an option"),
    "dash_name": ("-v", "write ./-v for a folder of that name"),
    "newline": ("a\nb", "--venv holds a newline or another control character"),
    "tab": ("a\tb", "--venv holds a newline or another control character"),
    "proc": ("/proc/self/venv", "is inside /proc"),
    "sys": ("/sys/kernel/venv", "is inside /sys"),
    "dev": ("/dev/null", "is inside /dev"),
    "name_too_long": ("v" * 300, "a name in it is longer than the file system's"),
    "a_file": ("{file}", "exists and is not a folder"),
    "a_full_folder": ("{full}", "is a folder that already holds files"),
    "current_folder": (".", "is a folder that already holds files"),
}


@pytest.mark.parametrize("case", list(VENVS))
def test_venv_targets_that_are_not_a_folder_to_build(
    case: str, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    venv, expected = VENVS[case]
    venv = venv.format(file=tmp_path / "a-file", full=tmp_path / "full")
    result = invoke("env", run, "--venv", venv)
    assert result.exit_code == 2, result.output
    assert_one_sentence(result.stderr, expected)
    assert "$ " not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "full" / "notes.txt").read_text() == "x"
