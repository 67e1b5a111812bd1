"""Every built-in verifier on every device: its sampler against its exact law, the audits, the contract, host syncs.

Parametrised on the device: ``cpu`` always, ``cuda`` when torch sees a GPU (skipped otherwise; on a
GPU machine ``scripts/gpu_check.sh`` runs this file).  On CUDA each verdict is compared with the
CPU's on the same inputs: the sampler's row by row (the same uniforms, drawn from a CPU generator),
the contract checks and the exact audit check by check, the statistical audit by its verdict.

Host syncs: a sampler's hot path must not wait for the GPU (``.item()``, ``bool(tensor)``,
``nonzero``, a copy of host data to the device).  The samplers take shortcuts on the CPU only
(``device.type == "cpu"``), where a host check costs nothing.  On CUDA the check is
``torch.cuda.set_sync_debug_mode("error")`` around one ``verify`` of each built-in; on any machine
the same call runs on ``meta`` tensors (no data: every data-dependent host read fails there, and a
CPU-only shortcut is not taken) under a function mode that also refuses host data copied to the
device.  Built-ins whose hot path still syncs are listed in :data:`KNOWN_SYNCS`, as strict xfails:
a fix makes them pass, and the entry must then go.

Statistical parts: each sampler case is one Pearson test at false-alarm rate 1e-3 with a fixed
seed; each statistical audit runs at the library's alpha (1e-3) with a fixed seed.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from spectr_audit.contract.correction import has_carried_correction
from spectr_audit.contract.randomness import sample_categorical
from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.registry import BUILTIN_VERIFIERS, load_verifier

from tests._stats import pooled_chisquare_pvalue

CUDA = torch.cuda.is_available()
NO_CUDA = "torch sees no CUDA device here; scripts/gpu_check.sh runs this file on a GPU machine"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA))]
BUILTINS = list(BUILTIN_VERIFIERS)

#: Built-ins whose sampler still synchronises with the host on an accelerator, and where.
KNOWN_SYNCS = {
    "kseq": "verifiers/rho_star.py builds constants from host data on the device (torch.tensor(inf, device=...), "
            "the Newton probe ulps): a host-to-device copy, which waits for the stream",
    "spectr-tree": "K-SEQ at every node: the rho_star.py constants, as for kseq",
    "greedy-block-repaired": "JointResidualCorrection.advance returns None when no row carries a correction: "
                             "decided on the host (bool(active.any()))",
    "spectr-gbv-published-alg2": "its carried correction, as for greedy-block-repaired",
    "multi-block": "the node rule runs on the canonical nodes only (nonzero), the priority sweeps stop once "
                   "converged (torch.equal), and the exact rho* solve checks convergence on the host",
}


def _known(name: str):
    reason = KNOWN_SYNCS.get(name)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


SYNC_CASES = [pytest.param(name, marks=_known(name)) for name in BUILTINS]


def _shape(verifier: Verifier) -> tuple[int, int]:
    """(K, L): two drafts and two tokens where the verifier takes them, else its limits."""
    num_drafts = max(verifier.min_drafts, min(2, verifier.max_drafts or 2))
    draft_len = max(verifier.min_draft_len, min(2, verifier.max_draft_len or 2))
    return num_drafts, draft_len


def _to_host(value):
    """Tensors (and a carried correction's tensor fields) back on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to_host(getattr(value, f.name)) for f in dataclasses.fields(value)
                                             if f.init and isinstance(getattr(value, f.name), torch.Tensor)})
    return value


class OnDevice(Verifier):
    """A verifier run on ``device`` behind the CPU-side audits: inputs moved there, outputs brought back.

    The generator stays the caller's (a CPU generator): ``uniform`` draws on the generator's device and
    moves the uniforms, so a verifier on CUDA consumes the same uniforms as on the CPU.  In-place changes
    to the moved inputs are copied back, so the contract's "inputs unchanged" check still sees them.
    """

    def __init__(self, inner: Verifier, device: str):
        self.inner, self.device = inner, torch.device(device)
        for attr in ("name", "description", "draft_scheme", "min_drafts", "max_drafts", "min_draft_len",
                     "max_draft_len", "expected", "guarantees"):
            setattr(self, attr, getattr(inner, attr))
        if has_carried_correction(inner):
            self.carried_correction = self._carried_correction

    @property
    def has_exact_law(self) -> bool:
        return self.inner.has_exact_law

    def _moved(self, tensors):
        return [t.to(self.device) for t in tensors]

    def _copy_back(self, originals, moved) -> None:
        for original, copy in zip(originals, moved):
            if copy is not original and not torch.equal(original, copy.cpu()):
                original.copy_(copy.cpu())

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        inputs = (draft_tokens, draft_probs, target_probs)
        moved = self._moved(inputs)
        out = self.inner.verify(*moved, generator, validate=False)
        self._copy_back(inputs, moved)
        return VerifyOutput(out.num_accepted.cpu(), out.draft_index.cpu(), out.next_token.cpu(),
                            correction=_to_host(out.correction))

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        moved = self._moved((draft_tokens, draft_probs, target_probs))
        return self.inner.output_probs(*moved, validate=False).cpu()

    def _carried_correction(self, *args):
        return _to_host(self.inner.carried_correction(*self._moved(args)))


