"""One input-validation module: one simplex tolerance at every boundary, messages naming the argument."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import spectr_audit
from spectr_audit import _validation
from spectr_audit._validation import (
    SIMPLEX_ATOL,
    as_distribution,
    as_float64,
    check_positive_int,
    check_prob,
    check_simplex,
    simplex_atol,
)
from spectr_audit.bounds.acceptance import kseq_acceptance, optimal_acceptance, optimal_acceptance_lp_from_sets
from spectr_audit.cli import parse_model_spec
from spectr_audit.contract.verifier import PROB_ATOL, check_verify_inputs
from spectr_audit.drafting.models import ContextFreeModel, MarkovModel, Model, TableModel
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.registry import load_verifier
from spectr_audit.run.suite import model_from_spec

GOOD = [0.5, 0.3, 0.2]


def _row(total: float) -> list:
    """A 3-token row that sums to ``total``."""
    return [x * total for x in GOOD]


def _contract(row):
    draft_probs = torch.tensor(row, dtype=torch.float64).view(1, 1, 1, 3)
    target_probs = torch.tensor(GOOD, dtype=torch.float64).view(1, 1, 1, 3).expand(1, 1, 2, 3)
    check_verify_inputs(torch.zeros(1, 1, 1, dtype=torch.int64), draft_probs, target_probs)


def _verify(row):
    draft_probs = torch.tensor(row, dtype=torch.float64).view(1, 1, 1, 3)
    target_probs = torch.tensor(GOOD, dtype=torch.float64).view(1, 1, 1, 3).expand(1, 1, 2, 3)
    load_verifier("speculative").verify(torch.zeros(1, 1, 1, dtype=torch.int64), draft_probs, target_probs,
                                        torch.Generator().manual_seed(0))


class _Rows(Model):
    """Context-free rows returned as given (not renormalised): what a user's model might do."""

    def __init__(self, row):
        self.row = torch.tensor(row, dtype=torch.float64)
        self.vocab_size = 3

    def __call__(self, contexts):
        return self.row.expand(contexts.shape[0], -1).clone()


def _exact(row):
    exact_iteration(load_verifier("speculative"), _Rows(row), ContextFreeModel(GOOD), num_drafts=1)


def _lp_sets(row):
    optimal_acceptance_lp_from_sets({frozenset({0}): row[0], frozenset({1}): row[1], frozenset({2}): row[2]}, GOOD)


#: Every boundary that takes probabilities: (name, call with one row, the argument its message names).
BOUNDARIES: list[tuple[str, Callable, str]] = [
    ("contract", _contract, "draft_probs"),
    ("Verifier.verify", _verify, "draft_probs"),
    ("optimal_acceptance", lambda row: optimal_acceptance(row, GOOD, 2), "draft_probs"),
    ("kseq_acceptance", lambda row: kseq_acceptance(GOOD, row, 2), "target_probs"),
    ("optimal_acceptance_lp_from_sets", _lp_sets, "set_probs"),
    ("ContextFreeModel", lambda row: ContextFreeModel(row), "probs"),
    ("MarkovModel", lambda row: MarkovModel(row, order=0), "table[row 0]"),
    ("TableModel", lambda row: TableModel({(): row}), "table[()]"),
    ("suite file", lambda row: model_from_spec(row, "case.draft"), "case.draft"),
    ("command line", lambda row: parse_model_spec(",".join(repr(x) for x in row), "--draft"), "--draft"),
    ("exact_iteration", _exact, "draft_probs"),
]


