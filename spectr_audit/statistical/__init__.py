"""The statistical audit of black-box verifiers.

Stages: validate (:mod:`._checks`), plan (:mod:`.power`; the prefix partition in
:mod:`.partition`, the draft-tuple strata in :mod:`.poststrata`), sample (:mod:`.sampling`,
chunk streams and sharding over processes in :mod:`.sharding`), test (:mod:`.gof`, the G
statistic's null in :mod:`.nulls`, the per-depth tests, e-process and TV bounds in
:mod:`.depths`; the TV interval and certification in :mod:`.confidence`); results in
:mod:`.results`; a sampler against its own exact law in :mod:`.agreement`; the auditor's own
calibration by construction in :mod:`.calibration`.
"""

from __future__ import annotations

from .results import (
    FamilyResult,
    LawAgreementResult,
    StatisticalAuditResult,
    WorstCell,
    worst_cells,
)
from .gof import (
    TestResult,
    PlugInEProcess,
    binomial_above,
    binomial_below,
    conditional_g_test,
    conditional_pearson_test,
    g_test,
    holm,
    independent_sum_test,
    pearson_test,
    pool_sparse,
    stratified_pearson_test,
    weighted_chi2_sf,
)
from .power import (
    DEFAULT_ALPHA,
    DEFAULT_POWER,
    DEFAULT_MIN_DETECTABLE_TV,
    effect_size_for_tv,
    noncentrality_for_power,
    required_samples,
    min_detectable_tv,
    chi2_power,
)
from .sampling import (
    IMPOSSIBLE,
    PREFIX,
    PrefixPartition,
    RARE,
    SampleChunk,
    build_partition,
    complete_with_target,
    default_chunk_size,
    draw_drafts,
    emitted_strings,
    sample_chunk,
    verify_batch,
)
from .confidence import (
    TVConfidenceSequence,
    TVInterval,
    certification_samples,
    deviation_radius,
    partition_tv,
    tv_interval,
)
from .sharding import chunk_generator, chunk_seed, run_chunks, spawn_local
from .audit import (
    plan_sample_size,
    sampler_law_agreement,
    statistical_audit,
    statistical_tree_audit,
)

__all__ = [
    "TVConfidenceSequence",
    "TVInterval",
    "certification_samples",
    "deviation_radius",
    "partition_tv",
    "tv_interval",
    "chunk_generator",
    "chunk_seed",
    "run_chunks",
    "spawn_local",
    "FamilyResult",
    "LawAgreementResult",
    "StatisticalAuditResult",
    "WorstCell",
    "worst_cells",
    "TestResult",
    "PlugInEProcess",
    "binomial_above",
    "binomial_below",
    "conditional_g_test",
    "conditional_pearson_test",
    "g_test",
    "holm",
    "independent_sum_test",
    "pearson_test",
    "pool_sparse",
    "stratified_pearson_test",
    "weighted_chi2_sf",
    "DEFAULT_ALPHA",
    "DEFAULT_POWER",
    "DEFAULT_MIN_DETECTABLE_TV",
    "effect_size_for_tv",
    "noncentrality_for_power",
    "required_samples",
    "min_detectable_tv",
    "chi2_power",
    "IMPOSSIBLE",
    "PREFIX",
    "PrefixPartition",
    "RARE",
    "SampleChunk",
    "build_partition",
    "complete_with_target",
    "default_chunk_size",
    "draw_drafts",
    "emitted_strings",
    "sample_chunk",
    "verify_batch",
    "plan_sample_size",
    "sampler_law_agreement",
    "statistical_audit",
    "statistical_tree_audit",
]
