"""The transplant section: each ``kv_transplant_<name>.csv`` panel as donor recovery over
its divergent rows and novel trajectories over its exact controls (section
``transplant_<name>``), beside the paper's primary and later panels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvreplay.experiments.transplant.table import SWAPS, TRANSPLANT_TABLE, recovers
from kvreplay.harness.section import Page, Reading, Row, Section
from kvreplay.harness.table import Ledger
from kvreplay.measure.rates import Json, count, fraction, rate_payload, rate_text
from kvreplay.measure.stats import TRANSPLANT_WILSON_Z
from kvreplay.render.document import Block, Heading, Image
from kvreplay.render.document import Table as Grid

PREFIX = "transplant_"  # a panel's claims section: transplant_<name>
PAPER_TRANSPLANT = {"primary": ((24, 24), (0, 8)), "later": ((43, 43), (0, 5))}
RATES = (
    ("baseline_divergence", "baseline divergent"),
    ("incremental_cache_into_prefill_donor_recovery", "replay cache → prefill"),
    ("prefill_cache_into_incremental_donor_recovery", "prefill cache → replay"),
    ("bidirectional_donor_recovery", "both ways"),
    ("exact_control_novel_trajectory", "exact control changed"),
)
"""What the report's table and figure both show: which rates, under which labels."""


def transplant_section(ledger: Ledger) -> Json:
    """Donor recovery over divergent rows and novel trajectories over exact controls."""
    z = TRANSPLANT_WILSON_Z
    divergent = ledger["baseline_divergent"]
    exact = ~divergent
    n_divergent, n_exact = count(divergent), count(exact)
    recovery_flags = {f"{swap.paper}_donor_recovery": ledger[recovers(swap)] for swap in SWAPS}
    recovery_flags["bidirectional_donor_recovery"] = ledger["bidirectional_donor_recovery"]
    return {
        "rows": len(ledger),
        "integrity_pass_rows": count(ledger["integrity_pass"]),
        "baseline_divergence": rate_payload(n_divergent, len(ledger), z),
        "baseline_exact_rows": n_exact,
        **{
            key: rate_payload(count(flag & divergent), n_divergent, z)
            for key, flag in recovery_flags.items()
        },
        "exact_control_novel_trajectory": rate_payload(
            count(ledger["exact_control_novel_trajectory"] & exact), n_exact, z
        ),
    }


def _claims(reading: Reading) -> Json:
    return {
        PREFIX + TRANSPLANT_TABLE.named(file): transplant_section(ledger)
        for file, ledger in reading.ledgers.items()
    }


def transplant_panels(claims: Json) -> Iterator[tuple[str, Json]]:
    """Each transplant panel in the claims (section `transplant_<panel>`), by panel name."""
    for section, block in claims.items():
        if section.startswith(PREFIX):
            yield section.removeprefix(PREFIX), block


def _summary(claims: Json) -> list[str]:
    return [
        f"{PREFIX}{panel}: donor recovered both ways on"
        f" {rate_text(block['bidirectional_donor_recovery'])} divergent rows;"
        f" exact controls changed {rate_text(block['exact_control_novel_trajectory'])}"
        for panel, block in transplant_panels(claims)
    ]


def _headline(claims: Json) -> list[Row]:
    rows: list[Row] = []
    for name, block in transplant_panels(claims):
        recovery, controls = PAPER_TRANSPLANT.get(name, (None, None))
        rows.append(
            (
                f"transplant {name}: donor recovered both ways",
                rate_text(block["bidirectional_donor_recovery"]),
                fraction(*recovery) if recovery else "—",
            )
        )
        rows.append(
            (
                f"transplant {name}: exact controls changed",
                rate_text(block["exact_control_novel_trajectory"]),
                fraction(*controls) if controls else "—",
            )
        )
    return rows


def _report(page: Page) -> list[Block]:
    transplants = list(transplant_panels(page.claims))
    if not transplants:
        return []
    blocks: list[Block] = [
        Heading("Transplant recovery"),
        Grid(
            ("panel", *(label for _, label in RATES)),
            [(name, *(rate_text(b[key]) for key, _ in RATES)) for name, b in transplants],
        ),
    ]
    figure = _figure(page, transplants)
    caption = "Donor recovery after swapping all K/V layers (Wilson 95% intervals)."
    return [*blocks, Image(figure, caption)]


def _figure(page: Page, transplants: list[tuple[str, Json]]) -> Path:
    """Every transplant panel's recovery rates, side by side."""
    figure, (ax,) = page.figures.panels(1, height=4.0)
    figure.set_figwidth(max(6.0, 2.2 * len(RATES)))
    series = {name: [block[key] for key, _ in RATES] for name, block in transplants}
    page.figures.rate_bars(ax, [label for _, label in RATES], series, "rows (%)")
    ax.set_title("whole-cache transplant: recipient follows the cache donor", fontsize=10)
    return page.figures.save(figure, "transplant_recovery.png")


TRANSPLANT = Section(
    "transplant", (TRANSPLANT_TABLE,), _claims, _summary, _headline, _report, paper_order=4
)
