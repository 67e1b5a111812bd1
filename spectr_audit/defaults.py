"""The numbers every audit starts from: one place for the defaults of the CLI, the pytest plugin,
the runner, the conformance check, the statistical audit and the real-LM suite.

This module imports nothing (no torch, no scipy): the pytest plugin reads it when pytest loads
it, in every project that has spectr-audit installed.  Each face reads these names when it is
imported, so a default changed here changes it everywhere; ``tests/test_defaults.py`` checks
that no face keeps a copy of its own.

Examples
--------
>>> from spectr_audit import defaults
>>> defaults.ALPHA, defaults.POWER, defaults.MIN_DETECTABLE_TV
(0.001, 0.99, 0.005)
"""

from __future__ import annotations

__all__ = [
    "ALPHA",
    "POWER",
    "MIN_DETECTABLE_TV",
    "SEED",
    "CHECK_SAMPLES",
    "SAMPLER_MAX_SAMPLES",
    "EXACT_TOL",
    "MULTI_TOL",
    "BOUND_TOL",
    "LP_TOL",
    "LP_SOLVER_TOL",
    "LP_SOLVER_FALLBACK_TOL",
    "LP_MAX_VARIABLES",
    "LP_CROSS_CHECK_MAX_VARIABLES",
    "MAX_MEMORY_FRACTION",
    "MAX_MEMORY_FALLBACK",
    "VERIFIER_TIMEOUT",
    "EXACT_MAX_TUPLES",
    "EXACT_MAX_HISTORIES",
    "EXACT_CHUNK",
    "EXACT_MAX_TREE_REALISATIONS",
    "EXACT_MAX_TREE_STRINGS",
    "EXACT_TREE_CHUNK",
    "TREE_LP_MAX_REALISATIONS",
    "PARTITION_MAX_CELLS",
    "MAX_STRATA",
    "MAX_STRATIFIED_ENTRIES",
    "MIN_EXPECTED",
    "MIN_CUT_MAX_SUPPORT",
    "NULL_MAX_EXACT_OUTCOMES",
    "MAX_COVARIANCE_CELLS",
    "MIN_PER_STRATUM",
    "MAX_STRATIFIED_CELLS",
    "PLAN_MAX_BOUND_STRINGS",
    "FIRST_CHUNK",
    "ENGINE_TREE_CHUNK",
    "PROBE_CALLS",
    "PROBE_ROWS",
    "UNDECLARED_NUM_DRAFTS",
    "UNDECLARED_DRAFT_LEN",
]

# -- the statistical audit ----------------------------------------------------------------------

#: False-alarm rate of one statistical audit (familywise over its sub-tests, Holm), of one
#: conformance check (Bonferroni over its tests) and of one fixture check in the pytest plugin.
#: A CI run of ~30 audits of correct verifiers then raises a false alarm about 3% of the time.
ALPHA = 1e-3
#: Probability that the planned sample size flags a verifier whose TV distance to the target
#: (on the audited partition) is at least :data:`MIN_DETECTABLE_TV`.
POWER = 0.99
#: The smallest TV distance (on the audited partition) the planned sample size must detect
#: with probability :data:`POWER`.
MIN_DETECTABLE_TV = 0.005
#: Seed of every random draw (drafts, verdicts, statistical samples) unless one is given.
SEED = 0

# -- sample budgets -------------------------------------------------------------------------------

#: Sample budget of each statistical test in the conformance check (``check_verifier``), in
#: the pytest plugin's fixture (``--spectr-samples``) and in ``python -m spectr_audit.engines``:
#: small enough for a unit test.
CHECK_SAMPLES = 20_000
#: Cap on the samples of a run's sampler-versus-exact-law check (verifiers with ``output_probs``).
SAMPLER_MAX_SAMPLES = 200_000

# -- tolerances of the audits ---------------------------------------------------------------------

#: An exact law (float64 enumeration of one step) must match the target to this absolute error.
EXACT_TOL = 1e-12
#: The multi-iteration law chains corrections over several iterations: more rounding than one step.
MULTI_TOL = 1e-9
#: Slack of comparisons with closed-form or LP optima of alpha* (and SpecTr's guarantee).
BOUND_TOL = 1e-9
#: Slack of block efficiencies against the block LP: the LP solver's accuracy, not float64's.
LP_TOL = 1e-6
#: Gap and feasibility tolerance asked of the LP solver (CLARABEL): its own defaults stop near
#: 1e-8, and the audit compares LP optima with exact efficiencies.
LP_SOLVER_TOL = 1e-11
#: The looser tolerance tried next when a badly scaled LP does not end optimal at LP_SOLVER_TOL.
LP_SOLVER_FALLBACK_TOL = 1e-9

# -- sizes ----------------------------------------------------------------------------------------

#: The largest alpha* LP (variables) built when asked for one (``optimal_acceptance_lp``,
#: ``spectr-audit bound``); larger ones are refused with a message.
LP_MAX_VARIABLES = 200_000
#: A run solves the alpha* LP next to the closed form, as a cross-check, up to this many variables.
LP_CROSS_CHECK_MAX_VARIABLES = 20_000

