"""Sampling parameters and the reference processing of logits into the law an engine samples from.

An engine does not sample from the model's softmax: it first applies the request's sampling
parameters (temperature, top-k, top-p, min-p) to the logits.  The law a speculative verifier
must reproduce is the law of the engine's *non-speculative* sampler with those parameters,
:func:`process_logits`.  Engines differ in the order of the steps and in how they treat the
boundaries; each engine's conventions are a :class:`ProcessingOrder`, available by name:

=============  ===========================================  ==========  =========  ===========  =============
name           steps, in order                               top-k ties  top-p      top-p mass   greedy when
=============  ===========================================  ==========  =========  ===========  =============
vllm           temperature, min_p, top_k, top_p              all kept    ahead < p  renormalised T < 1e-5
sglang         temperature, top_k, top_p, min_p              by rank     ahead <= p unfiltered   T < 1e-6
transformers   temperature, top_k, top_p, min_p              all kept    ahead < p  renormalised T == 0
eagle          temperature, top_p, top_k                     all kept    ahead < p  renormalised T <= 1e-5
=============  ===========================================  ==========  =========  ===========  =============

The definitions, for one row with (temperature-scaled) logits ``s`` and the tokens still kept:

* **temperature** ``T``: ``s = logits / T``.  Greedy rows (``T == 0``, or below the engine's
  threshold) emit the argmax of the raw logits with probability 1; among tied maxima the
  **lowest token index** wins (``torch.argmax``, which every engine here uses).  Greedy rows
  ignore top-k, top-p and min-p.
* **top-k** ``k`` (0 disables): "all kept" keeps every token whose logit is at least the k-th
  largest (so ties at the boundary all survive and more than k tokens may be kept: vLLM's
  ``apply_top_k_top_p``, transformers' ``TopKLogitsWarper``); "by rank" keeps exactly the first
  k tokens of the ranking (SGLang's ``probs.sort(descending=True)`` then ``rank < k``).
* **top-p** ``p`` (1 disables): tokens are ranked by probability; a token is kept when the
  mass ranked *ahead* of it is below ``p`` ("ahead < p": vLLM's and transformers' ascending
  ``cumsum <= 1 - p`` removal) or at most ``p`` ("ahead <= p": SGLang's ``cumsum - prob > p``
  removal).  The mass is that of the distribution left by the earlier steps, renormalised
  (vLLM, transformers), or of the temperature-scaled distribution before any filter
  ("unfiltered": SGLang, whose top-k and top-p share one sort of the unfiltered probabilities).
* **min-p** ``m`` (0 disables): keep the tokens whose probability is at least ``m`` times the
  largest one (a ratio, so it does not matter whether the distribution was renormalised).

Ties inside the top-p ranking (and, for "by rank", the top-k ranking) are ordered by token
index: vLLM and transformers sort ascending, so among equal probabilities the **highest**
index ranks first (it is the last one removed); SGLang sorts descending, so the **lowest**
index ranks first.  Both follow from a *stable* sort; ``torch.sort`` on CPU is stable for
vocabularies of at most 16 tokens and unspecified beyond, where an engine's choice among tied
tokens at a boundary is not reproducible.  The reference always uses the stable order.

Every step except temperature is a filter: the result is the softmax of the scaled logits over
the kept tokens.  Probabilities are computed in float64.

See ``docs/sampling.md`` for how each engine was read and what it does on the speculative path.

Examples
--------
>>> import torch
>>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
>>> process_logits(logits, SamplingParams(top_k=2)).tolist()[0][2:]
[0.0, 0.0]
>>> process_logits(logits, SamplingParams(temperature=0.0)).tolist()
[[1.0, 0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional, Sequence, Union

import torch

from spectr_audit.errors import InvalidArgument

__all__ = [
    "PROCESSING_ORDERS",
    "STEPS",
    "ProcessingOrder",
    "SamplingParams",
    "logits_from_probs",
    "order_names",
    "process_logits",
    "processing_order",
]

#: The processing steps, by name.
STEPS: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p")

ScalarOrRows = Union[float, int, torch.Tensor, Sequence[float]]


# ---------------------------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------------------------


def _as_rows(name: str, value: Any, integer: bool) -> Union[float, int, torch.Tensor]:
    """A Python scalar, or a 1-D CPU tensor (int64 for ``integer``, else float64) of per-row values."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise InvalidArgument(f"{name}: expected a number or a tensor of per-row numbers, got a bool")
    if isinstance(value, (list, tuple)):
        try:
            # float fields straight to float64 (a float32 detour would turn 0.7 into 0.699999988)
            value = torch.tensor(value) if integer else torch.tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"{name}: expected numbers, got {value!r} ({exc})") from exc
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.item()
        elif value.dim() != 1:
            raise InvalidArgument(f"{name}: expected a scalar or a [batch_size] tensor, got shape {tuple(value.shape)}")
        elif integer:
            if value.is_floating_point() or value.is_complex():
                raise InvalidArgument(f"{name}: expected an integer tensor, got dtype {value.dtype}")
            return value.detach().to("cpu", torch.int64).clone()
        else:
            if value.is_complex():
                raise InvalidArgument(f"{name}: expected a real tensor, got dtype {value.dtype}")
            return value.detach().to("cpu", torch.float64).clone()
    if integer:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise InvalidArgument(f"{name}: expected an integer, got {value!r}")
        return int(value)
    if not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name}: expected a number or a [batch_size] tensor, got {type(value).__name__}")
    return float(value)