@pytest.mark.parametrize("name, call, argument", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_every_boundary_has_the_one_simplex_tolerance(name, call, argument):
    call(_row(1 + 0.5 * SIMPLEX_ATOL))  # inside the tolerance: accepted
    call(_row(1 - 0.5 * SIMPLEX_ATOL))
    for total in (1 + 2 * SIMPLEX_ATOL, 1 - 2 * SIMPLEX_ATOL):
        with pytest.raises(InvalidArgument, match="sum to 1") as info:
            call(_row(total))
        assert str(info.value).startswith(f"{argument}: "), str(info.value)


@pytest.mark.parametrize("name, call, argument", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
@pytest.mark.parametrize("bad, problem", [(math.nan, "finite"), (math.inf, "finite"), (-0.1, "non-negative")])
def test_every_boundary_rejects_non_finite_and_negative_entries(name, call, argument, bad, problem):
    if name == "optimal_acceptance_lp_from_sets":
        problem = "finite and non-negative"
    row = [bad, 1.0, 0.0] if bad < 0 else [bad, 0.5, 0.5]
    with pytest.raises(InvalidArgument, match=problem) as info:
        call(row)
    assert str(info.value).startswith(f"{argument}: "), str(info.value)


def test_the_contract_exports_the_one_tolerance():
    assert PROB_ATOL == SIMPLEX_ATOL == 1e-4


def _half_rows(dtype: torch.dtype) -> torch.Tensor:
    """A row that its rounding to ``dtype`` takes off the simplex by more than SIMPLEX_ATOL."""
    for seed in range(100):
        row = torch.as_tensor(np.random.default_rng(seed).dirichlet(np.ones(8))).to(dtype)
        if abs(float(row.double().sum()) - 1) > 2 * SIMPLEX_ATOL:
            return row
    raise AssertionError("no row rounds off the simplex")  # pragma: no cover


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_widens_the_tolerance(dtype):
    row = _half_rows(dtype)
    off = abs(float(row.double().sum()) - 1)
    eps = torch.finfo(dtype).eps
    assert simplex_atol(dtype, 8) == pytest.approx(4 * eps * math.sqrt(8) + eps)
    assert SIMPLEX_ATOL < off <= simplex_atol(dtype, 8)
    # accepted in its own precision, at the contract and at the bounds ...
    check_simplex("draft_probs", row)
    tokens = torch.zeros(1, 1, 1, dtype=torch.int64)
    tokens[0, 0, 0] = int(row.argmax())
    check_verify_inputs(tokens, row.view(1, 1, 1, 8), row.view(1, 1, 1, 8).expand(1, 1, 2, 8))
    optimal_acceptance(row, row, 2)
    # ... and rejected once the same values claim to be float32 (no rounding excuse).
    with pytest.raises(InvalidArgument, match="draft_probs: each distribution must sum to 1 within 1.0e-04"):
        check_simplex("draft_probs", row.float())
    with pytest.raises(InvalidArgument, match="draft_probs: each distribution must sum to 1"):
        optimal_acceptance(row.float(), row.float(), 2)


def test_the_half_precision_tolerance_grows_with_the_vocabulary():
    assert simplex_atol(torch.float32, 10**6) == simplex_atol(torch.float64, 2) == SIMPLEX_ATOL
    small, large = simplex_atol(torch.bfloat16, 8), simplex_atol(torch.bfloat16, 50_000)
    assert SIMPLEX_ATOL < small < large


def test_check_simplex_names_the_argument_the_problem_and_the_place():
    probs = torch.tensor([[0.5, 0.5], [0.3, 0.7], [0.3, 0.8]])
    with pytest.raises(InvalidArgument) as info:
        check_simplex("target_probs", probs)
    assert str(info.value) == (
        "target_probs: each distribution must sum to 1 within 1.0e-04; the row at index (2,) sums to 1.1"
    )
    with pytest.raises(InvalidArgument, match=r"the row at batch index \(2,\)"):
        check_simplex("target_probs", probs, index_name="batch index")
    with pytest.raises(InvalidArgument, match=r"target_probs: probabilities must be finite; found nan at index \(1, 0\)"):
        check_simplex("target_probs", torch.tensor([[0.5, 0.5], [math.nan, 1.0]]))
    with pytest.raises(InvalidArgument, match=r"probabilities must be non-negative; found -0.25 at index \(0, 1\)"):
        check_simplex("target_probs", torch.tensor([[1.25, -0.25]]))
    # an explicit tolerance replaces the default
    check_simplex("target_probs", torch.tensor([[0.5, 0.6]]), atol=0.2)
    check_simplex("target_probs", torch.zeros(0, 3))  # nothing to check


def test_as_float64_keeps_the_tolerance_of_the_input_dtype():
    tensor, atol = as_float64("draft_probs", torch.tensor([0.5, 0.5], dtype=torch.bfloat16))
    assert tensor.dtype == torch.float64 and atol == simplex_atol(torch.bfloat16, 2)
    tensor, atol = as_float64("draft_probs", [[0.5, 0.5]])
    assert tensor.shape == (1, 2) and atol == SIMPLEX_ATOL
    for bad, message in [(torch.tensor([1, 0]), "floating-point"), ("abc", "expected a torch tensor"),
                         (0.5, "got a scalar"), ([[]], "vocab_size must be >= 1")]:
        with pytest.raises(InvalidArgument, match=f"draft_probs: .*{message}"):
            as_float64("draft_probs", bad)


def test_as_distribution_renormalises_and_checks_its_length():
    out = as_distribution([0.6 * (1 + 5e-5), 0.4 * (1 + 5e-5)], "probs")
    assert out.dtype == torch.float64 and float(out.sum()) == pytest.approx(1, abs=1e-15)
    with pytest.raises(InvalidArgument, match="probs: expected 3 probabilities, got 2"):
        as_distribution([0.5, 0.5], "probs", vocab_size=3)
    with pytest.raises(InvalidArgument, match="probs: expected a non-empty 1-D probability vector"):
        as_distribution([[0.5, 0.5]], "probs")


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, True, "0.1", None, math.nan])
def test_check_prob_rejects_what_is_not_in_the_open_unit_interval(value):
    with pytest.raises(InvalidArgument, match="alpha: expected a number in \\(0, 1\\)"):
        check_prob("alpha", value)


