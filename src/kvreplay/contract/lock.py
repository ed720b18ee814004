"""Locks: the exact versions of every distribution in an environment.

A run records the whole environment it was made in (every installed distribution, Python,
platform) in its manifest's header, and the libraries that can change a result in its
contract. When a resume or an audit meets other library versions it refuses with the
packages that differ and the one command that rebuilds the run's environment:
``kvreplay env RUN --venv DIR``. This module reads and writes those records; the
environment of a checkout is pinned by ``requirements/lock-*.txt`` (``make lock``).
"""

from __future__ import annotations

import re
import shlex
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kvreplay.core.errors import KvreplayError

# Contract environment fields that are library versions, with the distributions that
# provide each (the rest describe the machine, and Python, which pip cannot rebuild, is
# announced by audit rather than refused); each backend adds its own (``libraries``).
CORE_LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",), "numpy": ("numpy",)}
# The installer's own distributions, which pip freeze leaves out too: not the run's.
INSTALLER = ("pip", "setuptools", "wheel", "distribute", "kvreplay")
# Locks of no environment a run is made in: the docs site's (make docs).
NOT_RUN_LOCKS = ("lock-docs.txt",)
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", re.ASCII)
# A distribution's name (PEP 508) and an exact version (PEP 440: a public version, and the
# local label a CPU build of torch carries): all that may reach pip from a run folder.
NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", re.ASCII)
# ASCII only: a Unicode digit class or case folding would let full-width or Arabic-Indic
# digits, a Kelvin sign or a long s through as a version, for pip alone to refuse.
VERSION = re.compile(
    r"v?([0-9]+!)?[0-9]+(\.[0-9]+)*"  # epoch, release
    r"([-_.]?(a|b|c|rc|alpha|beta|pre|preview)[-_.]?[0-9]*)?"  # pre-release
    r"(-[0-9]+|[-_.]?(post|rev|r)[-_.]?[0-9]*)?"  # post-release
    r"([-_.]?dev[-_.]?[0-9]*)?"  # development release
    r"(\+[a-z0-9]+([-_.][a-z0-9]+)*)?",  # local label
    re.ASCII | re.IGNORECASE,
)
MAX_PIN = 200  # characters of a name or version: longer is no distribution's


