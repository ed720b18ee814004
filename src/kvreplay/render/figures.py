"""How the report draws: matplotlib's Agg renderer straight onto a Figure (no pyplot, so
no GUI backend and no global state), saved as PNG into the report's figures/ folder. The
report hands each analysis section a :class:`Figures`; a section draws through it and
never imports matplotlib, so ``kvreplay analyze`` loads none."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvreplay.core.errors import KvreplayError
from kvreplay.core.outputs import write_output
from kvreplay.measure.rates import Rate

PRECISION_COLOURS = {"bf16": "#c0392b", "fp32": "#2471a3"}


class Figures:
    """New figures, the report's shared drawing helpers, and the folder they are saved to."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @staticmethod
    def new(width: float, height: float) -> Figure:
        return Figure(figsize=(width, height), layout="constrained")

    def panels(self, count: int, height: float = 3.6) -> tuple[Figure, list[Any]]:
        """A figure of ``count`` panels side by side."""
        figure = self.new(max(5.0, 4.6 * count), height)
        axes = figure.subplots(1, count, squeeze=False)[0]
        return figure, list(axes)

    def path(self, name: str) -> Path:
        return self.folder / name

    def save(self, figure: Figure, name: str) -> Path:
        """PNG without a Software stamp, so reruns produce identical bytes."""
        return self.write(figure, name, metadata={"Software": None})

    def write(self, figure: Figure, name: str, **options: Any) -> Path:
        """The figure as PNG (at 110 dpi) into the folder, which must be a folder of its
        own (a symlink would send it elsewhere), replacing whatever held the name."""
        if self.folder.is_symlink():
            raise KvreplayError(f"{self.folder} is a symbolic link; figures go in a folder.")
        self.folder.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=110, **options)
        path = self.path(name)
        write_output(path, buffer.getvalue())
        return path

    @staticmethod
    def colour(precision: str) -> str | None:
        return PRECISION_COLOURS.get(precision)

    @staticmethod
    def integer_ticks(axis: Any) -> None:
        axis.set_major_locator(MaxNLocator(integer=True))

    def rate_bars(
        self, ax: Any, labels: list[str], series: dict[str, list[Rate]], ylabel: str
    ) -> None:
        """Grouped bars of rates with Wilson error bars and count/n labels."""
        width = 0.8 / max(1, len(series))
        positions = np.arange(len(labels))
        for i, (name, payloads) in enumerate(series.items()):
            rates = np.array([100 * p.rate for p in payloads])
            bounds = np.array([[100 * b for b in p.wilson_95_ci] for p in payloads])
            error = np.clip(np.vstack([rates - bounds[:, 0], bounds[:, 1] - rates]), 0, None)
            x = positions + (i - (len(series) - 1) / 2) * width
            ax.bar(x, rates, width, yerr=error, capsize=3, label=name, color=self.colour(name))
            for xi, payload, top in zip(x, payloads, bounds[:, 1], strict=True):
                ax.annotate(
                    payload.text,
                    (xi, top),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.set_xticks(positions, labels, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 110)
        ax.legend(fontsize=8)
