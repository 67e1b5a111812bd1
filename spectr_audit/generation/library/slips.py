"""Generation loops with planted slips: each a one-method override of the correct loop, with its ground truth.

Every class here is a :class:`~spectr_audit.generation.library.toy.SpecEngine` with one step
changed the way a real engine got it wrong; the correct loop is the same class without the
override, so the slip is all that differs.  :data:`SLIPS` lists them with what each needs to be
seen (a batch design, sampling parameters, long continuations, an end-of-sequence token).
"""

from __future__ import annotations

import dataclasses

import torch

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.audit import audit_generation
from spectr_audit.generation.library.toy import SpecEngine, ToyPair, ToyState

__all__ = ["SLIPS", "SLIP_EOS", "SLIP_PROMPTS", "Slip", "audit_slip"]


class PhantomContext(SpecEngine):
    """Ragged rollback: a row that accepted fewer tokens than the batch's longest keeps its rejected draft
    tokens in its caches (phantom context for its next step)."""

    name = "phantom-context"

    def commit(self, row, emitted, drafts, batch):
        super().commit(row, emitted, drafts, batch)
        longest = max(len(b) for b in drafts)
        for token in row.drafts[len(emitted):longest]:
            row.target = self.pair.target.step(row.target, token)
            row.draft = self.pair.draft.step(row.draft, token)


class PositionsByBlock(SpecEngine):
    """After a rejection the positions advance by the whole block, not by the tokens kept."""

    name = "positions-by-block"

    def commit(self, row, emitted, drafts, batch):
        super().commit(row, emitted, drafts, batch)
        extra = self.draft_len + 1 - len(emitted)
        row.target = dataclasses.replace(row.target, position=row.target.position + extra)
        row.draft = dataclasses.replace(row.draft, position=row.draft.position + extra)


class BonusWrongPosition(SpecEngine):
    """The bonus token is drawn from the target's law one position early (the last draft token's)."""

    name = "bonus-wrong-position"

    def bonus_law(self, laws):
        return laws[-2] if len(laws) >= 2 else laws[-1]


class ResidualUnprocessed(SpecEngine):
    """The residual after a rejection is built from the unprocessed target law (no temperature, top-k, top-p)."""

    name = "residual-unprocessed"

    def residual(self, target, draft, state: ToyState):
        raw = torch.softmax(self.pair.target.logits(state), -1)
        residual = (raw - draft).clamp(min=0)
        return residual / residual.sum() if float(residual.sum()) > 0 else raw


class ParamsDraftOnly(SpecEngine):
    """The sampling parameters reach the draft only: the target verifies against its raw softmax."""

    name = "params-draft-only"

    def target_law(self, state):
        return torch.softmax(self.pair.target.logits(state), -1)


class LowPrecisionDraft(SpecEngine):
    """The draft is sampled from its law in bfloat16 while the acceptance ratio reads the float64 law."""

    name = "low-precision-draft"

    def sample_draft(self, law, generator):
        coarse = law.to(torch.bfloat16).double()
        return int(torch.multinomial(coarse / coarse.sum(), 1, generator=generator))


class RowsPermuted(SpecEngine):
    """Once a row of the batch has finished, each emitted block is appended to the next row (an index shift)."""

    name = "rows-permuted"

    def assign(self, active, blocks, finished):
        if finished and len(active) > 1:
            blocks = blocks[1:] + blocks[:1]
        return list(zip(active, blocks))


class EosInsideBlock(SpecEngine):
    """An end-of-sequence token inside an accepted block does not end the row: the block's later tokens are kept."""

    name = "eos-inside-block"

    def truncate_at_eos(self, emitted):
        return emitted

    def generate(self, prompts, max_new_tokens, seed):
        eos, self.pair.eos_token_id = self.pair.eos_token_id, None  # the loop never stops at it either
        try:
            return super().generate(prompts, max_new_tokens, seed)
        finally:
            self.pair.eos_token_id = eos


class SharedStream(SpecEngine):
    """Every request of a call seeded alike (the call's seed): identical prompts give identical continuations."""

    name = "shared-stream"

    def row_generator(self, seed, row):
        return torch.Generator().manual_seed(int(seed) % (1 << 62))


class PastContextLength(SpecEngine):
    """Past position 40 the target's position features stop advancing (a cached table too short)."""

    name = "past-context-length"
    limit = 40

    def target_law(self, state):
        if state.position > self.limit:
            state = dataclasses.replace(state, position=self.limit)
        return super().target_law(state)


@dataclasses.dataclass(frozen=True)
class Slip:
    """A planted slip and what it takes to be seen.

    Attributes
    ----------
    engine : type
        The :class:`SpecEngine` subclass.
    needs : str
        The condition it shows under, in words.
    params : dict
        Sampling parameters of the pair it is audited on (empty: neutral).
    max_new_tokens : int
    eos : bool
        Audited with an end-of-sequence token.
    """

    engine: type
    needs: str
    params: dict = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 32
    eos: bool = False


#: Every planted slip, by name.
SLIPS = {
    "phantom-context": Slip(PhantomContext, "batches whose rows accept different numbers of tokens"),
    "positions-by-block": Slip(PositionsByBlock, "any rejection"),
    "bonus-wrong-position": Slip(BonusWrongPosition, "fully accepted blocks (a draft that agrees)"),
    "residual-unprocessed": Slip(ResidualUnprocessed, "rejections under non-neutral sampling parameters",
                                 {"temperature": 0.6, "top_k": 6}),
    "params-draft-only": Slip(ParamsDraftOnly, "non-neutral sampling parameters", {"temperature": 0.6}),
    "low-precision-draft": Slip(LowPrecisionDraft, "a draft law that bfloat16 rounds (small effect)"),
    "rows-permuted": Slip(RowsPermuted, "batches whose rows finish at different times (ragged arm)"),
    "eos-inside-block": Slip(EosInsideBlock, "an end-of-sequence token accepted inside a block", eos=True),
    "shared-stream": Slip(SharedStream, "the same prompt repeated in one batch (repeated arm)"),
    "past-context-length": Slip(PastContextLength, "continuations past position 40", max_new_tokens=64),
}


#: The prompts the slips are audited on: different lengths (the ragged arm mixes them).
SLIP_PROMPTS = ([1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11])
#: The end-of-sequence token of the slips audited with one.
SLIP_EOS = 3


def audit_slip(name, rounds: int = 1, seed: int = 0, *, correct: bool = False, vocab_size: int = 12,
               pair_seed: int = 0, **kwargs):
    """Audit the planted slip ``name`` (or, with ``correct=True``, the correct loop on the very same pair,
    prompts, sampling parameters and budget) over :data:`SLIP_PROMPTS`; ``rounds`` sets the budget.

    Returns the :class:`~spectr_audit.generation.results.GenerationAuditResult`.
    """
    if name not in SLIPS:
        raise InvalidArgument(f"name: expected one of {sorted(SLIPS)}, got {name!r}")
    slip = SLIPS[name]
    eos = SLIP_EOS if slip.eos else None
    pair = ToyPair(vocab_size, seed=pair_seed, params=SamplingParams(**slip.params), eos_token_id=eos)
    engine = SpecEngine(pair) if correct else slip.engine(pair)
    settings = dict(vocab_size=vocab_size, max_new_tokens=slip.max_new_tokens, rounds=rounds, seed=seed,
                    eos_token_id=eos, progress=False)
    settings.update(kwargs)
    return audit_generation(engine, pair.scorer(), [list(p) for p in SLIP_PROMPTS], **settings)