# -- the sampler against its exact law ---------------------------------------------------------------------

#: Large enough for the fast paths: two-level categorical draws (> 512), K-SEQ's sort-free rho (> 256), and
#: on CUDA the Triton kernels.
VOCAB_SIZE = 600
REPS = 10_000


def _law_case(num_drafts: int, draft_len: int, seed: int):
    """One draft tuple of float32 rows (i.i.d. drafts share their conditionals: a context-free toy)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 1, draft_len + 1, VOCAB_SIZE)
    target = torch.softmax(2.5 * torch.randn(shape, generator=gen, dtype=torch.float64), -1)
    draft = torch.softmax(0.8 * target.log() + 0.8 * torch.randn(shape, generator=gen, dtype=torch.float64), -1)
    draft = draft[:, :, :draft_len]
    u = torch.rand(1, num_drafts, draft_len, generator=gen, dtype=torch.float64)
    tokens = sample_categorical(draft.expand(1, num_drafts, draft_len, VOCAB_SIZE), u)
    return tokens, draft.expand(1, num_drafts, -1, -1).float(), target.expand(1, num_drafts, -1, -1).float()


def _sample(verifier, tokens, draft_probs, target_probs, device):
    rep = lambda t: t.expand(REPS, *t.shape[1:]).contiguous().to(device)  # noqa: E731
    out = verifier.verify(rep(tokens), rep(draft_probs), rep(target_probs), torch.Generator().manual_seed(5))
    return torch.stack([out.draft_index, out.num_accepted, out.next_token]).cpu()  # [3, REPS]


#: Built-ins whose float64 node rules make 10,000 rows at V = 600 take most of a minute on a CPU: their CPU
#: case is a slow test (their samplers meet their laws on the CPU at small V in tests/verifiers/).
HEAVY_ON_CPU = {"multi-block", "spectr-gbv-published", "spectr-gbv-published-alg2"}
LAW_CASES = [
    pytest.param("cpu", name, marks=[pytest.mark.slow] if name in HEAVY_ON_CPU else [], id=f"cpu-{name}")
    for name in BUILTINS
] + [pytest.param("cuda", name, marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA), id=f"cuda-{name}")
     for name in BUILTINS]


@pytest.mark.parametrize("device,name", LAW_CASES)
def test_sampler_follows_its_exact_law(device, name):
    verifier = load_verifier(name)
    num_drafts, draft_len = _shape(verifier)
    tokens, draft_probs, target_probs = _law_case(num_drafts, draft_len, seed=17 + num_drafts + draft_len)
    on_device = lambda t: t.to(device)  # noqa: E731
    law = verifier.output_probs(on_device(tokens), on_device(draft_probs), on_device(target_probs))[0].cpu()
    drawn = _sample(verifier, tokens, draft_probs, target_probs, device)
    cells = (drawn[0] * (draft_len + 1) + drawn[1]) * VOCAB_SIZE + drawn[2]
    counts = torch.bincount(cells, minlength=law.numel()).double()
    # float32 K-SEQ samplers use a valid rho a few ulps above rho*: residual mass ~1e-6 where the law has none
    pvalue = pooled_chisquare_pvalue(counts, law.reshape(-1) * REPS, max_zero_fraction=1e-4)
    assert pvalue > 1e-3, (name, device, pvalue)
    if device != "cpu":
        # the law and the sampler's draws, against the CPU's on the same inputs and uniforms
        cpu_law = verifier.output_probs(tokens, draft_probs, target_probs)[0]
        torch.testing.assert_close(law, cpu_law, rtol=1e-9, atol=1e-12)
        differ = (drawn != _sample(verifier, tokens, draft_probs, target_probs, "cpu")).any(0)
        # rows differ only where a uniform lands within float rounding of a threshold
        assert differ.double().mean() <= 1e-3, (name, int(differ.sum()))


# -- the contract checks and the exact audit ---------------------------------------------------------------

def _conformance(name: str, device: str):
    from spectr_audit.run.conformance import check_verifier

    verifier = load_verifier(name)
    num_drafts, _ = _shape(verifier)
    return check_verifier(OnDevice(verifier, device), num_drafts=num_drafts, draft_len=verifier.min_draft_len,
                          num_samples=2000, raise_on_failure=False, verifier_timeout=None)


def _verdicts(report) -> list:
    checks = [(c.name, c.where, c.passed) for c in report.checks]
    audits = [(r.case, r.passed) for r in report.audit.results]
    return checks + audits


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("device", DEVICES)
def test_contract_checks_and_exact_audit(device, name):
    """check_verifier: the contract on drafted batches, the sampler against its law, the exact audit of a suite."""
    report = _conformance(name, device)
    assert report.passed, str(report)
    assert report.audit.results and all(r.as_expected for r in report.audit.results)  # measured = declared
    if device != "cpu":
        assert _verdicts(report) == _verdicts(_conformance(name, "cpu"))
        for on_device, on_cpu in zip(report.audit.results, _conformance(name, "cpu").audit.results):
            for key in ("max_abs_error", "tv_distance"):
                if key in on_cpu.metrics:
                    assert on_device.metrics[key] == pytest.approx(on_cpu.metrics[key], abs=1e-12), (name, key)


# -- the statistical audit ------------------------------------------------------------------------------------

def _statistical(name: str, device: str):
    from spectr_audit.statistical.audit import statistical_audit

    verifier = load_verifier(name)
    num_drafts, draft_len = _shape(verifier)
    return statistical_audit(verifier, ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]), num_drafts,
                             draft_len, min_detectable_tv=0.05, seed=0, device=device)


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("device", DEVICES)
def test_statistical_audit(device, name):
    """The harness on the device (drafts, verdicts, completions); the declared verdict, and the CPU's."""
    result = _statistical(name, device)
    declared = load_verifier(name).expected
    assert result.verdict == ("FINDING" if declared == "inexact" else "exact"), (name, device, result.verdict)
    if device != "cpu":
        assert result.verdict == _statistical(name, "cpu").verdict


