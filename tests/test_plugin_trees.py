"""The pytest plugin's fixture and marker on tree verifiers (``tree=...``), in a scratch project (``pytester``)."""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

# An engine author's tree verifier as a plain function (no exact law: audited from samples), and a
# lossy variant that always keeps the root's first child.
TREE_VERIFIERS = textwrap.dedent('''
    import torch
    from spectr_audit.verifiers.tree import TreeTargetOnly

    _RULE = TreeTargetOnly()

    def my_verify_tree(tree, node_tokens, draft_probs, target_probs, generator):
        return _RULE.verify_tree(tree, node_tokens, draft_probs, target_probs, generator)

    def first_child_verify_tree(tree, node_tokens, draft_probs, target_probs, generator):
        return torch.ones(node_tokens.shape[0], dtype=torch.int64), target_probs[:, 1].argmax(-1)
''')

FAST = ("--spectr-samples", "2000", "-p", "no:cacheprovider")


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import what the in-process runs use once, here (see tests/test_plugin.py: torch's extension
    modules cannot be imported twice in one process)."""
    namespace: dict = {}
    exec(TREE_VERIFIERS, namespace)
    from spectr_audit.run.conformance import check_verifier

    check_verifier(namespace["my_verify_tree"], tree="cartesian:2", draft_scheme="topk", num_samples=500,
                   raise_on_failure=False)


def test_fixture_and_marker_check_a_tree_verifier(pytester):
    pytester.makepyfile(my_tree_verifiers=TREE_VERIFIERS)
    pytester.syspathinsert()
    pytester.makepyfile(test_scratch_trees="""
        import pytest
        from my_tree_verifiers import first_child_verify_tree, my_verify_tree

        EAGLE_LIKE = "paths:[[0],[1],[0,0]]"

        def test_fixture(spectr_audit):
            report = spectr_audit.check(my_verify_tree, tree=EAGLE_LIKE, draft_scheme="topk")
            assert not report.failures

        @pytest.mark.spectr_audit(verifier=my_verify_tree, tree="cartesian:2,1", draft_scheme="none")
        def test_marker():
            pass

        def test_lossy(spectr_audit):
            with pytest.raises(AssertionError, match="acceptance<=optimal"):
                spectr_audit.check(first_child_verify_tree, tree=EAGLE_LIKE, draft_scheme="topk")
    """)
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(passed=3)
