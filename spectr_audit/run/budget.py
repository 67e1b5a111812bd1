"""The memory budget: every size an audit would allocate, checked before anything is allocated.

An audit's memory is set by its sizes: the vocabulary V, K drafts of L tokens, the draft tuples
an exact audit enumerates (``(V^L)^K`` for i.i.d. drafts), the strings of a multi-iteration
audit, the rows of a sampled chunk, the cells of a partition, the samples of a plan, the tables
of a model.  :func:`audit_needs` estimates, from those sizes alone, the peak bytes of each stage
of :func:`~spectr_audit.run.runner.audit_case`, and :func:`check_audit` refuses an audit whose
largest stage exceeds the budget with :class:`MemoryBudgetExceeded` (an
:class:`~spectr_audit.errors.InvalidArgument`: the CLI exits 2), naming the size and the budget.
The faces call these at their boundaries: model tables when a model spec is parsed
(:func:`check_model_spec`), every job of a suite before its first audit (:func:`check_jobs`),
one audit before it starts, and :func:`~spectr_audit.run.conformance.check_verifier`'s own
batches (:func:`check_conformance`).

Estimates are upper bounds built from the allocations of each stage (float64 entries, times a
small factor for the temporaries of the step), computed in log2 so that ``2^10000`` tuples never
build an integer or overflow a float.  The budget is ``--max-memory`` on the CLI and
``max_memory`` in :class:`~spectr_audit.run.options.AuditOptions` and ``check_verifier``; by
default :data:`spectr_audit.defaults.MAX_MEMORY_FRACTION` of the machine's memory (the smaller of
physical memory and a cgroup limit), see :func:`default_max_memory`.  A verifier's own working
memory is not known; it is counted as a few copies of its inputs.

This module imports neither torch nor scipy at load time (suite files are checked before any
model is built).

Examples
--------
>>> from spectr_audit.run.budget import format_bytes, parse_memory
>>> parse_memory("2GiB"), parse_memory("500M"), parse_memory("1e9")
(2147483648, 500000000, 1000000000)
>>> format_bytes(3 * 2**30)
'3.0 GiB'
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Iterable, Optional, Sequence

from spectr_audit import defaults
from spectr_audit.run.options import AuditOptions
from spectr_audit.run.stages import EXTRA_STAGES, audit_stages
from spectr_audit.errors import InvalidArgument

__all__ = [
    "planned_work",
    "MemoryBudgetExceeded",
    "Need",
    "audit_needs",
    "check_audit",
    "check_block_lp",
    "check_conformance",
    "check_jobs",
    "check_model_spec",
    "default_max_memory",
    "format_bytes",
    "parse_memory",
    "resolve_max_memory",
]

#: Bytes of one float64 / int64 entry.
_ENTRY = 8
#: Rows of the guard's probe batch (see :mod:`spectr_audit.run.guard`).
PROBE_ROWS = defaults.PROBE_ROWS
#: The limits of the exact and statistical audits (read here without importing them: they import torch).
_MAX_TUPLES = defaults.EXACT_MAX_TUPLES
_MAX_HISTORIES = defaults.EXACT_MAX_HISTORIES
_EXACT_CHUNK = defaults.EXACT_CHUNK
_MAX_CELLS = defaults.PARTITION_MAX_CELLS
_MAX_STRATA = defaults.MAX_STRATA
_MIN_EXPECTED = defaults.MIN_EXPECTED
_LOG2_INF = math.inf


class MemoryBudgetExceeded(InvalidArgument):
    """An audit (or a model, or a sample plan) would need more memory than the budget allows.

    Attributes
    ----------
    need : Need
        The largest stage: what it allocates and its size.
    budget : int
        The budget, in bytes.
    """

    def __init__(self, message: str, need: "Need", budget: int):
        super().__init__(message)
        self.need = need
        self.budget = budget


@dataclasses.dataclass(frozen=True)
class Need:
    """One stage's estimated peak memory: ``2 ** log2_bytes`` bytes, and what it holds."""

    stage: str
    log2_bytes: float
    what: str
    #: set when the stage is refused for a count over its own limit, not for memory: that limit, in words
    limit: Optional[str] = None

    @property
    def bytes(self) -> float:
        """The size in bytes (``inf`` beyond a float's range)."""
        return 2.0**self.log2_bytes if self.log2_bytes < 1000 else math.inf

    def describe(self) -> str:
        if self.limit is not None:
            return f"{self.stage} would enumerate {self.what}, above its limit of {self.limit}"
        return f"{self.stage} ({self.what}) needs about {format_log2_bytes(self.log2_bytes)}"


