"""The pytest plugin's options and session state: command-line options, ini keys, the settings
``pytest_configure`` reads from them, and the records the session's audits leave in ``config.stash``.

:mod:`spectr_audit.plugin` imports this module at pytest start, so it is as light as the plugin:
pytest, the standard library, :mod:`spectr_audit.defaults`, :mod:`spectr_audit.run.gate` and
:mod:`spectr_audit.run.selection` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import pytest

from spectr_audit import defaults
from spectr_audit.errors import InvalidArgument
from spectr_audit.run.gate import add_gate_arguments, parse_threshold
from spectr_audit.run.selection import parse_values

#: The name of the plugin's marker.
MARKER = "spectr_audit"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The session's settings: command-line options over ini keys over the defaults."""

    seed: int = defaults.SEED
    num_samples: int = defaults.CHECK_SAMPLES
    alpha: float = defaults.ALPHA
    report: Optional[Path] = None
    thresholds: tuple = ()
    max_seconds: Optional[float] = None
    certify_tv: Optional[float] = None
    fail_on_inconclusive: bool = False
    #: The K and L the session's audits run at (``--spectr-num-drafts`` / ``--spectr-draft-len``); ``None``:
    #: each check's own, and a suite's every case the verifier supports.
    num_drafts: Optional[tuple] = None
    draft_len: Optional[tuple] = None


@dataclasses.dataclass
class Record:
    """One result of a verifier audit, with the test that ran it and the gate's violations on it."""

    nodeid: str
    result: Any
    gate_violations: tuple = ()


@dataclasses.dataclass
class GenerationRecord:
    """One generation audit's result, with the test that ran it and its verdict line."""

    nodeid: str
    #: ``GenerationAuditResult.to_dict()`` (plain JSON: it crosses pytest-xdist's channel as it is)
    result: dict
    line: str


