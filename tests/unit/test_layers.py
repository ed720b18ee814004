"""The import contract of the whole package (issue 42): every module of ``src/kvreplay``
belongs to one layer, every import runs down the layers (or within one), never back up,
and no module imports itself round a circle.

The layers are listed here, once; ``make lint`` runs this file, and so does every test run.
It reads the source as an AST (imports inside functions and under ``TYPE_CHECKING``
count too), so it needs nothing installed and imports none of kvreplay.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Top to bottom: a module may import its own layer and any layer below it. A module
# belongs to the most specific entry that names it or a package holding it.
LAYERS = (
    "kvreplay",  # the public surface (__init__: names imported on first use)
    "kvreplay.__main__",  # python -m kvreplay
    "kvreplay.testing",  # the pytest helper users import
    "kvreplay.faults",  # engine faults planted on purpose, and their launcher (never a run)
    "kvreplay.cli",  # the command line: options made from the typed requests
    "kvreplay.demo",  # make demo
    "kvreplay.run",  # the application: run, check, env, cut-and-refeed items
    "kvreplay.audit",  # re-execution and every check of a run folder
    "kvreplay.report",  # the report's files and the analyze/report commands
    "kvreplay.verify",  # verdicts: a value judged from rows, and its renderings
    "kvreplay.analysis",  # ledgers read as tables, claims.json, the derived-CSV check
    "kvreplay.engines",  # where units run: this process, worker processes, Ray
    "kvreplay.experiments",  # one package per experiment, and their registry
    "kvreplay.harness",  # what every experiment plugs into: panels, rows, tables, sections
    "kvreplay.contract",  # a run's configuration, environment and locks
    "kvreplay.backends",  # inference stacks behind one protocol
    "kvreplay.model",  # a model's files and boundary states, whatever runs them
    "kvreplay.render",  # the blocks and figures a page is made of
    "kvreplay.measure",  # statistics: intervals, rates, the certificate
    "kvreplay.ledger",  # the run folder's format: manifest, chained rows, atomic writes
    "kvreplay.core",  # the domain (errors, items, plans, trajectories, the registry)
)


def layer_of(module: str) -> int | None:
    """The index of the most specific layer entry naming ``module`` (None: outside)."""
    found = [
        (len(layer), index)
        for index, layer in enumerate(LAYERS)
        if module == layer or module.startswith(layer + ".")
    ]
    return max(found)[1] if found else None


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The kvreplay modules a file imports, anywhere in it (``from P import m`` names
    ``P.m`` when ``m`` is a module of P)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                as_path = SRC.joinpath(*submodule.split("."))
                if as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists():
                    found.add(submodule)
    return {name for name in found if name.split(".")[0] == "kvreplay"}


def graph() -> dict[str, set[str]]:
    """Each module of the package and the modules it imports."""
    modules = {module_name(path): path for path in sorted((SRC / "kvreplay").rglob("*.py"))}
    return {
        name: {m for m in imports(path) if layer_of(m) is not None and m != name}
        for name, path in modules.items()
    }


def back_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer into a higher one."""
    return sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if layer_of(target) < layer_of(source)  # type: ignore[operator]
    )


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among the modules (depth-first search for a path back)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_every_layer_exists() -> None:
    for layer in LAYERS:
        path = SRC.joinpath(*layer.split("."))
        assert path.is_dir() or path.with_suffix(".py").is_file(), layer


def test_every_module_is_in_a_layer_of_its_own_package() -> None:
    """No module falls through to the package's surface: a new package is listed here."""
    root = LAYERS.index("kvreplay")
    assert [m for m in graph() if m != "kvreplay" and layer_of(m) == root] == []


def test_no_import_runs_back_up_the_layers() -> None:
    assert back_arrows(graph()) == []


def test_no_module_imports_itself_round_a_circle() -> None:
    assert circles(graph()) == []


def test_the_check_sees_an_arrow_back_up_and_a_circle() -> None:
    """The contract can fail: an analysis module importing the report is caught, and so
    is a circle."""
    edges = {"kvreplay.analysis.x": {"kvreplay.report.build"}}
    assert back_arrows(edges) == ["kvreplay.analysis.x -> kvreplay.report.build"]
    edges = {
        "kvreplay.measure.a": {"kvreplay.measure.b"},
        "kvreplay.measure.b": {"kvreplay.measure.a"},
    }
    assert circles(edges) == [["kvreplay.measure.a", "kvreplay.measure.b", "kvreplay.measure.a"]]


def third_party(path: Path) -> set[str]:
    """The top-level packages outside kvreplay that a file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found - {"kvreplay"}


def test_the_core_layer_knows_no_command_line() -> None:
    """click belongs to the commands (``cli``, ``report/commands.py``): the domain under
    every layer is usable, and testable, without one."""
    core = sorted((SRC / "kvreplay" / "core").rglob("*.py"))
    assert [p.name for p in core if "click" in third_party(p)] == []
