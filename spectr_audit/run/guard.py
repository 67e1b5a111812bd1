"""Guards around a third party's verifier: a per-call time limit, and a probe of its contract.

Every path that runs a verifier under audit (:func:`~spectr_audit.run.runner.audit_case`, hence
``spectr-audit audit`` / ``run`` and :func:`spectr_audit.audit`, and
:func:`~spectr_audit.run.conformance.check_verifier`) goes through these.

The time limit
--------------
:func:`time_limited` hands out the verifier as a
:class:`~spectr_audit.contract.limited.TimeLimitedVerifier` (a tree verifier as a
:class:`~spectr_audit.contract.limited.TimeLimitedTreeVerifier`): an adapter of the contract whose every call of
``verify`` and ``output_probs`` (and ``verify_logits`` / ``output_probs_logits``, or a tree verifier's
``verify_tree`` / ``tree_output_probs``) raises :class:`VerifierTimeout` when it runs longer than ``seconds``.
It declares what the verifier declares and is called as any verifier is, from the audits below; no object
stands in for the verifier's class, and the verifier's own object is not modified (a frozen dataclass or a
class with ``__slots__`` is limited alike).  The runner turns the timeout into an error result naming the
verifier and the case, and the other results are kept.  The mechanism:

* in the main thread on POSIX, ``signal.setitimer(ITIMER_REAL)`` and a ``SIGALRM`` handler that
  raises: it stops pure-Python loops and interrupts blocking calls such as ``time.sleep``.  A
  timer armed by someone else (pytest-timeout, say) is saved and re-armed with what is left of it;
* elsewhere (another thread, or no ``SIGALRM``), a watchdog thread that raises the exception in
  the calling thread with ``PyThreadState_SetAsyncExc``: it stops pure-Python code at its next
  bytecode, but not a blocking system call until that returns.

Limits: both deliver the exception between Python bytecodes, so a C extension that never returns
to the interpreter (a torch kernel that spins, native code holding the GIL) is not stopped until
it does.  Run such code in a subprocess with its own timeout.

The contract probe
------------------
:func:`probe_checks` runs the verifier on a small drafted batch of the case (and on a batch whose
every probability is positive, so that an in-place change cannot hide behind a zero entry) and
returns two checks: ``inputs-unchanged`` (``verify`` and ``output_probs`` leave their arguments
as they were, compared bit for bit with copies) and ``deterministic`` (two calls with a
``torch.Generator`` seeded alike agree; a verifier that draws from torch's global generator
instead of the one it is given fails it).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch

from spectr_audit import _deadline, defaults
from spectr_audit.contract.convert import as_verifier
from spectr_audit.contract.limited import TimeLimitedTreeVerifier, TimeLimitedVerifier
from spectr_audit.contract.tree_verifier import TreeVerifier
from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import ContextFreeModel, contexts_from
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.results import Check

__all__ = ["VerifierTimeout", "call_limit", "check_timeout", "dense_mutations", "probe_checks", "time_limited"]


class VerifierTimeout(VerifierError):
    """A call of a verifier under audit ran past the per-call time limit."""


def check_timeout(seconds: Any, argument: str = "verifier_timeout") -> Optional[float]:
    """``None`` or 0 -> no limit; a positive finite number -> seconds; anything else InvalidArgument."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"{argument}: expected a number of seconds >= 0 (0: no limit), got {seconds!r}")
    return float(seconds) or None


def call_limit(seconds: Optional[float], message: str):
    """Raise :class:`VerifierTimeout` (with ``message``) in the block when it runs past ``seconds``.

    Nested limits: the outermost one holds (an inner call runs within the outer's time).  The
    mechanism is :func:`spectr_audit._deadline.call_limit`'s.
    """
    return _deadline.call_limit(seconds, message, VerifierTimeout)


#: How a timeout's message says where the limit comes from.
_HINT = "the per-call limit, --verifier-timeout / verifier_timeout"


@contextlib.contextmanager
def time_limited(verifier: Any, seconds: Optional[float]) -> Iterator[Any]:
    """Within the block, the yielded verifier limits every call of ``verifier``'s methods to ``seconds``.

    With a limit it is a :class:`~spectr_audit.contract.limited.TimeLimitedTreeVerifier` for a tree verifier,
    else a :class:`~spectr_audit.contract.limited.TimeLimitedVerifier` (of ``verifier`` as
    :func:`~spectr_audit.contract.convert.as_verifier` gives it); the caller audits that, never ``verifier``
    itself, which is left untouched.  Without (None or 0), ``verifier`` itself.
    """
    if not seconds:
        yield verifier
    elif isinstance(verifier, TreeVerifier):
        yield TimeLimitedTreeVerifier(verifier, seconds, VerifierTimeout, _HINT)
    else:
        chain = verifier if isinstance(verifier, Verifier) else as_verifier(verifier)
        yield TimeLimitedVerifier(chain, seconds, VerifierTimeout, _HINT)


