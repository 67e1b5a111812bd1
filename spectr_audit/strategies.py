"""Hypothesis strategies for property tests of verifiers, in your own test suite.

An engine author writes ``@given(verify_inputs())`` and gets, when a property fails, a shrunk
minimal case: the fewest rows, drafts, positions and tokens, the simplest distributions.  The
strategies favour the inputs that break verifiers: zeros in a row, one-hot rows, near-equal
rows (near-ties), targets within 1e-9 of the draft (tiny residuals ``(q - p)_+``), half
precision, greedy and filtering sampling parameters.

Needs Hypothesis, a test-time dependency that nothing else in the package imports::

    pip install "spectr-audit[test]"

Examples
--------
A property every exact verifier has, on every input: an emitted token never has target
probability 0 at its node (see ``docs/sampling.md`` for the planted-bug example)::

    from hypothesis import given
    from spectr_audit.strategies import verify_inputs, emitted_tokens_in_target_support

    @given(verify_inputs(num_drafts=1))
    def test_support(inputs):
        out = my_verifier.verify(*inputs.args(), torch.Generator().manual_seed(0))
        assert emitted_tokens_in_target_support(inputs, out)

>>> from hypothesis import find
>>> inputs = find(verify_inputs(), lambda inputs: inputs.vocab_size >= 3)
>>> inputs.shape
(1, 1, 1, 3)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "spectr_audit.strategies needs Hypothesis, a test-time dependency: pip install 'spectr-audit[test]'"
    ) from exc

from spectr_audit.contract.sampling import STEPS, ProcessingOrder, SamplingParams, process_logits, processing_order
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.errors import InvalidArgument

__all__ = [
    "DISTRIBUTION_KINDS",
    "DTYPES",
    "VerifyInputs",
    "chains",
    "distributions",
    "draft_trees",
    "emitted_tokens_in_target_support",
    "sampling_params",
    "verify_inputs",
]

#: Kinds of distribution rows, simplest first (Hypothesis shrinks towards the first).
DISTRIBUTION_KINDS: tuple[str, ...] = ("uniform", "one_hot", "random", "zeros", "near_equal")

#: Floating-point types of the rows, float64 first.
DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

Range = Union[int, tuple]


def _bounds(value: Range, name: str) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if isinstance(lo, bool) or not isinstance(lo, int) or not isinstance(hi, int) or lo > hi:
        raise InvalidArgument(f"{name}: expected an int or a (low, high) pair of ints, got {value!r}")
    return lo, hi


def _row(draw, vocab_size: int, kind: str, near: Optional[torch.Tensor] = None) -> torch.Tensor:  # [vocab_size] float64
    if kind == "uniform":
        return torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64)
    if kind == "one_hot":
        row = torch.zeros(vocab_size, dtype=torch.float64)
        row[draw(st.integers(0, vocab_size - 1))] = 1.0
        return row
    if kind == "random":
        weights = draw(st.lists(st.integers(0, 10), min_size=vocab_size, max_size=vocab_size))
    elif kind == "zeros":
        # (weight, zeroed) per token: a smaller vocabulary keeps a prefix of the same choices
        pairs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 10)), min_size=vocab_size, max_size=vocab_size))
        weights = [0 if zeroed else w for zeroed, w in pairs]
    elif kind == "near_equal":
        nudges = draw(st.lists(st.integers(-3, 3), min_size=vocab_size, max_size=vocab_size))
        row = torch.tensor([1.0 + 1e-7 * n for n in nudges], dtype=torch.float64)
        return row / row.sum()
    elif kind == "near_draft":
        nudges = draw(st.lists(st.integers(-2, 2), min_size=vocab_size, max_size=vocab_size))
        row = (near + 1e-9 * torch.tensor(nudges, dtype=torch.float64)).clamp(min=0)
        return row / row.sum() if float(row.sum()) > 0 else near.clone()
    else:
        raise InvalidArgument(f"kinds: unknown distribution kind {kind!r}; known: {DISTRIBUTION_KINDS + ('near_draft',)}")
    if sum(weights) == 0:
        weights[0] = 1
    row = torch.tensor(weights, dtype=torch.float64)
    return row / row.sum()


@st.composite
def distributions(
    draw,
    vocab_size: Range = (2, 8),
    *,
    kinds: Sequence[str] = DISTRIBUTION_KINDS,
    dtypes: Sequence[torch.dtype] = (torch.float64,),
) -> torch.Tensor:  # [vocab_size]
    """One distribution row: a kind from ``kinds`` (uniform, one-hot, random, with zeros, near-equal), in a dtype of ``dtypes``."""
    lo, hi = _bounds(vocab_size, "vocab_size")
    size = draw(st.integers(max(lo, 1), hi))
    row = _row(draw, size, draw(st.sampled_from(list(kinds))))
    return row.to(draw(st.sampled_from(list(dtypes))))


@st.composite
def sampling_params(
    draw,
    batch_size: Optional[int] = None,
    *,
    vocab_size: Optional[int] = None,
    greedy: bool = True,
    order: Union[str, Sequence[str], ProcessingOrder] = "vllm",
) -> SamplingParams:
    """Sampling parameters, neutral first: per-row tensors when ``batch_size`` is given, else scalars.

    Temperatures include 0 (greedy) when ``greedy``; top-k values up to ``vocab_size``; only
    the parameters ``order`` has a step for are set.
    """
    steps = processing_order(order).steps

    def one(strategy, name, neutral):
        if name not in steps:
            return (lambda: neutral)
        return lambda: draw(strategy)

    temperatures = [1.0] + ([0.0] if greedy else []) + [0.5, 0.7, 1.5]
    top_k_max = vocab_size if vocab_size is not None else 8
    values = {
        "temperature": one(st.one_of(st.sampled_from(temperatures), st.floats(0.05, 4.0)), "temperature", 1.0),
        "top_k": one(st.integers(0, top_k_max), "top_k", 0),
        "top_p": one(st.one_of(st.sampled_from([1.0, 0.9, 0.5]), st.floats(0.05, 1.0)), "top_p", 1.0),
        "min_p": one(st.one_of(st.sampled_from([0.0, 0.1]), st.floats(0.0, 0.9)), "min_p", 0.0),
    }
    if batch_size is None:
        return SamplingParams(**{name: values[name]() for name in STEPS})
    return SamplingParams(**{name: [values[name]() for _ in range(batch_size)] for name in STEPS})


@st.composite
def chains(
    draw,
    num_drafts: Range = (1, 3),
    draft_len: Range = (1, 3),
    verifier: Optional[Verifier] = None,
) -> tuple[int, int]:
    """``(num_drafts, draft_len)``, smallest first, restricted to what ``verifier`` supports."""
    k_lo, k_hi = _bounds(num_drafts, "num_drafts")
    l_lo, l_hi = _bounds(draft_len, "draft_len")
    pairs = [(k, l) for k in range(k_lo, k_hi + 1) for l in range(l_lo, l_hi + 1)
             if verifier is None or verifier.supports(k, l)]
    if not pairs:
        raise InvalidArgument(f"num_drafts, draft_len: no (K, L) in the ranges is supported by {getattr(verifier, 'name', verifier)!r}")
    pairs.sort(key=lambda kl: (kl[0] * kl[1], kl))
    return draw(st.sampled_from(pairs))


@st.composite
def draft_trees(draw, max_draft_nodes: int = 6, max_depth: int = 3):
    """Draft-tree topologies (:class:`spectr_audit.contract.tree.DraftTree`), a single node first."""
    count = draw(st.integers(1, max_draft_nodes))
    parents, depths = [-1], [0]
    for node in range(1, count + 1):
        allowed = [p for p in range(node) if depths[p] < max_depth]
        parent = draw(st.sampled_from(allowed))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return DraftTree.from_parents(parents)


@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """One verification step for property tests.

    ``draft_probs`` / ``target_probs`` are the laws the audit holds a verifier to; with logits,
    they are the processed laws of ``draft_logits`` / ``target_logits`` under ``params`` and
    ``order``.  Drafts that share a prefix share its conditionals, and every draft token has
    positive draft probability.
    """

    # [batch_size, num_drafts, draft_len]
    draft_tokens: torch.Tensor
    # [batch_size, num_drafts, draft_len, vocab_size]
    draft_probs: torch.Tensor
    # [batch_size, num_drafts, draft_len + 1, vocab_size]
    target_probs: torch.Tensor
    # [batch_size, num_drafts, draft_len, vocab_size] or None
    draft_logits: Optional[torch.Tensor] = None
    # [batch_size, num_drafts, draft_len + 1, vocab_size] or None
    target_logits: Optional[torch.Tensor] = None
    params: Optional[SamplingParams] = None
    order: str = "vllm"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch_size, num_drafts, draft_len, vocab_size)``."""
        return (*self.draft_tokens.shape, self.draft_probs.shape[-1])

    @property
    def vocab_size(self) -> int:
        return self.draft_probs.shape[-1]

    def args(self) -> tuple:
        """``(draft_tokens, draft_probs, target_probs)`` for ``Verifier.verify`` / ``output_probs``."""
        return self.draft_tokens, self.draft_probs, self.target_probs

    def logits_args(self) -> tuple:
        """``(draft_tokens, draft_logits, target_logits, params)`` for a logits verifier."""
        if self.draft_logits is None:
            raise InvalidArgument("inputs: drawn without logits; use verify_inputs(logits=True)")
        return self.draft_tokens, self.draft_logits, self.target_logits, self.params