def normalize(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Every distribution installed in this environment's site-packages, by normalized
    name; kvreplay itself (the code being run, installed from its own source) and the
    installer's own distributions are left out. Only site-packages is read: a library may
    put vendored copies on ``sys.path`` (setuptools' ``_vendor``) that pip never installed."""
    paths = sysconfig.get_paths()
    found = {}
    for dist in metadata.distributions(path=sorted({paths["purelib"], paths["platlib"]})):
        name = dist.metadata["Name"]
        if name and normalize(name) not in INSTALLER:
            found[normalize(name)] = dist.version
    return dict(sorted(found.items()))


def valid_pin(name: object, version: object) -> bool:
    """Whether ``name==version`` is an exact pin of a distribution on a package index,
    and nothing else pip would read: no URL, path, option, marker, extras or whitespace."""
    return (
        isinstance(name, str)
        and isinstance(version, str)
        and max(len(name), len(version)) <= MAX_PIN
        and NAME.fullmatch(name) is not None
        and VERSION.fullmatch(version) is not None
    )


def check_pin(name: object, version: object, where: str) -> None:
    """Refuse (one sentence naming the entry) a recorded distribution that is not an
    exact pin: a forged run folder must not choose what pip installs from where."""
    if not valid_pin(name, version):
        entry = f"{name}=={version}"
        shown = repr(entry if len(entry) <= 80 else entry[:80] + "...")
        raise KvreplayError(
            f"{where} records {shown}, which is not an exact pin of a package on the index "
            "(name==version), so nothing is installed from this run."
        )


def parse_lock(text: str, where: str) -> dict[str, str]:
    """``name==version`` lines (comments and blank lines aside), by normalized name."""
    pins = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _REQUIREMENT.match(line)
        if match is None or not valid_pin(*match.groups()):
            raise KvreplayError(f"{where} line {number} is not an exact pin (name==version).")
        pins[normalize(match.group(1))] = match.group(2)
    return pins


def lock_differences(pins: dict[str, str], present: dict[str, str]) -> list[str]:
    """How an environment departs from its lock: unpinned, missing or other versions."""
    out = [f"{name} {present[name]} is installed but not in the lock" for name in present
           if name not in pins]  # fmt: skip
    for name, version in pins.items():
        if name not in present:
            out.append(f"{name}=={version} is in the lock but not installed")
        elif present[name] != version:
            out.append(f"{name} is {present[name]}, the lock pins {version}")
    return out


def source_checkout() -> Path | None:
    """The kvreplay checkout this code runs from, when it is one (an editable install)."""
    root = Path(__file__).resolve().parents[3]
    is_checkout = (root / "pyproject.toml").is_file() and (root / "requirements").is_dir()
    return root if is_checkout else None


def libraries() -> dict[str, tuple[str, ...]]:
    """Every result-changing library a contract may record, with its distributions."""
    from kvreplay.backends import backend_class, registry

    found = dict(CORE_LIBRARIES)
    for name in registry():
        found |= backend_class(name).libraries
    return found


def _library_versions(present: dict[str, str]) -> dict[str, str]:
    return {
        library: present[name]
        for library, names in libraries().items()
        for name in names
        if name in present
    }


def library_differences(contract: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(library, recorded, here) for each result-changing library whose version differs
    from the run's; a library the run did not use is not compared."""
    recorded = contract.get("environment")
    if not isinstance(recorded, dict):
        return []
    here = _library_versions(installed())
    out = []
    for library in libraries():
        if library in recorded and str(recorded[library]) != here.get(library, "none"):
            out.append((library, str(recorded[library]), here.get(library, "not installed")))
    return out


def rebuild_sentence(run_dir: Path, differences: list[tuple[str, str, str]]) -> str:
    """The refusal a resume or an audit gives on other library versions."""
    listed = ", ".join(f"{lib} {old} (here {new})" for lib, old, new in differences)
    venv = default_venv(run_dir)
    return (
        f"{run_dir} was made with {listed}; rebuild its environment with "
        f"'kvreplay env {shlex.quote(str(run_dir))} --venv {venv}' and rerun the command with "
        f"{venv}/bin/kvreplay."
    )


def check_libraries(manifest: dict[str, Any], run_dir: Path) -> None:
    """Refuse (one sentence) when this environment's libraries are not the run's. The
    refusal tells the user to rebuild the run's environment, so a run whose recorded
    environment is not plain exact pins is refused for that instead."""
    differences = library_differences(manifest["contract"])
    if differences:
        run_environment(manifest)
        raise KvreplayError(rebuild_sentence(run_dir, differences))


def default_venv(run_dir: Path) -> str:
    return f".venv-{re.sub(r'[^A-Za-z0-9._-]+', '-', run_dir.resolve().name) or 'run'}"


@dataclass(frozen=True)
class RunEnvironment:
    """What it takes to rebuild the environment a run was made in.

    ``exact`` is True when ``pins`` name every distribution (the run recorded them, or a
    checkout lock agrees with every library it recorded); otherwise only the recorded
    libraries are pinned and pip resolves kvreplay's other dependencies.
    """

    pins: dict[str, str]
    python: str
    exact: bool
    origin: str

    def requirements(self) -> str:
        lines = [
            f"# The environment of the run: {self.origin}.",
            f"# Python {self.python}; rebuild with: kvreplay env RUN --venv DIR",
        ]
        if not self.exact:
            lines.append("# Only the libraries the run recorded are pinned; pip resolves the rest.")
        return "\n".join([*lines, *self.pinned()]) + "\n"

    def pinned(self) -> list[str]:
        return [f"{name}=={version}" for name, version in self.pins.items()]

    def commands(self, venv: Path) -> list[list[str]]:
        """The commands that build ``venv``: torch first (so nothing pulls a CUDA build),
        then the pins, then this kvreplay from its source (or its release). The pins go
        to pip as arguments, never as a requirements file, so that nothing recorded can
        be read as an option; each was checked to be ``name==version``."""
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        torch = self.pins.get("torch", "").split("+")[0]
        steps = [[sys.executable, "-m", "venv", str(venv)], [*pip, "--upgrade", "pip"]]
        if torch:
            steps.append([*pip, f"torch=={torch}"])
        steps.append([*pip, *(["--no-deps"] if self.exact else []), *self.pinned()])
        checkout = source_checkout()
        release = f"kvreplay=={metadata.version('kvreplay')}"
        kvreplay = ["-e", str(checkout)] if checkout else [release]
        steps.append([*pip, "--no-deps", *kvreplay])
        return steps


def run_environment(manifest: dict[str, Any]) -> RunEnvironment:
    """The environment a run records, or for an older run the best rebuild it allows.
    Everything taken from the manifest must be an exact pin (see :func:`check_pin`)."""
    header = manifest.get("environment")
    contract_env = manifest.get("contract", {}).get("environment", {})
    python = str(contract_env.get("python", "unknown"))
    if python != "unknown" and (len(python) > MAX_PIN or not VERSION.fullmatch(python)):
        raise KvreplayError(
            f"manifest.json's contract records Python {python[:40]!r}, which is not a version."
        )
    known = libraries()
    recorded = {lib: contract_env[lib] for lib in known if lib in contract_env}
    for lib, version in recorded.items():
        check_pin(lib, version, "manifest.json's contract")
    if isinstance(header, dict) and isinstance(header.get("distributions"), dict):
        for name, version in header["distributions"].items():
            check_pin(name, version, "manifest.json's environment")
        pins = {normalize(k): v for k, v in header["distributions"].items()}
        return RunEnvironment(dict(sorted(pins.items())), python, True, "recorded by the run")
    checkout = source_checkout()
    for path in sorted(checkout.glob("requirements/lock-*.txt")) if checkout else ():
        if path.name in NOT_RUN_LOCKS:
            continue
        pins = parse_lock(path.read_text(encoding="utf-8"), str(path))
        if all(_library_versions(pins).get(lib) == v for lib, v in recorded.items()):
            return RunEnvironment(pins, python, True, f"requirements/{path.name} (it agrees "
                                  "with every library the run recorded)")  # fmt: skip
    pins = {known[lib][-1]: version for lib, version in recorded.items()}
    return RunEnvironment(pins, python, False, "only its libraries were recorded")