# ---------------------------------------------------------------------------------------------
# The contract probe
# ---------------------------------------------------------------------------------------------


def _dense_models(vocab_size: int, seed: int):
    """A context-free pair over the case's vocabulary with every probability positive."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.rand(vocab_size, generator=generator, dtype=torch.float64) + 0.5
    target = torch.rand(vocab_size, generator=generator, dtype=torch.float64) + 0.5
    return ContextFreeModel(draft / draft.sum()), ContextFreeModel(target / target.sum())


def dense_mutations(verifier: Any, vocab_size: int, num_drafts: int, draft_len: int, seed: int = 0,
                    rows: int = defaults.PROBE_ROWS) -> list[str]:
    """What ``verifier.verify`` modifies in place on drafts whose every probability is positive (empty: nothing).

    A zero probability hides an in-place scaling or clamping of that entry; here none is zero.
    """
    dense_draft, dense_target = _dense_models(vocab_size, seed)
    batch = draft(dense_draft, dense_target, torch.zeros(rows, 0, dtype=torch.int64), num_drafts, draft_len,
                  torch.Generator().manual_seed(seed), verifier.draft_scheme)
    inputs = (batch.draft_tokens, batch.draft_probs, batch.target_probs)
    originals = tuple(t.clone() for t in inputs)
    verifier.verify(*inputs, torch.Generator().manual_seed(seed))
    changed = _changed(originals, inputs)
    return [f"verify modified {', '.join(changed)} in place (on drafts with every probability positive)"] if changed else []


def _batches(verifier, case, seed: int, rows: int) -> list:
    contexts = contexts_from(case.prefix, torch.zeros(rows, 0, dtype=torch.int64))
    generator = torch.Generator().manual_seed(seed)
    batches = [draft(case.draft_model, case.target_model, contexts, case.num_drafts, case.draft_len, generator,
                     verifier.draft_scheme)]
    dense_draft, dense_target = _dense_models(case.vocab_size, seed)
    batches.append(draft(dense_draft, dense_target, torch.zeros(rows, 0, dtype=torch.int64), case.num_drafts,
                         case.draft_len, generator, verifier.draft_scheme))
    return batches


def _changed(originals, inputs) -> list[str]:
    names = ("draft_tokens", "draft_probs", "target_probs")
    return [n for n, before, after in zip(names, originals, inputs)
            if before.shape != after.shape or not torch.equal(before, after)]


def _fields(output) -> tuple:
    if isinstance(output, VerifyOutput):
        return output.num_accepted, output.draft_index, output.next_token
    return tuple(output)


def probe_checks(verifier: Any, case: Any, seed: int = 0, rows: int = defaults.PROBE_ROWS) -> list:
    """``inputs-unchanged`` and ``deterministic`` checks of ``verifier`` on small batches of ``case``.

    Returns a list of :class:`~spectr_audit.results.Check`.  Errors of the verifier propagate
    (the caller makes them an error result).
    """
    if getattr(case, "tree", None) is not None or not isinstance(verifier, Verifier):
        return []  # draft trees have their own contract
    mutated: list[str] = []
    differs: list[str] = []
    for label, batch in zip(("the case's drafts", "drafts with every probability positive"),
                            _batches(verifier, case, seed, rows)):
        inputs = (batch.draft_tokens, batch.draft_probs, batch.target_probs)
        originals = tuple(t.clone() for t in inputs)
        first = _fields(verifier.verify(*inputs, torch.Generator().manual_seed(seed)))
        changed = _changed(originals, inputs)
        if changed:
            if not mutated:
                mutated.append(f"verify modified {', '.join(changed)} in place (on {label})")
            inputs = tuple(t.clone() for t in originals)
        second = _fields(verifier.verify(*inputs, torch.Generator().manual_seed(seed)))
        rows_differ = [name for name, a, b in zip(("num_accepted", "draft_index", "next_token"), first, second)
                       if not torch.equal(torch.as_tensor(a), torch.as_tensor(b))]
        if rows_differ and not differs:
            differs.append(f"two verify calls with torch.Generator().manual_seed({seed}) returned different "
                           f"{', '.join(rows_differ)} (on {label}); does it draw from the global generator?")
        if verifier.has_exact_law:
            inputs = tuple(t.clone() for t in originals)
            law_first = verifier.output_probs(*inputs)
            changed = _changed(originals, inputs)
            if changed and not mutated:
                mutated.append(f"output_probs modified {', '.join(changed)} in place (on {label})")
            law_second = verifier.output_probs(*(t.clone() for t in originals))
            if not differs and not torch.equal(torch.as_tensor(law_first), torch.as_tensor(law_second)):
                differs.append(f"two output_probs calls on the same inputs returned different laws (on {label})")
        if mutated and differs:
            break
    return [
        Check("inputs-unchanged", not mutated, None, None,
              "; ".join(mutated) if mutated else "verify and output_probs leave their inputs as they were"),
        Check("deterministic", not differs, None, None,
              "; ".join(differs) if differs else "calls with generators seeded alike agree"),
    ]