@st.composite
def verify_inputs(
    draw,
    batch_size: Range = (1, 3),
    num_drafts: Range = (1, 3),
    draft_len: Range = (1, 3),
    vocab_size: Range = (2, 8),
    *,
    kinds: Sequence[str] = DISTRIBUTION_KINDS,
    dtypes: Sequence[torch.dtype] = (torch.float64,),
    tiny_residuals: bool = True,
    logits: bool = False,
    params=None,
    order: Union[str, Sequence[str], ProcessingOrder] = "vllm",
    verifier: Optional[Verifier] = None,
) -> VerifyInputs:
    """Complete, valid inputs of one verification step.

    Parameters
    ----------
    batch_size, num_drafts, draft_len, vocab_size : int or (low, high)
    kinds : sequence of str
        Distribution kinds of the rows (:data:`DISTRIBUTION_KINDS`).
    dtypes : sequence of torch.dtype
        Row dtypes to draw from (e.g. :data:`DTYPES` for half precision too).
    tiny_residuals : bool
        Also draw target rows within 1e-9 of the draft row at the same node.
    logits : bool
        Draw raw logits (``log`` of the rows, so zeros become ``-inf``) and sampling parameters;
        the probabilities are then the processed laws.
    params : SamplingParams or strategy, optional
        With ``logits``: fixed parameters, or a strategy of them (default :func:`sampling_params`
        per row).
    order : str, sequence or ProcessingOrder
        The processing order of the logits.
    verifier : Verifier, optional
        Restrict ``(num_drafts, draft_len)`` to what it supports.
    """
    b_lo, b_hi = _bounds(batch_size, "batch_size")
    v_lo, v_hi = _bounds(vocab_size, "vocab_size")
    k, length = draw(chains(num_drafts, draft_len, verifier))
    size = draw(st.integers(max(v_lo, 1), v_hi))
    dtype = draw(st.sampled_from(list(dtypes)))
    spec = processing_order(order)
    fixed = None
    if logits and params is not None:
        fixed = params if isinstance(params, SamplingParams) else draw(params)
        if fixed.batch_size is not None:
            b_lo = b_hi = fixed.batch_size
    one_row = _one_row(k, length, size, dtype, tuple(kinds), tiny_residuals, logits, fixed, spec)
    # rows as a list, so that shrinking can delete whole rows
    # min_size 0 gives every row its own "one more" choice, so that deleting a leading row is a clean cut
    drawn = draw(st.lists(one_row, min_size=0, max_size=b_hi))
    while len(drawn) < max(b_lo, 0):
        drawn.append(draw(one_row))
    rows = len(drawn)
    tokens = torch.stack([r[0] for r in drawn]) if rows else torch.zeros(0, k, length, dtype=torch.int64)
    draft = torch.stack([r[1] for r in drawn]) if rows else torch.zeros(0, k, length, size, dtype=torch.float64)
    target = torch.stack([r[2] for r in drawn]) if rows else torch.zeros(0, k, length + 1, size, dtype=torch.float64)
    if not logits:
        return VerifyInputs(tokens, draft.to(dtype), target.to(dtype))
    if fixed is not None:
        params = fixed
    else:
        params = SamplingParams(**{name: [getattr(r[3], name) for r in drawn] for name in STEPS}) if rows else SamplingParams()
    draft_logits, target_logits = draft.log(), target.log()
    return VerifyInputs(
        tokens, process_logits(draft_logits, params, spec), process_logits(target_logits, params, spec),
        draft_logits, target_logits, params, spec.name,
    )


