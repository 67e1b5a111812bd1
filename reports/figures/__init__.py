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

A generation audit (``GenerationAuditResult.to_dict()``) has its own figures (``generation``):
:func:`pit_figure` (the PIT histograms of each order's strata with their 99% acceptance bands),
:func:`held_out_tv_figure` (the held-out TV lower bounds per order, the engine's beside the
numerics floor's); :func:`generation_figures` draws both.

The real-LM suite's tables (``meta["real_lm"]``) have their own two figures, drawn from the
table rows rather than from results: :func:`real_lm_acceptance_figure` (acceptance against
K with the bounds, measured K-SEQ and RRS with whiskers) and
:func:`real_lm_block_efficiency_figure` (block efficiency against L per method and K, with
95% whiskers); :func:`real_lm_figures` draws both.

One module per concept, every name re-exported here: ``reading`` (what the figures read
from results and table rows), ``chain`` (the chain audit's figures and
:func:`report_figures`), ``tree`` (draft trees), ``real_lm`` (the real-LM suite's tables),
``generation`` (the generation audit's figures),
``_plot`` (the canvas, colours and legends they share).
"""

from __future__ import annotations

# in the order the API page lists them: what is read, the chain audit's figures, trees, the real-LM tables
from spectr_audit.reports.figures._plot import Figure
from spectr_audit.reports.figures.reading import case_shape, law_with_ci, deviation_points, acceptance_interval
from spectr_audit.reports.figures.chain import (law_figure, law_caption, acceptance_figure, acceptance_at_k_figure,
                                                acceptance_caption, block_efficiency_figure, report_figures)
from spectr_audit.reports.figures.tree import tree_cases, tree_text, tree_figure
from spectr_audit.reports.figures.real_lm import (real_lm_block_grid, real_lm_power, real_lm_power_summary,
                                                  real_lm_acceptance_figure, real_lm_block_efficiency_figure,
                                                  real_lm_figures)
from spectr_audit.reports.figures.generation import (generation_strata, outside_band, pit_figure, held_out_tv_figure,
                                                     generation_figures)

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
    "generation_strata",
    "outside_band",
    "pit_figure",
    "held_out_tv_figure",
    "generation_figures",
]
