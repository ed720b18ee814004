"""The import contract of the analysis stack (issue 36): every import among these packages
runs down the layers, never back up, and no module imports itself round a circle.

The layers are listed here, once; ``make lint`` runs this file, and so does every test run.
It reads the source as an AST (imports inside functions and under ``TYPE_CHECKING``
count too), so it needs nothing installed and imports none of kvreplay.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Top to bottom: a module may import its own layer and any layer below it.
LAYERS = (
    "kvreplay.report",  # the report's files and the analyze/report commands
    "kvreplay.analysis",  # ledgers read as tables, claims.json
    "kvreplay.experiments",  # each experiment's run, table and section
    "kvreplay.render",  # the blocks and figures a page is made of
    "kvreplay.measure",  # statistics: intervals, rates, the certificate
    "kvreplay.core",  # the domain (errors, items, plans, trajectories): imports none above
)


def layer_of(module: str) -> int | None:
    """The index of the layer holding ``module`` (None: outside the contract)."""
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return index
    return None


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
    """Each module of the layers and the modules of the layers it imports."""
    modules = {
        module_name(path): path
        for layer in LAYERS
        for path in sorted(SRC.joinpath(*layer.split(".")).rglob("*.py"))
    }
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
        assert SRC.joinpath(*layer.split(".")).is_dir(), layer


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