#: Where the session's settings and records live in ``config.stash``.
SETTINGS = pytest.StashKey[Settings]()
RECORDS = pytest.StashKey[list]()
GENERATION_RECORDS = pytest.StashKey[list]()
#: The key of a worker's records in pytest-xdist's ``workeroutput``.
WORKER_KEY = "spectr_audit_records"
WORKER_GENERATION_KEY = "spectr_audit_generation_records"


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def _int(text: str, argument: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{argument}: expected an integer, got {text!r}") from None


def _seed(text: str, argument: str = "--spectr-seed") -> int:
    value = _int(text, argument)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{argument}: expected an integer >= 0, got {text!r}")
    return value


def _samples(text: str, argument: str = "--spectr-samples") -> int:
    value = _int(text, argument)
    if value < 100:
        raise argparse.ArgumentTypeError(f"{argument}: expected an integer >= 100, got {text!r}")
    return value


def _alpha(text: str, argument: str = "--spectr-alpha") -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{argument}: expected a number in (0, 1), got {text!r}") from None
    if not (math.isfinite(value) and 0 < value < 1):
        raise argparse.ArgumentTypeError(f"{argument}: expected a number in (0, 1), got {text!r}")
    return value


def _seconds(text: str, argument: str = "--spectr-max-seconds") -> Optional[float]:
    if text in ("", None):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{argument}: expected a positive number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{argument}: expected a positive number of seconds, got {text!r}")
    return value


def _tolerance(text: str, argument: str = "--spectr-certify-tv") -> Optional[float]:
    if text in ("", None):
        return None
    return _alpha(text, argument)


def _values(text: str, argument: str) -> Optional[tuple]:
    if text in ("", None):
        return None
    try:
        return parse_values(text, argument)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spectr-audit", "spectr-audit: audit speculative-decoding verifiers")
    group.addoption("--spectr-seed", dest="spectr_seed", type=_seed, default=None, metavar="N",
                    help=f"seed of every random draw in audits (ini: spectr_audit_seed; default {defaults.SEED})")
    group.addoption("--spectr-samples", "--spectr-max-samples", dest="spectr_samples", type=_samples, default=None,
                    metavar="N", help="sample budget of each statistical test (ini: spectr_audit_samples; "
                    f"default {defaults.CHECK_SAMPLES})")
    group.addoption("--spectr-max-seconds", dest="spectr_max_seconds", type=_seconds, default=None, metavar="S",
                    help="wall-time budget of each statistical audit's sampling (ini: spectr_audit_max_seconds)")
    group.addoption("--spectr-certify-tv", dest="spectr_certify_tv", type=_tolerance, default=None, metavar="EPS",
                    help="certify TV <= EPS on every case: a check passes only when every case is CERTIFIED "
                    "(ini: spectr_audit_certify_tv)")
    group.addoption("--spectr-fail-on-inconclusive", dest="spectr_fail_on_inconclusive", action="store_true",
                    default=None, help="fail a check whose results held only below their planned power "
                    "(INCONCLUSIVE) (ini: spectr_audit_fail_on_inconclusive)")
    group.addoption("--spectr-alpha", dest="spectr_alpha", type=_alpha, default=None, metavar="ALPHA",
                    help=f"false-alarm rate of each check (ini: spectr_audit_alpha; default {defaults.ALPHA:g})")
    group.addoption("--spectr-report", dest="spectr_report", default=None, metavar="PATH",
                    help="write every audit of the session to PATH: .json, .md, .html or .xml (JUnit) "
                    "(ini: spectr_audit_report)")
    group.addoption("--spectr-num-drafts", dest="spectr_num_drafts", default=None, metavar="K",
                    type=lambda text: _values(text, "--spectr-num-drafts"),
                    help="audit at these K only (e.g. 1, 1,2 or 1-3): the fixture's checks and suite audits "
                    "(ini: spectr_audit_num_drafts; default: each check's own, every K a verifier supports)")
    group.addoption("--spectr-draft-len", dest="spectr_draft_len", default=None, metavar="L",
                    type=lambda text: _values(text, "--spectr-draft-len"),
                    help="audit at these L only (e.g. 3 or 1-2) (ini: spectr_audit_draft_len)")
    add_gate_arguments(group.addoption, prefix="--spectr-", dest="spectr_gate")
    parser.addini("spectr_audit_num_drafts", "spectr-audit: the K the session's audits run at (e.g. 1,2)", default="")
    parser.addini("spectr_audit_draft_len", "spectr-audit: the L the session's audits run at (e.g. 3)", default="")
    parser.addini("spectr_audit_seed", f"spectr-audit: seed of every random draw (default {defaults.SEED})",
                  default=str(defaults.SEED))
    parser.addini("spectr_audit_samples", "spectr-audit: sample budget of each statistical test",
                  default=str(defaults.CHECK_SAMPLES))
    parser.addini("spectr_audit_alpha", "spectr-audit: false-alarm rate of each check", default=repr(defaults.ALPHA))
    parser.addini("spectr_audit_report", "spectr-audit: path of the session report (.json/.md/.html/.xml)",
                  default="")
    parser.addini("spectr_audit_gate", "spectr-audit: gate thresholds 'METRIC OP NUMBER', one per line",
                  type="linelist", default=[])
    parser.addini("spectr_audit_max_seconds", "spectr-audit: wall-time budget of each statistical audit", default="")
    parser.addini("spectr_audit_certify_tv", "spectr-audit: certify TV <= this on every case", default="")
    parser.addini("spectr_audit_fail_on_inconclusive", "spectr-audit: fail checks with INCONCLUSIVE results",
                  type="bool", default=False)


def _from_ini(config: pytest.Config, key: str, convert) -> Any:
    raw = config.getini(key)
    try:
        return convert(str(raw).strip(), key)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {exc}") from None


def _writable_report(path: Path, source: str) -> Path:
    """The session report's path, or a usage error now (not a traceback after the whole session ran)."""
    import os

    if path.is_dir():
        raise pytest.UsageError(f"{source}: {str(path)!r} is a folder; give the path of the report file "
                                "(.json, .md, .html or .xml)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise pytest.UsageError(f"{source}: {str(path)!r} lies under {str(parent)!r}, which is a file, "
                                        "not a folder")
            import tempfile

            try:  # a real probe: os.access says yes to root, and knows nothing of read-only file systems
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as exc:
                raise pytest.UsageError(f"{source}: {str(path)!r} cannot be written: the folder {str(parent)!r} "
                                        f"does not take new files ({exc.strerror or exc})") from None
            break
    if path.exists() and not os.access(path, os.W_OK):
        raise pytest.UsageError(f"{source}: {str(path)!r} exists and is not writable")
    return path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(verifier=None, *, num_drafts=..., draft_len=..., suite=..., name=..., output_probs=..., "
        "draft_scheme=..., tree=..., params=..., order=..., temperature=..., top_k=..., top_p=..., min_p=...): with a "
        "verifier, audit it after the test body (the test fails if the audit does); without, supply defaults to the "
        "spectr_audit fixture.",
    )
    option = config.option
    seed = option.spectr_seed if getattr(option, "spectr_seed", None) is not None else _from_ini(
        config, "spectr_audit_seed", _seed)
    samples = option.spectr_samples if getattr(option, "spectr_samples", None) is not None else _from_ini(
        config, "spectr_audit_samples", _samples)
    alpha = option.spectr_alpha if getattr(option, "spectr_alpha", None) is not None else _from_ini(
        config, "spectr_audit_alpha", _alpha)
    report: Optional[Path] = None
    if getattr(option, "spectr_report", None):
        report = _writable_report(Path(option.spectr_report).resolve(), "--spectr-report")
    elif str(config.getini("spectr_audit_report")).strip():
        base = config.inipath.parent if config.inipath is not None else config.rootpath
        report = _writable_report((base / str(config.getini("spectr_audit_report")).strip()).resolve(),
                                  "ini option spectr_audit_report")
    thresholds = list(getattr(option, "spectr_gate", None) or [])
    for line in config.getini("spectr_audit_gate"):
        if line.strip():
            try:
                thresholds.append(parse_threshold(line, "spectr_audit_gate"))
            except ValueError as exc:
                raise pytest.UsageError(f"ini option {exc}") from None
    max_seconds = (option.spectr_max_seconds if getattr(option, "spectr_max_seconds", None) is not None
                   else _from_ini(config, "spectr_audit_max_seconds", _seconds))
    certify_tv = (option.spectr_certify_tv if getattr(option, "spectr_certify_tv", None) is not None
                  else _from_ini(config, "spectr_audit_certify_tv", _tolerance))
    fail_on_inconclusive = (bool(option.spectr_fail_on_inconclusive)
                            if getattr(option, "spectr_fail_on_inconclusive", None) is not None
                            else bool(config.getini("spectr_audit_fail_on_inconclusive")))
    shape = {}
    for key in ("num_drafts", "draft_len"):
        given = getattr(option, f"spectr_{key}", None)
        shape[key] = given if given is not None else _from_ini(config, f"spectr_audit_{key}", _values)
    config.stash[SETTINGS] = Settings(seed, samples, alpha, report, tuple(thresholds), max_seconds, certify_tv,
                                        fail_on_inconclusive, **shape)
    config.stash[RECORDS] = []
    config.stash[GENERATION_RECORDS] = []
