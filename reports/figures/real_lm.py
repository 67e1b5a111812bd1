"""The real-LM suite's tables (``meta["real_lm"]``, i.e. ``RealLMTables.to_dict()``): their pivots, the power
reached, and two figures drawn from the table rows rather than from results."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from spectr_audit.reports.figures._plot import Figure, _colors, _legend_below, _new_figure, _png
from spectr_audit.reports.figures.reading import _count, _number, _row

__all__ = ["real_lm_acceptance_figure", "real_lm_block_efficiency_figure", "real_lm_block_grid", "real_lm_figures",
           "real_lm_power", "real_lm_power_summary"]


def real_lm_block_grid(rows: Sequence[Any]) -> tuple[list[int], list[tuple[str, int, dict]]]:
    """Pivot the real-LM block-efficiency rows into the shape of SpecTr's tables.

    Returns the sorted draft lengths L and, per (method, K) in the order the rows first
    name them, ``(method, K, {L: row})``.  Rows without an integer K or L are left out.
    """
    lengths: set = set()
    series: dict = {}
    for raw in rows or ():
        row = _row(raw)
        k, length = _count(row.get("num_drafts")), _count(row.get("draft_len"))
        if k is None or length is None:
            continue
        method = str(row.get("method") or row.get("verifier") or "?")
        lengths.add(length)
        series.setdefault((method, k), {})[length] = row
    return sorted(lengths), [(method, k, cells) for (method, k), cells in series.items()]


def real_lm_power(tables: Any) -> Optional[dict]:
    """The minimum detectable TVs the real-LM suite's judged first-token tests reached.

    Returns ``None`` without fidelity rows, else ``{"alpha", "power", "token", "sequence",
    "not_detecting", "not_judged"}``: per level the ``(smallest, largest, count)`` of the
    minimum detectable TVs below 1 (``None`` when the level has none); ``not_detecting``
    counts judged tests whose sample detects no deviation at all (minimum detectable TV of 1
    or more, or none); ``not_judged`` names the verifiers declared inexact, whose rows are
    reported and not judged.
    """
    if not isinstance(tables, dict):
        return None
    rows = [_row(r) for r in tables.get("fidelity") or ()]
    if not rows:
        return None
    judged = [r for r in rows if r.get("judged", True) is not False]
    out: dict = {"alpha": _number(tables.get("alpha")), "power": _number(tables.get("power")), "not_detecting": 0,
                 "not_judged": list(dict.fromkeys(str(r.get("verifier")) for r in rows
                                                    if r.get("judged", True) is False))}
    for level in ("token", "sequence"):
        values = []
        for r in judged:
            if r.get("level") != level:
                continue
            value = _number(r.get("sampled_min_detectable_tv"))
            if value is None or value >= 1.0:
                out["not_detecting"] += 1
            else:
                values.append(value)
        out[level] = (min(values), max(values), len(values)) if values else None
    return out


def real_lm_power_summary(tables: Any) -> Optional[str]:
    """One line on the power the real-LM suite reached (``None`` without fidelity rows).

    Examples
    --------
    >>> rows = [{"level": "token", "sampled_min_detectable_tv": 0.25}, {"level": "token",
    ...          "sampled_min_detectable_tv": 0.5}, {"level": "sequence", "sampled_min_detectable_tv": 0.3}]
    >>> real_lm_power_summary({"fidelity": rows, "power": 0.99})
    'minimum detectable TV reached at power 0.99 on the ratio cells: 0.250 to 0.500 at the token level (2 tests), 0.300 at the sequence level (1 test)'
    """
    power = real_lm_power(tables)
    if power is None:
        return None
    parts = []
    for level in ("token", "sequence"):
        reached = power[level]
        if reached is None:
            continue
        low, high, count = reached
        span = f"{low:.3f}" if abs(high - low) < 5e-4 else f"{low:.3f} to {high:.3f}"
        parts.append(f"{span} at the {level} level ({count} test{'s' if count != 1 else ''})")
    count = power["not_detecting"]
    if count:
        parts.append(f"{count} test{'s' if count != 1 else ''} too small to detect any deviation")
    level = f" at power {power['power']:.2f}" if power["power"] is not None else ""
    return f"minimum detectable TV reached{level} on the ratio cells: " + (", ".join(parts) if parts else "none")


def real_lm_acceptance_figure(rows: Sequence[Any], title: str = "SmolLM2-135M") -> Optional[bytes]:
    """Token-level acceptance against K on the real model (the real-LM suite's acceptance table).

    Lines: alpha*, SpecTr's bound ``(1 - (1 - 1/K)^K) alpha*``, the ``(1 - 1/e) alpha*``
    floor, the single-draft acceptance and K-SEQ's closed-form ``P_A``; points with 95%
    whiskers: K-SEQ and recursive rejection sampling as measured (K-SEQ's on its own
    subset of contexts, whose alpha* is marked beside it).  Missing values (``None`` or
    NaN: a verifier not run at that K) are skipped.  Returns ``None`` without any row.
    """
    table = sorted((r for r in map(_row, rows or ()) if _count(r.get("num_drafts")) is not None),
                   key=lambda r: _count(r.get("num_drafts")))
    if not table:
        return None
    ks = [_count(r.get("num_drafts")) for r in table]

    def values(key: str, offset: float = 0.0):
        pairs = [(k + offset, _number(r.get(key))) for k, r in zip(ks, table)]
        return [x for x, v in pairs if v is not None], [v for _, v in pairs if v is not None]

    fig, (ax,) = _new_figure(6.4, 4.6)
    lines = (
        ("optimal", "alpha* (optimal)", dict(color="black", linewidth=2)),
        ("spectr_bound", "(1-(1-1/K)^K) alpha* (SpecTr bound)", dict(color="black", linestyle="--", linewidth=1)),
        ("e_bound", "(1-1/e) alpha*", dict(color="grey", linestyle=":", linewidth=1.2)),
        ("single_draft", "single draft: sum min(p, q)", dict(color="#8c564b", linestyle="-.", linewidth=1.2)),
        ("kseq_closed_form", "K-SEQ P_A at rho* (closed form)",
         dict(color="#1f77b4", linewidth=1.5, marker=".", markersize=6)),
    )
    for key, label, style in lines:
        xs, ys = values(key)
        if xs:
            ax.plot(xs, ys, label=label, **style)
    points = (
        ("kseq_measured", "kseq_measured_half_width", -0.12, "K-SEQ measured (95% CI)",
         dict(color="#1f77b4", fmt="o")),
        ("rrs_measured", "rrs_measured_half_width", 0.12, "RRS measured (95% CI)", dict(color="#d62728", fmt="s")),
    )
    for key, half_key, offset, label, style in points:
        drawn = [(k + offset, _number(r.get(key)), _number(r.get(half_key)) or 0.0) for k, r in zip(ks, table)
                 if _number(r.get(key)) is not None]
        if drawn:
            ax.errorbar([x for x, _, _ in drawn], [y for _, y, _ in drawn], yerr=[abs(h) for _, _, h in drawn],
                        markersize=4.5, capsize=3, linewidth=0, elinewidth=1.2, label=label, zorder=4, **style)
    xs, ys = values("kseq_optimal_same_contexts", -0.12)
    measured_ks = {x for x, _ in zip(*values("kseq_measured", -0.12))}
    pairs = [(x, y) for x, y in zip(xs, ys) if x in measured_ks]
    if pairs:
        ax.plot([x for x, _ in pairs], [y for _, y in pairs], linestyle="none", marker="_", markersize=11,
                markeredgewidth=2, color="black", label="alpha* on K-SEQ's contexts", zorder=5)
    ax.set_xlabel("number of drafts K")
    ax.set_ylabel("P(first token among drafts)")
    ax.set_xticks(ks)
    ax.set_title(f"token-level acceptance against K: {title}", fontsize=10)
    _legend_below(ax)
    return _png(fig)


def real_lm_block_efficiency_figure(rows: Sequence[Any], title: str = "SmolLM2-135M") -> Optional[bytes]:
    """Block efficiency against L on the real model: one series per (method, K), 95% CI whiskers.

    Colour by method, marker and line style by K (the ceiling L + 1 is left out: real
    block efficiencies sit far below it and it would squash the series).  The x axis is
    logarithmic in L (the suite's grid doubles L); series are nudged sideways so their
    whiskers do not overlap.  Returns ``None`` without any row that has K and L.
    """
    lengths, series = real_lm_block_grid(rows)
    series = [(m, k, cells) for m, k, cells in series
              if any(_number(row.get("block_efficiency")) is not None for row in cells.values())]
    if not series:
        return None
    methods = list(dict.fromkeys(m for m, _, _ in series))
    colors = _colors(methods)
    all_ks = sorted({k for _, k, _ in series})
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    linestyles = ["-", "--", "-.", ":"]
    fig, (ax,) = _new_figure(6.4, 4.6)
    log_x = len(lengths) > 1 and min(lengths) > 0
    if log_x:
        ax.set_xscale("log", base=2)
    spread = 0.07  # sideways nudge per series: in log2 units on a log axis, in units of L otherwise
    for index, (method, k, cells) in enumerate(series):
        nudge = (index - (len(series) - 1) / 2) * spread
        xs, ys, low, high = [], [], [], []
        for length in lengths:
            row = cells.get(length)
            value = _number(row.get("block_efficiency")) if row else None
            if value is None:
                continue
            xs.append(length * 2.0**nudge if log_x else length + nudge)
            ys.append(value)
            lo, hi = _number(row.get("ci_low")), _number(row.get("ci_high"))
            low.append(max(0.0, value - lo) if lo is not None else 0.0)
            high.append(max(0.0, hi - value) if hi is not None else 0.0)
        kpos = all_ks.index(k)
        ax.errorbar(xs, ys, yerr=[low, high], color=colors[method], marker=markers[kpos % len(markers)],
                    linestyle=linestyles[kpos % len(linestyles)], markersize=4, capsize=2.5, linewidth=1.2,
                    elinewidth=1, label=f"{method}, K={k}", alpha=0.9)
    ax.set_xlabel("draft length L")
    ax.set_ylabel("tokens per target call")
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(length) for length in lengths])
    ax.minorticks_off()
    ax.set_title(f"block efficiency against L: {title}", fontsize=10)
    _legend_below(ax)
    return _png(fig)


def real_lm_figures(tables: Any) -> list[Figure]:
    """The real-LM section's figures for ``meta["real_lm"]``: acceptance against K, block efficiency against L."""
    if not isinstance(tables, dict):
        return []
    figures: list[Figure] = []
    png = real_lm_acceptance_figure(tables.get("acceptance") or ())
    if png is not None:
        figures.append(Figure("real-lm-acceptance", "acceptance against K",
                              "mean over contexts; alpha* is the most any exact verifier accepts, and K-SEQ's closed "
                              "form must reach SpecTr's bound; measured values are estimates with 95% whiskers "
                              "(K-SEQ's on its own subset of contexts, whose alpha* is marked beside it) and can lie "
                              "above alpha* by sampling error alone", png))
    png = real_lm_block_efficiency_figure(tables.get("block_efficiency") or ())
    if png is not None:
        figures.append(Figure("real-lm-block-efficiency", "block efficiency against L",
                              "tokens emitted per target call; whiskers: 95% t-interval over prompts", png))
    return figures