# ---------------------------------------------------------------------------------------------
# Sizes in log2
# ---------------------------------------------------------------------------------------------


def _lg(value: float) -> float:
    """log2 of a positive number (an int of any size), -inf for 0."""
    if value <= 0:
        return -_LOG2_INF
    return math.log2(value)


def _lgsum(*terms: float) -> float:
    """log2(sum 2^t) without leaving log space."""
    finite = [t for t in terms if t != -_LOG2_INF]
    if not finite:
        return -_LOG2_INF
    top = max(finite)
    if top == _LOG2_INF:
        return _LOG2_INF
    return top + math.log2(sum(2.0 ** (t - top) for t in finite))


def _power_text(base: int, exponent: float) -> str:
    """``base^exponent``, written out when small."""
    log2_value = exponent * _lg(base)
    if log2_value < 40:
        return f"{round(2 ** log2_value):,}"
    if base <= 1:
        return "1"
    return f"{base}^{int(exponent)}" if float(exponent).is_integer() else f"{base}^{exponent:.1f}"


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; sizes beyond a float's range come through :func:`format_log2_bytes`."""
    return format_log2_bytes(_lg(num_bytes)) if num_bytes > 0 else "0 B"


def format_log2_bytes(log2_bytes: float) -> str:
    """A size given as log2(bytes), in binary units, or as a power of ten when beyond exbibytes."""
    if log2_bytes == -_LOG2_INF:
        return "0 B"
    if log2_bytes < 10:
        return f"{round(2 ** log2_bytes)} B"
    if log2_bytes < 70:
        units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
        index = min(len(units), int(log2_bytes // 10)) - 1
        return f"{2 ** (log2_bytes - 10 * (index + 1)):.1f} {units[index]}"
    if log2_bytes == _LOG2_INF:
        return "an unbounded amount"
    return f"10^{log2_bytes * math.log10(2):.0f} bytes"


_MEMORY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtTpP]?)(i?)[bB]?\s*$")


