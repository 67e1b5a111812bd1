"""The engines-e2e suite, its factories, the shipped prompts and the standalone reproductions.

The suite's cases resolve to real engines (transformers here; vLLM in the slow stage), a case
whose engine is missing is skipped and says so, ``--case`` selects cases, and a reproduction
script written by spectr-audit rebuilds the same checkpoint, processes logits as the project
does, stays quiet on a lossless engine and fires on a sharpened one.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.engine_adapters.prompts import SHIPPED_VOCAB_SIZE, shipped_prompt_ids, shipped_prompts
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.checks import select_cases
from spectr_audit.run.generation_suite import run_generation_suite
from spectr_audit.run.suite import load_suite

REPO = Path(__file__).resolve().parents[2]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="the transformers extra")


def test_the_shipped_prompts_are_a_few_dozen_distinct_texts_with_their_ids():
    texts, ids = shipped_prompts(), shipped_prompt_ids()
    assert 30 <= len(texts) == len(ids) and len(set(texts)) == len(texts)
    assert all(p and all(0 <= t < SHIPPED_VOCAB_SIZE for t in p) for p in ids)
    assert shipped_prompt_ids(3) == ids[:3]
    with pytest.raises(InvalidArgument, match="count"):
        shipped_prompt_ids(0)


def test_the_stored_ids_are_smollm2_s_tokenization_of_the_texts():
    from spectr_audit.lm.smollm import LMUnavailable

    try:
        from spectr_audit.engine_adapters.prompts import smollm2_prompt_ids

        live = smollm2_prompt_ids()
    except LMUnavailable as exc:
        pytest.skip(str(exc))
    assert live == shipped_prompt_ids()


def test_every_case_of_the_suite_names_a_factory_that_exists():
    from spectr_audit.registry import load_object

    suite = load_suite("engines-e2e")
    assert len(suite.generation) >= 15
    names = [c.name for c in suite.generation]
    assert len(set(names)) == len(names)
    for case in suite.generation:
        assert callable(load_object(case.engine, "engine")), case.name
        assert case.requires, f"{case.name}: a real engine's case says what it needs"
    kinds = {c.engine.rpartition(":")[2] for c in suite.generation}
    assert kinds == {"transformers_engine", "vllm_engine", "vllm_served_engine", "llama_cpp_engine", "own_engine"}


@pytest.mark.parametrize("options, message", [
    (dict(method="eagle"), "method: expected one of"),
    (dict(block_size=48), "block_size: expected a multiple of 32"),
    (dict(block_size=16), "block_size: expected a multiple of 32"),
    (dict(block_size=True), "block_size: expected a multiple of 32"),
])
def test_the_served_factory_refuses_bad_options_before_starting_a_server(options, message):
    from spectr_audit.engine_adapters.factories import vllm_served_engine

    with pytest.raises(InvalidArgument, match=message):
        vllm_served_engine(**options)


def test_cases_are_selected_by_pattern_in_suite_order():
    cases = load_suite("engines-e2e").generation
    chosen = select_cases(cases, ["vllm-ngram-*", "transformers-assisted-greedy"])
    assert [c.name for c in chosen] == ["transformers-assisted-greedy", "vllm-ngram-serving-conditions",
                                        "vllm-ngram-greedy", "vllm-ngram-requests-greedy", "vllm-ngram-T0.7"]
    with pytest.raises(InvalidArgument, match="matches no case"):
        select_cases(cases, ["sglang-*"])


def test_a_case_whose_engine_is_not_installed_is_skipped_and_said(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(textwrap.dedent("""
        [suite]
        name = "s"
        [[generation]]
        name = "missing"
        engine = "no_such_engine_package.factories:make"
        requires = ["no_such_engine_package"]
        [[generation]]
        name = "toy"
        engine = "toy"
        max_new_tokens = 8
    """))
    report = run_generation_suite(str(suite))
    assert [r.case for r in report.results] == ["toy"]
    assert report.skipped == (("missing", "needs no_such_engine_package: not installed"),)
    assert report.to_dict()["skipped"] == [{"case": "missing", "reason": "needs no_such_engine_package: not installed"}]
    proc = subprocess.run([sys.executable, "-m", "spectr_audit", "generation", "--suite", str(suite), "--progress",
                           "none"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "missing: SKIPPED (needs no_such_engine_package: not installed)" in proc.stdout
    assert "1 skipped" in proc.stdout


def test_requires_must_name_modules(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n[[generation]]\nname = "a"\nengine = "toy"\nrequires = [3]\n')
    with pytest.raises(InvalidArgument, match="requires: expected a list of module names"):
        load_suite(str(suite))


def test_the_cli_refuses_case_without_a_suite_and_an_unknown_pattern(tmp_path):
    one = subprocess.run([sys.executable, "-m", "spectr_audit", "generation", "--engine", "toy", "--case", "x"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert one.returncode == 2 and "--case: selects cases of a suite; only with --suite" in one.stderr
    two = subprocess.run([sys.executable, "-m", "spectr_audit", "generation", "--suite", "engines-e2e", "--case",
                          "nothing-*"], capture_output=True, text=True, cwd=tmp_path)
    assert two.returncode == 2 and "'nothing-*' matches no case" in two.stderr


def test_repro_says_why_nothing_was_written_for_an_engine_that_cannot_describe_itself(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "spectr_audit", "generation", "--engine", "toy:positions-by-block",
                           "--max-new-tokens", "16", "--repro", str(tmp_path / "r.py"), "--progress", "none"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gives no repro_spec" in proc.stderr and not (tmp_path / "r.py").exists()


# ---------------------------------------------------------------------------------------------
# The reproduction script
# ---------------------------------------------------------------------------------------------

def _spec(**params):
    return {"engine": "transformers", "method": "plain", "engine_name": "transformers generate (plain)",
            "checkpoint": {"kind": "random", "vocab_size": SHIPPED_VOCAB_SIZE}, "draft": None,
            "speculative_config": None, "num_speculative_tokens": 3, "seed": 0,
            "params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **params}}


def _finding(z=8.0, tokens=400, zero=0):
    return SimpleNamespace(verdict="FINDING", decided_by="one-sample", test="surprisal / all", pvalue=1e-9,
                           surprisal_z=z, tv_lower=0.1, num_tokens=tokens, zero_mass=(None,) * zero, alpha=1e-3)


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"repro_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script(tmp_path):
    from spectr_audit.engine_adapters.repro import write_repro

    def make(spec, prompts=None, **kwargs):
        path = write_repro(tmp_path / "repro.py", _finding(**kwargs), spec, prompts or shipped_prompt_ids(4),
                           max_new_tokens=16)
        return path, _load_script(path)

    return make


def test_the_number_of_requests_follows_the_measured_effect():
    from spectr_audit.engine_adapters.repro import repro_requests

    # Z = 4 over 400 tokens: twice the 3.29 threshold needs 400 * (6.58 / 4)^2 = 1,083 tokens, 68 requests of 16
    assert repro_requests(_finding(z=4.0, tokens=400), 4, 16) == 68
    # Z = 8 needs 271 tokens: the floor of 512 tokens holds (32 requests)
    assert repro_requests(_finding(z=8.0, tokens=400), 4, 16) == 32
    # a support violation seen 5 times in 1,000 tokens: 10 expected in 2,000 tokens
    assert repro_requests(_finding(z=float("nan"), tokens=1000, zero=5), 5, 20) == 100


def test_a_reproduction_is_only_of_a_finding(tmp_path):
    from spectr_audit.engine_adapters.repro import write_repro

    passed = SimpleNamespace(verdict="PASS")
    with pytest.raises(InvalidArgument, match="a reproduction is of a FINDING"):
        write_repro(tmp_path / "r.py", passed, _spec(), [[1, 2]])
    assert write_repro(tmp_path / "r.py", _finding(), None, [[1, 2]]) is None


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_script_processes_logits_as_the_project_does(script_module, data):
    from spectr_audit.contract.sampling import SamplingParams, process_logits

    temperature = data.draw(st.sampled_from([0.0, 0.5, 0.7, 1.0, 1.3]))
    top_k = data.draw(st.sampled_from([0, 1, 3, 20]))
    top_p = data.draw(st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.2]))
    seed = data.draw(st.integers(0, 10_000))
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    script_module.SPEC["params"] = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    theirs = script_module.processed_logits(logits).softmax(-1)
    ours = process_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), order="vllm")
    assert torch.allclose(theirs, ours, atol=1e-9), (temperature, top_k, top_p)


@pytest.fixture(scope="module")
def script_module(tmp_path_factory):
    from spectr_audit.engine_adapters.repro import write_repro

    path = write_repro(tmp_path_factory.mktemp("repro") / "repro.py", _finding(), _spec(), [[1, 2, 3]],
                       max_new_tokens=4)
    return _load_script(path)


@needs_transformers
def test_the_script_writes_the_same_random_checkpoint_as_spectr_audit(script_module, tmp_path):
    from safetensors.torch import load_file

    from spectr_audit.engine_adapters.checkpoints import write_llama

    ours = write_llama(tmp_path / "ours", seed=0, vocab_size=300)
    theirs = script_module.write_llama(str(tmp_path / "theirs"), 0, 300)
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(Path(theirs) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ours_draft = write_llama(tmp_path / "ours-draft", seed=1, base=ours, noise=0.3)
    theirs_draft = script_module.write_llama(str(tmp_path / "theirs-draft"), 1, 300, base=theirs, noise=0.3)
    a, b = load_file(str(ours_draft / "model.safetensors")), load_file(str(Path(theirs_draft) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    from spectr_audit.engine_adapters.checkpoints import write_eagle_head

    ours_head = write_eagle_head(tmp_path / "ours-head", ours)
    theirs_head = script_module.write_eagle_head(str(tmp_path / "theirs-head"), theirs)
    a, b = load_file(str(ours_head / "model.safetensors")), load_file(str(Path(theirs_head) / "model.safetensors"))
    assert a.keys() == b.keys() and "fc.weight" in a and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((ours_head / "config.json").read_text()) == json.loads((Path(theirs_head) / "config.json").read_text())


@needs_transformers
def test_the_script_is_quiet_on_a_lossless_engine_and_fires_on_a_sharpened_one(script, tmp_path, monkeypatch,
                                                                                 capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path, module = script(_spec(temperature=0.8), z=4.0, tokens=300)
    source = path.read_text()
    assert "spectr_audit" not in source.replace("spectr-audit", "")  # a maintainer runs it without the project
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "not reproduced" in proc.stdout and "threshold |Z| > 3.29" in proc.stdout

    honest = module.run_transformers

    def sharpened(target, draft):  # the engine samples at temperature 0.4 while the request says 0.8
        module.SPEC["params"]["temperature"] = 0.4
        try:
            return honest(target, draft)
        finally:
            module.SPEC["params"]["temperature"] = 0.8

    monkeypatch.setattr(module, "run_transformers", sharpened)
    assert module.main() == 1
    assert "REPRODUCED" in capsys.readouterr().out


@needs_transformers
def test_a_suite_case_runs_a_real_engine_through_its_factory():
    report = run_generation_suite("engines-e2e", select=["transformers-assisted-greedy"], max_tokens=300)
    (entry,) = report.results
    assert entry.result.greedy and entry.result.verdict in ("PASS", "INCONCLUSIVE"), entry.line()
    assert entry.result.num_tokens >= 300 and not entry.result.failures
    assert entry.repro_spec["engine"] == "transformers" and entry.repro_spec["method"] == "assisted"
    assert json.loads(json.dumps(report.to_dict()))["results"][0]["case"] == "transformers-assisted-greedy"


def _readme_block(first_line: str) -> str:
    import re

    readme = (REPO / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if b.startswith(first_line))


@needs_transformers
def test_the_readme_transformers_example_runs_as_written(tmp_path):
    script = tmp_path / "audit_transformers.py"
    script.write_text(_readme_block("# audit_transformers.py"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    verdict, tokens = proc.stdout.split()[-2:]
    assert verdict in ("PASS", "INCONCLUSIVE") and int(tokens) > 100


@needs_transformers
def test_a_suite_case_with_whole_requests_runs_a_real_engine():
    report = run_generation_suite("engines-e2e", select=["transformers-assisted-requests"], max_tokens=300)
    (case,) = report.results
    assert case.as_expected, case.result.test
    assert {t.name for t in case.result.subtests} >= {"logprobs", "stopping"}
    assert case.result.request_findings == ()
