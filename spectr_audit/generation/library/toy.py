"""A small context-dependent model pair with a KV cache, and a correct speculative generation loop over it.

:class:`ToyLM` is a deterministic random model whose next-token law depends on the whole context
(a running mean of token embeddings, the role a KV cache plays), on the last token and on the
absolute position (the role RoPE plays), so the generation-loop bugs that corrupt a cache, a
position or a row assignment change what it says.  Its state is incremental: :meth:`ToyLM.step`
consumes one token, as a decode step appends one entry to a KV cache; rolling back a rejected
draft means restoring an earlier state.

:class:`ToyPair` holds a target and a draft (the target's weights perturbed, so the accept
path and the bonus token are exercised, or an unrelated model, so the rejection path is), the
sampling parameters, and builds the scorer, the draft scorer and the reference generator of the
generation contract.

:class:`SpecEngine` is a correct batched speculative-decoding loop: per row, the draft proposes
``draft_len`` tokens from its processed law, the target scores the block, each token is
accepted with probability ``min(1, q/p)``, a rejection draws from the normalised residual
``(q - p)+``, a fully accepted block adds a bonus token from the target's next law, the caches
keep the committed tokens only, and rows stop at ``max_new_tokens`` or at the end-of-sequence
token.  Each step is one method, so a planted slip (:mod:`spectr_audit.generation.library.slips`)
overrides exactly one of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit.contract.sampling import SamplingParams, process_logits
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.contract import GenerationOutput, ScoredLogits

__all__ = ["SpecEngine", "ToyLM", "ToyPair", "ToyState"]


@dataclasses.dataclass(frozen=True)
class ToyState:
    """The cache of one row: the sum and count of the context's embeddings, the last token, the position."""

    total: torch.Tensor  # [dim]
    count: int
    last: int
    position: int


