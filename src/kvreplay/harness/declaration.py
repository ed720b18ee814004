"""What ``kvreplay run NAME`` is, declared once beside the experiment (design: experiments).

A declaration names the experiment's classes by where they live (``module:Class``, so
that declaring loads no torch), holds its tables and, where the experiment is one
package, its section. Its own options are the fields of a dataclass whose metadata
gives each field's flag and help (:func:`kvreplay.core.options.option`), as a backend's
settings are: the CLI builds ``kvreplay run NAME``'s options from them, and the
experiment reads its options as that dataclass, so a default is stated once, in the
field. The registry
(:mod:`kvreplay.experiments.registry`) lists the declarations, one line each, and
installed packages add theirs through the ``kvreplay.experiments`` entry point group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import Declared, declared
from kvreplay.core.registry import load
from kvreplay.harness.schema import Schema
from kvreplay.harness.table import Table

if TYPE_CHECKING:
    from kvreplay.harness.section import Section


@dataclass(frozen=True)
class Declaration:
    """One experiment, declared once: its name and summary (``kvreplay run NAME --help``),
    its class and, where a backend without K/V access runs it as served panels, its
    served class and table; its own options; its section where the experiment is one
    package; the backend setting it needs where only some backends run it (history:
    ``traffic``) or the capability (``rollout``); the role it plays in ``kvreplay check``
    (``greedy``, ``faithful``, ``traffic``, ``trainer``) and, where it judges that role
    with a verdict of its own, its gate; whether a verdict judges its rows
    (``judged``: they hold a compared pair of arms); and where a later panel reads prior
    outcomes from its rows, its rank among such sources (``outcome_rank``, 1 first) and
    which of its rows record a prefix (``prefix_kind``); and its schema
    (:class:`~kvreplay.harness.schema.Schema`: its manifest config's and its rows'
    fields, types, values and relations, which the audit checks every run against),
    without which a declaration is refused."""

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
    capability: str | None = None  # a backend capability it cannot run without (rollout)
    check: str | None = None  # the role it plays in kvreplay check (None: none)
    gate: str | None = None  # module:object of its own gate in that role (harness/gate.py)
    judged: bool = False  # a verdict judges its rows
    outcome_rank: int | None = None  # a source of prior outcomes for panels, by preference
    # Of such a source, the kind of row that records a prefix for a later panel (None: its
    # rows at the backend's prefix precision; fixed-prefix: its ``prefix`` rows).
    prefix_kind: str | None = None
    schema: Schema | None = None  # required: checked by __post_init__

    def __post_init__(self) -> None:
        if not isinstance(self.schema, Schema):
            raise KvreplayError(
                f"The experiment {self.name!r} declares no schema: every experiment states "
                "the fields of its manifest config and of its rows, their types, values and "
                "relations (kvreplay.harness.schema.Schema), which the audit checks every run "
                "against; add schema=Schema(...) to its declaration."
            )

    def runs_on(self, backend_cls: type) -> bool:
        """Whether a backend of this class runs it: it has the K/V access, the served
        form, the setting and the capability the experiment needs."""
        capabilities = backend_cls.capabilities  # type: ignore[attr-defined]
        if self.needs is not None and self.needs not in backend_cls.settings():  # type: ignore[attr-defined]
            return False
        if self.capability is not None and not getattr(capabilities, self.capability):
            return False
        return capabilities.kv_access or self.served is not None

    def option_fields(self) -> dict[str, Declared]:
        """Each own option (those it takes) by field name."""
        if self.options is None:
            return {}
        own = declared(load(self.options))
        return {k: v for k, v in own.items() if self.takes is None or k in self.takes}
