"""Figures of the chain audit: output laws, acceptance against K and block efficiency against L.

:func:`report_figures` groups a report's results by case family into these figures
(draft-tree cases excepted: :mod:`~spectr_audit.reports.figures.tree` draws them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Optional, Sequence

from spectr_audit.reports.figures._plot import Figure, _colors, _error_bars, _legend_under, _new_figure, _png
from spectr_audit.reports.figures.reading import (
    _interval,
    _number,
    acceptance_interval,
    case_shape,
    deviation_points,
    law_with_ci,
)
from spectr_audit.reports.figures.tree import _tree_of

__all__ = ["acceptance_at_k_figure", "acceptance_caption", "acceptance_figure", "block_efficiency_figure",
           "law_caption", "law_figure", "report_figures"]

_ONE_MINUS_INV_E = 1.0 - math.exp(-1.0)


def _law_label(name: str, kind: str, verdict: Optional[str]) -> str:
    """A law's legend entry: whose law, how it was obtained, and that verifier's verdict (not to be confused)."""
    how = "its law, computed exactly" if kind == "exact" else "sampled frequencies, 95% CI"
    return f"{name}: {how}" + (f" [{verdict}]" if verdict else "")


def law_figure(results: Sequence[Any], title: str, colors: Optional[dict] = None,
               max_strings: int = 10, *, png: bool = True) -> Any:
    """One case: the first token's law against the target (left), and where the laws differ (right).

    Left: each verifier's first-token law (bars, labelled "its law, computed exactly" or "sampled
    frequencies") against the target law q (black ticks); a verifier's verdict is in its label.
    Right: the strings of L + 1 tokens with the largest ``|F(w) - q(w)|`` of the verifiers whose
    audit has a finding (up to ``max_strings`` strings, :func:`deviation_points`): a finding often
    lies past the first token, where the left panel cannot show it.  Without a finding the right
    panel says so.

    Parameters
    ----------
    results : sequence of AuditResult
        Results of one case (one per verifier); those with neither a law nor a deviation are left out.
    title : str
    colors : dict, optional
        Verifier name -> colour, to keep colours stable across figures.
    max_strings : int
    png : bool
        PNG bytes (default), or the matplotlib figure itself (to restyle it, or to read what it draws).

    Returns
    -------
    bytes, matplotlib.figure.Figure or None
        ``None`` when no result carries a law or a deviation.
    """
    laws = [(r, law_with_ci(r)) for r in results]
    laws = [(r, law) for r, law in laws if law is not None]
    findings = [r for r in results if not getattr(r, "passed", True) and getattr(r, "error", None) is None]
    deviations = [(r, deviation_points(r)) for r in findings]
    deviations = [(r, points) for r, points in deviations if points]
    if not laws and not deviations:
        return None
    colors = colors or _colors(sorted({r.verifier for r in results}))
    target = next((law["target"] for _, law in laws if law["target"] is not None), None)
    # the strings worst over every finding, largest deviation first
    worst: dict = {}
    for _, points in deviations:
        for p in points:
            worst[p["string"]] = max(worst.get(p["string"], 0.0), abs(p["deviation"]))
    strings = sorted(worst, key=lambda s: -worst[s])[:max_strings]
    height = max(3.1, 0.26 * len(strings) * max(1, len(deviations)) ** 0.5 + 1.4)
    fig, (ax_law, ax_dev) = _new_figure(12.0, min(height, 7.0), ncols=2)
    vocab_size = max([len(law["law"]) for _, law in laws] + [0])
    width = 0.8 / max(1, len(laws))
    for i, (r, law) in enumerate(laws):
        xs = [t - 0.4 + width * (i + 0.5) for t in range(len(law["law"]))]
        ax_law.bar(xs, law["law"], width=width, color=colors.get(r.verifier), alpha=0.85,
                   label=_law_label(r.verifier, law["kind"], getattr(r, "verdict", None)))
        if law["kind"] == "sampled":
            ax_law.errorbar(xs, law["law"], yerr=[[max(0.0, a - lo) for a, lo in zip(law["law"], law["low"])],
                                                  [max(0.0, hi - a) for a, hi in zip(law["law"], law["high"])]],
                            fmt="none", ecolor="black", capsize=2, linewidth=0.8)
    if target is not None:
        ax_law.hlines(target, [t - 0.45 for t in range(len(target))], [t + 0.45 for t in range(len(target))],
                      colors="black", linewidth=2.0, zorder=5, label="target law q")
    if laws:
        ax_law.set_title(f"first token only: {title}", fontsize=10)
        ax_law.set_xlabel("first emitted token")
        ax_law.set_xticks(range(vocab_size))
        if vocab_size > 20:
            ax_law.tick_params(axis="x", labelsize=6)
        ax_law.set_ylabel("probability")
    else:
        ax_law.text(0.5, 0.5, "no first-token law recorded\n(a statistical audit records its worst cells)",
                    ha="center", va="center", transform=ax_law.transAxes, fontsize=8)
        ax_law.set_axis_off()
    if strings:
        rows = {s: i for i, s in enumerate(strings)}
        step = 0.8 / len(deviations)
        for j, (r, points) in enumerate(deviations):
            drawn = [p for p in points if p["string"] in rows]
            if not drawn:
                continue
            ys = [rows[p["string"]] - 0.4 + step * (j + 0.5) for p in drawn]
            sampled = drawn[0]["kind"] == "sampled"
            ax_dev.errorbar([p["deviation"] for p in drawn], ys,
                            xerr=[[max(0.0, p["deviation"] - p["low"]) for p in drawn],
                                  [max(0.0, p["high"] - p["deviation"]) for p in drawn]] if sampled else None,
                            fmt="s" if sampled else "o", markersize=5, capsize=3, linestyle="none",
                            markerfacecolor="white" if sampled else colors.get(r.verifier), color=colors.get(r.verifier),
                            label=f"{r.verifier}: " + ("observed - target (sampled, 95% CI)" if sampled
                                                       else "F(w) - q(w), computed exactly"))
        ax_dev.axvline(0.0, color="black", linewidth=1.0)
        ax_dev.set_yticks(range(len(strings)), strings, fontsize=7)
        ax_dev.invert_yaxis()
        ax_dev.set_ylabel("string w (tokens)")
        ax_dev.set_xlabel("emitted probability - target probability")
        ax_dev.ticklabel_format(axis="x", style="sci", scilimits=(-3, 3))
        ax_dev.set_title("where the findings are: the strings with the largest |F(w) - q(w)|", fontsize=9)
    else:
        text = ("the findings recorded no deviating strings\n(see the findings table)" if findings
                else "no finding on this case: every check held")
        ax_dev.text(0.5, 0.5, text, ha="center", va="center", transform=ax_dev.transAxes, fontsize=9)
        ax_dev.set_axis_off()
    _legend_under(fig, [ax_law, ax_dev], ncol=3)
    return _png(fig) if png else fig


#: Labels of the acceptance figures' reference lines.
_ALPHA_STAR_LABEL = "alpha*: the most any exact verifier accepts"
_SPECTR_LABEL = "(1-(1-1/K)^K) alpha*: SpecTr's guarantee"
_E_FLOOR_LABEL = "(1-1/e) alpha*"


def _acceptance_points(results: Sequence[Any]) -> tuple[dict, dict, dict]:
    """Per verifier ``[(K, acceptance, interval or None)]``, the i.i.d. alpha* per K, and the verifiers'
    own alpha* where their drafting differs (without replacement), ``{name: [(K, alpha*)]}``."""
    points: dict = {}
    alpha_star: dict = {}
    own_optimum: dict = {}
    for r in results:
        _, k, _ = case_shape(r)
        acceptance = _number(r.metrics.get("acceptance"))
        optimum = _number(r.metrics.get("optimal_acceptance"))
        if k is None:
            continue
        if acceptance is not None:
            points.setdefault(r.verifier, []).append((k, acceptance, acceptance_interval(r.metrics)))
        if optimum is None:
            continue
        # The i.i.d. alpha* (the one that comes with a SpecTr bound) is the reference line; a
        # verifier drafting otherwise (without replacement) has its own alpha*, drawn in its colour.
        if r.metrics.get("spectr_bound") is not None:
            alpha_star[k] = optimum
        else:
            own_optimum.setdefault(r.verifier, []).append((k, optimum))
    for name in list(own_optimum):
        # an LP optimum agrees with the closed form to the solver's accuracy only
        differs = any(k not in alpha_star or abs(alpha_star[k] - v) > 1e-7 for k, v in own_optimum[name])
        if differs:
            own_optimum[name] = sorted(own_optimum[name])
        else:
            del own_optimum[name]
    return points, alpha_star, own_optimum


def _sampled_label(name: str, series: Sequence[tuple]) -> str:
    """A verifier's legend entry, saying whether its acceptance was sampled (drawn with its interval)."""
    return f"{name} (sampled, 95% CI)" if any(ci is not None for _, _, ci in series) else name


