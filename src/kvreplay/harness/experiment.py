"""The Experiment base class: everything the runner and the audit know of an
experiment. Each experiment declares its panel (arms), selection, units and figures; its
name and its table (its CSV, which analysis reads too) are its declaration's
(:class:`~kvreplay.harness.declaration.Declaration`), which it is made with; the runner
names none of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.core.errors import KvreplayError
from kvreplay.core.items import Item
from kvreplay.harness.panel import Panel
from kvreplay.harness.rows import PanelRow
from kvreplay.harness.scope import Scope, Selection
from kvreplay.harness.table import Table
from kvreplay.harness.units import Clock, Unit, UnitKey, Workbench
from kvreplay.ledger import Record

if TYPE_CHECKING:
    from kvreplay.harness.declaration import Declaration


class Experiment(ABC):
    """An experiment: its selection, phased units, the per-unit computation and figures,
    made with its declaration (its name and tables)."""

    panel: Panel[Any]  # its arms: built in process (Arm) or served (ServedArm)
    phases: int = 1
    served: bool = False  # its arms are served requests, not boundary states

    def __init__(self, declaration: Declaration) -> None:
        self.declaration = declaration

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def table(self) -> Table:
        """The CSV it writes: its served table when its arms are served requests."""
        served = self.declaration.served_table
        return served if self.served and served is not None else self.declaration.table

    def default_n(self, total: int) -> int:
        """How many items ``--n`` means when it is not given."""
        return total

    def count(self, n: int | None, items: list[Item]) -> int:
        n = n if n is not None else self.default_n(len(items))
        if n < 1 or n > len(items):
            raise KvreplayError(f"--n is {n} but the item set holds {len(items)} items.")
        return n

    def prompt_pool(self, items: list[Item], n: int) -> list[Item]:
        """The items whose prompts this experiment may generate live from."""
        return []

    def check_prompts(self, items: list[Item], n: int) -> None:
        """An experiment that generates live needs a prompt for every item it may choose."""
        missing = [i.id for i in self.prompt_pool(items, n) if i.prompt is None]
        if missing:
            raise KvreplayError(
                f"{self.name} generates live from a prompt, but item {missing[0]} "
                "has only a recorded prefix; use fixed-prefix or transplant for trajectories."
            )

    def select(self, scope: Scope, rows: dict[str, Record]) -> Selection:
        """Which items run; ``rows`` are the ``--from`` run's and this run's. Every
        refusal of a selection happens here, before the run writes anything."""
        n = self.count(scope.n, scope.items)
        return Selection(scope.items[:n], {"rule": "first_n", "n": n})

    @abstractmethod
    def config(self, scope: Scope, selection: Selection) -> dict[str, Any]:
        """The experiment's part of the manifest: what a resume must ask for again."""

    @abstractmethod
    def units(
        self, phase: int, scope: Scope, selection: Selection, rows: dict[str, Record]
    ) -> list[Unit]: ...

    @abstractmethod
    def run_unit(self, worker: Workbench, unit: Unit, clock: Clock) -> dict[str, Any]: ...

    @abstractmethod
    def planned(self, config: dict[str, Any], rows: Mapping[str, Record]) -> list[str]:
        """Every row key the experiment holds once complete, from its recorded config."""

    def read_row(self, data: dict[str, Any]) -> PanelRow:
        """A completed row of this experiment, typed."""
        return PanelRow.from_dict(data, self.panel.compared)

    def derived_inputs(
        self, config: dict[str, Any], run: Any, items: dict[str, Item]
    ) -> dict[str, dict[str, Any]]:
        """Inputs each row's unit takes from the recorded config and items alone, by row
        key; the audit checks a row's recorded inputs against them. Inputs copied from
        another row are checked by the audit itself (their ``source``)."""
        return {}

    def row_values(self, scope: Scope) -> tuple[int, str]:
        """How many values one row will record at most, from the run's options, and the
        options that set it (the memory guard, :mod:`kvreplay.harness.memory`); 0: a
        row's size is set by the plan, which the context window bounds."""
        return 0, ""

    def run_summary(
        self, rows: list[Record], config: dict[str, Any]
    ) -> tuple[dict[str, Any], str] | None:
        """What a run of an experiment whose rows are not panels returns and prints at
        its end (its summary and the text); None: the panel summary and verdict."""
        return None

    def figures(self, run_dir: Path, rows: Iterable[Record]) -> list[Path]:
        """Figures drawn from the rows after each run; most experiments draw none."""
        return []


def derived_units(experiment: Experiment, scope: Scope, selection: Selection) -> list[Unit]:
    """One unit per precision and selected item, each with the inputs the experiment
    derives for it from its config (:meth:`Experiment.derived_inputs`)."""
    items = {item.id: item for item in selection.items}
    config = experiment.config(scope, selection)
    derived = experiment.derived_inputs(config, scope.config, items)
    return [
        Unit(key, item, dtype, derived[str(key)])
        for dtype in scope.dtypes
        for item in selection.items
        if (key := UnitKey(experiment.name, item.id, dtype))
    ]


def planned_keys(
    experiment: str,
    item_ids: list[str],
    precisions: list[str],
    rows: Mapping[str, Record],
    prefixed: bool = False,
) -> list[str]:
    """Row keys of a complete experiment; with ``prefixed``, one prefix row per item
    first, and later rows only for items whose prefix row reached the boundary."""
    prefixes = [str(UnitKey.prefix(experiment, i)) for i in item_ids] if prefixed else []
    if prefixed:
        reached = {k for k in prefixes if k in rows and rows[k].data.get("status") == "ok"}
        item_ids = [i for i in item_ids if str(UnitKey.prefix(experiment, i)) in reached]
    return prefixes + [str(UnitKey(experiment, i, p)) for p in precisions for i in item_ids]
