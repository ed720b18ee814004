"""Every section in reading order: the order of the ``analyze`` summary, of the report's
headline rows and of its body. A new experiment adds its section here."""

from __future__ import annotations

from kvreplay.analysis.sections.bridge import BRIDGE
from kvreplay.analysis.sections.flip import FLIP
from kvreplay.analysis.sections.history import HISTORY
from kvreplay.analysis.sections.localize import LOCALIZE
from kvreplay.analysis.sections.matrix import MATRIX
from kvreplay.analysis.sections.paper import HISTORICAL, STOCK
from kvreplay.analysis.sections.resample import RESAMPLE
from kvreplay.analysis.sections.section import Section
from kvreplay.analysis.sections.served import SERVED
from kvreplay.analysis.sections.transplant import TRANSPLANT

SECTIONS: tuple[Section, ...] = (
    MATRIX,
    BRIDGE,
    HISTORICAL,
    TRANSPLANT,
    SERVED,
    STOCK,
    RESAMPLE,
    LOCALIZE,
    HISTORY,
    FLIP,
)