# -- limits of the audits -------------------------------------------------------------------------
#
# Beyond these sizes an audit is refused with a message naming the limit (and the memory budget,
# spectr_audit.run.budget, checks each before anything is allocated).

#: The exact single-step audit enumerates at most this many draft tuples.
EXACT_MAX_TUPLES = 2_000_000
#: The exact decoding-loop audit follows at most this many histories.
EXACT_MAX_HISTORIES = 200_000
#: The exact audit calls ``output_probs`` on this many draft tuples at a time.
EXACT_CHUNK = 8192
#: The exact draft-tree audit enumerates at most this many realisations of the tree's drafts ...
EXACT_MAX_TREE_REALISATIONS = 500_000
#: ... and holds laws over at most this many strings (V^(max_depth + 1)).
EXACT_MAX_TREE_STRINGS = 1 << 22
#: The exact draft-tree audit calls ``tree_output_probs`` on this many realisations at a time.
EXACT_TREE_CHUNK = 4096
#: An engine's tree audit solves the draft-tree LP when the drafts have at most this many realisations.
TREE_LP_MAX_REALISATIONS = 5_000
#: Cells of the statistical audit's prefix-tree partition.
PARTITION_MAX_CELLS = 1 << 20
#: Draft-tuple strata of the stratified test (and of the sampler-versus-law check).
MAX_STRATA = 4096
#: Entries (strata x cells) of the stratified test's expected counts.
MAX_STRATIFIED_ENTRIES = 1 << 20
#: Cells with fewer expected counts than this are pooled before a goodness-of-fit test.
MIN_EXPECTED = 5.0
#: alpha* of drafts without replacement (a chain's K drafts, a tree root's children) is the exact min-cut
#: over the law of the set of drafts: both sum over the 2**n subsets of the n tokens of positive draft
#: probability at the first position, for n up to this.  Beyond it no alpha* is computed, in a run and in
#: the statistical audit's plan alike: the run notes why in its details (``optimal_acceptance``,
#: ``tree_bound``) and checks acceptance against no bound; the plan goes without the
#: ``acceptance<=optimal`` sub-test.
MIN_CUT_MAX_SUPPORT = 20
#: A goodness-of-fit null is enumerated exactly (every multinomial outcome) up to this many outcomes,
#: Monte-Carlo beyond.
NULL_MAX_EXACT_OUTCOMES = 1_000_000
#: Up to this many cells (K (L + 1) V), the sampler-versus-law test uses the counts' exact covariance
#: (its null needs an eigen-decomposition); beyond, the multinomial chi-square that bounds it.
MAX_COVARIANCE_CELLS = 2048
#: The stratified test runs (with ``stratify="auto"``) only when strata average this many samples ...
MIN_PER_STRATUM = 32
#: ... and the partition has at most this many cells (its null needs an eigen-decomposition).
MAX_STRATIFIED_CELLS = 2048
#: The planner's block-efficiency bound enumerates joint laws over at most this many strings (V^L).
PLAN_MAX_BOUND_STRINGS = 4096
#: Smallest chunk of the statistical audit's geometric chunk schedule (the e-process sees blatant bugs
#: early).
FIRST_CHUNK = 1 << 12
#: An engine's tree audit draws this many samples per chunk.
ENGINE_TREE_CHUNK = 2_000
#: The contract probe of a third party's verifier: this many calls of at most this many rows.
PROBE_CALLS = 4
PROBE_ROWS = 16

# -- resources ------------------------------------------------------------------------------------

#: The memory budget of a run (``--max-memory``, ``AuditOptions.max_memory``, ``check_verifier``'s
#: ``max_memory``) by default: this fraction of the machine's memory (the smaller of physical memory
#: and a cgroup limit), so that a run refuses an audit it cannot hold instead of being killed.
MAX_MEMORY_FRACTION = 0.5
#: The default budget, in bytes, where the machine's memory cannot be read.
MAX_MEMORY_FALLBACK = 4 * 2**30
#: Seconds one call of a verifier (``verify`` or ``output_probs``) may take before it is stopped and
#: the audit becomes an error result (``--verifier-timeout``, ``AuditOptions.verifier_timeout``,
#: ``check_verifier``'s ``verifier_timeout``; ``None`` or 0: no limit).  Generous: the exact audit calls
#: ``output_probs`` on 8192 draft tuples at a time.
VERIFIER_TIMEOUT = 300.0

#: The generation audit: the TV of the pooled PIT law its PASS verdict requires the power to detect
#: (docs/generation.md), and the logit margin below which a zero-mass token or a greedy divergence is
#: numerics (a near-tie), not a finding.
GENERATION_MIN_DETECTABLE_TV = 0.02
GENERATION_LOGIT_TOLERANCE = 1e-3

#: The K and L a suite run audits a verifier at when it declares none of its (K, L) (a plain function
#: without ``num_drafts`` / ``draft_len`` / ``max_drafts`` ...) and none is selected (``--num-drafts``,
#: ``--draft-len``): the smallest step, which every verifier takes.
UNDECLARED_NUM_DRAFTS = (1,)
UNDECLARED_DRAFT_LEN = (1,)