# -- host syncs -----------------------------------------------------------------------------------------------

class HostSync(RuntimeError):
    """A host-side read of device data, or host data copied to the device, inside a sampler."""


class RefuseHostData(TorchFunctionMode):
    """Raise on ``torch.tensor`` / ``as_tensor`` / ``asarray`` of host data onto a non-CPU device (a blocking copy)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor, torch.asarray):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                raise HostSync(f"{func.__name__}(<host data>, device={device!r}) copies host data to the device")
        return func(*args, **kwargs)


def _sync_case(name: str, vocab_size: int, device: str):
    verifier = load_verifier(name)
    num_drafts, draft_len = _shape(verifier)
    gen = torch.Generator().manual_seed(3)
    shape = (4, num_drafts, draft_len + 1, vocab_size)
    target = torch.softmax(2 * torch.randn(shape, generator=gen), -1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(shape, generator=gen), -1)[:, :, :draft_len]
    tokens = sample_categorical(draft, torch.rand(draft.shape[:-1], generator=gen, dtype=torch.float64))
    return verifier, (tokens.to(device), draft.contiguous().to(device), target.to(device))


def _where(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "site-packages" not in f.filename and "test_device" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


@pytest.mark.parametrize("vocab_size", [50, 1000])  # both rho* solvers, both categorical draws
@pytest.mark.parametrize("name", SYNC_CASES)
def test_no_host_sync_in_the_sampler_on_meta_tensors(name, vocab_size):
    verifier, inputs = _sync_case(name, vocab_size, "meta")
    try:
        with RefuseHostData():
            verifier.verify(*inputs, None, validate=False)
    except (HostSync, RuntimeError, NotImplementedError) as error:  # meta: "cannot be called on meta tensors"
        pytest.fail(f"{name}: host sync at {_where(error)}: {type(error).__name__}: {str(error)[:200]}")


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("vocab_size", [50, 1000])
@pytest.mark.parametrize("name", SYNC_CASES)
def test_no_host_sync_in_the_sampler_on_cuda(name, vocab_size):
    verifier, inputs = _sync_case(name, vocab_size, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    verifier.verify(*inputs, generator, validate=False)  # warm-up: kernels compiled and loaded, caches filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verifier.verify(*inputs, generator, validate=False)
    except RuntimeError as error:
        pytest.fail(f"{name}: host sync at {_where(error)}: {str(error)[:200]}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