def _check_range(name: str, value, ok, requirement: str) -> None:
    values = value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=torch.float64)
    good = ok(values.double()) & torch.isfinite(values.double())
    if not bool(good.all()):
        row = int((~good).nonzero()[0])
        where = f" at row {row}" if isinstance(value, torch.Tensor) else ""
        raise InvalidArgument(f"{name}: {requirement}; got {values[row].item()!r}{where}")


@dataclasses.dataclass(frozen=True, eq=False)
class SamplingParams:
    """Per-row sampling parameters: temperature, top-k, top-p, min-p.

    Each field is a scalar (the same for every row) or a ``[batch_size]`` tensor (one value per
    row of the batch; a row of the contract's ``[batch_size, num_drafts, ...]`` tensors shares
    its value across drafts and positions).  The defaults change nothing.

    Parameters
    ----------
    temperature : float or tensor, default 1.0
        ``>= 0``; 0 is greedy (a one-hot at the argmax, lowest index among ties).
    top_k : int or integer tensor, default 0
        ``>= 0``; 0 disables, as does any value ``>= vocab_size``.
    top_p : float or tensor, default 1.0
        In ``(0, 1]``; 1 disables.
    min_p : float or tensor, default 0.0
        In ``[0, 1]``; 0 disables.

    Raises
    ------
    InvalidArgument
        Naming the field and the row: out-of-range, non-finite or non-integer values,
        tensors of another shape, or per-row tensors of different lengths.

    Examples
    --------
    >>> params = SamplingParams(temperature=[0.0, 0.7], top_p=0.9)
    >>> params.batch_size
    2
    >>> params.describe()
    {'temperature': [0.0, 0.7], 'top_p': 0.9}
    >>> SamplingParams(top_p=0.0)
    Traceback (most recent call last):
    ...
    spectr_audit.errors.InvalidArgument: top_p: must lie in (0, 1]; got 0.0
    """

    temperature: ScalarOrRows = 1.0
    top_k: ScalarOrRows = 0
    top_p: ScalarOrRows = 1.0
    min_p: ScalarOrRows = 0.0

    def __post_init__(self):
        values = {
            "temperature": _as_rows("temperature", self.temperature, integer=False),
            "top_k": _as_rows("top_k", self.top_k, integer=True),
            "top_p": _as_rows("top_p", self.top_p, integer=False),
            "min_p": _as_rows("min_p", self.min_p, integer=False),
        }
        _check_range("temperature", values["temperature"], lambda t: t >= 0, "must be finite and >= 0")
        _check_range("top_k", values["top_k"], lambda k: k >= 0, "must be >= 0 (0 disables top-k)")
        _check_range("top_p", values["top_p"], lambda p: (p > 0) & (p <= 1), "must lie in (0, 1]")
        _check_range("min_p", values["min_p"], lambda m: (m >= 0) & (m <= 1), "must lie in [0, 1]")
        sizes = {name: v.shape[0] for name, v in values.items() if isinstance(v, torch.Tensor)}
        if len(set(sizes.values())) > 1:
            raise InvalidArgument(
                "temperature, top_k, top_p, min_p: per-row tensors must have one length, got "
                + ", ".join(f"{name}={size}" for name, size in sizes.items())
            )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # -- shape ---------------------------------------------------------------------------
    @property
    def batch_size(self) -> Optional[int]:
        """The number of rows of the per-row tensors, or ``None`` when every field is a scalar."""
        for name in STEPS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                return int(value.shape[0])
        return None

    def column(self, name: str, batch_size: int) -> torch.Tensor:
        """Field ``name`` as a ``[batch_size]`` CPU tensor (int64 for ``top_k``, float64 otherwise)."""
        if name not in STEPS:
            raise InvalidArgument(f"name: expected one of {STEPS}, got {name!r}")
        self.check_batch_size(batch_size)
        value = getattr(self, name)
        dtype = torch.int64 if name == "top_k" else torch.float64
        if isinstance(value, torch.Tensor):
            return value.clone()
        return torch.full((batch_size,), value, dtype=dtype)

    def check_batch_size(self, batch_size: int, argument: str = "params") -> None:
        """Raise :class:`InvalidArgument` when per-row tensors do not have ``batch_size`` rows."""
        own = self.batch_size
        if own is not None and own != batch_size:
            raise InvalidArgument(f"{argument}: sampling parameters have {own} rows, the batch has {batch_size}")

    def select(self, rows) -> "SamplingParams":
        """The parameters of the rows ``rows`` (an index tensor, a slice or a list of ints)."""
        if self.batch_size is None:
            return self
        picked = {}
        for name in STEPS:
            value = getattr(self, name)
            picked[name] = value[rows] if isinstance(value, torch.Tensor) else value
            if isinstance(picked[name], torch.Tensor) and picked[name].dim() == 0:
                picked[name] = picked[name].reshape(1)
        return SamplingParams(**picked)

    def repeat_interleave(self, repeats) -> "SamplingParams":
        """Row ``b`` repeated ``repeats[b]`` times (e.g. per-request values to per-token ones)."""
        if self.batch_size is None:
            return self
        repeats = torch.as_tensor(repeats, dtype=torch.int64)
        return SamplingParams(
            **{
                name: (value.repeat_interleave(repeats) if isinstance(value, torch.Tensor) else value)
                for name, value in ((name, getattr(self, name)) for name in STEPS)
            }
        )

    # -- meaning -------------------------------------------------------------------------
    @classmethod
    def greedy(cls) -> "SamplingParams":
        """Temperature 0: every row emits its argmax."""
        return cls(temperature=0.0)

    def is_neutral(self, vocab_size: Optional[int] = None) -> bool:
        """Whether the parameters change nothing (temperature 1 and no filter) on every row."""
        t = self.temperature
        k = self.top_k
        k_off = (k == 0) | ((k >= vocab_size) if vocab_size is not None else (k == 0))
        checks = [t == 1.0, k_off, self.top_p == 1.0, self.min_p == 0.0]
        return all(bool(torch.as_tensor(c).all()) for c in checks)

    def describe(self) -> dict:
        """The non-default fields, JSON-ready: a float for a uniform field, a list for per-row values."""
        defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        out = {}
        for name in STEPS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                out[name] = value.tolist()
            elif value != defaults[name]:
                out[name] = value
        return out

    def __eq__(self, other) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        size = self.batch_size or other.batch_size or 1
        if (self.batch_size or size) != (other.batch_size or size):
            return False
        return all(torch.equal(self.column(n, size), other.column(n, size)) for n in STEPS)

    __hash__ = None  # mutable-looking tensors inside: not hashable


