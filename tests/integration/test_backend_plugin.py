"""A backend that arrives as a plugin (another package's ``kvreplay.backends`` entry point)
brings its settings with it, with no change to kvreplay (issue 52): they reach a
command's ``--help`` scoped to it (``--backend toy --help`` describes them, the plain
``--help`` says which backend takes which), the docs' settings table, and the refusal of
a setting given to another backend. Each command runs in its own process, as a user's
does, with the plugin installed on its path the way pip installs one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"

PLUGIN = '''
from dataclasses import dataclass, field

from kvreplay.backends.base import Backend, Capabilities, option


@dataclass(frozen=True)
class Toy(Backend):
    """A third-party backend with one setting of its own."""

    name = "toy"
    summary = "a toy plugin"
    capabilities = Capabilities(kv_access=False)
    depth: int = field(
        default=2,
        metadata=option("--toy-depth", "How deep the toy looks.", minimum=1, maximum=8),
    )
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A folder holding the plugin as an installed distribution."""
    (tmp_path / "toy_backend.py").write_text(PLUGIN)
    info = tmp_path / "toy_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvreplay.backends]\ntoy = toy_backend:Toy\n")
    return tmp_path


def python(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(site), *sys.path])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": path})  # fmt: skip


def test_a_plugin_backends_settings_reach_help_docs_and_refusals(site: Path) -> None:
    plain = python(site, "-m", "kvreplay", "check", "--help")
    assert plain.returncode == 0, plain.stderr
    assert "--toy-depth" in plain.stdout.split("Backend settings")[1]  # listed, not described
    assert "How deep the toy looks" not in plain.stdout
    assert "--block-size" not in plain.stdout.split("Backend settings")[0]

    scoped = python(site, "-m", "kvreplay", "check", "--backend", "toy", "--help")
    assert scoped.returncode == 0, scoped.stderr
    own = scoped.stdout.split("Settings of the toy backend:")[1]
    assert "--toy-depth" in own and "How deep the toy looks" in own and "1<=x<=8" in own
    assert "--block-size" not in scoped.stdout  # another backend's setting is not shown

    hooks = str(DOCS / "_hooks" / "kvreplay_docs.py")
    table = python(
        site, "-c",
        f"import importlib.util; spec = importlib.util.spec_from_file_location('h', {hooks!r}); "
        "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h); "
        "print(h.settings_markdown('toy'))",
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "| `--toy-depth` | `2` | How deep the toy looks. (from 1 to 8) |" in table.stdout

    refused = python(site, "-m", "kvreplay", "check", "--toy-depth", "3", "--out", str(site / "r"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--toy-depth does not apply to the hf backend" in refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and not (site / "r").exists()