def acceptance_figure(results: Sequence[Any], title: str, colors: Optional[dict] = None, *, png: bool = True) -> Any:
    """Membership acceptance against K for one case family, with alpha* and the SpecTr bounds.

    Uses the metrics ``acceptance``, ``optimal_acceptance`` (alpha*) and ``spectr_bound``;
    the ``(1 - 1/e) alpha*`` floor is drawn from alpha*.  A sampled acceptance is drawn with
    its interval (:func:`acceptance_interval`) as an error bar.  With a single K there is no
    line to draw against K: :func:`acceptance_at_k_figure` draws the verifiers side by side
    instead.  Only what is drawn is in the legend.  Returns PNG bytes (with ``png=False`` the
    matplotlib figure), or ``None`` when no result has both K and an acceptance.
    """
    points, alpha_star, own_optimum = _acceptance_points(results)
    if not points:
        return None
    all_ks = sorted({k for series in points.values() for k, _, _ in series} | set(alpha_star))
    if len(all_ks) == 1:
        return acceptance_at_k_figure(results, title, colors, png=png)
    colors = colors or _colors(sorted(points))
    fig, (ax,) = _new_figure(6.0, 4.2)
    if alpha_star:
        ks = sorted(alpha_star)
        # a reference known at one K only is a tick, not an invisible one-point line
        tick = dict(marker="_", markersize=14, markeredgewidth=2) if len(ks) == 1 else {}
        ax.plot(ks, [alpha_star[k] for k in ks], color="black", linewidth=2, label=_ALPHA_STAR_LABEL, **tick)
        if any(k > 1 for k in ks):  # at K = 1 SpecTr's bound is alpha* itself
            ax.plot(ks, [(1 - (1 - 1 / k) ** k) * alpha_star[k] for k in ks], color="black", linestyle="--",
                    linewidth=1, label=_SPECTR_LABEL, **tick)
        ax.plot(ks, [_ONE_MINUS_INV_E * alpha_star[k] for k in ks], color="grey", linestyle=":", linewidth=1.2,
                label=_E_FLOOR_LABEL, **tick)
    for name in sorted(points):
        series = sorted(points[name], key=lambda point: point[0])
        ax.plot([k for k, _, _ in series], [a for _, a, _ in series], marker="o", markersize=4, color=colors.get(name),
                label=_sampled_label(name, series), alpha=0.9)
        _error_bars(ax, series, colors.get(name))
        if name in own_optimum:
            ks = [k for k, _ in own_optimum[name]]
            ax.plot(ks, [v for _, v in own_optimum[name]], color=colors.get(name), linestyle="-.", linewidth=1.5,
                    marker="_" if len(ks) == 1 else None, markersize=14, label=f"alpha* for {name}'s drafts")
    ax.set_xlabel("number of drafts K")
    ax.set_ylabel("P(first token among drafts)")
    ax.set_xticks(all_ks)
    ax.set_title(f"acceptance against K: {title}", fontsize=10)
    _legend_under(fig, [ax], ncol=1 if len(points) + len(own_optimum) < 4 else 2)
    return _png(fig) if png else fig


