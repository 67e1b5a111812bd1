"""Figures for the HTML report: PNG bytes drawn with matplotlib's Agg canvas.

matplotlib is imported inside the drawing functions (never at module import) and
only through ``matplotlib.figure.Figure`` with an Agg canvas, so the global backend
of a user's session is left alone.

Each figure reads result objects only and uses whatever metrics are present:

* :func:`law_figure`: per case, the first-token law each verifier implies against the
  target's (the first token only), and where the findings are: the strings of L + 1 tokens
  with the largest ``|F(w) - q(w)|`` (exact laws; sampled cells with Wilson intervals);
* :func:`acceptance_figure`: membership acceptance against K, with alpha*, SpecTr's
  ``(1 - (1 - 1/K)^K) alpha*`` and the ``(1 - 1/e) alpha*`` floor, sampled values with
  their intervals as error bars; a family with a single K gets
  :func:`acceptance_at_k_figure` (the verifiers side by side) instead of a one-dot plot;
* :func:`block_efficiency_figure`: block efficiency against L, with the block LP optima
  when the results carry them;
* :func:`tree_figure`: a draft-tree case (results with ``details["tree"]``): the tree drawn,
  and each verifier's acceptance and expected accepted length against the best any lossless
  verifier reaches on it; :func:`tree_text` is the same tree as indented text.

:func:`report_figures` groups a report's results into these figures.

The real-LM suite's tables (``meta["real_lm"]``) have their own two figures, drawn from the
table rows rather than from results: :func:`real_lm_acceptance_figure` (acceptance against
K with the bounds, measured K-SEQ and RRS with whiskers) and
:func:`real_lm_block_efficiency_figure` (block efficiency against L per method and K, with
95% whiskers); :func:`real_lm_figures` draws both.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from typing import Any, Iterable, Optional, Sequence

__all__ = [
    "Figure",
    "case_shape",
    "law_with_ci",
    "law_figure",
    "law_caption",
    "deviation_points",
    "acceptance_figure",
    "acceptance_at_k_figure",
    "acceptance_caption",
    "acceptance_interval",
    "block_efficiency_figure",
    "report_figures",
    "tree_cases",
    "tree_figure",
    "tree_text",
    "real_lm_block_grid",
    "real_lm_power",
    "real_lm_power_summary",
    "real_lm_acceptance_figure",
    "real_lm_block_efficiency_figure",
    "real_lm_figures",
]

#: z for the two-sided 95% intervals drawn on sampled laws.
_Z95 = 1.959963984540054
_ONE_MINUS_INV_E = 1.0 - math.exp(-1.0)
_K_RE = re.compile(r"/K=(\d+)")
_L_RE = re.compile(r"/L=(\d+)")


@dataclasses.dataclass(frozen=True)
class Figure:
    """One rendered figure: its section, title, a caption and the PNG bytes."""

    kind: str
    title: str
    caption: str
    png: bytes


# ---------------------------------------------------------------------------------------------
# Reading results
# ---------------------------------------------------------------------------------------------


def _int_field(result: Any, key: str) -> Optional[int]:
    for source in (result.metrics, result.details):
        value = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def case_shape(result: Any) -> tuple[str, Optional[int], Optional[int]]:
    """``(base name, K, L)`` of a result's case.

    K and L come from ``num_drafts`` / ``draft_len`` in the metrics or details when the
    runner records them, else from the ``/K=`` and ``/L=`` suffixes that suites give to
    expanded cases; the base name drops those suffixes.
    """
    name = result.case
    num_drafts = _int_field(result, "num_drafts")
    draft_len = _int_field(result, "draft_len")
    k_match, l_match = _K_RE.search(name), _L_RE.search(name)
    if num_drafts is None and k_match:
        num_drafts = int(k_match.group(1))
    if draft_len is None and l_match:
        draft_len = int(l_match.group(1))
    base = _L_RE.sub("", _K_RE.sub("", name))
    return base, num_drafts, draft_len


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _vector(value: Any) -> Optional[list[float]]:
    if isinstance(value, (list, tuple)) and value and all(_number(v) is not None for v in value):
        return [float(v) for v in value]
    return None


def law_with_ci(result: Any) -> Optional[dict]:
    """The first-token law a result implies, with a confidence interval per token.

    Returns ``None`` when the result carries no law.  Otherwise a dict with ``law``,
    ``low``, ``high`` (lists over the vocabulary), ``target`` (or ``None``) and ``kind``:
    ``"exact"`` (an enumerated law: zero-width interval) or ``"sampled"`` (observed
    frequencies with 95% Wilson intervals, or the intervals the audit recorded).

    Recognised details: ``first_token_law`` (exact); ``first_token_counts`` or
    ``observed_first_token_counts`` (sampled counts); ``observed_first_token_law`` with
    ``first_token_law_ci_low`` / ``first_token_law_ci_high``; ``target_first_token_law``.
    """
    details = result.details if isinstance(result.details, dict) else {}
    target = _vector(details.get("target_first_token_law"))
    counts = _vector(details.get("first_token_counts")) or _vector(details.get("observed_first_token_counts"))
    if counts is not None and sum(counts) > 0:
        total = sum(counts)
        law, low, high = [], [], []
        for count in counts:
            phat = count / total
            denom = 1 + _Z95**2 / total
            centre = (phat + _Z95**2 / (2 * total)) / denom
            half = _Z95 * math.sqrt(phat * (1 - phat) / total + _Z95**2 / (4 * total**2)) / denom
            law.append(phat)
            low.append(max(0.0, centre - half))
            high.append(min(1.0, centre + half))
        return {"law": law, "low": low, "high": high, "target": target, "kind": "sampled"}
    observed = _vector(details.get("observed_first_token_law"))
    if observed is not None:
        low = _vector(details.get("first_token_law_ci_low")) or observed
        high = _vector(details.get("first_token_law_ci_high")) or observed
        return {"law": observed, "low": low, "high": high, "target": target, "kind": "sampled"}
    exact = _vector(details.get("first_token_law"))
    if exact is not None:
        return {"law": exact, "low": exact, "high": exact, "target": target, "kind": "exact"}
    return None


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


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


def _law_label(name: str, kind: str, verdict: Optional[str]) -> str:
    """A law's legend entry: whose law, how it was obtained, and that verifier's verdict (not to be confused)."""
    how = "its law, computed exactly" if kind == "exact" else "sampled frequencies, 95% CI"
    return f"{name}: {how}" + (f" [{verdict}]" if verdict else "")


def deviation_points(result: Any) -> list[dict]:
    """Where a result's law differs from the target: ``{"string", "deviation", "low", "high", "kind"}`` per string.

    From an exact audit's ``worst_strings`` (``implied - target`` over strings of L + 1 tokens,
    no interval), or a statistical audit's ``worst_cells`` with ``worst_cells_num_samples``
    (observed frequency minus the cell's target probability, with a 95% Wilson interval).
    Strings are written as their tokens separated by spaces.

    Examples
    --------
    >>> from types import SimpleNamespace as R
    >>> [p["string"] for p in deviation_points(R(details={"worst_strings": [
    ...     {"string": [1, 0, 2], "implied": 0.2, "target": 0.1}]}))]
    ['1 0 2']
    """
    details = result.details if isinstance(result.details, dict) else {}
    out = []
    for w in details.get("worst_strings") or ():
        implied, target = (_number(w.get("implied")), _number(w.get("target"))) if isinstance(w, dict) else (None, None)
        if implied is not None and target is not None:
            string = " ".join(str(t) for t in w.get("string") or ())
            out.append({"string": string, "deviation": implied - target, "low": implied - target,
                        "high": implied - target, "kind": "exact"})
    total = _number(details.get("worst_cells_num_samples"))
    if not out and total:
        for c in details.get("worst_cells") or ():
            observed, expected = (_number(c.get("observed")), _number(c.get("expected"))) if isinstance(c, dict) else (
                None, None)
            if observed is None or expected is None:
                continue
            phat, target = observed / total, expected / total
            denom = 1 + _Z95**2 / total
            centre = (phat + _Z95**2 / (2 * total)) / denom
            half = _Z95 * math.sqrt(phat * (1 - phat) / total + _Z95**2 / (4 * total**2)) / denom
            out.append({"string": str(c.get("cell")), "deviation": phat - target, "low": centre - half - target,
                        "high": centre + half - target, "kind": "sampled"})
    return out


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


def _interval(value: Any) -> Optional[tuple[float, float]]:
    """A two-number interval from a metric (``acceptance_ci``), or None."""
    pair = _vector(value)
    if pair is None or len(pair) != 2 or any(not math.isfinite(v) for v in pair):
        return None
    return (min(pair), max(pair))


def acceptance_interval(metrics: dict) -> Optional[tuple[float, float]]:
    """The interval of a sampled acceptance: ``acceptance_ci``, or ``acceptance_ci_low`` / ``_high``
    (the real-LM suite's); None for an acceptance computed exactly.

    Examples
    --------
    >>> acceptance_interval({"acceptance": 0.5, "acceptance_ci_low": 0.45, "acceptance_ci_high": 0.55})
    (0.45, 0.55)
    >>> acceptance_interval({"acceptance": 0.5}) is None
    True
    """
    return _interval(metrics.get("acceptance_ci")) or _interval(
        [metrics.get("acceptance_ci_low"), metrics.get("acceptance_ci_high")])


def _error_bars(ax, series: Sequence[tuple], color: Any) -> None:
    """Error bars at the points ``(x, y, (low, high) or None)`` that have an interval (sampled measurements)."""
    drawn = [(x, y, ci) for x, y, ci in series if ci is not None]
    if not drawn:
        return
    ax.errorbar([x for x, _, _ in drawn], [y for _, y, _ in drawn],
                yerr=[[max(y - ci[0], 0.0) for _, y, ci in drawn], [max(ci[1] - y, 0.0) for _, y, ci in drawn]],
                fmt="none", ecolor=color, capsize=3, linewidth=1)


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
    optimum: dict = {}
    repair: dict = {}
    for r in results:
        _, _, length = case_shape(r)
        efficiency = _number(r.metrics.get("block_efficiency"))
        if length is None or efficiency is None:
            continue
        points.setdefault(r.verifier, []).append((length, efficiency, _interval(r.metrics.get("block_efficiency_ci"))))
        lp = _number(r.metrics.get("block_lp_optimum"))
        if lp is not None:
            optimum[length] = max(optimum.get(length, lp), lp)
        lp_repair = _number(r.metrics.get("block_lp_repair_optimum"))
        if lp_repair is not None:
            repair[length] = max(repair.get(length, lp_repair), lp_repair)
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


# ---------------------------------------------------------------------------------------------
# Grouping a report
# ---------------------------------------------------------------------------------------------


def _group(results: Iterable[Any], key) -> dict:
    groups: dict = {}
    for r in results:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return groups


# ---------------------------------------------------------------------------------------------
# Draft trees (results whose details carry "tree": spec, description, paths, parents, draft_scheme)
# ---------------------------------------------------------------------------------------------


def _tree_of(result: Any) -> Optional[dict]:
    tree = result.details.get("tree") if isinstance(result.details, dict) else None
    return tree if isinstance(tree, dict) and isinstance(tree.get("paths"), list) else None


def tree_cases(results: Iterable[Any]) -> list[tuple[str, dict, list]]:
    """``(case, tree, results)`` for every draft-tree case, in the order the cases first appear."""
    out: dict = {}
    for r in results:
        tree = _tree_of(r)
        if tree is not None:
            out.setdefault(r.case, (r.case, tree, []))[2].append(r)
    return list(out.values())


def _tree_children(paths: Sequence[Sequence[int]]) -> dict:
    """Node numbers (1-based, in path-list order) and each node's children: ``{node: [child, ...]}``, 0 the root."""
    index = {tuple(p): i + 1 for i, p in enumerate(paths)}
    children: dict = {0: []}
    for path, node in index.items():
        children.setdefault(node, [])
        children.setdefault(index.get(path[:-1], 0), []).append(node)
    return children


def tree_text(tree: dict) -> str:
    """The tree as indented text: one line per node, its number and its sibling rank.

    Examples
    --------
    >>> print(tree_text({"paths": [[0], [1], [0, 0]]}))
    root
    ├── 1 (rank 0)
    │   └── 3 (rank 0)
    └── 2 (rank 1)
    """
    paths = [tuple(p) for p in tree.get("paths", [])]
    children = _tree_children(paths)
    lines = ["root"]

    def walk(node: int, indent: str) -> None:
        kids = children.get(node, [])
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{indent}{'└── ' if last else '├── '}{child} (rank {paths[child - 1][-1]})")
            walk(child, indent + ("    " if last else "│   "))

    walk(0, "")
    return "\n".join(lines)


def _tree_layout(paths: Sequence[Sequence[int]]) -> dict:
    """``{node: (depth, y)}``: leaves one unit apart in depth-first order, parents centred on their children."""
    children = _tree_children([tuple(p) for p in paths])
    place: dict = {}
    next_leaf = [0.0]

    def walk(node: int, depth: int) -> float:
        kids = children.get(node, [])
        if not kids:
            y = next_leaf[0]
            next_leaf[0] += 1.0
        else:
            ys = [walk(child, depth + 1) for child in kids]
            y = (ys[0] + ys[-1]) / 2
        place[node] = (depth, y)
        return y

    walk(0, 0)
    return place


def tree_figure(tree: dict, results: Sequence[Any], title: str, colors: Optional[dict] = None) -> Optional[bytes]:
    """A draft-tree case: the tree (left) and each verifier's accepted length and acceptance against the bound (right).

    Uses ``accepted_length``, ``optimal_accepted_length``, ``acceptance`` and
    ``optimal_acceptance`` where the results carry them.  Returns None for a tree without paths.
    """
    paths = [tuple(p) for p in tree.get("paths", [])]
    if not paths:
        return None
    place = _tree_layout(paths)
    children = _tree_children(paths)
    height = max(2.6, 0.28 * (max(y for _, y in place.values()) + 1) + 1.0)
    fig, (ax_tree, ax_bars) = _new_figure(9.0, min(height, 8.0), ncols=2)
    ax_tree.grid(False)
    for node, kids in children.items():
        x0, y0 = place[node]
        for child in kids:
            x1, y1 = place[child]
            ax_tree.plot([x0, x1], [y0, y1], color="#888", linewidth=1)
    for node, (x, y) in place.items():
        ax_tree.scatter([x], [y], s=140, color="black" if node == 0 else "#4c72b0", zorder=3)
        ax_tree.annotate("root" if node == 0 else str(node), (x, y), textcoords="offset points", xytext=(0, 7),
                         ha="center", fontsize=7)
    depth = max(x for x, _ in place.values())
    ax_tree.set_xticks(range(depth + 1))
    ax_tree.set_xlabel("depth")
    ax_tree.set_yticks([])
    ax_tree.invert_yaxis()
    ax_tree.set_title(tree.get("description") or "draft tree", fontsize=8)
    fig.suptitle(title, fontsize=9)
    rows = [r for r in results if _number(r.metrics.get("accepted_length")) is not None]
    colors = colors or _colors(sorted({r.verifier for r in rows}))
    labels = [f"{r.verifier} ({(r.details.get('tree') or {}).get('draft_scheme') or '-'})" for r in rows]
    positions = list(range(len(rows)))
    ax_bars.barh(positions, [r.metrics["accepted_length"] for r in rows], color=[colors.get(r.verifier) for r in rows],
                 alpha=0.85, label="E[accepted draft tokens]")
    best = [_number(r.metrics.get("optimal_accepted_length")) for r in rows]
    for y, value in zip(positions, best):
        if value is not None:
            ax_bars.plot([value, value], [y - 0.4, y + 0.4], color="black", linewidth=2)
    accept = [(y, _number(r.metrics.get("acceptance")), _number(r.metrics.get("optimal_acceptance")))
              for y, r in zip(positions, rows)]
    ax_bars.scatter([a for _, a, _ in accept if a is not None], [y for y, a, _ in accept if a is not None],
                    marker="o", color="white", edgecolor="black", zorder=3, label="acceptance")
    ax_bars.scatter([s for _, _, s in accept if s is not None], [y for y, _, s in accept if s is not None],
                    marker="|", s=120, color="#d62728", zorder=3, label="alpha*")
    ax_bars.plot([], [], color="black", linewidth=2, label="best accepted length (lossless)")
    ax_bars.set_yticks(positions, labels, fontsize=7)
    ax_bars.invert_yaxis()
    ax_bars.set_xlim(0, max(1.0, depth) * 1.05)
    ax_bars.set_xlabel("tokens")
    ax_bars.set_title("against the best any lossless verifier achieves", fontsize=8)
    ax_bars.legend(fontsize=6, loc="best")
    return _png(fig)


def report_figures(report: Any, max_law_figures: int = 48) -> list[Figure]:
    """Every figure for ``report``, grouped by case family.

    Acceptance figures: one per (case family, L) with at least one result that has K and an
    acceptance (draft-tree cases are drawn by :func:`tree_figure`, in the report's tree section).  Block-efficiency figures: one per (case family, K) with at least two draft
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


# ---------------------------------------------------------------------------------------------
# The real-LM suite's tables (``meta["real_lm"]``, i.e. ``RealLMTables.to_dict()``)
# ---------------------------------------------------------------------------------------------


def _row(row: Any) -> dict:
    """A table row as a dict (rows come as dicts from ``to_dict``; dataclass rows are accepted too)."""
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    return row if isinstance(row, dict) else {}


def _count(value: Any) -> Optional[int]:
    number = _number(value)
    return int(number) if number is not None and number == int(number) else None


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


def _legend_below(ax) -> None:
    """Legend in two columns under the axes, so a half-width figure keeps a wide plot."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False,
              handlelength=2.6, columnspacing=1.2)


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