class ToyLM:
    """A deterministic random next-token model over ``vocab_size`` tokens, context- and position-dependent.

    ``logits = W tanh(E[last] + A mean(E[context]) + P(position)) + b``: ``E`` token embeddings,
    ``P`` sinusoidal position features, ``A`` a mixing matrix.  ``scale`` sharpens it.
    """

    def __init__(self, vocab_size: int = 16, dim: int = 12, seed: int = 0, scale: float = 2.5):
        if vocab_size < 2 or dim < 2:
            raise InvalidArgument(f"vocab_size, dim: expected at least 2, got {vocab_size}, {dim}")
        generator = torch.Generator().manual_seed(int(seed))
        self.vocab_size, self.dim = vocab_size, dim
        self.embed = torch.randn(vocab_size, dim, generator=generator, dtype=torch.float64)
        self.mix = torch.randn(dim, dim, generator=generator, dtype=torch.float64) / math.sqrt(dim)
        self.out = torch.randn(vocab_size, dim, generator=generator, dtype=torch.float64) * scale / math.sqrt(dim)
        self.bias = torch.randn(vocab_size, generator=generator, dtype=torch.float64) * 0.5
        frequencies = 1.0 / (10.0 ** (torch.arange(dim // 2, dtype=torch.float64) / max(dim // 2, 1)))
        self.frequencies = frequencies
        self._positions: dict = {}

    def perturbed(self, noise: float, seed: int) -> "ToyLM":
        """A copy with every weight moved by ``noise`` standard normal units: a draft that mostly agrees."""
        generator = torch.Generator().manual_seed(int(seed))
        other = object.__new__(ToyLM)
        other.vocab_size, other.dim, other.frequencies = self.vocab_size, self.dim, self.frequencies
        other._positions = {}
        for name in ("embed", "mix", "out", "bias"):
            value = getattr(self, name)
            setattr(other, name, value + noise * torch.randn(value.shape, generator=generator, dtype=torch.float64)
                    * value.std())
        return other

    def _position(self, position: int) -> torch.Tensor:
        features = self._positions.get(position)
        if features is None:  # a pure function of the position: computed once (a cached table)
            angles = position * self.frequencies
            features = torch.cat([torch.sin(angles), torch.cos(angles)])
            features = torch.nn.functional.pad(features, (0, self.dim - features.numel()))
            self._positions[position] = features
        return features

    def start(self, prompt: Sequence[int]) -> ToyState:
        """The state after consuming ``prompt`` (at least one token)."""
        state = ToyState(self.embed[int(prompt[0])].clone(), 1, int(prompt[0]), 0)
        for token in prompt[1:]:
            state = self.step(state, int(token))
        return state

    def step(self, state: ToyState, token: int, advance: int = 1) -> ToyState:
        """The state after one more token (its position ``advance`` further)."""
        return ToyState(state.total + self.embed[token], state.count + 1, int(token), state.position + advance)

    def logits(self, state: ToyState) -> torch.Tensor:  # [vocab_size] float64
        """The next-token logits after ``state``."""
        hidden = torch.tanh(self.embed[state.last] + self.mix @ (state.total / state.count)
                            + self._position(state.position))
        return self.out @ hidden + self.bias


class ToyPair:
    """A target and a draft :class:`ToyLM`, the sampling parameters, and the contract's scorers.

    Parameters
    ----------
    vocab_size : int
    seed : int
        The target's weights.
    draft_noise : float or None
        The draft is the target perturbed by this much (default 0.3: it agrees most of the
        time); None gives an unrelated draft (seeded ``seed + 1``): the rejection path.
    params : SamplingParams
        Scalar sampling parameters of every request (default neutral).
    order : str
        Processing order of the parameters (``process_logits``).
    eos_token_id : int, optional
    """

    def __init__(self, vocab_size: int = 16, seed: int = 0, draft_noise: Optional[float] = 0.3,
                 params: Optional[SamplingParams] = None, order: str = "vllm", eos_token_id: Optional[int] = None):
        self.vocab_size = vocab_size
        self.target = ToyLM(vocab_size, seed=seed)
        self.draft = (ToyLM(vocab_size, seed=seed + 1) if draft_noise is None
                      else self.target.perturbed(draft_noise, seed + 1))
        self.params = params or SamplingParams()
        self._neutral = self.params.is_neutral()
        self.order = order
        self.eos_token_id = eos_token_id

    def law(self, model: ToyLM, state: ToyState, params: Optional[SamplingParams] = None) -> torch.Tensor:
        """The processed next-token law ``[vocab_size]`` (float64)."""
        neutral = self._neutral if params is None else params.is_neutral()
        params = params or self.params
        if neutral:  # process_logits is the softmax then, bit for bit (and 10x dearer)
            return torch.softmax(model.logits(state), -1)
        return process_logits(model.logits(state).unsqueeze(0), params, self.order)[0]

    def _teacher_forced(self, model: ToyLM, prompts, continuations) -> list:
        out = []
        for prompt, continuation in zip(prompts, continuations):
            state = model.start(prompt)
            rows = []
            for token in continuation:
                rows.append(self.law(model, state))
                state = model.step(state, token)
            out.append(torch.stack(rows) if rows else torch.zeros(0, self.vocab_size, dtype=torch.float64))
        return out

    def scorer(self):
        """``score(prompts, continuations)``: the target's processed law at every emitted position."""
        def score(prompts, continuations):
            return self._teacher_forced(self.target, prompts, continuations)
        score.__name__ = "toy target"
        return score

    def logits_scorer(self):
        """``score(prompts, continuations)`` returning the target's raw logits with the pair's sampling parameters
        (:class:`~spectr_audit.generation.contract.ScoredLogits`): the audit processes them and reads margins."""
        pair = self

        def score(prompts, continuations):
            out = []
            for prompt, continuation in zip(prompts, continuations):
                state, rows = pair.target.start(prompt), []
                for token in continuation:
                    rows.append(pair.target.logits(state))
                    state = pair.target.step(state, token)
                out.append(torch.stack(rows) if rows else torch.zeros(0, pair.vocab_size, dtype=torch.float64))
            return ScoredLogits(out, pair.params, pair.order)

        score.__name__ = "toy target logits"
        return score

    def draft_scorer(self):
        """``score(prompts, continuations)``: the draft's processed law at every emitted position."""
        def score(prompts, continuations):
            return self._teacher_forced(self.draft, prompts, continuations)
        score.__name__ = "toy draft"
        return score

    def reference(self):
        """The same target sampled without speculation: ``generate(prompts, max_new_tokens, seed)``."""
        pair = self

        def generate(prompts, max_new_tokens, seed):
            limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
            out = []
            for row, (prompt, limit) in enumerate(zip(prompts, limits)):
                generator = torch.Generator().manual_seed(_row_seed(seed, row))
                state, tokens = pair.target.start(prompt), []
                while len(tokens) < limit:
                    token = int(torch.multinomial(pair.law(pair.target, state), 1, generator=generator))
                    tokens.append(token)
                    if token == pair.eos_token_id:
                        break
                    state = pair.target.step(state, token)
                out.append(tokens)
            return out

        generate.__name__ = "toy reference"
        generate.per_row_max_new_tokens = True
        return generate


def _row_seed(seed: int, row: int) -> int:
    """Each request's own random stream: the call's seed and the row."""
    return (int(seed) * 1_000_003 + row * 7_919 + 1) % (1 << 62)


@dataclasses.dataclass
class _Row:
    """One request while it generates."""

    index: int
    target: ToyState
    draft: ToyState
    tokens: list
    limit: int
    generator: torch.Generator
    done: bool = False
    accepted: int = 0
    calls: int = 0
    drafts: list = dataclasses.field(default_factory=list)


class SpecEngine:
    """A correct batched speculative-decoding loop over a :class:`ToyPair` (single draft chain).

    ``generate(prompts, max_new_tokens, seed)`` returns a :class:`~spectr_audit.generation.contract.GenerationOutput`
    with the accepted draft tokens and target calls per row.  The methods are the loop's steps;
    a planted slip overrides one.
    """

    name = "toy speculative"
    per_row_max_new_tokens = True

    def __init__(self, pair: ToyPair, draft_len: int = 3):
        if draft_len < 1:
            raise InvalidArgument(f"draft_len: expected >= 1, got {draft_len}")
        self.pair = pair
        self.draft_len = draft_len

    # --- the steps -----------------------------------------------------------------------------

    def row_generator(self, seed: int, row: int) -> torch.Generator:
        """The request's own random stream."""
        return torch.Generator().manual_seed(_row_seed(seed, row))

    def draft_law(self, state: ToyState) -> torch.Tensor:
        """The law the draft samples from (and the ratio reads)."""
        return self.pair.law(self.pair.draft, state)

    def sample_draft(self, law: torch.Tensor, generator: torch.Generator) -> int:
        return int(torch.multinomial(law, 1, generator=generator))

    def target_law(self, state: ToyState) -> torch.Tensor:
        """The law the target verifies against (processed)."""
        return self.pair.law(self.pair.target, state)

    def residual(self, target: torch.Tensor, draft: torch.Tensor, state: ToyState) -> torch.Tensor:
        """The correction law after a rejection: ``(q - p)+`` normalised (q itself if that is zero);
        ``state`` is the target's cache at that position."""
        residual = (target - draft).clamp(min=0)
        return residual / residual.sum() if float(residual.sum()) > 0 else target

    def accepts(self, q: float, p: float, coin: float) -> bool:
        """Whether a drafted token of target probability ``q`` and draft probability ``p`` is kept, given a
        uniform ``coin``: speculative sampling's ``coin < min(1, q / p)``."""
        return p > 0 and coin < min(1.0, q / p)

    def acceptance_law(self, laws: list, i: int) -> torch.Tensor:
        """The target law the ``i``-th drafted token's acceptance test reads: the one at its position."""
        return laws[i]

    def bonus_law(self, laws: list) -> torch.Tensor:
        """The bonus token's law after a fully accepted block: the target's law after the last draft token."""
        return laws[-1]

    def advance(self, accepted: int) -> int:
        """How far the position moves per committed token (1)."""
        return 1

    def commit(self, row: _Row, emitted: list, drafts: list, batch: list) -> None:
        """Append the emitted tokens to both caches (the rejected tail is not kept)."""
        for token in emitted:
            row.target = self.pair.target.step(row.target, token, self.advance(len(emitted)))
            row.draft = self.pair.draft.step(row.draft, token, self.advance(len(emitted)))

    def finish(self, rows: list) -> list:
        """The continuations in the order of the prompts."""
        return [row.tokens for row in rows]

    def assign(self, active: list, blocks: list, finished: int) -> list:
        """Which row each emitted block belongs to (``finished``: rows done so far)."""
        return list(zip(active, blocks))

    def truncate_at_eos(self, emitted: list) -> list:
        """The emitted block up to and including the end-of-sequence token."""
        eos = self.pair.eos_token_id
        if eos is not None and eos in emitted:
            return emitted[: emitted.index(eos) + 1]
        return emitted

    # --- the loop -------------------------------------------------------------------------------

    def step(self, row: _Row, batch: list) -> list:
        """One speculative step of one row: the tokens it emits."""
        drafts, draft_laws, target_laws, states = [], [], [], []
        state = row.draft
        for _ in range(self.draft_len):
            law = self.draft_law(state)
            token = self.sample_draft(law, row.generator)
            drafts.append(token)
            draft_laws.append(law)
            state = self.pair.draft.step(state, token)
        state = row.target
        for token in drafts:
            states.append(state)
            target_laws.append(self.target_law(state))
            state = self.pair.target.step(state, token)
        target_laws.append(self.target_law(state))
        row.calls += 1
        row.drafts = drafts
        emitted = []
        for i, token in enumerate(drafts):
            q, p = float(self.acceptance_law(target_laws, i)[token]), float(draft_laws[i][token])
            coin = float(torch.rand((), generator=row.generator, dtype=torch.float64))
            if self.accepts(q, p, coin):
                emitted.append(token)
                row.accepted += 1
                continue
            law = self.residual(target_laws[i], draft_laws[i], states[i])
            emitted.append(int(torch.multinomial(law, 1, generator=row.generator)))
            return emitted
        emitted.append(int(torch.multinomial(self.bonus_law(target_laws), 1, generator=row.generator)))
        return emitted

    def generate(self, prompts, max_new_tokens, seed):
        limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        rows = [_Row(i, self.pair.target.start(p), self.pair.draft.start(p), [], int(limit),
                     self.row_generator(seed, i)) for i, (p, limit) in enumerate(zip(prompts, limits))]
        while True:
            active = [row for row in rows if not row.done]
            if not active:
                break
            blocks = []
            for row in active:
                blocks.append(self.step(row, active))
            finished = len(rows) - len(active)
            for row, emitted in self.assign(active, blocks, finished):
                emitted = self.truncate_at_eos(emitted)[: row.limit - len(row.tokens)]
                row.tokens.extend(emitted)
                self.commit(row, emitted, blocks, active)
                eos = self.pair.eos_token_id
                if len(row.tokens) >= row.limit or (eos is not None and emitted and emitted[-1] == eos):
                    row.done = True
        return GenerationOutput(self.finish(rows), accepted=[r.accepted for r in rows],
                                target_calls=[r.calls for r in rows])
