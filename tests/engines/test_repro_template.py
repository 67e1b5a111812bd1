"""The reproduction script's program is a real module (``engine_adapters/repro_template.py``): imported here, and
copied into every written script verbatim but for its settings block."""

from __future__ import annotations

import ast
import types
from pathlib import Path

from spectr_audit.engine_adapters import repro_template
from spectr_audit.engine_adapters.repro import repro_source

SPEC = {"engine": "vllm", "method": "ngram", "params": {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
        "checkpoint": {"kind": "random", "vocab_size": 512}, "seed": 0, "draft": None,
        "speculative_config": {"method": "ngram"}}
FINDING = types.SimpleNamespace(verdict="FINDING", test="surprisal / all", pvalue=1e-6, surprisal_z=5.0,
                                tv_lower=0.1, num_tokens=400, zero_mass=())
START = "# --- settings: spectr-audit fills these in when it writes a reproduction ---\n"
END = "# --- end of settings ---\n"


def test_the_template_is_a_module_that_imports_no_spectr_audit():
    assert callable(repro_template.main) and callable(repro_template.write_llama)
    tree = ast.parse(Path(repro_template.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("spectr_audit")]


def test_a_written_script_is_the_template_with_its_settings_filled_in():
    script = repro_source(FINDING, SPEC, [[1, 2, 3], [4, 5]], max_new_tokens=16, alpha=1e-3)
    template = Path(repro_template.__file__).read_text()
    program = template[template.index("\nimport ") + 1:]
    before, rest = program.split(START)
    after = rest.split(END)[1]
    assert before in script and after in script and script.endswith(after)
    settings = script.split(START)[1].split(END)[0]
    namespace: dict = {"json": __import__("json")}
    exec(settings, namespace)
    assert namespace["SPEC"]["engine"] == "vllm" and namespace["MAX_NEW_TOKENS"] == 16
    assert namespace["ALPHA"] == 1e-3 and namespace["PROMPTS"][:2] == [[1, 2, 3], [4, 5]]
    compile(script, "repro.py", "exec")
