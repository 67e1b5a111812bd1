"""Verifiers for the worker-process tests, importable by spawned workers."""

from __future__ import annotations

import os

from spectr_audit.verifiers.speculative import SpeculativeSampling


class DiesOnToken3(SpeculativeSampling):
    """Speculative sampling whose process exits (as a crashed extension would) on a draft of token 3."""

    name = "dies-on-token-3"

    def _verify(self, draft_tokens, draft_probs, target_probs, generator):
        if bool((draft_tokens == 3).any()):
            os._exit(3)
        return super()._verify(draft_tokens, draft_probs, target_probs, generator)


class RaisesOnToken3(SpeculativeSampling):
    name = "raises-on-token-3"

    def _verify(self, draft_tokens, draft_probs, target_probs, generator):
        if bool((draft_tokens == 3).any()):
            raise ZeroDivisionError("token 3")
        return super()._verify(draft_tokens, draft_probs, target_probs, generator)


def make_speculative():
    return SpeculativeSampling()
