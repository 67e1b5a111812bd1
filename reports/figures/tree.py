"""Draft-tree figures: results whose details carry ``"tree"`` (spec, description, paths, parents, draft_scheme).

:func:`tree_figure` draws a tree case's tree beside each verifier's acceptance and expected
accepted length against the best any lossless verifier reaches on it; :func:`tree_text` is
the same tree as indented text.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from spectr_audit.reports.figures._plot import _colors, _legend_under, _new_figure, _png
from spectr_audit.reports.figures.reading import _number

__all__ = ["tree_cases", "tree_figure", "tree_text"]


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
    _legend_under(fig, [ax_bars], ncol=3)  # under the figure: never over a bar
    return _png(fig)
