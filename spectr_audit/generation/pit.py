"""The randomized probability integral transform of emitted tokens, and their surprisal.

For an emitted token y at a position whose target law is q (the scorer's row), and a fixed
order of the vocabulary,

    u = q(tokens before y in the order) + U q(y),     U ~ Uniform(0, 1) independent,

is uniform on [0, 1] when y ~ q (the randomized PIT for discrete laws).  Along a generated
sequence each u_t is uniform given everything before it, whatever the generation loop did to
reach that context, so the u_t of an exact engine are i.i.d. uniform (Rosenblatt's transform of
the sequence).  If the engine draws y from p instead, u has density p(y)/q(y) on y's interval,
so the law of u is exactly as far from uniform as p is from q in TV, whatever the order: the
order only decides where in [0, 1] a deviation lands, and so whether deviations at different
positions add up or cancel.  Three orders:

``probability``
    by decreasing q (ties by token id): a too-sharp engine puts u near 0, a too-flat one near 1
    (temperature, top-k, top-p slips);
``ratio``
    by decreasing q / p for the draft law p at the same position (with a draft scorer): a
    coupling that over-accepts drafted tokens moves u towards the low-ratio end;
``token-id``
    by token id: deviations tied to particular tokens.

Each value costs one masked sum over the row (no sort).  Also per token: the surprisal
``-log q(y)``, the entropy ``H(q)`` and the variance of ``-log q`` under q, for the surprisal
martingale (:mod:`spectr_audit.generation.statistical_tests`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from spectr_audit.errors import InvalidArgument

__all__ = ["ORDERINGS", "TokenStats", "token_stats"]

#: The vocabulary orders of the PIT.
ORDERINGS = ("probability", "ratio", "token-id")

#: Rows processed at once (the masks are [rows, vocab_size]) at most, and the elements of one block: every pass
#: over a block stays in the CPU's cache (fresh tensors of a whole large-vocabulary batch cost far more than the
#: arithmetic on them).
_ROWS = 512
_BLOCK = 1 << 18


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """Per emitted token: its PIT under each order, its target mass and its surprisal's moments.

    Attributes
    ----------
    pit : dict of str -> torch.Tensor
        ``[num_tokens]`` float64 per order of :data:`ORDERINGS` computed.
    mass : torch.Tensor
        ``[num_tokens]`` q(y), the scorer's probability of the emitted token.
    surprisal, entropy, surprisal_var : torch.Tensor
        ``[num_tokens]``: ``-log q(y)``, ``H(q)``, ``Var_q(-log q)`` (0 where q is one-hot).
    """

    pit: dict
    mass: torch.Tensor
    surprisal: torch.Tensor
    entropy: torch.Tensor
    surprisal_var: torch.Tensor

    @classmethod
    def concatenate(cls, parts: Sequence["TokenStats"]) -> "TokenStats":
        """The statistics of several token sequences, one after the other."""
        return cls({o: torch.cat([p.pit[o] for p in parts]) for o in parts[0].pit},
                   *(torch.cat([getattr(p, f) for p in parts]) for f in ("mass", "surprisal", "entropy",
                                                                          "surprisal_var")))


def _before(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[rows, V]`` bool: token x comes before y in the order of decreasing ``keys`` (ties by token id)."""
    own = keys.gather(1, tokens.unsqueeze(1))
    ids = torch.arange(keys.shape[1], device=keys.device).unsqueeze(0)
    return (keys > own) | ((keys == own) & (ids < tokens.unsqueeze(1)))


def token_stats(
    laws: torch.Tensor,  # [num_tokens, vocab_size] the scorer's law at each emitted token
    tokens: torch.Tensor,  # [num_tokens] int64 the emitted tokens
    uniforms: torch.Tensor,  # [num_tokens] float64 in [0, 1)
    draft_laws: Optional[torch.Tensor] = None,  # [num_tokens, vocab_size] the draft's law, for "ratio"
    orderings: Sequence[str] = ("probability", "token-id"),
) -> TokenStats:
    """The PIT of every token under each order, and its surprisal's moments.

    Examples
    --------
    >>> laws = torch.tensor([[0.5, 0.3, 0.2]] * 2, dtype=torch.float64)
    >>> stats = token_stats(laws, torch.tensor([1, 2]), torch.tensor([0.5, 0.0], dtype=torch.float64))
    >>> [round(float(x), 4) for x in stats.pit["probability"]], [round(float(x), 4) for x in stats.pit["token-id"]]
    ([0.65, 0.8], [0.65, 0.8])
    """
    laws = laws.double()
    if laws.dim() != 2 or tokens.shape != laws.shape[:1] or uniforms.shape != tokens.shape:
        raise InvalidArgument(f"laws, tokens, uniforms: expected [n, V], [n], [n], got {list(laws.shape)}, "
                              f"{list(tokens.shape)}, {list(uniforms.shape)}")
    unknown = [o for o in orderings if o not in ORDERINGS]
    if unknown:
        raise InvalidArgument(f"orderings: expected some of {ORDERINGS}, got {unknown}")
    if "ratio" in orderings and draft_laws is None:
        raise InvalidArgument("orderings: 'ratio' needs the draft's laws (a draft scorer)")
    if draft_laws is not None and tuple(draft_laws.shape) != tuple(laws.shape):
        raise InvalidArgument(f"draft_laws: expected the shape of laws {list(laws.shape)}, got "
                              f"{list(draft_laws.shape)}")
    tokens = tokens.long()
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= laws.shape[1]):
        raise InvalidArgument(f"tokens: expected ids in [0, {laws.shape[1]})")
    num = tokens.shape[0]
    pit = {o: torch.empty(num, dtype=torch.float64) for o in orderings}
    mass = laws.gather(1, tokens.unsqueeze(1)).squeeze(1)
    entropy = torch.empty(num, dtype=torch.float64)
    variance = torch.empty(num, dtype=torch.float64)
    step = max(1, min(_ROWS, _BLOCK // max(1, laws.shape[1])))
    for start in range(0, num, step):
        rows = slice(start, start + step)
        q, y, u = laws[rows], tokens[rows], uniforms[rows].double()
        own = mass[rows]
        for order in orderings:
            if order == "token-id":
                ids = torch.arange(q.shape[1]).unsqueeze(0)
                before = ids < y.unsqueeze(1)
            elif order == "probability":
                before = _before(q, y)
            else:
                p = draft_laws[rows].double()
                # exactly q / p where p > 0 (no clamp: a clamped tiny p changed the order); q > 0 = p: first
                ratio = torch.where(p > 0, q / torch.where(p > 0, p, torch.ones_like(p)),
                                    torch.where(q > 0, torch.inf, 0.0))
                before = _before(ratio, y)
            pit[order][rows] = torch.where(before, q, 0.0).sum(1) + u * own
        # log q where q > 0, and 0 where q = 0 (every term it enters there is q times it, 0)
        log_q = torch.where(q > 0, q, 1.0).log_()
        h = -(q * log_q).sum(1)
        entropy[rows] = h
        # two passes: E[(-log q - H)^2], not E[log^2 q] - H^2 (which cancels to noise on flat laws)
        deviation = log_q.add_(h.unsqueeze(1))
        variance[rows] = (q * deviation).mul_(deviation).sum(1)
    surprisal = torch.where(mass > 0, -torch.where(mass > 0, mass, torch.ones_like(mass)).log(),
                            torch.full_like(mass, torch.inf))
    return TokenStats({o: v.clamp(0.0, 1.0) for o, v in pit.items()}, mass, surprisal, entropy, variance)
