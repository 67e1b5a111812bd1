"""One registry with namespaces: short names, namespace:name, entry points of other packages, laziness."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from spectr_audit import registry
from spectr_audit.cli import main
from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import (
    BUILTIN_VERIFIERS,
    ENTRY_POINT_GROUP,
    NAMESPACES,
    describe,
    entries,
    find,
    load_broken,
    load_engine,
    load_historic,
    load_verifier,
    namespaces,
)

_PLUGIN_DIST = "Fake_Spectr.Plugin"  # spelled as a maintainer might; the namespace is its canonical form
_PLUGIN_NS = "fake-spectr-plugin"

_PLUGIN_MODULE = '''
from spectr_audit.contract.verifier import Verifier
from spectr_audit.verifiers.speculative import SpeculativeSampling


class FakeRule(SpeculativeSampling):
    """A third party's rule: speculative sampling under another name."""

    name = "fake-rule"
    description = "a third-party rule registered through an entry point"
    max_draft_len = 3


def fake_function(draft_tokens, draft_probs, target_probs, generator):
    """A plain verify function, registered too."""
    return SpeculativeSampling().verify(draft_tokens, draft_probs, target_probs, generator)


class KSeqLookalike(SpeculativeSampling):
    name = "kseq"
'''


def _install_plugin(tmp_path, monkeypatch, entry_points: str, module: str = _PLUGIN_MODULE) -> str:
    """A distribution in ``tmp_path`` (a dist-info folder and its module), put on ``sys.path``."""
    package = f"fake_spectr_plugin_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{package}.py").write_text(module)
    dist_info = tmp_path / "fake_spectr_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {_PLUGIN_DIST}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n" + entry_points.format(package=package))
    monkeypatch.syspath_prepend(str(tmp_path))
    return package


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    return _install_plugin(tmp_path, monkeypatch, textwrap.dedent(
        """\
        fake-rule = {package}:FakeRule
        fake-function = {package}:fake_function
        kseq = {package}:KSeqLookalike
        always-accept = {package}:FakeRule
        broken-import = {package}_does_not_exist:Nothing
        """
    ))


# --- the shipped namespaces -----------------------------------------------------------------


def test_short_names_keep_working():
    assert [load_verifier(name).name for name in BUILTIN_VERIFIERS] == list(BUILTIN_VERIFIERS)
    assert load_broken("always-accept").name == "always-accept"
    assert load_broken("kseq-sampler-drift").name == "kseq-sampler-drift"
    assert load_historic("inclusive-coin").name == "inclusive-coin"
    from spectr_audit import engines

    assert engines.ENGINES is registry.ENGINES and engines.load_engine is load_engine


@pytest.mark.parametrize("namespace", ["builtin", "broken", "historic"])
def test_every_shipped_entry_loads_under_its_own_name(namespace):
    shipped = entries(namespace)
    assert shipped and all(e.namespace == namespace for e in shipped)
    for entry in shipped:
        if entry.name == "block-tokenwise-residual":
            pytest.importorskip("spectr_audit.verifiers.block")
        assert entry.create().name == entry.name
        # the bare name and the qualified name find the same entry
        assert find(entry.name) == find(entry.qualified_name) == entry


def test_short_names_are_unique_across_the_shipped_namespaces():
    names = [e.name for ns in NAMESPACES for e in entries(ns)]
    assert len(names) == len(set(names))


def test_namespace_name_reaches_every_namespace():
    assert type(load_verifier("broken:always-accept")).__name__ == "AlwaysAccept"
    assert type(load_verifier("always-accept")).__name__ == "AlwaysAccept"  # unique, so the bare name works
    assert load_verifier("historic:always-accept-npu").name == "always-accept-npu"
    assert find("engine:vllm").extra == "vllm"


def test_engines_are_described_without_building_them():
    # Building an adapter imports its engine; describing one reads the class.
    row = describe(find("sglang"))
    assert row["exact_law"] is False and row["num_drafts"] == "[1, 1]" and row["extra"] == "sglang"
    kseq = describe(find("kseq"))
    assert (kseq["num_drafts"], kseq["draft_len"], kseq["exact_law"]) == ("[1, inf)", "[1, 1]", True)


@pytest.mark.parametrize("call, suggestion", [
    (lambda: load_verifier("ksq"), "did you mean 'kseq'"),
    (lambda: load_verifier("spectr-tre"), "did you mean 'spectr-tree'"),
    (lambda: load_verifier("alwys-accept"), "did you mean 'always-accept'"),
    (lambda: load_verifier("broken:always-acept"), "did you mean 'broken:always-accept'"),
    (lambda: load_broken("always-acept"), "did you mean 'always-accept'"),
    (lambda: load_historic("inclusive-con"), "did you mean 'inclusive-coin'"),
    (lambda: load_engine("vlm"), "did you mean 'vllm'"),
    (lambda: find("kseqq"), "did you mean 'kseq'"),
])
def test_unknown_names_get_a_suggestion(call, suggestion):
    with pytest.raises(InvalidArgument, match=suggestion):
        call()


def test_unknown_names_keep_their_messages():
    with pytest.raises(InvalidArgument, match="verifier: 'zzzz' is neither a built-in name") as info:
        load_verifier("zzzz")
    assert "did you mean" not in str(info.value)  # nothing is close
    with pytest.raises(InvalidArgument, match="name: unknown broken verifier 'zzzz'; known: independent-accept"):
        load_broken("zzzz")
    with pytest.raises(InvalidArgument, match="name: unknown historic-bug verifier"):
        load_historic("zzzz")
    with pytest.raises(InvalidArgument, match="name: unknown engine 'zzzz'"):
        load_engine("zzzz")
    with pytest.raises(InvalidArgument, match="namespace: unknown namespace 'brokn'.*did you mean 'broken'"):
        entries("brokn")


def test_a_builtin_name_imports_nothing_else():
    code = textwrap.dedent(
        """
        import importlib.metadata, sys
        real = importlib.metadata.entry_points
        def no_scan(**params):
            # torch scans its own groups at import; the registry must not scan its own for a built-in
            assert params.get("group") != "spectr_audit.verifiers", "entry points scanned for a built-in name"
            return real(**params)
        importlib.metadata.entry_points = no_scan
        import spectr_audit.registry as registry
        assert not [m for m in sys.modules if m.startswith(("spectr_audit.verifiers", "spectr_audit.engines"))]
        registry.load_verifier("kseq")
        registry.find("broken:always-accept")  # found, not imported
        loaded = sorted(m for m in sys.modules if m.startswith(("spectr_audit.verifiers", "spectr_audit.engines")))
        print(",".join(loaded))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.strip().split(","))
    assert "spectr_audit.verifiers.kseq" in loaded
    assert not {m for m in loaded if m.startswith(("spectr_audit.verifiers.library", "spectr_audit.engines"))}


# --- entry points of other packages ---------------------------------------------------------


def test_an_entry_point_registers_a_verifier(plugin):
    assert _PLUGIN_NS in namespaces() and namespaces()[: len(NAMESPACES)] == list(NAMESPACES)
    found = {e.name: e for e in entries(_PLUGIN_NS)}
    assert set(found) == {"fake-rule", "fake-function", "kseq", "always-accept", "broken-import"}
    assert plugin not in sys.modules  # listed, not imported
    verifier = load_verifier("fake-rule")
    assert plugin in sys.modules
    assert type(verifier).__name__ == "FakeRule" and verifier.max_draft_len == 3
    assert type(load_verifier(f"{_PLUGIN_NS}:fake-rule")).__name__ == "FakeRule"
    function = load_verifier("fake-function")
    assert function.name == "fake_function" and not function.has_exact_law


def test_builtins_win_and_clashes_need_a_namespace(plugin):
    assert type(load_verifier("kseq")).__name__ == "KSeq"
    assert type(load_verifier(f"{_PLUGIN_NS}:kseq")).__name__ == "KSeqLookalike"
    with pytest.raises(InvalidArgument, match="registered in several namespaces.*'broken:always-accept'"):
        load_verifier("always-accept")
    assert type(load_verifier("broken:always-accept")).__name__ == "AlwaysAccept"


def test_a_plugin_that_fails_to_import_is_reported_not_fatal(plugin):
    with pytest.raises(InvalidArgument, match="'broken-import' is unavailable: ModuleNotFoundError"):
        load_verifier("broken-import")
    row = describe(find("broken-import"))
    assert "unavailable" in row["error"]


def test_list_shows_the_plugin_namespace(plugin, capsys):
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert _PLUGIN_NS in data["namespaces"]
    rule = next(v for v in data["verifiers"] if v["namespace"] == _PLUGIN_NS and v["name"] == "fake-rule")
    assert (rule["num_drafts"], rule["draft_len"], rule["exact_law"]) == ("[1, 1]", "[1, 3]", True)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    section = lines[lines.index(f"{_PLUGIN_NS}:") + 1:]
    row = next(line for line in section if line.split()[:1] == ["fake-rule"])
    kseq = next(line for line in lines if line.split()[:1] == ["kseq"])
    assert row.index("[1, 1]") == kseq.index("[1, inf)")  # one column offset for every namespace
    assert "a third-party rule registered through an entry point" in row
    assert any(line.split()[:2] == ["broken-import", "unavailable:"] for line in section)


def test_a_monkeypatched_entry_point_is_seen(monkeypatch):
    import importlib.metadata as metadata

    fake = metadata.EntryPoint(name="patched-rule", value="spectr_audit.verifiers.speculative:SpeculativeSampling",
                               group=ENTRY_POINT_GROUP)
    real = metadata.entry_points

    def entry_points(**params):
        return metadata.EntryPoints([fake]) if params.get("group") == ENTRY_POINT_GROUP else real(**params)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    assert "plugin" in namespaces()  # no distribution: the generic namespace
    assert load_verifier("patched-rule").name == "speculative"
    assert load_verifier("plugin:patched-rule").name == "speculative"


# --- files --------------------------------------------------------------------------------------


def test_a_verifier_file_imports_its_neighbours(tmp_path, capsys):
    neighbour = f"rules_beside_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{neighbour}.py").write_text(
        "from spectr_audit.verifiers.speculative import SpeculativeSampling\n"
        "class Neighbour(SpeculativeSampling):\n"
        "    name = 'neighbour'\n"
    )
    (tmp_path / "my_verifier.py").write_text(f"from {neighbour} import Neighbour\nclass Mine(Neighbour):\n    pass\n")
    path_before = list(sys.path)
    verifier = load_verifier(f"{tmp_path / 'my_verifier.py'}:Mine")
    assert type(verifier).__name__ == "Mine" and verifier.name == "neighbour"
    assert sys.path == path_before  # the folder was on sys.path only while importing
    code = main(["audit", "--verifier", f"{tmp_path / 'my_verifier.py'}:Mine", "--draft", "0.6,0.4",
                 "--target", "0.3,0.7", "--num-drafts", "1", "--json"])
    assert code == 0, capsys.readouterr().err


def test_a_file_without_attr_gets_told_to_add_it(tmp_path, capsys):
    path = tmp_path / "my_verifier.py"
    path.write_text("X = 1\n")
    code = main(["audit", "--verifier", str(path), "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "verifier:" in err
    assert "add ':attr'" in err and f"{path}:MyVerifier" in err
    with pytest.raises(InvalidArgument, match="names a file but not the verifier in it"):
        load_verifier("no_such_file.py")