# ---------------------------------------------------------------------------------------------
# Engines' processing conventions
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessingOrder:
    """One engine's conventions for turning logits and parameters into a sampling law.

    Attributes
    ----------
    name : str
    steps : tuple of str
        Subset of :data:`STEPS` in the order applied.  A parameter whose step is absent must be
        left at its neutral value (the engine does not support it).
    top_k_ties : {"keep", "rank"}
        "keep": every token tied with the k-th largest survives; "rank": exactly the first k of
        the ranking (ties ordered by ``tie_order``).
    top_p_boundary : {"strict", "inclusive"}
        Keep a token when the mass ranked ahead of it is ``< p`` ("strict") or ``<= p``.
    top_p_mass : {"renormalised", "unfiltered"}
        Whether top-p measures the distribution left by the earlier filters, renormalised, or
        the distribution before any filter (after the steps that scale logits).
    tie_order : {"highest_index_first", "lowest_index_first"}
        How equal probabilities are ranked (top-p, and top-k "rank").
    greedy_below : float
        A row is greedy when its temperature is 0 or ``< greedy_below``.
    greedy_inclusive : bool
        Greedy also at ``temperature == greedy_below`` (EAGLE samples only when ``T > 1e-5``).
    description : str
        Where the conventions were read.
    """

    name: str
    steps: tuple
    top_k_ties: Literal["keep", "rank"] = "keep"
    top_p_boundary: Literal["strict", "inclusive"] = "strict"
    top_p_mass: Literal["renormalised", "unfiltered"] = "renormalised"
    tie_order: Literal["highest_index_first", "lowest_index_first"] = "highest_index_first"
    greedy_below: float = 0.0
    greedy_inclusive: bool = False
    description: str = ""

    def __post_init__(self):
        steps = tuple(self.steps)
        unknown = [s for s in steps if s not in STEPS]
        if unknown or len(set(steps)) != len(steps):
            raise InvalidArgument(
                f"order: steps must be distinct names from {STEPS}, got {steps!r}"
            )
        object.__setattr__(self, "steps", steps)
        for field, allowed in (
            ("top_k_ties", ("keep", "rank")),
            ("top_p_boundary", ("strict", "inclusive")),
            ("top_p_mass", ("renormalised", "unfiltered")),
            ("tie_order", ("highest_index_first", "lowest_index_first")),
        ):
            if getattr(self, field) not in allowed:
                raise InvalidArgument(f"order: {field} must be one of {allowed}, got {getattr(self, field)!r}")
        if not (self.greedy_below >= 0 and math.isfinite(self.greedy_below)):
            raise InvalidArgument(f"order: greedy_below must be finite and >= 0, got {self.greedy_below!r}")

    def greedy_rows(self, temperature: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: which rows of ``temperature [N]`` are greedy under this engine."""
        below = temperature <= self.greedy_below if self.greedy_inclusive else temperature < self.greedy_below
        return (temperature == 0) | below

    def with_steps(self, steps: Sequence[str], name: Optional[str] = None) -> "ProcessingOrder":
        """The same conventions with the steps in another order (e.g. to model an engine's slip)."""
        return dataclasses.replace(self, steps=tuple(steps), name=name or "+".join(steps))


#: The engines' conventions by name (see the module docstring and ``docs/sampling.md``).
PROCESSING_ORDERS: dict[str, ProcessingOrder] = {
    "vllm": ProcessingOrder(
        "vllm", ("temperature", "min_p", "top_k", "top_p"), greedy_below=1e-5,
        description="vLLM v1 Sampler: temperature, argmax-invariant logits processors (min-p), apply_top_k_top_p",
    ),
    "sglang": ProcessingOrder(
        "sglang", ("temperature", "top_k", "top_p", "min_p"), top_k_ties="rank", top_p_boundary="inclusive",
        top_p_mass="unfiltered", tie_order="lowest_index_first", greedy_below=1e-6,
        description="SGLang Sampler, PyTorch backend: top_k_top_p_min_p_sampling_from_probs_torch",
    ),
    "transformers": ProcessingOrder(
        "transformers", ("temperature", "top_k", "top_p", "min_p"),
        description="transformers generate(): Temperature, TopK, TopP, MinP logits warpers",
    ),
    "eagle": ProcessingOrder(
        "eagle", ("temperature", "top_p", "top_k"), greedy_below=1e-5, greedy_inclusive=True,
        description="EAGLE prepare_logits_processor: transformers' Temperature, TopP, TopK warpers",
    ),
}


def order_names() -> list[str]:
    """Names of the engines' processing orders."""
    return list(PROCESSING_ORDERS)


def processing_order(order: Union[str, Sequence[str], ProcessingOrder] = "vllm") -> ProcessingOrder:
    """Resolve ``order``: a name of :data:`PROCESSING_ORDERS`, a sequence of step names (vLLM's
    boundary conventions, greedy only at temperature 0), or a :class:`ProcessingOrder`.

    Examples
    --------
    >>> processing_order("eagle").steps
    ('temperature', 'top_p', 'top_k')
    >>> processing_order(["top_p", "temperature"]).name
    'top_p+temperature'
    """
    if isinstance(order, ProcessingOrder):
        return order
    if isinstance(order, str):
        if order not in PROCESSING_ORDERS:
            raise InvalidArgument(f"order: unknown processing order {order!r}; known: {', '.join(PROCESSING_ORDERS)}")
        return PROCESSING_ORDERS[order]
    if isinstance(order, (list, tuple)):
        steps = tuple(order)
        return ProcessingOrder("+".join(str(s) for s in steps), steps)
    raise InvalidArgument(f"order: expected a name, a sequence of steps or a ProcessingOrder, got {type(order).__name__}")


# ---------------------------------------------------------------------------------------------
# The reference processing
# ---------------------------------------------------------------------------------------------


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if not isinstance(logits, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise InvalidArgument(f"{name}: expected a floating-point tensor, got dtype {logits.dtype}")
    if logits.dim() < 2:
        raise InvalidArgument(f"{name}: expected shape [batch_size, ..., vocab_size], got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise InvalidArgument(f"{name}: vocab_size must be >= 1")
    if logits.numel() == 0:
        return
    # one reduction: a row's maximum is NaN where it holds a NaN, +inf where it holds +inf, -inf where it is empty
    largest = logits.amax(-1)
    if bool((torch.isnan(largest) | (largest == math.inf)).any()):
        bad = torch.isnan(logits) | (logits == math.inf)
        index = tuple(bad.nonzero()[0].tolist())
        raise InvalidArgument(
            f"{name}: logits must be finite or -inf; found {logits[index].item()} at index {index}"
        )
    empty = largest == -math.inf
    if bool(empty.any()):
        index = tuple(empty.nonzero()[0].tolist())
        raise InvalidArgument(f"{name}: the row at index {index} is -inf everywhere (no token can be sampled)")


def _ranking(values: torch.Tensor, tie_order: str) -> torch.Tensor:  # [N, V] token ids, best first
    """Token ids sorted by ``values`` descending, ties by index as ``tie_order`` says (stable sort)."""
    if tie_order == "lowest_index_first":
        return torch.sort(values, dim=-1, descending=True, stable=True).indices
    vocab_size = values.shape[-1]
    flipped = torch.sort(values.flip(-1), dim=-1, descending=True, stable=True).indices
    return vocab_size - 1 - flipped


def _ranks(order_ids: torch.Tensor) -> torch.Tensor:  # [N, V]: rank of each token
    ranks = torch.empty_like(order_ids)
    ranks.scatter_(-1, order_ids, torch.arange(order_ids.shape[-1], device=order_ids.device).expand_as(order_ids))
    return ranks


def _masked(scaled: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return scaled.masked_fill(~keep, -math.inf)


def _top_k(scaled, keep, top_k, spec: ProcessingOrder):
    vocab_size = scaled.shape[-1]
    active = (top_k > 0) & (top_k < vocab_size)
    if not bool(active.any()):
        return keep
    values = _masked(scaled, keep)
    k_index = (top_k.clamp(1, vocab_size) - 1).unsqueeze(-1)  # [N, 1]
    if spec.top_k_ties == "keep":
        kth = torch.sort(values, dim=-1, descending=True).values.gather(-1, k_index)
        survives = values >= kth
    else:
        survives = _ranks(_ranking(values, spec.tie_order)) <= k_index
    return keep & (survives | ~active.unsqueeze(-1))


def _top_p(scaled, keep, top_p, finite, spec: ProcessingOrder):
    active = top_p < 1
    if not bool(active.any()):
        return keep
    basis = _masked(scaled, keep) if spec.top_p_mass == "renormalised" else _masked(scaled, finite)
    probs = torch.softmax(basis, dim=-1)
    order_ids = _ranking(basis, spec.tie_order)
    sorted_probs = probs.gather(-1, order_ids)
    # mass ranked strictly ahead of each token: a shifted cumulative sum (no subtraction)
    ahead = torch.cat([torch.zeros_like(sorted_probs[:, :1]), sorted_probs.cumsum(-1)[:, :-1]], dim=-1)
    threshold = top_p.unsqueeze(-1)
    kept_sorted = ahead <= threshold if spec.top_p_boundary == "inclusive" else ahead < threshold
    survives = torch.zeros_like(keep).scatter(-1, order_ids, kept_sorted)
    return keep & (survives | ~active.unsqueeze(-1))


def _min_p(scaled, keep, min_p):
    active = min_p > 0
    if not bool(active.any()):
        return keep
    values = _masked(scaled, keep)
    # prob / max prob = exp(s - max s): the ratio min-p thresholds, free of the softmax's normaliser
    ratio = torch.exp(values - values.max(-1, keepdim=True).values)
    return keep & ((ratio >= min_p.unsqueeze(-1)) | ~active.unsqueeze(-1))


def process_logits(
    logits: torch.Tensor,  # [batch_size, ..., vocab_size]
    params: Optional[SamplingParams] = None,
    order: Union[str, Sequence[str], ProcessingOrder] = "vllm",
) -> torch.Tensor:  # [batch_size, ..., vocab_size] float64
    """The law an engine's non-speculative sampler draws from, given logits and parameters.

    Parameters
    ----------
    logits : torch.Tensor
        ``[batch_size, ..., vocab_size]``, finite or ``-inf`` (a token that cannot be drawn).
        Rows of the parameters align with the first dimension and are shared by the others
        (a contract tensor ``[batch_size, num_drafts, draft_len, vocab_size]`` works as is).
    params : SamplingParams, optional
        Defaults to the neutral parameters (the result is the softmax).
    order : str, sequence of str or ProcessingOrder
        The engine whose conventions apply (see :func:`processing_order`).

    Returns
    -------
    torch.Tensor
        float64 probabilities of the shape of ``logits``, on its device.

    Raises
    ------
    InvalidArgument
        For NaN or ``+inf`` logits, a row that is ``-inf`` everywhere, parameters whose rows do
        not match the batch, or a non-neutral parameter that the order has no step for.

    Examples
    --------
    >>> import torch
    >>> logits = torch.tensor([[0.0, 0.0, -math.log(2.0)]])   # probabilities 0.4, 0.4, 0.2
    >>> process_logits(logits, SamplingParams(top_p=0.3)).tolist()     # the tie: highest index kept
    [[0.0, 1.0, 0.0]]
    >>> process_logits(logits, SamplingParams(top_p=0.3), "sglang").tolist()   # lowest index kept
    [[1.0, 0.0, 0.0]]
    """
    _check_logits(logits, "logits")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
    spec = processing_order(order)
    batch_size, vocab_size = logits.shape[0], logits.shape[-1]
    params.check_batch_size(batch_size)
    for step, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
        if step not in spec.steps:
            value = params.column(step, batch_size)
            if step == "top_k":
                unused = (value == 0) | (value >= vocab_size)
            else:
                unused = value == neutral
            if not bool(unused.all()):
                raise InvalidArgument(f"params: {step} is set but processing order {spec.name!r} has no {step} step")
    if "temperature" not in spec.steps and not bool((params.column("temperature", batch_size) == 1).all()):
        raise InvalidArgument(f"params: temperature is set but processing order {spec.name!r} has no temperature step")

    shape = logits.shape
    raw = logits.reshape(batch_size, -1, vocab_size).double()
    per_row = raw.shape[1]
    flat = raw.reshape(-1, vocab_size)  # [N, V], N = batch_size * (positions per row)
    device = logits.device

    def column(name):
        return params.column(name, batch_size).to(device).repeat_interleave(per_row)

    temperature = column("temperature")
    greedy = spec.greedy_rows(temperature)
    finite = flat > -math.inf
    keep = finite.clone()
    scaled = flat
    for step in spec.steps:
        if step == "temperature":
            safe = torch.where(greedy, torch.ones_like(temperature), temperature)
            scaled = scaled / safe.unsqueeze(-1)
        elif step == "top_k":
            keep = _top_k(scaled, keep, column("top_k"), spec)
        elif step == "top_p":
            keep = _top_p(scaled, keep, column("top_p"), finite, spec)
        else:
            keep = _min_p(scaled, keep, column("min_p"))
    probs = torch.softmax(_masked(scaled, keep), dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, flat.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs.reshape(shape)


def logits_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """``log(probs)`` in float64, ``-inf`` where a probability is 0: logits whose softmax is ``probs``.

    Examples
    --------
    >>> import torch
    >>> logits = logits_from_probs(torch.tensor([[0.25, 0.75, 0.0]]))
    >>> [round(x, 12) for x in process_logits(logits)[0].tolist()]
    [0.25, 0.75, 0.0]
    """
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise InvalidArgument("probs: expected a floating-point torch.Tensor")
    if probs.numel() and bool((probs < 0).any() | torch.isnan(probs).any()):
        raise InvalidArgument("probs: probabilities must be non-negative")
    return probs.double().log()
