"""The generation audit's figures, drawn from ``GenerationAuditResult.to_dict()`` (or the result itself).

* :func:`pit_figure`: per PIT order, one histogram per stratum of the tokens' binned PIT values
  with that stratum's 99% acceptance band (the range of one bin's count under uniformity,
  Binomial(n, 1/bins)) and its expected count ``n / bins``; bins outside the band are drawn red;
* :func:`held_out_tv_figure`: per order, the held-out lower confidence bound on the engine's mean
  per-token TV to the scorer, beside the reference generator's (the numerics floor: how far the
  scorer's numerics alone put a speculation-free engine), with the point estimates;
* :func:`generation_figures`: both, in the order the HTML report shows them.

Like every figure here, they read plain values only (a missing or non-finite one is left out) and
import matplotlib inside the drawing functions, through an Agg canvas.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

from spectr_audit.reports.figures._plot import Figure, _colors, _legend_below, _new_figure, _png
from spectr_audit.reports.figures.reading import _number

__all__ = ["generation_figures", "generation_strata", "held_out_tv_figure", "outside_band", "pit_figure"]

#: At most this many strata per order are drawn (``all`` first, then the smallest p-values).
MAX_STRATA = 12


def _as_dict(result: Any) -> dict:
    if hasattr(result, "to_dict"):
        result = result.to_dict()
    if not isinstance(result, Mapping):
        raise TypeError(f"expected a GenerationAuditResult or its to_dict() dict, got {type(result).__name__}")
    return dict(result)


def _counts(value: Any) -> Optional[list]:
    if not isinstance(value, (list, tuple)) or not value:
        return None
    numbers = [_number(v) for v in value]
    return None if any(v is None for v in numbers) else numbers


def _band(row: Mapping) -> Optional[tuple]:
    band = _counts(row.get("band"))
    if band is None or len(band) != 2 or band[1] <= 0:
        return None
    return band[0], band[1]


def _sort_p(row: Mapping) -> float:
    for key in ("pvalue_adjusted", "pvalue"):
        value = _number(row.get(key))
        if value is not None:
            return value
    return math.inf


def generation_strata(result: Any) -> dict:
    """``{order: [stratum row, ...]}`` in the result's order (rows with a histogram only)."""
    out: dict = {}
    for row in _as_dict(result).get("strata") or ():
        if isinstance(row, Mapping) and _counts(row.get("histogram")) is not None:
            out.setdefault(str(row.get("ordering", "?")), []).append(dict(row))
    return out


def outside_band(row: Mapping) -> Optional[int]:
    """How many of a stratum row's bins lie outside its 99% band (None without a band)."""
    counts, band = _counts(row.get("histogram")), _band(row)
    if counts is None or band is None:
        return None
    return sum(c < band[0] or c > band[1] for c in counts)


