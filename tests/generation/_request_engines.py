"""Small engines that take whole requests, for the whole-request checks of the generation audit.

:class:`RequestSampler` samples each row, token by token, from its request's law over its own history
(:func:`~spectr_audit.contract.history.process_request_step` on a :class:`ToyLM`'s logits): correct by
construction, the engine every check must pass.  Each broken subclass changes one thing, as an engine slip
would; the tests assert that the check meant for it finds it.
"""

from __future__ import annotations

import torch

from spectr_audit.contract.history import process_request_step
from spectr_audit.generation.contract import GenerationOutput
from spectr_audit.generation.library.toy import ToyPair

EOS = 0


class RequestSampler:
    """A correct non-speculative engine with whole requests (raw logprobs, top-n, finish reasons, usage)."""

    accepts_requests = True
    seeded = True
    name = "request-sampler"
    logprobs_mode = "raw"

    def __init__(self, vocab_size: int = 10, seed: int = 0, order: str = "vllm"):
        self.pair = ToyPair(vocab_size=vocab_size, seed=seed, order=order)
        self.model = self.pair.target
        self.order = order
        self.vocab_size = vocab_size

    # one step of one row: its law, the token drawn, what is reported
    def law(self, logits, prompt, emitted, request, row):
        return process_request_step(logits, prompt, emitted, request, self.order, eos_token_id=EOS)

    def draw(self, law, generator):
        return int(torch.multinomial(law.float(), 1, generator=generator))

    def reported_logprob(self, logits, law, token):
        return float(torch.log_softmax(logits, -1)[token])

    def top_table(self, logits, law):
        """The log-probabilities the top-n lists are read from."""
        return torch.log_softmax(logits, -1)

    def stop_ids(self, request):
        return request.stop_ids(EOS)

    def cap(self, request, limit):
        return limit if request.max_tokens is None else min(limit, request.max_tokens)

    def finish(self, row, request, stopped, limit):
        return "stop" if stopped else "length"

    def generator_for(self, request, seed, row):
        g = torch.Generator()
        g.manual_seed(request.seed if request.seed is not None else (seed * 1000 + row) % 2**62)
        return g

    def generate(self, prompts, max_new_tokens, seed, requests=None):
        from spectr_audit.contract.requests import Request

        requests = requests or [Request()] * len(prompts)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        rows, logprobs, tops, finishes, usage = [], [], [], [], []
        for r, (prompt, request, limit) in enumerate(zip(prompts, requests, limits)):
            generator = self.generator_for(request, seed, r)
            state = self.model.start(prompt)
            emitted, lps, top, stopped = [], [], [], False
            for _ in range(self.cap(request, limit)):
                logits = self.model.logits(state)
                law = self.law(logits, prompt, emitted, request, r)
                token = self.draw(law, generator)
                emitted.append(token)
                lps.append(self.reported_logprob(logits, law, token))
                if request.logprobs:
                    values, ids = self.top_table(logits, law).topk(request.logprobs)
                    top.append({int(i): float(v) for i, v in zip(ids, values)})
                state = self.model.step(state, token)
                if token in self.stop_ids(request):
                    stopped = True
                    break
            rows.append(emitted)
            logprobs.append(lps if request.logprobs is not None else None)
            tops.append(top if request.logprobs else None)
            finishes.append(self.finish(emitted, request, stopped, limit))
            usage.append(len(emitted))
        return GenerationOutput(rows, logprobs=logprobs, top_logprobs=tops, finish_reasons=finishes,
                                completion_tokens=usage, logprobs_mode=self.logprobs_mode)

    def score(self, prompts, continuations):
        return self.pair.logits_scorer()(prompts, continuations)


class PenaltiesIgnored(RequestSampler):
    """Samples every row as if it carried no penalty."""

    def law(self, logits, prompt, emitted, request, row):
        import dataclasses

        plain = dataclasses.replace(request, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        return super().law(logits, prompt, emitted, plain, row)


class ProcessedLogprobs(RequestSampler):
    """Reports the processed law's log-probability where raw ones are declared."""

    def reported_logprob(self, logits, law, token):
        return float(torch.log(law[token]))


class ZeroLogprobs(RequestSampler):
    """Reports log-probability 0.0 for every token."""

    def reported_logprob(self, logits, law, token):
        return 0.0


class GoesOnAfterStop(RequestSampler):
    """Does not stop at a stop token."""

    def stop_ids(self, request):
        return ()


class MinTokensInSteps(RequestSampler):
    """Counts min_tokens as half the tokens (as an engine counting steps of two would)."""

    def law(self, logits, prompt, emitted, request, row):
        import dataclasses

        return super().law(logits, prompt, emitted, dataclasses.replace(request, min_tokens=request.min_tokens // 2),
                           row)


class WrongFinishReason(RequestSampler):
    def finish(self, row, request, stopped, limit):
        return "length"


class SeedIgnored(RequestSampler):
    """Draws every row from one stream of the batch, whatever its seed."""

    def generate(self, prompts, max_new_tokens, seed, requests=None):
        self._shared = torch.Generator()
        self._shared.manual_seed(seed % 2**62)
        return super().generate(prompts, max_new_tokens, seed, requests)

    def generator_for(self, request, seed, row):
        return self._shared


class MaskedLogprobs(RequestSampler):
    """Returns, as vLLM does under structured outputs, the log-softmax of the raw logits over the tokens the law
    can draw (for requests whose only filter is a constraint: the tokens the constraint allows)."""

    logprobs_mode = "raw-masked"

    def top_table(self, logits, law):
        return torch.log_softmax(logits.masked_fill(law == 0, float("-inf")), -1)

    def reported_logprob(self, logits, law, token):
        return float(self.top_table(logits, law)[token])


class MaskedLogprobsDeclaredRaw(MaskedLogprobs):
    """The same log-probabilities declared raw."""

    logprobs_mode = "raw"
