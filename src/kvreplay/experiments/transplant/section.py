"""The transplant section: each ``kv_transplant_<name>.csv`` panel as donor recovery over
its divergent rows and novel trajectories over its exact controls (section
``transplant_<name>``), beside the paper's primary and later panels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvreplay.core.claims import key
from kvreplay.experiments.transplant.table import SWAPS, TRANSPLANT_TABLE, recovers
from kvreplay.harness.section import Page, Reading, Row, Section
from kvreplay.harness.table import Ledger
from kvreplay.measure.rates import Rate, count, fraction
from kvreplay.measure.stats import TRANSPLANT_WILSON_Z
from kvreplay.render.document import Block, Heading, Image
from kvreplay.render.document import Table as Grid

PREFIX = "transplant_"  # a panel's claims section: transplant_<name>
PAPER_TRANSPLANT = {"primary": ((24, 24), (0, 8)), "later": ((43, 43), (0, 5))}


@dataclass(frozen=True)
class TransplantPanel:
    """Donor recovery over a panel's divergent rows (each direction, and both), and novel
    trajectories over its exact controls."""

    rows: int
    integrity_pass_rows: int
    baseline_divergence: Rate
    baseline_exact_rows: int
    incremental_cache_into_prefill_donor_recovery: Rate
    prefill_cache_into_incremental_donor_recovery: Rate
    bidirectional_donor_recovery: Rate
    exact_control_novel_trajectory: Rate


@dataclass(frozen=True)
class TransplantClaims:
    """Every panel of the folder, by the name its CSV gives it."""

    panels: dict[str, TransplantPanel] = field(metadata=key(flatten=True, prefix=PREFIX))


RATES: tuple[tuple[str, Callable[[TransplantPanel], Rate]], ...] = (
    ("baseline divergent", lambda p: p.baseline_divergence),
    ("replay cache → prefill", lambda p: p.incremental_cache_into_prefill_donor_recovery),
    ("prefill cache → replay", lambda p: p.prefill_cache_into_incremental_donor_recovery),
    ("both ways", lambda p: p.bidirectional_donor_recovery),
    ("exact control changed", lambda p: p.exact_control_novel_trajectory),
)
"""What the report's table and figure both show: which rates, under which labels."""


def transplant_section(ledger: Ledger) -> TransplantPanel:
    """Donor recovery over divergent rows and novel trajectories over exact controls."""
    z = TRANSPLANT_WILSON_Z
    divergent = ledger["baseline_divergent"]
    exact = ~divergent
    n_divergent, n_exact = count(divergent), count(exact)
    recovered = {
        f"{swap.paper}_donor_recovery": Rate.of(
            count(ledger[recovers(swap)] & divergent), n_divergent, z
        )
        for swap in SWAPS
    }
    return TransplantPanel(
        rows=len(ledger),
        integrity_pass_rows=count(ledger["integrity_pass"]),
        baseline_divergence=Rate.of(n_divergent, len(ledger), z),
        baseline_exact_rows=n_exact,
        **recovered,
        bidirectional_donor_recovery=Rate.of(
            count(ledger["bidirectional_donor_recovery"] & divergent), n_divergent, z
        ),
        exact_control_novel_trajectory=Rate.of(
            count(ledger["exact_control_novel_trajectory"] & exact), n_exact, z
        ),
    )


def _claims(reading: Reading) -> TransplantClaims:
    return TransplantClaims(
        {
            TRANSPLANT_TABLE.named(file): transplant_section(ledger)
            for file, ledger in reading.ledgers.items()
        }
    )


def _summary(claims: TransplantClaims) -> list[str]:
    return [
        f"{PREFIX}{name}: donor recovered both ways on"
        f" {panel.bidirectional_donor_recovery.text} divergent rows;"
        f" exact controls changed {panel.exact_control_novel_trajectory.text}"
        for name, panel in claims.panels.items()
    ]


def _headline(claims: TransplantClaims) -> list[Row]:
    rows: list[Row] = []
    for name, panel in claims.panels.items():
        recovery, controls = PAPER_TRANSPLANT.get(name, (None, None))
        rows.append(
            (
                f"transplant {name}: donor recovered both ways",
                panel.bidirectional_donor_recovery.text,
                fraction(*recovery) if recovery else "—",
            )
        )
        rows.append(
            (
                f"transplant {name}: exact controls changed",
                panel.exact_control_novel_trajectory.text,
                fraction(*controls) if controls else "—",
            )
        )
    return rows


def _report(page: Page[TransplantClaims]) -> list[Block]:
    panels = page.claims.panels
    if not panels:
        return []
    blocks: list[Block] = [
        Heading("Transplant recovery"),
        Grid(
            ("panel", *(label for label, _ in RATES)),
            [(name, *(rate(p).text for _, rate in RATES)) for name, p in panels.items()],
        ),
    ]
    figure = _figure(page, panels)
    caption = "Donor recovery after swapping all K/V layers (Wilson 95% intervals)."
    return [*blocks, Image(figure, caption)]


def _figure(page: Page[TransplantClaims], panels: dict[str, TransplantPanel]) -> Path:
    """Every transplant panel's recovery rates, side by side."""
    figure, (ax,) = page.figures.panels(1, height=4.0)
    figure.set_figwidth(max(6.0, 2.2 * len(RATES)))
    series = {name: [rate(panel) for _, rate in RATES] for name, panel in panels.items()}
    page.figures.rate_bars(ax, [label for label, _ in RATES], series, "rows (%)")
    ax.set_title("whole-cache transplant: recipient follows the cache donor", fontsize=10)
    return page.figures.save(figure, "transplant_recovery.png")


TRANSPLANT = Section(
    "transplant",
    (TRANSPLANT_TABLE,),
    TransplantClaims,
    _claims,
    _summary,
    _headline,
    _report,
    paper_order=4,
)