def _grid(count: int, ncols: int, cell_width: float, cell_height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    ncols = max(1, min(ncols, count))
    nrows = max(1, math.ceil(count / ncols))
    fig = MplFigure(figsize=(cell_width * ncols, cell_height * nrows + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3, linewidth=0.6)
        ax.set_axisbelow(True)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def _p_text(value: Any) -> str:
    number = _number(value)
    if number is None:
        return "–"
    return f"{number:.1e}" if 0 < number < 1e-3 else f"{number:.3f}"


def pit_figure(rows: Sequence[Mapping], ordering: str, alpha: Optional[float] = None) -> Optional[Figure]:
    """One order's PIT histograms, one panel per stratum, each with its 99% acceptance band.

    ``rows``: that order's stratum rows (``strata`` of the result's dict).  At most
    :data:`MAX_STRATA` panels: ``all``, then the strata with the smallest adjusted p-values.
    Returns None without a row to draw.
    """
    rows = [r for r in rows if _counts(r.get("histogram")) is not None]
    if not rows:
        return None
    chosen = sorted(rows, key=lambda r: (r.get("stratum") != "all", _sort_p(r)))[:MAX_STRATA]
    chosen = [r for r in rows if r in chosen]  # the result's order (all, arms, positions, prompts)
    fig, axes = _grid(len(chosen), 4, 2.9, 2.2)
    flagged = 0
    for ax, row in zip(axes, chosen):
        counts = _counts(row["histogram"])
        bins = len(counts)
        n = _number(row.get("num_tokens")) or sum(counts)
        band = _band(row)
        colors = ["#4c72b0"] * bins
        if band is not None:
            colors = ["#d62728" if c < band[0] or c > band[1] else "#4c72b0" for c in counts]
            flagged += colors.count("#d62728")
            ax.axhspan(band[0], band[1], color="#2ca02c", alpha=0.15, linewidth=0, label="99% band per bin")
            for edge in band:
                ax.axhline(edge, color="#2ca02c", linewidth=0.8, alpha=0.8)
        ax.bar([(i + 0.5) / bins for i in range(bins)], counts, width=0.9 / bins, color=colors, label="tokens per bin")
        ax.axhline(n / bins, color="#2ca02c", linewidth=1, linestyle="--", label="expected n / bins")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, max(max(counts), band[1] if band else 0.0, n / bins) * 1.15 or 1.0)
        reject = alpha is not None and _number(row.get("pvalue_adjusted")) is not None \
            and row["pvalue_adjusted"] <= alpha
        ax.set_title(f"{row.get('stratum', '?')}: n = {int(n)}\np = {_p_text(row.get('pvalue'))}, "
                     f"adj. {_p_text(row.get('pvalue_adjusted'))}" + (" (rejected)" if reject else ""),
                     fontsize=8, color="#cf222e" if reject else "black")
        ax.tick_params(labelsize=7)
        ax.set_xlabel("PIT value", fontsize=7)
    axes[0].set_ylabel("tokens", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    shown = f"{len(chosen)} of {len(rows)} strata" if len(chosen) < len(rows) else f"{len(rows)} strata"
    caption = (f"PIT values of the emitted tokens along the {ordering} order, {shown} ('all' first, then the "
               "smallest adjusted p-values), binned into equal bins. Under an exact engine each bin's count is "
               "Binomial(n, 1/bins): the green band is its central 99% range, the dashed line its mean. "
               f"{flagged} bin(s) fall outside their band (red); about 1% of bins do so by chance, and the test "
               "(G-test, Holm-adjusted p in the title) is what decides.")
    return Figure("pit", f"PIT histograms, {ordering} order", caption, _png(fig))


def held_out_tv_figure(held_out: Sequence[Mapping], floor: Sequence[Mapping] = (),
                       requested_tv: Optional[float] = None) -> Optional[Figure]:
    """The held-out lower bounds on the mean per-token TV per order: the engine's and the numerics floor's.

    Bars: the lower confidence bounds; dots: the point estimates (the held-out excess).  Returns None
    without a bound to draw.
    """
    engine = {str(h.get("ordering")): h for h in held_out or () if isinstance(h, Mapping)}
    reference = {str(h.get("ordering")): h for h in floor or () if isinstance(h, Mapping)}
    orders = list(dict.fromkeys([*engine, *reference]))
    if not orders:
        return None
    series = [("engine", engine)] + ([("reference (numerics floor)", reference)] if reference else [])
    colors = _colors([name for name, _ in series])
    fig, (ax,) = _new_figure(max(4.0, 1.6 * len(orders) + 2.0), 3.2)
    width = 0.8 / len(series)
    top = 0.0
    for s, (name, bounds) in enumerate(series):
        xs, lows, estimates = [], [], []
        for i, order in enumerate(orders):
            h = bounds.get(order)
            if h is None:
                continue
            x = i + (s - (len(series) - 1) / 2) * width
            low = _number(h.get("lower"))
            xs.append(x)
            lows.append(low if low is not None else 0.0)
            estimates.append(_number(h.get("estimate")))
            ax.annotate(f"≥ {lows[-1]:.3f}", (x, lows[-1]), textcoords="offset points", xytext=(0, 2),
                        ha="center", fontsize=7)
        ax.bar(xs, lows, width=width * 0.9, color=colors[name], alpha=0.85, label=f"{name}: lower bound")
        points = [(x, e) for x, e in zip(xs, estimates) if e is not None]
        if points:
            ax.plot([x for x, _ in points], [e for _, e in points], "o", color=colors[name], markeredgecolor="black",
                    markersize=5, label=f"{name}: estimate")
        top = max([top, *lows, *(e for _, e in points)])
    requested = _number(requested_tv)
    if requested is not None:
        ax.axhline(requested, color="#7f7f7f", linestyle=":", linewidth=1,
                   label=f"requested min detectable TV {requested:g}")
        top = max(top, requested)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(orders)))
    ax.set_xticklabels(orders, fontsize=8)
    ax.set_ylabel("mean per-token TV", fontsize=8)
    bottom = min(0.0, *(_number(h.get("estimate")) or 0.0 for b in (engine, reference) for h in b.values()))
    span = max(top, 0.01) - bottom
    ax.set_ylim(bottom=bottom - 0.12 * span if bottom < 0 else 0.0, top=max(top, 0.01) + 0.2 * span)
    _legend_below(ax)
    confidence = next((_number(h.get("confidence")) for h in [*engine.values(), *reference.values()]
                       if _number(h.get("confidence")) is not None), None)
    level = f" at confidence {confidence:g}" if confidence is not None else ""
    caption = ("Held-out lower confidence bounds" + level + " on the mean per-token TV to the scorer, per PIT "
               "order: the bins over-represented in one half of the continuations are scored on the other half, "
               "less an Azuma-Hoeffding radius (bars; 0 means no excess was shown). Dots: the point estimates."
               + (" The reference generator (speculation off, same scorer) is the numerics floor: a bound on it is "
                  "what the scorer's numerics alone account for." if reference else ""))
    return Figure("held-out-tv", "Held-out TV lower bounds", caption, _png(fig))


def generation_figures(result: Any) -> list[Figure]:
    """Every figure of a generation audit: the PIT histograms per order, then the held-out TV bounds."""
    data = _as_dict(result)
    alpha = _number(data.get("alpha"))
    out = [f for order, rows in generation_strata(data).items() if (f := pit_figure(rows, order, alpha)) is not None]
    held = held_out_tv_figure(data.get("held_out_tv") or (), data.get("numerics_floor") or (),
                              data.get("requested_tv"))
    if held is not None:
        out.append(held)
    return out
