"""Argument types, the argument groups several commands share, and the suites ``--suite`` takes by name."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from spectr_audit import defaults
from spectr_audit.contract.sampling import order_names
from spectr_audit.errors import InvalidArgument
from spectr_audit.run.budget import parse_memory
from spectr_audit.run.suite import builtin_suites, model_from_spec


class _UsageError(Exception):
    pass


def parse_model_spec(text: str, argument: str, max_memory=None, inputs: str = "probs"):
    """Parse ``0.6,0.4`` or ``markov:vocab_size=3,seed=1`` / ``dirichlet:vocab_size=8,seed=2`` into a model.

    Integral numbers may be written as floats (``vocab_size=1e6``); a model whose tables exceed
    ``max_memory`` is refused before it is built.  With ``inputs="logits"`` (``--logits``) a
    comma-separated list is a context-free model's raw logits (``-inf`` allowed).
    """
    text = text.strip()
    if ":" in text:
        kind, _, rest = text.partition(":")
        params: dict = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise _UsageError(f"{argument}: expected key=value in {item!r} (from {text!r})")
            try:
                params[key.strip()] = int(value)
            except ValueError:
                try:
                    number = float(value)
                except ValueError:
                    raise _UsageError(f"{argument}: {key}={value!r} is not a number") from None
                # 1e9 means the integer 1000000000 (a size or a seed), not a float to be refused as one
                params[key.strip()] = int(number) if number.is_integer() else number
        return model_from_spec({kind.strip(): params}, argument, max_memory=max_memory, inputs=inputs)
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        what = "logits (e.g. 1.2,0.3,-inf)" if inputs == "logits" else "probabilities (e.g. 0.6,0.4)"
        raise _UsageError(
            f"{argument}: expected comma-separated {what} or kind:key=value,... "
            f"(markov:vocab_size=3,seed=1 or dirichlet:vocab_size=8,seed=2), got {text!r}"
        ) from None
    return model_from_spec(values, argument, max_memory=max_memory, inputs=inputs)


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _number_in(text: str, low: float, high: float, low_open: bool, high_open: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _temperature(text: str) -> float:
    return _number_in(text, 0.0, float("inf"), False, True, "a finite temperature >= 0 (0: greedy)")


def _top_k(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0 (0 disables top-k)")


def _top_p(text: str) -> float:
    return _number_in(text, 0.0, 1.0, True, False, "a number in (0, 1] (1 disables top-p)")


def _min_p(text: str) -> float:
    return _number_in(text, 0.0, 1.0, False, False, "a number in [0, 1] (0 disables min-p)")


def _add_sampling_params(p: argparse.ArgumentParser, logits: bool) -> None:
    """The sampling parameters the verifier is held to (docs/sampling.md)."""
    group = p.add_argument_group(
        "sampling parameters", "hold the verifier to the law the engine's sampler draws from with these parameters "
        "(docs/sampling.md); a verifier that takes logits is handed the raw logits and the parameters"
        + ("" if logits else "; they replace every chain case's own"))
    group.add_argument("--temperature", type=_temperature, default=None, metavar="T",
                       help="temperature (0: greedy; default 1)")
    group.add_argument("--top-k", type=_top_k, default=None, metavar="K", help="top-k (default 0: off)")
    group.add_argument("--top-p", type=_top_p, default=None, metavar="P", help="top-p (default 1: off)")
    group.add_argument("--min-p", type=_min_p, default=None, metavar="M", help="min-p (default 0: off)")
    group.add_argument("--order", choices=order_names(), default=None,
                       help="the engine whose processing order applies (default vllm)")
    if logits:
        group.add_argument("--logits", action="store_true",
                           help="--draft and --target lists are raw logits (write --draft=-1.5,0.2 when one starts "
                           "with a minus sign; -inf allowed), not probabilities")


def _sampling_overrides(args) -> dict:
    """The sampling keys given on the command line (suite.SAMPLING_KEYS), none when none was given."""
    values = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
              "order": args.order, "inputs": "logits" if getattr(args, "logits", False) else None}
    return {key: value for key, value in values.items() if value is not None}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=defaults.SEED, help=f"seed of every random draw (default {defaults.SEED})")


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


def _add_resources(p: argparse.ArgumentParser, timeout: bool = True) -> None:
    """The memory budget and the per-call verifier time limit."""
    p.add_argument("--max-memory", type=_memory, default=None, metavar="SIZE",
                   help="memory budget, e.g. 4GiB, 500M or 1e9 (bytes): an audit, model or sample plan that would "
                   f"need more is refused (exit 2) before anything is allocated (default "
                   # argparse %-formats help: the percent sign is written %%
                   f"{100 * defaults.MAX_MEMORY_FRACTION:.0f}%% of this machine's memory)")
    if timeout:
        p.add_argument("--verifier-timeout", type=_timeout, default=defaults.VERIFIER_TIMEOUT, metavar="SECONDS",
                       help="stop a verifier call that runs longer (the audit becomes an error result, the others "
                       f"are kept; 0: no limit; default {defaults.VERIFIER_TIMEOUT:g})")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _add_sampling(p: argparse.ArgumentParser, gate=None) -> None:
    """The statistical audits' budgets, the certification, and failing on inconclusive results."""
    if not any(a.dest == "max_samples" for a in p._actions):
        p.add_argument("--max-samples", type=_positive_int, default=None, metavar="N",
                       help="sample budget of each statistical audit (default: planned by power analysis)")
    p.add_argument("--max-seconds", type=_positive_seconds, default=None, metavar="S",
                   help="wall-time budget of each statistical audit's sampling (default: none); a result cut "
                   "short below its planned power is INCONCLUSIVE")
    p.add_argument("--certify-tv", type=_probability, default=None, metavar="EPS",
                   help="certify TV <= EPS: a black box is CERTIFIED when the anytime-valid upper confidence bound "
                   "(level 1 - alpha) on its TV on the audited partition is at most EPS (the audit stops as soon as "
                   "certified or refuted); a verifier with an exact law by its exact TV; a result not certified "
                   "fails the run")
    p.add_argument("--device", default="cpu", help="device of the drafting, verification and counting (default cpu; "
                   "under torchrun, cuda selects NCCL and the process's LOCAL_RANK GPU)")
    (gate or p).add_argument("--fail-on-inconclusive", action="store_true",
                             help="exit 3 when every result went as expected but some were INCONCLUSIVE (achieved "
                             "minimum detectable TV above the planned one: a budget cut the sample short)")


#: The real-language-model suite: not a TOML file but SmolLM2-135M in the loop (an optional extra).
REAL_LM_SUITE = "real-lm"
#: The built-in suite of generation audits (``spectr-audit generation --suite generation``).
GENERATION_SUITE = "generation"


def suite_names() -> list:
    """Every suite ``--suite`` takes by name: the TOML suites shipped, then the real-LM suite.

    The one list that ``spectr-audit list`` prints and a bad ``--suite`` is told.
    """
    return builtin_suites() + [REAL_LM_SUITE]


def _check_suite_name(text: str) -> None:
    """A ``--suite`` that is neither a suite name nor a file: a usage error listing every suite (with a near match)."""
    names = suite_names()
    if text in names or text.endswith(".toml") or Path(text).exists():
        return  # a name, or a file for load_suite to read (and to complain about)
    close = difflib.get_close_matches(text, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise _UsageError(f"--suite: {text!r} is neither a suite name{hint} nor a .toml file; suites: {', '.join(names)}")
