"""What ``kvreplay run NAME`` is, declared once beside the experiment (design: experiments).

A declaration names the experiment's classes by where they live (``module:Class``, so
that declaring loads no torch), holds its tables and, where the experiment is one
package, its section. Its own options are the fields of a dataclass whose metadata
gives each field's flag and help (:func:`option`), as a backend's settings are: the CLI
builds ``kvreplay run NAME``'s options from them, and the experiment reads its options as
that dataclass, so a default is stated once, in the field. The registry
(:mod:`kvreplay.experiments.registry`) lists the declarations, one line each, and
installed packages add theirs through the ``kvreplay.experiments`` entry point group.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any

from kvreplay.backends import load
from kvreplay.experiments.table import Table

if TYPE_CHECKING:
    from kvreplay.experiments.section import Section


def option(
    flag: str, help: str, choices: tuple[str, ...] = (), minimum: int | None = None
) -> dict[str, Any]:
    """An options field's metadata: the CLI flag that sets it, its help, and the values
    it may take (choices, or an integer's minimum; neither: any of its type)."""
    return {"option": flag, "help": help, "choices": choices, "minimum": minimum}


@dataclass(frozen=True)
class Declaration:
    """One experiment: its name and summary (``kvreplay run NAME --help``), its class
    and, where a backend without K/V access runs it as served panels, its served class
    and table; its own options; its section where the experiment is one package; the
    backend setting it needs where only some backends run it (history: ``traffic``); the
    keys and types of its manifest config."""

    name: str
    summary: str
    experiment: str  # module:Class of the Experiment
    table: Table
    served: str | None = None  # module:Class of the served form (None: needs K/V access)
    served_table: Table | None = None
    options: str | None = None  # module:Class of its options dataclass
    takes: tuple[str, ...] | None = None  # which option fields it takes (None: every one)
    source: str | None = None  # the help of --from, where it reads another run
    temperature: float = 0.0  # its default --temperature (one that samples by nature)
    default_n: str = "all"  # what --n is when not given, as its help says it
    section: Section | None = None  # its part of claims and report (None: listed in analysis)
    needs: str | None = None  # a backend setting it cannot run without (None: any backend)
    # The keys its manifest config holds (what ``Experiment.config`` writes, besides the
    # table's schema version) and the JSON type(s) of each: the audit names any other key
    # or type in a recorded config (None: not declared, not checked).
    config: dict[str, type | tuple[type, ...]] | None = None

    def runs_on(self, backend_cls: Any) -> bool:
        """Whether a backend of this class runs it: it has the K/V access, the served
        form or the setting the experiment needs."""
        if self.needs is not None and self.needs not in backend_cls.settings():
            return False
        return backend_cls.capabilities.kv_access or self.served is not None

    def option_fields(self) -> dict[str, dict[str, Any]]:
        """Each own option's field name -> flag, help, choices, type and default."""
        if self.options is None:
            return {}
        found = {}
        for f in fields(load(self.options)):
            if "option" not in f.metadata or (self.takes is not None and f.name not in self.takes):
                continue
            default = None if f.default is MISSING else f.default
            found[f.name] = {**f.metadata, "type": str(f.type), "default": default}
        return found
