"""A correct speculative loop over whole requests, and the slips engines have shipped in the rest of the request.

:class:`RequestSpecEngine` is :class:`~spectr_audit.generation.library.toy.SpecEngine` with one
:class:`~spectr_audit.contract.requests.Request` per row: at every position of a block, the draft's and the
target's laws are their logits under the row's request and its history so far (the committed tokens, then the
drafted tokens before that position), by :func:`~spectr_audit.contract.history.process_request_step`; a row
stops at its first stop token (the end of sequence or one of its ``stop_token_ids``) or at the token that
completes one of its stop strings (in the toy's text, :meth:`RequestSpecEngine.detokenize`), and at its own
``max_tokens``; a row with a seed draws from its own stream whatever its batch; it returns the raw
log-probability of every emitted token (and the top-n where asked), the finish reasons and the usage counts.
Each step is one method, so each planted slip of :data:`REQUEST_SLIPS` overrides exactly one.

:func:`audit_request_slip` audits one slip (or the correct loop) on the request mix that exercises it;
:func:`audit_every_feature` audits the correct loop with every feature on.  docs/generation.md ("Planted slips
in the whole request") gives each slip's ground truth and the budget at which the audit finds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from spectr_audit.contract.history import process_request_step
from spectr_audit.contract.requests import ConstraintViolation, Request, TokenAutomaton
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.audit import audit_generation
from spectr_audit.generation.contract import GenerationOutput
from spectr_audit.generation.library.toy import SpecEngine, ToyPair, _row_seed

#: The toy engines' text: token ``i`` reads as the letter ``TOY_LETTERS[i % 26]`` (their ``detokenize``).
TOY_LETTERS = "abcdefghijklmnopqrstuvwxyz"

__all__ = [
    "REQUEST_SLIPS",
    "RequestSlip",
    "RequestSpecEngine",
    "TOY_LETTERS",
    "audit_every_feature",
    "audit_request_slip",
    "feature_requests",
    "found",
    "request_pair",
    "request_prompts",
]


@dataclasses.dataclass
class _ReqRow:
    """One row while it generates."""

    index: int
    prompt: list
    request: Request
    target: Any
    draft: Any
    limit: int
    generator: torch.Generator
    tokens: list = dataclasses.field(default_factory=list)
    history: list = dataclasses.field(default_factory=list)  # what the processors read as emitted
    logprobs: list = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)
    done: bool = False
    stopped: bool = False
    accepted: int = 0
    calls: int = 0


class RequestSpecEngine(SpecEngine):
    """A correct batched speculative loop with one whole request per row (single draft chain).

    ``generate(prompts, max_new_tokens, seed, requests=None)``; ``requests=None`` gives every row the neutral
    request.  The pair's own sampling parameters must be neutral (the requests carry them).
    """

    name = "toy speculative (requests)"
    accepts_requests = True
    seeded = True

    def __init__(self, pair: ToyPair, draft_len: int = 3, order: str = "vllm"):
        super().__init__(pair, draft_len)
        if not pair.params.is_neutral():
            raise InvalidArgument("pair: its sampling parameters must be neutral; the requests carry them")
        self.order = order

    # --- the steps a slip overrides ----------------------------------------------------------------

    def request_for(self, row: _ReqRow, batch: list) -> Request:
        """The request whose parameters row ``row`` is sampled with."""
        return row.request

    def stream(self, request: Request, seed: int, row: int, shared: torch.Generator) -> torch.Generator:
        """The row's random stream: its own seed's, else the call's seed and the row."""
        seed = request.seed if request.seed is not None else _row_seed(seed, row)
        return torch.Generator().manual_seed(int(seed) % (1 << 62))

    def law(self, row: _ReqRow, logits: torch.Tensor, history: list, request: Request, position: int,
            bonus: bool, batch: list) -> torch.Tensor:
        """The law at one position of a block (``position`` in the block; ``bonus``: after a full block)."""
        return self._processed(logits, row, history, request)

    def draft_side_law(self, row: _ReqRow, logits: torch.Tensor, history: list, request: Request,
                       position: int, batch: list) -> torch.Tensor:
        """The draft's law (the same processing as the target's)."""
        return self._processed(logits, row, history, request)

    def _processed(self, logits, row, history, request):
        try:
            return process_request_step(logits, row.prompt, history, request, self.order,
                                        eos_token_id=self.pair.eos_token_id)
        except ConstraintViolation:  # a slip let a disallowed token through: it goes on unconstrained
            return process_request_step(logits, row.prompt, history, _without(request, constraint=None), self.order,
                                        eos_token_id=self.pair.eos_token_id)

    def record_history(self, row: _ReqRow, emitted: list, drafts: list) -> None:
        """What the processors read as the row's emitted tokens after a step: every committed token."""
        row.history.extend(emitted)

    def reported_logprob(self, target_logits: torch.Tensor, law: torch.Tensor, draft_law: Optional[torch.Tensor],
                         token: int, accepted: bool) -> float:
        """The log-probability returned for an emitted token: the raw target log-softmax."""
        return float(torch.log_softmax(target_logits.double(), -1)[token])

    def detokenize(self, tokens) -> str:
        """The toy's text: token ``i`` is the letter ``"abc...z"[i % 26]`` (stop strings are matched in it)."""
        return "".join(TOY_LETTERS[int(t) % len(TOY_LETTERS)] for t in tokens)

    def row_end(self, row: _ReqRow, tokens: list) -> int:
        """Where a row whose tokens are ``tokens`` ends: its first stop token or completed stop string (-1: none)."""
        return row.request.stop_position(tokens, self.pair.eos_token_id, self.detokenize, self.order)

    def cut(self, row: _ReqRow, emitted: list, stops: tuple, room: int) -> list:
        """The emitted block up to and including the token that ends the row (its first stop token or the token
        completing a stop string), within the row's room."""
        end = self.row_end(row, row.tokens + emitted)
        if end >= 0:
            return emitted[: end - len(row.tokens) + 1][:room]
        return emitted[:room]

    # --- the loop -------------------------------------------------------------------------------

    def _step(self, row: _ReqRow, batch: list) -> tuple:
        request = self.request_for(row, batch)
        stops = request.stop_ids(self.pair.eos_token_id)
        drafts, draft_laws, states = [], [], []
        state = row.draft
        for i in range(self.draft_len):
            # past a drafted stop token the block is cut anyway: those positions are drafted unconstrained
            here = request if not any(t in stops for t in drafts) else _without(request, constraint=None)
            law = self.draft_side_law(row, self.pair.draft.logits(state), row.history + drafts, here, i, batch)
            token = int(torch.multinomial(law, 1, generator=row.generator))
            drafts.append(token)
            draft_laws.append(law)
            state = self.pair.draft.step(state, token)
        target_logits, target_laws = [], []
        state = row.target
        for i, token in enumerate(drafts):
            states.append(state)
            logits = self.pair.target.logits(state)
            target_logits.append(logits)
            here = request if not any(t in stops for t in drafts[:i]) else _without(request, constraint=None)
            target_laws.append(self.law(row, logits, row.history + drafts[:i], here, i, False, batch))
            state = self.pair.target.step(state, token)
        logits = self.pair.target.logits(state)
        target_logits.append(logits)
        here = request if not any(t in stops for t in drafts) else _without(request, constraint=None)
        target_laws.append(self.law(row, logits, row.history + drafts, here, len(drafts), True, batch))
        row.calls += 1
        emitted, reported = [], []
        for i, token in enumerate(drafts):
            q, p = float(target_laws[i][token]), float(draft_laws[i][token])
            coin = float(torch.rand((), generator=row.generator, dtype=torch.float64))
            if p > 0 and coin < min(1.0, q / p):
                emitted.append(token)
                reported.append((target_logits[i], target_laws[i], draft_laws[i], token, True))
                row.accepted += 1
                continue
            residual = (target_laws[i] - draft_laws[i]).clamp(min=0)
            law = residual / residual.sum() if float(residual.sum()) > 0 else target_laws[i]
            token = int(torch.multinomial(law, 1, generator=row.generator))
            emitted.append(token)
            reported.append((target_logits[i], target_laws[i], None, token, False))
            return emitted, reported, drafts
        token = int(torch.multinomial(target_laws[-1], 1, generator=row.generator))
        emitted.append(token)
        reported.append((target_logits[-1], target_laws[-1], None, token, False))
        return emitted, reported, drafts

    def generate(self, prompts, max_new_tokens, seed, requests=None):
        requests = list(requests) if requests is not None else [Request()] * len(prompts)
        if len(requests) != len(prompts):
            raise InvalidArgument(f"requests: {len(requests)} for {len(prompts)} prompts")
        limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        shared = torch.Generator().manual_seed(int(seed) % (1 << 62))
        rows = []
        for i, (prompt, request, limit) in enumerate(zip(prompts, requests, limits)):
            cap = int(limit) if request.max_tokens is None else min(int(limit), request.max_tokens)
            rows.append(_ReqRow(i, list(prompt), request, self.pair.target.start(prompt), self.pair.draft.start(prompt),
                                cap, self.stream(request, seed, i, shared)))
        while True:
            active = [row for row in rows if not row.done]
            if not active:
                break
            steps = [self._step(row, active) for row in active]
            for row, (emitted, reported, drafts) in zip(active, steps):
                stops = row.request.stop_ids(self.pair.eos_token_id)
                kept = self.cut(row, emitted, stops, row.limit - len(row.tokens))
                row.tokens.extend(kept)
                for token in kept:
                    row.target = self.pair.target.step(row.target, token)
                    row.draft = self.pair.draft.step(row.draft, token)
                self.record_history(row, kept, drafts)
                for logits, law, draft_law, token, accepted in reported[: len(kept)]:
                    row.logprobs.append(self.reported_logprob(logits, law, draft_law, token, accepted))
                    if row.request.logprobs:
                        values, ids = torch.log_softmax(logits.double(), -1).topk(row.request.logprobs)
                        row.top.append({int(i): float(v) for i, v in zip(ids, values)})
                if kept and (kept[-1] in stops or self.row_end(row, row.tokens) >= 0):
                    row.done = row.stopped = True
                if len(row.tokens) >= row.limit:
                    row.done = True
        return GenerationOutput(
            [row.tokens for row in rows], accepted=[row.accepted for row in rows],
            target_calls=[row.calls for row in rows],
            logprobs=[row.logprobs if row.request.logprobs is not None else None for row in rows],
            top_logprobs=[row.top if row.request.logprobs else None for row in rows],
            finish_reasons=["stop" if row.stopped else "length" for row in rows],
            completion_tokens=[len(row.tokens) for row in rows])