def test_check_prob_and_check_positive_int_accept_valid_values():
    assert check_prob("alpha", 1e-3) == 1e-3 and check_prob("power", 0.99) == 0.99
    assert check_positive_int("num_samples", 5) == 5 and check_positive_int("num_samples", None) is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument, match="num_samples: expected an integer >= 1"):
            check_positive_int("num_samples", bad)
    with pytest.raises(InvalidArgument):
        check_positive_int("num_samples", None, allow_none=False)


#: The boundaries that once had tolerances of their own; only _validation may hold one now.
_BOUNDARY_MODULES = ["contract/verifier.py", "bounds/acceptance.py", "drafting/models.py", "run/suite.py",
                     "statistical/_checks.py", "cli/_args.py", "exact/iteration.py", "exact/multi_iteration.py"]


@pytest.mark.parametrize("module", _BOUNDARY_MODULES)
def test_no_boundary_keeps_a_simplex_tolerance_of_its_own(module):
    path = Path(spectr_audit.__file__).parent / module
    tolerances = {1e-4, 1e-5, 1e-6, 1e-7}
    found = [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, float) and node.value in tolerances]
    assert not found, f"{module}: tolerance literals {found}; use spectr_audit._validation"


def test_the_validation_module_is_a_leaf():
    imported = {alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "")
                for node in ast.walk(ast.parse(Path(_validation.__file__).read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    assert imported <= {"__future__", "math", "typing", "numpy", "torch", "spectr_audit.errors",
                        "spectr_audit._arguments"}, imported


def test_an_integer_at_least_is_checked_by_name():
    from spectr_audit._validation import check_int_at_least
    from spectr_audit._arguments import check_int_at_least as torch_free

    for check in (check_int_at_least, torch_free):
        assert check("rounds", 3, 1) == 3
        for bad in (0, True, 2.0, "3", None):
            with pytest.raises(InvalidArgument, match=r"^rounds: expected an integer >= 1, got "):
                check("rounds", bad, 1)
