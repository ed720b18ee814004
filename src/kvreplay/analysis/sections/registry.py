"""Every section in reading order: the order of the ``analyze`` summary, of the report's
headline rows and of its body. The paper's sections come in the paper's order; an
experiment that is one package declares its own section, which follows them in the
registry's order (its name is enough: nothing is added here)."""

from __future__ import annotations

from kvreplay.analysis.sections.flip import FLIP
from kvreplay.analysis.sections.served import SERVED
from kvreplay.experiments.bridge.section import BRIDGE
from kvreplay.experiments.localize.section import LOCALIZE
from kvreplay.experiments.matrix.section import MATRIX
from kvreplay.experiments.paper.section import HISTORICAL, STOCK
from kvreplay.experiments.registry import declared
from kvreplay.experiments.resample.section import RESAMPLE
from kvreplay.experiments.transplant.section import TRANSPLANT
from kvreplay.harness.section import Section

PAPER_ORDER: tuple[Section, ...] = (
    MATRIX,
    BRIDGE,
    HISTORICAL,
    TRANSPLANT,
    SERVED,
    STOCK,
    RESAMPLE,
    LOCALIZE,
    FLIP,
)
SECTIONS: tuple[Section, ...] = (
    *PAPER_ORDER,
    *(d.section for d in declared().values() if d.section and d.section not in PAPER_ORDER),
)
