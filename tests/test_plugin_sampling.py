"""The pytest plugin with sampling parameters: ``check(params=...)``, fields on the marker, ``audit(params=...)``.

In-process ``pytester`` runs of a scratch project; every verifier has an exact law, so each
verdict is deterministic (the exact audit, no sampling).
"""

from __future__ import annotations

import textwrap

pytest_plugins = ["pytester"]

SCRATCH = textwrap.dedent('''
    import pytest
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.verifiers.library.sampling_bugs import LogitsSpeculativeSampling, load_sampling_bug


    def test_check_with_params(spectr_audit):
        report = spectr_audit.check(LogitsSpeculativeSampling(), num_drafts=1, params=SamplingParams(top_p=0.8),
                                    order="transformers")
        assert {r.metrics["sampling"] for r in report.audit.results} == {"top_p=0.8; transformers order"}


    @pytest.mark.spectr_audit(num_drafts=1, temperature=0.6, top_k=3)
    def test_marker_fields(spectr_audit):
        report = spectr_audit.check(LogitsSpeculativeSampling())
        assert {r.metrics["sampling"] for r in report.audit.results} == {"temperature=0.6, top_k=3; vllm order"}


    def test_slip_fails_the_check(spectr_audit):
        slip = load_sampling_bug("bonus-unprocessed")
        slip.expected = None  # undeclared: the finding must fail the check
        spectr_audit.check(slip, num_drafts=1, temperature=0.6)


    def test_audit_with_params(spectr_audit):
        from spectr_audit.run.suite import parse_suite

        suite = parse_suite({"case": [{"name": "c", "draft": [0.5, 0.3, 0.2], "target": [0.2, 0.3, 0.5],
                                       "num_drafts": 1, "draft_len": [1, 2], "checks": ["exact"]}]})
        report = spectr_audit.audit("logits-speculative", suite=suite, params=SamplingParams(temperature=0.5))
        assert report.results and all(r.metrics["temperature"] == 0.5 for r in report.results)
        spectr_audit.assert_passed(report)
''')


def test_plugin_takes_sampling_parameters(pytester):
    pytester.makepyfile(test_scratch_sampling=SCRATCH)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "--spectr-samples", "2000")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_slip_fails_the_check*", "*bonus-unprocessed*"])