def acceptance_at_k_figure(results: Sequence[Any], title: str, colors: Optional[dict] = None, *,
                           png: bool = True) -> Any:
    """Acceptance of each verifier at the one K of a case family, side by side, against alpha*.

    One point per verifier (a sampled acceptance with its 95% interval as an error bar), and
    horizontal lines for what is known at that K: alpha*, SpecTr's ``(1 - (1 - 1/K)^K) alpha*``
    (for K >= 2; at K = 1 it is alpha*) and the ``(1 - 1/e) alpha*`` floor; a verifier with its
    own alpha* (drafts without replacement) gets a tick of its colour at its place.  Returns
    PNG bytes (with ``png=False`` the matplotlib figure), or ``None`` when no result has an acceptance.
    """
    points, alpha_star, own_optimum = _acceptance_points(results)
    if not points:
        return None
    names = sorted(points)
    colors = colors or _colors(names)
    ks = sorted({k for series in points.values() for k, _, _ in series} | set(alpha_star))
    fig, (ax,) = _new_figure(6.0, 4.2)
    for k in ks:
        if k not in alpha_star:
            continue
        star = alpha_star[k]
        ax.axhline(star, color="black", linewidth=2,
                   label=_ALPHA_STAR_LABEL + (" (= SpecTr's bound at K = 1)" if k == 1 else ""))
        if k > 1:
            ax.axhline((1 - (1 - 1 / k) ** k) * star, color="black", linestyle="--", linewidth=1, label=_SPECTR_LABEL)
        ax.axhline(_ONE_MINUS_INV_E * star, color="grey", linestyle=":", linewidth=1.2, label=_E_FLOOR_LABEL)
    sampled_drawn = exact_drawn = False
    for x, name in enumerate(names):
        for _, acceptance, ci in points[name]:
            if ci is None:
                ax.plot([x], [acceptance], marker="o", markersize=6, linestyle="none", color=colors.get(name))
                exact_drawn = True
            else:
                ax.errorbar([x], [acceptance], yerr=[[max(acceptance - ci[0], 0.0)], [max(ci[1] - acceptance, 0.0)]],
                            marker="s", markersize=5, markerfacecolor="white", capsize=4, linestyle="none",
                            color=colors.get(name))
                sampled_drawn = True
        for _, value in own_optimum.get(name, ()):
            ax.plot([x], [value], marker="_", markersize=22, markeredgewidth=2, linestyle="none",
                    color=colors.get(name), label=f"alpha* for {name}'s drafts")
    # the point styles in the legend, in grey (the colours name the verifiers on the x axis)
    if exact_drawn:
        ax.plot([], [], marker="o", linestyle="none", color="#555", label="acceptance computed exactly")
    if sampled_drawn:
        ax.errorbar([], [], yerr=[], marker="s", markerfacecolor="white", capsize=4, linestyle="none", color="#555",
                    label="acceptance sampled, 95% interval")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylabel("P(first token among drafts)")
    k_text = ", ".join(str(k) for k in ks)
    ax.set_title(f"acceptance at K = {k_text}: {title}", fontsize=10)
    _legend_under(fig, [ax], ncol=1)
    return _png(fig) if png else fig


