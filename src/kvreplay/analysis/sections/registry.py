"""Every section in reading order: the order of the ``analyze`` summary, of the report's
headline rows and of its body. The paper's sections come in the paper's order (each says
its place, ``paper_order``); an experiment's declared section follows in the registry's
order, and so does any other; a name given twice is refused."""

from __future__ import annotations

from kvreplay.analysis.sections.flip import FLIP
from kvreplay.analysis.sections.served import SERVED
from kvreplay.core.registry import Registry
from kvreplay.experiments.paper.section import HISTORICAL, STOCK
from kvreplay.experiments.registry import EXPERIMENTS
from kvreplay.harness.section import Section


def _gather() -> list[tuple[str, Section]]:
    declared = [(f"experiment {d.name}", d.section) for d in EXPERIMENTS.values() if d.section]
    own = [(f"{__name__}", s) for s in (HISTORICAL, STOCK, SERVED, FLIP)]
    unique = list({id(section): (origin, section) for origin, section in declared + own}.values())
    return sorted(unique, key=lambda pair: (pair[1].paper_order is None, pair[1].paper_order or 0))


REGISTRY: Registry[Section] = Registry("section", _gather)


def sections() -> tuple[Section, ...]:
    """Every section, in reading order."""
    return tuple(REGISTRY.values())