def parse_memory(text: Any, argument: str = "--max-memory") -> int:
    """Parse a memory size: bytes (``1e9``, ``4096``) or with a unit (``500M``, ``2GiB``, ``1.5g``).

    Decimal units (``K``, ``M``, ``G``, ``T``, ``P``) are powers of 1000, binary ones (``KiB`` ...)
    powers of 1024.  Raises :class:`~spectr_audit.errors.InvalidArgument` naming ``argument``.
    """
    if isinstance(text, bool):
        raise InvalidArgument(f"{argument}: expected a size such as 4GiB, 500M or 1e9 bytes, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _MEMORY.match(str(text))
        if not match:
            raise InvalidArgument(f"{argument}: expected a size such as 4GiB, 500M or 1e9 bytes, got {text!r}")
        number, unit, binary = match.groups()
        scale = (1024 if binary else 1000) ** " KMGTP".index(unit.upper() or " ")
        value = float(number) * scale
    if not math.isfinite(value) or value < 1 << 20:
        raise InvalidArgument(f"{argument}: expected a finite size of at least 1 MiB, got {text!r}")
    return int(value)


def _cgroup_limit() -> Optional[int]:
    """The memory limit of this process's cgroup (v2, then v1), when there is one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as handle:
                raw = handle.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def physical_memory() -> Optional[int]:
    """This machine's memory in bytes (the smaller of RAM and a cgroup limit), or None when unknown."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append(cgroup)
    limits = [x for x in limits if x > 0]
    return min(limits) if limits else None


def default_max_memory() -> int:
    """The default budget: :data:`~spectr_audit.defaults.MAX_MEMORY_FRACTION` of :func:`physical_memory`,
    or :data:`~spectr_audit.defaults.MAX_MEMORY_FALLBACK` bytes when it is unknown."""
    total = physical_memory()
    if total is None:
        return defaults.MAX_MEMORY_FALLBACK
    return int(total * defaults.MAX_MEMORY_FRACTION)


def resolve_max_memory(max_memory: Any, argument: str = "max_memory") -> int:
    """``None`` -> :func:`default_max_memory`; a size (int or text) -> bytes, validated."""
    if max_memory is None:
        return default_max_memory()
    return parse_memory(max_memory, argument)


def _refuse(need: Need, budget: int, where: str) -> MemoryBudgetExceeded:
    return MemoryBudgetExceeded(
        f"{where}: {need.describe()}, above the memory budget of {format_bytes(budget)} "
        f"(raise it with --max-memory / max_memory=, or shrink the case)",
        need, budget,
    )


def _check(needs: Iterable[Need], budget: int, where: str) -> None:
    limits = [n for n in needs if n.limit is not None]
    needs = [n for n in needs if n.limit is None]
    # The parts of one audit may be alive together (an exact audit holds its grid, tuples, a chunk
    # and its laws at once): their sum is compared with the budget, the largest part named.
    total = _lgsum(*(n.log2_bytes for n in needs))
    if needs and total > _lg(budget):
        worst = max(needs, key=lambda n: n.log2_bytes)
        if len(needs) > 1 and total - worst.log2_bytes > 0.1:
            worst = dataclasses.replace(worst, log2_bytes=total, what=f"{worst.what}, with the audit's other parts")
        raise _refuse(worst, budget, where)
    for need in limits:  # within the memory budget, but over a count limit of its own
        raise MemoryBudgetExceeded(f"{where}: {need.describe()}; lower K, L or the vocabulary", need, budget)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def model_need(kind: str, vocab_size: int, order: int = 0) -> Need:
    """Memory to build a random model: ``(V + 1)^order`` rows of V float64 entries, about six copies
    (the Dirichlet draw, its logarithm, exponential and normalisation, the tensor and its rows)."""
    log2_rows = order * _lg(vocab_size + 1)
    rows = "" if order == 0 else f"({vocab_size} + 1)^{order} = {_power_text(vocab_size + 1, order)} rows of "
    return Need(f"the {kind} model", log2_rows + _lg(vocab_size) + _lg(6 * _ENTRY),
                f"{rows}{vocab_size:,} float64 probabilities")


def _as_count(value: Any) -> Optional[int]:
    """An integer size (an integral float too, as a CLI parses 1e9), else None (validation elsewhere)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def check_model_spec(spec: Any, where: str, max_memory: Any = None) -> None:
    """Refuse a ``dirichlet`` or ``markov`` model spec whose tables exceed the budget (before building it).

    Explicit tables and probability lists are already in memory: they pass.
    """
    if not isinstance(spec, dict):
        return
    for kind, default_order in (("dirichlet", 0), ("markov", 1)):
        params = spec.get(kind)
        if not isinstance(params, dict):
            continue
        vocab_size = _as_count(params.get("vocab_size"))
        order = _as_count(params.get("order", default_order)) if kind == "markov" else 0
        if vocab_size is None or vocab_size < 1 or order is None or order < 0:
            return
        _check([model_need(kind, vocab_size, order)], resolve_max_memory(max_memory), f"{where}.{kind}")


# ---------------------------------------------------------------------------------------------
# Audits
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The sizes of one audit."""

    vocab_size: int
    num_drafts: int
    draft_len: int
    prefix_len: int
    num_tokens: int
    #: log2 of the number of draft sequences of positive probability (upper bound)
    log2_sequences: float
    #: tokens of positive draft probability at the first position
    support: int
    draft_scheme: str
    #: whether ``log2_sequences`` is exact (every sequence over the support has positive probability)
    exact_count: bool = False


def _sizes(case: Any, draft_scheme: str) -> _Sizes:
    from spectr_audit.drafting.models import ContextFreeModel, MarkovModel

    vocab_size, num_drafts, draft_len = case.vocab_size, case.num_drafts, case.draft_len
    draft_model = case.draft_model
    if isinstance(draft_model, ContextFreeModel):
        support = int((draft_model.probs > 0).sum())
        log2_sequences = draft_len * _lg(support)
        exact_count = True
    else:
        support = vocab_size
        log2_sequences = draft_len * _lg(vocab_size)
        # a Markov table without zeros (every random one): every sequence has positive probability
        exact_count = isinstance(draft_model, MarkovModel) and bool((draft_model.table > 0).all())
    num_tokens = getattr(case, "num_tokens", None) or draft_len + 1
    return _Sizes(vocab_size, num_drafts, draft_len, len(case.prefix), num_tokens, log2_sequences, support,
                  draft_scheme, exact_count)


def _batch_log2(rows_log2: float, s: _Sizes, copies: float) -> float:
    """Rows of drafted inputs: ``rows x K x (L + 1) x V`` float64 entries (draft and target probabilities,
    node contexts), ``copies`` times over (clones, the verifier's temporaries, its outputs)."""
    per_row = _lg(s.num_drafts) + _lg(s.draft_len + 1) + _lg(s.vocab_size + s.prefix_len + s.draft_len)
    return rows_log2 + per_row + _lg(copies * _ENTRY)


def _probe_need(s: _Sizes) -> Need:
    return Need("the verifier probe", _batch_log2(_lg(PROBE_ROWS), s, 16),
                f"{PROBE_ROWS} drafted rows of K={s.num_drafts} drafts of L={s.draft_len} tokens over V={s.vocab_size}, "
                "twice, with copies")


def _exact_log2_tuples(s: _Sizes) -> float:
    """log2 of the draft tuples the exact audit enumerates (before its own tuple limit)."""
    if s.draft_scheme == "without_replacement":
        if s.num_drafts > s.support:
            return -_LOG2_INF
        return (math.lgamma(s.support + 1) - math.lgamma(s.support - s.num_drafts + 1)) / math.log(2)
    return s.num_drafts * s.log2_sequences


def _tuples_text(s: _Sizes, tuples_lg: float) -> str:
    """The number of draft tuples: written out when small, else as a power (``2^10000``)."""
    if tuples_lg < 40:
        return f"{round(2 ** tuples_lg):,}"
    if s.draft_scheme == "without_replacement":
        return f"{s.support}!/({s.support} - {s.num_drafts})!"
    return f"{s.support}^{s.draft_len * s.num_drafts}"


def _exact_needs(s: _Sizes, what: str = "the exact audit", laws: bool = True, limit: bool = True) -> list[Need]:
    """Peak memory of ``exact_iteration``: the draft and target laws after every path of up to L tokens (about
    the V^L grid of draft sequences with their conditionals), the tuples (the chain tree's realisations: tokens,
    path codes and factors of its 1 + K L nodes) and one chunk of their conditionals, and the laws over V^(L+1)
    strings."""
    vocab_lg, length = _lg(s.vocab_size), s.draft_len
    grid_lg = length * vocab_lg if s.draft_scheme == "iid" else vocab_lg
    # per sequence: tokens and codes, draft conditionals (list and stack), target conditionals, contexts; twice
    # (the positive-probability copy)
    per_sequence = 2 * (2 * length + 2 * length * s.vocab_size + 2 * (length + 1) * s.vocab_size
                        + 2 * (s.prefix_len + length + 1))
    grid = Need(what, grid_lg + _lg(per_sequence * _ENTRY),
                f"{_power_text(s.vocab_size, length if s.draft_scheme == 'iid' else 1)} draft sequences "
                f"(V={s.vocab_size}, L={length}) with their conditionals")
    laws_need = Need(what, (length + 1) * vocab_lg + _lg(14 * _ENTRY) + _lg(1 + length),
                f"laws over {_power_text(s.vocab_size, length + 1)} strings of L + 1 = {length + 1} tokens")
    needs = [grid, laws_need] if laws else [grid]
    tuples_lg = _exact_log2_tuples(s)
    if s.exact_count and tuples_lg > _lg(_MAX_TUPLES) and limit:
        needs.append(Need(what, tuples_lg + _lg(_ENTRY), f"{_tuples_text(s, tuples_lg)} draft tuples "
                          f"(K={s.num_drafts} drafts of L={s.draft_len} tokens over {s.support} tokens)",
                          limit=f"{_MAX_TUPLES:,} tuples"))
    if tuples_lg <= _lg(_MAX_TUPLES):  # beyond the limit, the audit refuses right after the grid
        tuple_text = f"{_tuples_text(s, tuples_lg)} draft tuples of K={s.num_drafts}"
        # tokens, path codes and factors per node, the branch grid, the weight and its copies
        per_tuple = 3 * (1 + s.num_drafts * s.draft_len) + s.num_drafts + 2
        if s.draft_scheme == "without_replacement":  # the drawn-token masks, [N, K, V], and their masses
            per_tuple += 9 * s.num_drafts * s.vocab_size / _ENTRY
        needs.append(Need(what, tuples_lg + _lg(per_tuple * _ENTRY), tuple_text))
        chunk_lg = min(tuples_lg, _lg(_EXACT_CHUNK))
        needs.append(Need(what, _batch_log2(chunk_lg, s, 12),
                          f"the conditionals and laws of {_power_text(2, chunk_lg)} tuples at a time"))
    return needs


def _chunk_rows_log2(s: _Sizes) -> float:
    """log2 of the rows of one sampled chunk (``default_chunk_size``: 2^20 float64 entries, 2^6 to 2^18 rows)."""
    per_row = _lg(s.num_drafts) + _lg(s.draft_len + 1) + _lg(s.vocab_size)
    return min(18.0, max(6.0, math.floor(max(0.0, 20 - per_row))))


def _planned_samples_log2(s: _Sizes, options: Any) -> float:
    """log2 of an upper bound on the statistical audit's planned sample (the plan before pooling)."""
    cells_lg = min(s.num_tokens * _lg(s.vocab_size), _lg(_MAX_CELLS))
    cap = getattr(options, "max_samples", None)
    try:
        from spectr_audit.statistical import power as sizing

        planned = sizing.required_samples(options.min_detectable_tv, max(2, round(2**cells_lg)), options.alpha / 6,
                                          options.power)
        planned_lg = _lg(planned)
    except Exception:  # pragma: no cover - an invalid option is reported by the audit itself
        planned_lg = 40.0
    return min(planned_lg, _lg(cap)) if cap else planned_lg


def _statistical_needs(s: _Sizes, options: Any) -> list[Need]:
    """Peak memory of ``statistical_audit``: one sampled chunk, the partition (its cells and the children of
    its open nodes) and, when the draft space is small, the stratified design's enumeration and sample."""
    what = "the statistical audit"
    rows_lg = _chunk_rows_log2(s)
    needs = [Need(what, _batch_log2(rows_lg, s, 10),
                  f"a chunk of {round(2 ** rows_lg)} drafted rows of K={s.num_drafts} x (L + 1)={s.draft_len + 1} "
                  f"nodes x V={s.vocab_size}")]
    samples_lg = _planned_samples_log2(s, options)
    cells_lg = min(s.num_tokens * _lg(s.vocab_size), _lg(_MAX_CELLS))
    open_lg = min(cells_lg, samples_lg - _lg(_MIN_EXPECTED), (s.num_tokens - 1) * _lg(s.vocab_size))
    needs.append(Need(what, _lgsum(cells_lg + _lg((s.num_tokens + 8) * 2 * _ENTRY),
                                   max(0.0, open_lg) + _lg(s.vocab_size) + _lg(4 * _ENTRY)),
                      f"a partition of up to {_power_text(2, cells_lg)} cells of strings of N={s.num_tokens} tokens, "
                      f"V={s.vocab_size} children per open node"))
    strata_lg = s.draft_len * s.num_drafts * _lg(s.support)
    if strata_lg <= _lg(_MAX_STRATA):
        needs += _exact_needs(s, what, laws=False, limit=False)
        needs.append(Need(what, samples_lg + _lg(3 * _ENTRY),
                          f"the stratified design's sample of up to {_power_text(2, samples_lg)} rows"))
    return needs


def _sampler_needs(s: _Sizes) -> list[Need]:
    rows_lg = _chunk_rows_log2(s)
    return [Need("the sampler-versus-law check", _batch_log2(rows_lg, s, 14),
                 f"a chunk of {round(2 ** rows_lg)} drafted rows with their exact laws")]


def _multi_iteration_needs(s: _Sizes) -> list[Need]:
    """Peak memory of ``exact_multi_iteration``: the law over V^N strings, the target law's contexts (Python
    tuples), and one iteration's rows (every draft tuple at every live history)."""
    what = "the multi-iteration audit"
    vocab_lg, n = _lg(s.vocab_size), s.num_tokens
    needs = [
        Need(what, n * vocab_lg + _lg(4 * _ENTRY), f"laws over {_power_text(s.vocab_size, n)} strings of N={n} tokens"),
        Need(what, (n - 1) * vocab_lg + _lg(72 + 40 * n), f"{_power_text(s.vocab_size, n - 1)} contexts as tuples"),
    ]
    histories_lg = min(_lg(_MAX_HISTORIES), _lgsum(*(m * vocab_lg for m in range(max(1, n)))))
    tuples_lg = _exact_log2_tuples(s)
    if tuples_lg <= _lg(_MAX_TUPLES):
        needs.append(Need(what, _batch_log2(histories_lg + tuples_lg, s, 10),
                          f"up to {_power_text(2, histories_lg)} live histories x {_tuples_text(s, tuples_lg)} "
                          "draft tuples per iteration"))
    needs += _exact_needs(s, what)
    return needs


def audit_needs(verifier: Any, case: Any, options: Any = None) -> list[Need]:
    """The estimated peak memory of each stage of ``audit_case(verifier, case, options)``: the stages of
    :data:`~spectr_audit.run.stages.STAGES` that apply, the table the runner reads.

    The block LP is left out: it is an extra, skipped (with a note) when over budget
    (:func:`check_block_lp`).
    """
    if options is None:
        options = AuditOptions()
    if getattr(case, "tree", None) is not None:
        return []  # draft-tree cases: the exact tree audit holds its enumeration to its own limits
    s = _sizes(case, verifier.draft_scheme)
    needs: list[Need] = []
    for stage in audit_stages(verifier, case):
        if stage not in EXTRA_STAGES:  # an extra is sized when it runs (check_block_lp) and skipped, not refused
            needs += _STAGE_NEEDS[stage](s, options)
    return needs


def planned_work(verifier: Any, case: Any, options: Any = None) -> tuple[int, int]:
    """What ``audit_case(verifier, case, options)`` will draw and enumerate, for a run's plan: ``(samples,
    tuples)``, an upper bound on the statistical audit's planned sample (the sampler check's cap where that
    stage runs) and the draft tuples the exact audits enumerate (0 where the stage does not run).  A tree
    case: ``(0, 0)`` (its audits size themselves)."""
    if options is None:
        options = AuditOptions()
    if getattr(case, "tree", None) is not None:
        return 0, 0
    s = _sizes(case, verifier.draft_scheme)
    stages = audit_stages(verifier, case)
    samples = 0
    if "statistical" in stages:
        samples += round(2 ** min(_planned_samples_log2(s, options), 62.0))
    if "sampler" in stages and options.sampler_max_samples:
        samples += int(options.sampler_max_samples)
    tuples = 0
    if "exact" in stages or "multi-iteration" in stages:
        tuples = round(2 ** min(_exact_log2_tuples(s), _lg(_MAX_TUPLES)))
    return samples, tuples


def _optimality_needs(s: _Sizes, options: Any) -> list[Need]:
    return [Need("the optimality bound", _lg(s.vocab_size * 16 * _ENTRY) + 4, f"V={s.vocab_size} tokens")]


#: What each stage of a chain case's audit but the extras allocates at its peak (none: no sizeable allocation;
#: ``bounds`` runs on tree cases only).
_STAGE_NEEDS = {
    "probe": lambda s, options: [_probe_need(s)],
    "optimality": _optimality_needs,
    "exact": lambda s, options: _exact_needs(s),
    "multi-iteration": lambda s, options: _multi_iteration_needs(s),
    "sampler": lambda s, options: _sampler_needs(s),
    "certificate": lambda s, options: [],
    "statistical": _statistical_needs,
    "bounds": lambda s, options: [],
}


def _where(verifier: Any, case: Any) -> str:
    return (f"case {case.name!r}, verifier {verifier.name!r} (K={case.num_drafts}, L={case.draft_len}, "
            f"V={case.vocab_size})")


def check_audit(verifier: Any, case: Any, options: Any = None, where: str = "") -> None:
    """Refuse ``audit_case(verifier, case, options)`` when a stage would exceed ``options.max_memory``."""
    budget = resolve_max_memory(getattr(options, "max_memory", None))
    _check(audit_needs(verifier, case, options), budget, (where + " " if where else "") + _where(verifier, case))


def check_jobs(jobs: Sequence[tuple], options: Any = None, source: str = "suite") -> None:
    """Refuse a run whose planned (verifier, case) jobs include one over the budget, before the first audit.

    The message names the suite, the case and the verifier: a suite error, not a result.
    """
    budget = resolve_max_memory(getattr(options, "max_memory", None))
    for verifier, case in jobs:
        _check(audit_needs(verifier, case, options), budget, f"{source}: {_where(verifier, case)}")


def check_block_lp(case: Any, options: Any = None) -> None:
    """Raise :class:`MemoryBudgetExceeded` when the block LP of ``case`` would exceed the budget
    (the runner then skips it with the message): its enumeration, and about 2 KB per LP variable."""
    budget = resolve_max_memory(getattr(options, "max_memory", None))
    s = _sizes(case, "iid")
    needs = _exact_needs(s, "the block LP", limit=False)
    tuples_lg = _exact_log2_tuples(s)
    if tuples_lg <= _lg(_MAX_TUPLES):
        needs.append(Need("the block LP", tuples_lg + _lg(s.num_drafts * (s.draft_len + 1) * s.vocab_size * 2048),
                          f"{_tuples_text(s, tuples_lg)} draft tuples x K x (L + 1) x V candidate strings as LP variables"))
    _check(needs, budget, f"case {case.name!r}")


def check_conformance(verifier: Any, combos: Sequence[tuple], cases: Sequence[Any], *, batch_size: int,
                      num_samples: int, options: Any) -> None:
    """Refuse a :func:`~spectr_audit.run.conformance.check_verifier` call over the budget: its contract batches
    (``batch_size`` rows, and ``num_samples / 3`` rows per sampled draft tuple) at every (K, L), and the
    audits of its suite."""
    budget = resolve_max_memory(getattr(options, "max_memory", None))
    for num_drafts, draft_len in combos:
        s = _Sizes(5, num_drafts, draft_len, 0, draft_len + 1, 0.0, 5, verifier.draft_scheme)
        rows = max(batch_size, max(200, num_samples // 3) if verifier.has_exact_law else 0)
        needs = [Need("the contract checks", _batch_log2(_lg(rows), s, 12),
                      f"{rows:,} drafted rows of K={num_drafts} drafts of L={draft_len} tokens")]
        _check(needs, budget, f"check_verifier({verifier.name}) at K={num_drafts}, L={draft_len}")
    for case in cases:
        _check(audit_needs(verifier, case, options), budget, f"check_verifier({verifier.name}): {_where(verifier, case)}")