def block_efficiency_figure(results: Sequence[Any], title: str, colors: Optional[dict] = None) -> Optional[bytes]:
    """Block efficiency (expected emitted tokens per step) against L for one case family.

    Draws the block LP optimum (``block_lp_optimum``) and its next-iteration-repair
    relaxation (``block_lp_repair_optimum``) where the results carry them, and the
    ceiling L + 1.  Returns ``None`` when no result has both L and a block efficiency.
    """
    points: dict = {}
    optimum: dict = {}  # per L, the largest block LP optimum any result recorded
    repair: dict = {}  # and the largest optimum of the LP with repair
    for r in results:
        length, efficiency = case_shape(r)[2], _number(r.metrics.get("block_efficiency"))
        if length is None or efficiency is None:
            continue
        points.setdefault(r.verifier, []).append((length, efficiency, _interval(r.metrics.get("block_efficiency_ci"))))
        for key, best in (("block_lp_optimum", optimum), ("block_lp_repair_optimum", repair)):
            lp = _number(r.metrics.get(key))
            if lp is not None:
                best[length] = max(best.get(length, lp), lp)
    if not points:
        return None
    colors = colors or _colors(sorted(points))
    fig, (ax,) = _new_figure(6.0, 3.4)
    ls = sorted({length for series in points.values() for length, _, _ in series})
    ax.plot(ls, [length + 1 for length in ls], color="lightgrey", linewidth=1, linestyle="-.", label="L + 1 (ceiling)")
    if optimum:
        xs = sorted(optimum)
        ax.plot(xs, [optimum[x] for x in xs], color="black", linewidth=2, label="block LP optimum")
    if repair:
        xs = sorted(repair)
        ax.plot(xs, [repair[x] for x in xs], color="black", linestyle="--", linewidth=1, label="LP with repair")
    for name in sorted(points):
        series = sorted(points[name], key=lambda point: point[0])
        ax.plot([x for x, _, _ in series], [e for _, e, _ in series], marker="o", markersize=4, color=colors.get(name),
                label=name, alpha=0.9)
        _error_bars(ax, series, colors.get(name))
    ax.set_xlabel("draft length L")
    ax.set_ylabel("E[tokens emitted per step]")
    ax.set_xticks(ls)
    ax.set_title(f"block efficiency against L: {title}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def _group(results: Iterable[Any], key) -> dict:
    groups: dict = {}
    for r in results:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return groups


def report_figures(report: Any, max_law_figures: int = 48) -> list[Figure]:
    """Every figure for ``report``, grouped by case family.

    Acceptance figures: one per (case family, L) with results that have K and an acceptance at
    several K, or of several verifiers side by side at one K (one verifier at one K is a single point:
    no figure; draft-tree cases are drawn by :func:`tree_figure`, in the report's tree section).  Block-efficiency figures: one per (case family, K) with at least two draft
    lengths.  Law figures: one per case, cases with findings first, at most
    ``max_law_figures`` of them (the rest are counted in the last caption).
    """
    results = [r for r in report.results if r.error is None]
    colors = _colors(sorted({r.verifier for r in report.results}))
    figures: list[Figure] = []

    def shape_key_k(r):
        base, k, length = case_shape(r)
        if _tree_of(r) is not None:
            return None  # a tree case has its own figure (tree_figure)
        return (base, length) if k is not None and _number(r.metrics.get("acceptance")) is not None else None

    for (base, length), group in sorted(_group(results, shape_key_k).items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if len({case_shape(r)[1] for r in group}) < 2 and len({r.verifier for r in group}) < 2:
            continue  # one verifier at one K: a single point, nothing drawn against K (the tables hold it)
        label = base if length is None else f"{base}, L={length}"
        png = acceptance_figure(group, label, colors)
        if png is not None:
            figures.append(Figure("acceptance", label, acceptance_caption(group), png))

    def shape_key_l(r):
        base, k, length = case_shape(r)
        if _tree_of(r) is not None:
            return None
        return (base, k) if length is not None and _number(r.metrics.get("block_efficiency")) is not None else None

    for (base, k), group in sorted(_group(results, shape_key_l).items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if len({case_shape(r)[2] for r in group}) < 2:
            continue
        label = base if k is None else f"{base}, K={k}"
        png = block_efficiency_figure(group, label, colors)
        if png is not None:
            figures.append(Figure("block-efficiency", label, "expected tokens emitted per verification step", png))

    by_case = _group(results, lambda r: r.case if law_with_ci(r) is not None or (
        not r.passed and deviation_points(r)) else None)
    with_findings = {r.case for r in report.results if not r.passed}
    order = sorted(by_case, key=lambda case: (case not in with_findings, case))
    for index, case in enumerate(order):
        if index >= max_law_figures:
            figures[-1] = dataclasses.replace(
                figures[-1], caption=figures[-1].caption + f" ({len(order) - max_law_figures} more cases not drawn)"
            )
            break
        png = law_figure(by_case[case], case, colors)
        if png is not None:
            figures.append(Figure("law", case, law_caption([r for r in report.results if r.case == case]), png))
    return figures


def acceptance_caption(results: Sequence[Any]) -> str:
    """The caption of an acceptance figure, true of what it draws.

    alpha* bounds the acceptance of an exact verifier: an acceptance computed exactly above it
    is a finding.  A sampled acceptance is an estimate: it is drawn with its 95% interval, and
    can lie above alpha* by sampling error alone.

    Examples
    --------
    >>> from types import SimpleNamespace as R
    >>> acceptance_caption([R(metrics={"acceptance": 0.5, "optimal_acceptance": 0.6})])
    'alpha* is the most any exact verifier accepts: an acceptance computed exactly above it is a finding'
    >>> acceptance_caption([R(metrics={"acceptance": 0.5})])
    'acceptance as measured; alpha* was not computed for these cases'
    """
    if not any(_number(r.metrics.get("optimal_acceptance")) is not None for r in results):
        text = "acceptance as measured; alpha* was not computed for these cases"
    else:
        text = "alpha* is the most any exact verifier accepts: an acceptance computed exactly above it is a finding"
    if any(acceptance_interval(r.metrics) is not None for r in results):
        text += ("; a sampled acceptance is an estimate, drawn with its 95% interval, and can lie above alpha* by "
                 "sampling error alone")
    return text


def law_caption(results: Sequence[Any]) -> str:
    """The caption of a case's law figure: its findings (with the declarations), or that there was none.

    Examples
    --------
    >>> from spectr_audit.results import AuditResult, Check
    >>> law_caption([AuditResult("kseq", "c"), AuditResult("b", "c", (Check("exact", False),), expected=False)])
    'findings: b (declared inexact)'
    """
    findings = [r for r in results if r.error is None and not r.passed]
    if findings:
        def declared(r):
            if r.expected is None:
                return ""
            return " (declared inexact)" if r.expected is False else " (declared exact: UNEXPECTED)"

        return "findings: " + ", ".join(f"{r.verifier}{declared(r)}" for r in findings)
    inconclusive = [r.verifier for r in results if r.error is None and r.inconclusive]
    return "no finding: every check of every verifier held" + (
        f"; INCONCLUSIVE (below the planned power): {', '.join(inconclusive)}" if inconclusive else "")