# ---------------------------------------------------------------------------------------------------
# The slips
# ---------------------------------------------------------------------------------------------------


def _without(request: Request, **fields) -> Request:
    return dataclasses.replace(request, **fields)


class RowsParamsSwapped(RequestSpecEngine):
    """A mixed batch: each row sampled with the next row's request (rows misaligned)."""

    def request_for(self, row, batch):
        others = [r for r in batch]
        return others[(others.index(row) + 1) % len(others)].request


class GreedyArgmaxOfOtherRow(RequestSpecEngine):
    """Greedy rows of a mixed batch take the argmax of the next row's target logits."""

    def law(self, row, logits, history, request, position, bonus, batch):
        if request.greedy and len(batch) > 1:
            other = batch[(batch.index(row) + 1) % len(batch)]
            logits = self.pair.target.logits(other.target)
        return super().law(row, logits, history, request, position, bonus, batch)


class PenaltiesIgnored(RequestSpecEngine):
    """Penalties dropped under speculation (draft and target laws alike)."""

    def law(self, row, logits, history, request, position, bonus, batch):
        plain = _without(request, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        return super().law(row, logits, history, plain, position, bonus, batch)

    def draft_side_law(self, row, logits, history, request, position, batch):
        plain = _without(request, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        return super().draft_side_law(row, logits, history, plain, position, batch)


class PenaltyLastAcceptedOnly(RequestSpecEngine):
    """The penalty state receives only the last token of each step."""

    def record_history(self, row, emitted, drafts):
        row.history.extend(emitted[-1:])


class PenaltyCountsRejected(RequestSpecEngine):
    """The penalty state records every drafted token, rejected ones too, and counts accepted ones twice."""

    def record_history(self, row, emitted, drafts):
        row.history.extend(drafts + emitted)


class BiasBonusOnly(RequestSpecEngine):
    """The logit bias (and min-p) applied at the bonus position only."""

    def law(self, row, logits, history, request, position, bonus, batch):
        if not bonus:
            request = _without(request, logit_bias=(), min_p=0.0)
        return super().law(row, logits, history, request, position, bonus, batch)


class MinTokensInSteps(RequestSpecEngine):
    """min_tokens counted in steps, not tokens: the stop tokens masked until that many steps have run."""

    def law(self, row, logits, history, request, position, bonus, batch):
        if request.min_tokens:
            masked = row.calls < request.min_tokens
            request = _without(request, min_tokens=len(history) + 1 if masked else 0)
        return super().law(row, logits, history, request, position, bonus, batch)

    def draft_side_law(self, row, logits, history, request, position, batch):
        if request.min_tokens:
            masked = row.calls < request.min_tokens
            request = _without(request, min_tokens=len(history) + 1 if masked else 0)
        return super().draft_side_law(row, logits, history, request, position, batch)


class DraftLogprobs(RequestSpecEngine):
    """The draft model's log-probability returned for accepted tokens."""

    def reported_logprob(self, target_logits, law, draft_law, token, accepted):
        if accepted and draft_law is not None:
            return float(torch.log(draft_law[token]))
        return super().reported_logprob(target_logits, law, draft_law, token, accepted)


class LogprobZero(RequestSpecEngine):
    """Log-probability 0.0 returned for every token."""

    def reported_logprob(self, target_logits, law, draft_law, token, accepted):
        return 0.0


class ProcessedLogprobs(RequestSpecEngine):
    """The processed law's log-probability returned where raw ones are declared."""

    def reported_logprob(self, target_logits, law, draft_law, token, accepted):
        return float(torch.log(law[token]))


class KeepsAfterStop(RequestSpecEngine):
    """A stop token completed inside an accepted block: the tokens after it kept."""

    def cut(self, row, emitted, stops, room):
        if any(t in row.request.stop_token_ids for t in emitted[:-1]):
            return emitted[:room]
        return super().cut(row, emitted, stops, room)


class KeepsAfterStopString(RequestSpecEngine):
    """A stop string completed inside an accepted block: the row finishes, but the block's tokens after the one
    that completed it are kept (the text trimmed, the token ids and logprobs not)."""

    def cut(self, row, emitted, stops, room):
        kept = super().cut(row, emitted, stops, room)
        if kept and kept[-1] not in stops and self.row_end(row, row.tokens + kept) >= 0:
            return emitted[:room]
        return kept


class MaxTokensMasksEos(RequestSpecEngine):
    """A max_tokens cap inside an accepted run hides an end of sequence in it: the row runs on to the cap."""

    def cut(self, row, emitted, stops, room):
        if len(emitted) >= room:
            return emitted[:room]
        return super().cut(row, emitted, stops, room)


class AfterEosMidBlock(RequestSpecEngine):
    """An end of sequence accepted mid-block does not end the row: the rest of the block is emitted."""

    def cut(self, row, emitted, stops, room):
        eos = self.pair.eos_token_id
        if eos in emitted[:-1]:
            return emitted[:room]
        return super().cut(row, emitted, stops, room)


class ConstraintFirstPositionOnly(RequestSpecEngine):
    """The constraint's mask applied at the first position of each block only."""

    def law(self, row, logits, history, request, position, bonus, batch):
        if position > 0:
            request = _without(request, constraint=None)
        return super().law(row, logits, history, request, position, bonus, batch)

    def draft_side_law(self, row, logits, history, request, position, batch):
        if position > 0:
            request = _without(request, constraint=None)
        return super().draft_side_law(row, logits, history, request, position, batch)


class SeedIgnored(RequestSpecEngine):
    """A per-request seed ignored: every row draws from the batch's one stream."""

    def stream(self, request, seed, row, shared):
        return shared


@dataclasses.dataclass(frozen=True)
class RequestSlip:
    """A planted slip: its engine, what it gets wrong (the ground truth), the check meant to find it, and the
    requests that exercise it."""

    name: str
    engine: type
    truth: str
    check: str
    requests: str


def request_pair(vocab_size: int = 12, seed: int = 0) -> ToyPair:
    """The pair the request slips run on (neutral sampling parameters, end of sequence 0)."""
    return ToyPair(vocab_size=vocab_size, seed=seed, eos_token_id=0)


def request_prompts(vocab_size: int = 12) -> list:
    """The six two-token prompts the request slips are audited on (ids below ``vocab_size``).

    >>> request_prompts(12)
    [[1, 2], [2, 5], [3, 8], [4, 11], [5, 4], [6, 7]]
    """
    return [[1 + (i % (vocab_size - 1)), 2 + (3 * i) % (vocab_size - 2)] for i in range(6)]


def _parity_automaton(vocab_size: int) -> TokenAutomaton:
    """Odd tokens, then even ones, alternating; the end of sequence 0 after any odd token."""
    odd = {t: 1 for t in range(1, vocab_size, 2)}
    even = {t: 0 for t in range(2, vocab_size, 2)}
    return TokenAutomaton({0: odd, 1: even}, accepting=[1], end_tokens=[0], name="odd-even")


def feature_requests(mix: str, vocab_size: int = 12) -> list:
    """The requests of a mix: ``every`` (every feature on), or the features one slip needs."""
    penalties = Request(temperature=0.9, repetition_penalty=1.6, presence_penalty=0.6, frequency_penalty=0.8,
                        logprobs=2)
    greedy_pen = Request(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.5, logprobs=0)
    bias = Request(temperature=0.8, logit_bias={3: 2.5, 5: -3.0}, bad_words=[[4, 4]], logprobs=1)
    minimum = Request(temperature=1.0, min_tokens=6, stop_token_ids=[1], logprobs=0)
    constrained = Request(temperature=1.0, constraint=_parity_automaton(vocab_size))
    seeded = Request(temperature=0.7, top_k=6, seed=11)
    stop = Request(temperature=1.2, stop_token_ids=[2, 7], max_tokens=20)
    stop_string = Request(temperature=1.2, stop=["ji", "lk"], max_tokens=20)
    plain = Request(temperature=1.0, top_p=0.9)
    mixes = {
        "every": [penalties, greedy_pen, bias, minimum, constrained, seeded, stop, plain, stop_string],
        "mixed": [Request(temperature=0.0), Request(temperature=1.4, top_k=3), penalties, Request(temperature=0.5)],
        "penalties": [penalties, greedy_pen],
        "bias": [bias, Request(temperature=1.0, logit_bias={2: 3.0}, logprobs=0)],
        "min-tokens": [minimum, Request(temperature=1.0, min_tokens=4)],
        "logprobs": [Request(temperature=1.0, logprobs=2), penalties],
        "stop": [stop, Request(temperature=1.0, stop_token_ids=[3])],
        "stop-string": [stop_string, Request(temperature=1.0, stop=["gh", "e"], min_tokens=3)],
        "eos": [Request(temperature=1.0, max_tokens=5, logit_bias={0: 2.5}), Request(temperature=1.0, logit_bias={0: 2.0})],
        "constraint": [constrained, Request(temperature=0.8, constraint=_parity_automaton(vocab_size))],
        "seed": [seeded, Request(temperature=1.0, seed=3)],
    }
    if mix not in mixes:
        raise InvalidArgument(f"mix: expected one of {sorted(mixes)}, got {mix!r}")
    return mixes[mix]


REQUEST_SLIPS = {s.name: s for s in (
    RequestSlip("rows-params-swapped", RowsParamsSwapped, "each row sampled with the next row's request", "law",
                "mixed"),
    RequestSlip("greedy-argmax-other-row", GreedyArgmaxOfOtherRow,
                "greedy rows take the argmax of another row's logits", "law", "mixed"),
    RequestSlip("penalties-ignored", PenaltiesIgnored, "repetition, presence and frequency penalties dropped", "law",
                "penalties"),
    RequestSlip("penalty-last-accepted-only", PenaltyLastAcceptedOnly,
                "the penalty state gets the last token of each step only", "law", "penalties"),
    RequestSlip("penalty-counts-rejected", PenaltyCountsRejected,
                "the penalty state counts rejected drafts and accepted tokens twice", "law", "penalties"),
    RequestSlip("bias-bonus-only", BiasBonusOnly, "the logit bias applied at the bonus position only", "law", "bias"),
    RequestSlip("min-tokens-in-steps", MinTokensInSteps, "min_tokens counted in steps", "law", "min-tokens"),
    RequestSlip("draft-logprobs", DraftLogprobs, "the draft's log-probabilities returned for accepted tokens",
                "logprobs", "logprobs"),
    RequestSlip("logprob-zero", LogprobZero, "log-probability 0.0 for every token", "logprobs", "logprobs"),
    RequestSlip("processed-logprobs", ProcessedLogprobs, "processed log-probabilities where raw ones are declared",
                "logprobs", "logprobs"),
    RequestSlip("keeps-after-stop", KeepsAfterStop, "tokens kept after a stop token inside an accepted block",
                "stopping", "stop"),
    RequestSlip("keeps-after-stop-string", KeepsAfterStopString,
                "tokens kept after a stop string completed inside an accepted block", "stopping", "stop-string"),
    RequestSlip("max-tokens-masks-eos", MaxTokensMasksEos,
                "a max_tokens cap inside an accepted run hides the end of sequence", "stopping", "eos"),
    RequestSlip("after-eos-mid-block", AfterEosMidBlock, "tokens emitted after an end of sequence accepted mid-block",
                "stopping", "eos"),
    RequestSlip("constraint-first-position-only", ConstraintFirstPositionOnly,
                "the constraint's mask applied at the first position of each block only", "constraint", "constraint"),
    RequestSlip("seed-ignored", SeedIgnored, "a per-request seed ignored (the batch's one stream)", "determinism",
                "seed"),
)}


def _audit(engine_cls: type, mix: str, rounds: int, seed: int, vocab_size: int, draft_len: int,
           max_new_tokens: int, **kwargs):
    pair = request_pair(vocab_size, seed=0)
    engine = engine_cls(pair, draft_len=draft_len)
    prompts = request_prompts(vocab_size)
    options = dict(vocab_size=vocab_size, max_new_tokens=max_new_tokens, rounds=rounds, seed=seed, eos_token_id=0,
                   requests=feature_requests(mix, vocab_size), progress=False, batch_size=4)
    options.update(kwargs)
    return audit_generation(engine, pair.logits_scorer(), prompts, **options)


def audit_request_slip(name: str, rounds: int = 1, seed: int = 0, *, correct: bool = False, vocab_size: int = 12,
                       draft_len: int = 3, max_new_tokens: int = 24, **kwargs):
    """Audit slip ``name`` (or, with ``correct=True``, the correct loop on the same requests)."""
    if name not in REQUEST_SLIPS:
        raise InvalidArgument(f"name: expected one of {sorted(REQUEST_SLIPS)}, got {name!r}")
    slip = REQUEST_SLIPS[name]
    return _audit(RequestSpecEngine if correct else slip.engine, slip.requests, rounds, seed, vocab_size, draft_len,
                  max_new_tokens, **kwargs)


def audit_every_feature(rounds: int = 1, seed: int = 0, *, vocab_size: int = 12, draft_len: int = 3,
                        max_new_tokens: int = 24, **kwargs):
    """Audit the correct loop with every feature on (penalties, bias, bad words, min_tokens, stop tokens,
    max_tokens, a constraint, seeds, logprobs, greedy beside sampled rows)."""
    return _audit(RequestSpecEngine, "every", rounds, seed, vocab_size, draft_len, max_new_tokens, **kwargs)


def found(result, slip: RequestSlip) -> bool:
    """Whether ``result`` found ``slip`` by what is meant to find it (the determinism line for a seed slip)."""
    if slip.check == "determinism":
        return bool(result.determinism) and bool(result.determinism.get("differing"))
    return result.verdict == "FINDING"

