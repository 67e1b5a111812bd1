"""What every figure shares: the :class:`Figure` record and the matplotlib canvas, colours and legends.

matplotlib is imported inside the drawing functions (never at module import) and only
through ``matplotlib.figure.Figure`` with an Agg canvas, so the global backend of a user's
session is left alone.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Sequence

__all__ = ["Figure"]


@dataclasses.dataclass(frozen=True)
class Figure:
    """One rendered figure: its section, title, a caption and the PNG bytes."""

    kind: str
    title: str
    caption: str
    png: bytes


def _new_figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3, linewidth=0.6)
        ax.set_axisbelow(True)
    return fig, axes


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _colors(verifiers: Sequence[str]) -> dict:
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf"]
    return {name: palette[i % len(palette)] for i, name in enumerate(verifiers)}


def _legend_under(fig, axes, ncol: int = 2) -> None:
    """One legend under the whole figure for what ``axes`` drew (the plots keep their width)."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=7, frameon=False)


def _legend_below(ax) -> None:
    """Legend in two columns under the axes, so a half-width figure keeps a wide plot."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False,
              handlelength=2.6, columnspacing=1.2)


def _error_bars(ax, series: Sequence[tuple], color: Any) -> None:
    """Error bars at the points ``(x, y, (low, high) or None)`` that have an interval (sampled measurements)."""
    drawn = [(x, y, ci) for x, y, ci in series if ci is not None]
    if not drawn:
        return
    ax.errorbar([x for x, _, _ in drawn], [y for _, y, _ in drawn],
                yerr=[[max(y - ci[0], 0.0) for _, y, ci in drawn], [max(ci[1] - y, 0.0) for _, y, ci in drawn]],
                fmt="none", ecolor=color, capsize=3, linewidth=1)