@st.composite
def _node(draw, size, kinds, target_kinds, dtype):
    """The draft and target rows at one node (one strategy per node, so that shrinking can reorder nodes)."""
    d_row = _row(draw, size, draw(st.sampled_from(list(kinds)))).to(dtype).double()
    t_row = _row(draw, size, draw(st.sampled_from(list(target_kinds))), near=d_row).to(dtype).double()
    return d_row, t_row


@st.composite
def _one_row(draw, k, length, size, dtype, kinds, tiny_residuals, logits, fixed, spec):
    """One batch row: ``(tokens [K, L], draft [K, L, V], target [K, L + 1, V], row params or None)``.

    Nodes are drawn as the drafts reach them: drafts through one node share its conditionals.
    """
    row_params = None
    if logits:
        row_params = fixed.select([0]) if fixed is not None and fixed.batch_size is not None else fixed
        if row_params is None:
            row_params = draw(sampling_params(vocab_size=size, order=spec))
    target_kinds = list(kinds) + (["near_draft"] if tiny_residuals else [])
    tokens = torch.zeros(k, length, dtype=torch.int64)
    draft = torch.zeros(k, length, size, dtype=torch.float64)
    target = torch.zeros(k, length + 1, size, dtype=torch.float64)
    nodes: dict = {}  # prefix -> (draft row, target row)
    for j in range(k):
        prefix: tuple = ()
        for level in range(length + 1):
            if prefix not in nodes:
                nodes[prefix] = draw(_node(size, tuple(kinds), tuple(target_kinds), dtype))
            d_row, t_row = nodes[prefix]
            target[j, level] = t_row
            if level == length:
                break
            draft[j, level] = d_row
            law = process_logits(d_row.log().view(1, -1), row_params, spec)[0] if logits else d_row
            token = draw(st.sampled_from(law.nonzero().flatten().tolist()))
            tokens[j, level] = token
            prefix = prefix + (token,)
    return tokens, draft, target, row_params


def emitted_tokens_in_target_support(inputs: VerifyInputs, output: VerifyOutput) -> bool:
    """Whether every emitted token has positive target probability at its node.

    Every exact verifier has this property on every input (a token the target cannot produce
    must never be emitted): a cheap sample-level check for property tests.
    """
    target = inputs.target_probs
    for b in range(inputs.draft_tokens.shape[0]):
        k, n = int(output.draft_index[b]), int(output.num_accepted[b])
        path = inputs.draft_tokens[b, k, :n].tolist() + [int(output.next_token[b])]
        for level, token in enumerate(path):
            if float(target[b, k, level, token]) <= 0:
                return False
    return True
