"""One registry of verifiers by name, in namespaces; nothing is imported until it is asked for.

========  ===================================================================================
builtin   the reference rules (``spectr_audit.verifiers``): what ``run`` audits by default
broken    realistic slips that break exactness (``spectr_audit.verifiers.library.broken``)
historic  public bugs of real engines, reproduced (``spectr_audit.verifiers.library.historic``),
          and declared-lossy rules beside them, not bugs: Medusa, declared lossy (typical
          acceptance, by design), and Spec-RL's rollout residual
engine    adapters around the engines' own verification functions (``spectr_audit.engines``;
          each needs its optional extra)
tree      the built-in tree verifiers (``spectr_audit.verifiers.tree``): what ``run`` audits
          on a suite's draft-tree cases by default
sampling- verifiers that take logits and sampling parameters
bugs      (``spectr_audit.verifiers.library.sampling_bugs``): the correct ``logits-speculative``
          and its processing slips (docs/sampling.md)
<dist>    a third-party package's verifiers, registered through the ``spectr_audit.verifiers``
          entry-point group; the namespace is the distribution's name (``plugin`` when unknown)
========  ===================================================================================

Tree verifiers (:class:`~spectr_audit.contract.tree_verifier.TreeVerifier`, in any namespace)
load two ways: :func:`load_tree_verifier` gives the tree verifier itself, for draft trees
(a chain verifier comes as :class:`~spectr_audit.contract.chain_trees.ChainVerifierAsTree`,
for chain trees); :func:`load_verifier` gives a chain
:class:`~spectr_audit.contract.verifier.Verifier` as everywhere else, a tree verifier run on the
chain contract's drafts (:class:`~spectr_audit.contract.chain_trees.TreeVerifierAsChain`).

A verifier is found by its short name (``"kseq"``, ``"always-accept"``) or, where a short name
is in more than one namespace, by ``"namespace:name"`` (``"broken:always-accept"``).  The
built-ins take precedence: a bare built-in name never scans entry points or imports another
namespace.  ``spectr-audit list`` shows every namespace and what each verifier supports.

A third-party package registers a verifier (a :class:`~spectr_audit.contract.verifier.Verifier`
class, an instance, or a ``verify`` function) in its ``pyproject.toml``::

    [project.entry-points."spectr_audit.verifiers"]
    my-rule = "my_package.rules:MyRule"

and then ``spectr-audit audit --verifier my-rule ...`` (or ``my-package:my-rule``) audits it.

Examples
--------
>>> load_verifier("kseq").name
'kseq'
>>> find("broken:always-accept").target
'spectr_audit.verifiers.library.broken:AlwaysAccept'
>>> load_verifier("ksq")
Traceback (most recent call last):
...
spectr_audit.errors.InvalidArgument: verifier: 'ksq' is neither a built-in name (speculative, kseq, spectr-tree, rrs, rrs-wor, block, greedy-block, greedy-block-repaired, spectr-gbv-published, spectr-gbv-published-alg2, multi-block) nor a registered one nor an import string 'package.module:attr' or 'path/to/file.py:attr'; did you mean 'kseq'? (spectr-audit list shows every name)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Optional

from spectr_audit.contract.chain_trees import TreeVerifierAsChain
from spectr_audit.contract.convert import as_tree_verifier, as_verifier
from spectr_audit.contract.logits import LogitsVerifier
from spectr_audit.contract.tree_verifier import TreeVerifier
from spectr_audit.contract.verifier import Verifier
from spectr_audit.errors import InvalidArgument

__all__ = [
    "BROKEN_VERIFIERS",
    "BUILTIN_VERIFIERS",
    "ENGINES",
    "ENTRY_POINT_GROUP",
    "HISTORIC_VERIFIERS",
    "INCONSISTENT_VERIFIERS",
    "NAMESPACES",
    "RegistryEntry",
    "TREE_VERIFIERS",
    "broken_names",
    "broken_verifiers",
    "builtin_names",
    "builtin_verifiers",
    "describe",
    "engine_names",
    "entries",
    "find",
    "historic_names",
    "load_broken",
    "load_engine",
    "load_historic",
    "load_object",
    "load_tree_verifier",
    "load_verifier",
    "namespaces",
    "sampling_bug_verifiers",
    "tree_names",
    "tree_verifiers",
]

#: The entry-point group through which other packages register verifiers.
ENTRY_POINT_GROUP = "spectr_audit.verifiers"
#: The namespaces shipped with spectr-audit, in listing (and lookup) order.
NAMESPACES: tuple[str, ...] = ("builtin", "broken", "historic", "engine", "tree", "sampling-bugs")
#: The namespace of an entry point whose distribution is unknown.
PLUGIN_NAMESPACE = "plugin"

_RULES = "spectr_audit.verifiers"
_BROKEN = "spectr_audit.verifiers.library.broken"
_HISTORIC = "spectr_audit.verifiers.library.historic"
_ENGINES = "spectr_audit.engines"

#: builtin: short name -> "module:attribute" of the reference rules.
BUILTIN_VERIFIERS: dict[str, str] = {
    "speculative": f"{_RULES}.speculative:SpeculativeSampling",
    "kseq": f"{_RULES}.kseq:KSeq",
    "spectr-tree": f"{_RULES}.kseq:SpecTrTree",
    "rrs": f"{_RULES}.recursive_rejection:RecursiveRejection",
    "rrs-wor": f"{_RULES}.recursive_rejection:RecursiveRejectionWithoutReplacement",
    "block": f"{_RULES}.block:BlockVerification",
    "greedy-block": f"{_RULES}.greedy_block:GreedyBlockVerification",
    "greedy-block-repaired": f"{_RULES}.greedy_block:RepairedGreedyBlockVerification",
    "spectr-gbv-published": f"{_RULES}.spectr_gbv:PublishedSpecTrGBV",
    "spectr-gbv-published-alg2": f"{_RULES}.spectr_gbv:PublishedSpecTrGBVWithCorrection",
    "multi-block": f"{_RULES}.multi_block:MultiDraftBlockVerification",
}

#: tree: short name -> "module:attribute" of the built-in tree verifiers (docs/rules/trees.md).
TREE_VERIFIERS: dict[str, str] = {
    "tree-rrs": f"{_RULES}.tree:TreeRecursiveRejection",
    "tree-rrs-wor": f"{_RULES}.tree:TreeRecursiveRejectionWithoutReplacement",
    "tree-target-only": f"{_RULES}.tree:TreeTargetOnly",
    "tree-spectr": f"{_RULES}.tree:TreeSpecTr",
}

#: broken: the slips (each declares ``expected = "inexact"``), in library order.
BROKEN_VERIFIERS: dict[str, str] = {
    "independent-accept": f"{_BROKEN}:IndependentAccept",
    "kseq-low-rho": f"{_BROKEN}:KSeqLowRho",
    "kseq-dedup": f"{_BROKEN}:KSeqDedup",
    "rrs-skip-duplicates": f"{_BROKEN}:RRSSkipDuplicates",
    "resample-target": f"{_BROKEN}:ResampleTarget",
    "inflated-ratio": f"{_BROKEN}:InflatedRatio",
    "bonus-from-draft": f"{_BROKEN}:BonusFromDraft",
    "block-first-failure": f"{_BROKEN}:BlockFirstFailure",
    "residual-drop-rejected": f"{_BROKEN}:ResidualDropRejected",
    "always-accept": f"{_BROKEN}:AlwaysAccept",
}

#: broken, too: verifiers whose sampler is exact but disagrees with their own exact law (only
#: :func:`spectr_audit.statistical.agreement.sampler_law_agreement` sees those).
INCONSISTENT_VERIFIERS: dict[str, str] = {
    "kseq-sampler-drift": f"{_BROKEN}:KSeqSamplerDrift",
}

#: historic: the reproduced public bugs, in backlog order (their fixed counterparts:
#: ``spectr_audit.verifiers.library.historic.FIXED_COUNTERPART``), and two declared-lossy rules that
#: are not bugs: ``medusa-typical-acceptance`` (Medusa: declared lossy, typical acceptance, by design)
#: and ``residual-is-target`` (Spec-RL's RL-rollout residual).
HISTORIC_VERIFIERS: dict[str, str] = {
    "always-accept-npu": f"{_HISTORIC}:AlwaysAcceptBug",
    "greedy-draft-soft-q": f"{_HISTORIC}:GreedyDraftSoftQBug",
    "eagle-residual-zeroing": f"{_HISTORIC}:EagleResidualBug",
    "residual-is-target": f"{_HISTORIC}:ResidualIsTargetBug",
    "stale-residual-bonus": f"{_HISTORIC}:StaleResidualBonusBug",
    "bonus-without-temperature": f"{_HISTORIC}:BonusWithoutTemperatureBug",
    "correction-from-bonus-row": f"{_HISTORIC}:CorrectionFromBonusRowBug",
    "medusa-typical-acceptance": f"{_HISTORIC}:MedusaTypicalAcceptance",
    "strict-no-draft-probs": f"{_HISTORIC}:StrictNoDraftProbs",
    "target-only-siblings": f"{_HISTORIC}:TargetOnlySiblings",
    "target-only-inclusive-coin": f"{_HISTORIC}:TargetOnlyInclusiveCoinBug",
    "inclusive-coin": f"{_HISTORIC}:InclusiveCoinBug",
    "draft-probs-mutated": f"{_HISTORIC}:DraftProbsMutatedBug",
    "block-tokenwise-residual": f"{_HISTORIC}:BlockTokenwiseResidualBug",
}

#: engine: short name -> ("module:Class", the pip extra the engine comes with).
ENGINES: dict[str, tuple[str, str]] = {
    "transformers": (f"{_ENGINES}.transformers_sd:TransformersSpeculativeSampling", "transformers"),
    "vllm": (f"{_ENGINES}.vllm_v1:VLLMRejectionSampler", "vllm"),
    "vllm-no-draft-probs": (f"{_ENGINES}.vllm_v1:VLLMRejectionSamplerNoDraftProbs", "vllm"),
    "vllm-sampler": (f"{_ENGINES}.vllm_v1:VLLMSampler", "vllm"),
    "vllm-sampler-fixed-expand": (f"{_ENGINES}.vllm_v1:VLLMSamplerFixedExpand", "vllm"),
    "lmdeploy": (f"{_ENGINES}.lmdeploy_rs:LMDeployRejectionSampler", "lmdeploy"),
    "lmdeploy-no-draft-probs": (f"{_ENGINES}.lmdeploy_rs:LMDeployRejectionSamplerNoDraftProbs", "lmdeploy"),
    "keras-hub": (f"{_ENGINES}.keras_hub_sd:KerasHubSpeculativeSampler", "keras-hub"),
    "sglang": (f"{_ENGINES}.sglang_chain:SGLangChainVerifier", "sglang"),
    "sglang-block": (f"{_ENGINES}.sglang_chain:SGLangBlockVerifier", "sglang"),
    "eagle": (f"{_ENGINES}.eagle_tree:EagleTreeVerifier", "eagle"),
    "medusa": (f"{_ENGINES}.medusa_tree:MedusaTreeVerifier", "medusa"),
    "sglang-tree": (f"{_ENGINES}.sglang_tree:SGLangTreeVerifier", "sglang"),
}

#: How messages call a verifier of each shipped namespace.
_KIND = {"builtin": "built-in verifier", "broken": "broken verifier", "historic": "historic-bug verifier",
         "engine": "engine", "tree": "built-in tree verifier", "sampling-bugs": "sampling-bug verifier"}


def _is_tree_object(obj: Any) -> bool:
    """Whether a loaded object is a tree verifier (class, instance, or object with ``verify_tree`` only)."""
    if isinstance(obj, type):
        return issubclass(obj, TreeVerifier)
    return isinstance(obj, TreeVerifier) or (callable(getattr(obj, "verify_tree", None)) and not hasattr(obj, "verify"))


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """One registered verifier: where it lives, not yet imported.

    Attributes
    ----------
    namespace, name : str
        ``namespace:name`` is the verifier's qualified name.
    target : str
        ``"module:attribute"`` of the class (or instance, or function).
    extra : str, optional
        The pip extra an engine adapter needs.
    entry_point : importlib.metadata.EntryPoint, optional
        Set for verifiers registered by other packages.
    """

    namespace: str
    name: str
    target: str
    extra: Optional[str] = None
    entry_point: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}:{self.name}"

    @property
    def kind(self) -> str:
        return _KIND.get(self.namespace, f"verifier of {self.namespace!r}")

    def _unavailable(self, exc: BaseException) -> InvalidArgument:
        if self.extra is not None:
            return InvalidArgument(
                f"name: {self.kind} {self.name!r} needs the optional extra: pip install 'spectr-audit[{self.extra}]' "
                f"({exc})"
            )
        return InvalidArgument(f"name: {self.kind} {self.name!r} is unavailable: {type(exc).__name__}: {exc}")

    def load(self) -> Any:
        """Import and return the registered object (usually a class)."""
        try:
            if self.entry_point is not None:
                return self.entry_point.load()
            module, _, attr = self.target.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError) as exc:
            raise self._unavailable(exc) from exc
        except Exception as exc:  # a third party's module that fails on import
            if self.entry_point is None:
                raise
            raise self._unavailable(exc) from exc

    def _build(self, **kwargs: Any) -> Any:
        """The registered object, instantiated when it is a verifier class (or given arguments)."""
        obj = self.load()
        if kwargs:
            if not isinstance(obj, type):
                raise InvalidArgument(f"name: {self.kind} {self.name!r} is not a class; it takes no arguments")
            try:
                obj = obj(**kwargs)
            except ImportError as exc:
                raise self._unavailable(exc) from exc
        elif isinstance(obj, type) and issubclass(obj, (Verifier, TreeVerifier)):
            try:
                obj = obj()
            except ImportError as exc:  # engine adapters import their engine when built
                raise self._unavailable(exc) from exc
        return obj

    def create(self, **kwargs: Any) -> Verifier:
        """A fresh :class:`Verifier` (keyword arguments go to the class's constructor).

        A tree verifier comes run on the chain contract's drafts
        (:class:`~spectr_audit.contract.chain_trees.TreeVerifierAsChain`); :meth:`create_tree`
        gives it as it is.
        """
        obj = self._build(**kwargs)
        if _is_tree_object(obj):
            return _tree_as_chain(_named_tree(obj, self.name), f"{self.kind} {self.name!r}")
        verifier = as_verifier(obj)
        if not verifier.name:
            verifier.name = self.name
        return verifier

    def create_tree(self, **kwargs: Any) -> TreeVerifier:
        """A fresh :class:`~spectr_audit.contract.tree_verifier.TreeVerifier` (a chain verifier on chain trees)."""
        return _named_tree(self._build(**kwargs), self.name)


def _named_tree(obj: Any, default_name: str) -> TreeVerifier:
    if not _is_tree_object(obj) and not isinstance(obj, type) and hasattr(obj, "verify"):
        obj = as_verifier(obj)  # a chain verifier object: it runs on chain trees
    tree_verifier = as_tree_verifier(obj)
    if not tree_verifier.name:
        tree_verifier.name = default_name
    return tree_verifier


def _tree_as_chain(tree_verifier: TreeVerifier, what: str) -> Verifier:
    """A tree verifier as a chain verifier, or a message that says where to audit it instead."""
    try:
        return TreeVerifierAsChain(tree_verifier)
    except InvalidArgument:
        raise InvalidArgument(
            f"verifier: {what} verifies draft trees under the draft schemes {tree_verifier.draft_schemes} only, which "
            f"the chain contract does not draft; audit it on a tree (spectr-audit audit --tree SPEC, a suite case "
            f"with tree = ..., or load_tree_verifier)"
        ) from None


# ---------------------------------------------------------------------------------------------
# The namespaces
# ---------------------------------------------------------------------------------------------


def _shipped(namespace: str) -> list[RegistryEntry]:
    if namespace == "builtin":
        return [RegistryEntry("builtin", n, t) for n, t in BUILTIN_VERIFIERS.items()]
    if namespace == "broken":
        table = {**BROKEN_VERIFIERS, **INCONSISTENT_VERIFIERS}
        return [RegistryEntry("broken", n, t) for n, t in table.items()]
    if namespace == "historic":
        return [RegistryEntry("historic", n, t) for n, t in HISTORIC_VERIFIERS.items()]
    if namespace == "engine":
        return [RegistryEntry("engine", n, t, extra) for n, (t, extra) in ENGINES.items()]
    if namespace == "tree":
        return [RegistryEntry("tree", n, t) for n, t in TREE_VERIFIERS.items()]
    if namespace == "sampling-bugs":
        return [RegistryEntry("sampling-bugs", n, t) for n, t in sampling_bug_verifiers().items()]
    raise KeyError(namespace)


def sampling_bug_verifiers() -> dict[str, str]:
    """sampling-bugs: short name -> "module:attribute": the correct ``logits-speculative``, then the slips
    (``SAMPLING_BUG_VERIFIERS``, each declared inexact)."""
    from spectr_audit.verifiers.library.sampling_bugs import SAMPLING_BUG_VERIFIERS

    control = "spectr_audit.verifiers.library.sampling_bugs:LogitsSpeculativeSampling"
    return {"logits-speculative": control, **SAMPLING_BUG_VERIFIERS}


def _canonical(name: str) -> str:
    """A distribution name as pip spells it in a URL (PEP 503): lower case, runs of -_. as -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _plugins() -> dict[str, list[RegistryEntry]]:
    """The entry points of :data:`ENTRY_POINT_GROUP`, by namespace (read now, imported later)."""
    found: dict[str, list[RegistryEntry]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        namespace = _canonical(dist.name) if dist is not None and getattr(dist, "name", None) else PLUGIN_NAMESPACE
        if namespace in NAMESPACES:
            namespace = PLUGIN_NAMESPACE
        bucket = found.setdefault(namespace, [])
        if all(e.name != ep.name for e in bucket):
            bucket.append(RegistryEntry(namespace, ep.name, ep.value, entry_point=ep))
    return found


def namespaces() -> list[str]:
    """Every namespace: the shipped ones, then those of installed plugins (sorted)."""
    return list(NAMESPACES) + sorted(_plugins())


def entries(namespace: Optional[str] = None) -> list[RegistryEntry]:
    """The entries of one namespace, or of all (in :func:`namespaces` order); nothing is imported."""
    plugins = _plugins() if namespace is None or namespace not in NAMESPACES else {}
    if namespace is None:
        return [e for ns in NAMESPACES for e in _shipped(ns)] + [e for ns in sorted(plugins) for e in plugins[ns]]
    if namespace in NAMESPACES:
        return _shipped(namespace)
    if namespace in plugins:
        return plugins[namespace]
    raise InvalidArgument(
        f"namespace: unknown namespace {namespace!r}; known: {', '.join(list(NAMESPACES) + sorted(plugins))}"
        f"{_did_you_mean(namespace, list(NAMESPACES) + list(plugins))}"
    )


def _did_you_mean(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def _qualified(spec: str) -> Optional[RegistryEntry]:
    """The entry a ``namespace:name`` string names, if it names one (else it is an import string)."""
    namespace, sep, name = spec.partition(":")
    if not sep or not namespace or any(c in namespace for c in "./\\"):
        return None
    if namespace in NAMESPACES:
        pool = _shipped(namespace)
    else:
        pool = _plugins().get(namespace, [])
    return next((e for e in pool if e.name == name), None)


def _registered(spec: str, argument: str) -> Optional[RegistryEntry]:
    """The entry ``spec`` names (a built-in first, then ``namespace:name``, then a short name), if any."""
    if spec in BUILTIN_VERIFIERS:  # the common case: no entry-point scan, no other namespace
        return RegistryEntry("builtin", spec, BUILTIN_VERIFIERS[spec])
    if spec in TREE_VERIFIERS:
        return RegistryEntry("tree", spec, TREE_VERIFIERS[spec])
    qualified = _qualified(spec)
    if qualified is not None:
        return qualified
    if ":" in spec or _is_path(spec):
        return None
    matches = [e for e in entries() if e.name == spec]
    if len(matches) > 1:
        raise InvalidArgument(
            f"{argument}: {spec!r} is registered in several namespaces; name one of "
            f"{', '.join(repr(e.qualified_name) for e in matches)}"
        )
    return matches[0] if matches else None


def _suggestion(spec: str) -> str:
    """``; did you mean ...?`` for a name that is close to registered ones (in its namespace if it names one)."""
    if _is_path(spec.rpartition(":")[0] if ":" in spec else spec):
        return ""
    namespace, sep, _ = spec.partition(":")
    if sep:
        if namespace not in namespaces():
            return ""
        return _did_you_mean(spec, [e.qualified_name for e in entries(namespace)])
    return _did_you_mean(spec, dict.fromkeys(e.name for e in entries()))


def find(name: str, *, argument: str = "verifier") -> RegistryEntry:
    """The entry of a short name or ``namespace:name``, not imported; unknown names get a suggestion.

    Raises
    ------
    InvalidArgument
        For a name in no namespace (with the closest names), or a short name in several.
    """
    entry = _registered(name, argument)
    if entry is None:
        raise InvalidArgument(f"{argument}: unknown verifier {name!r}{_suggestion(name)}")
    return entry


def _namespace_loader(namespace: str, name: str, known: list[str], **kwargs: Any) -> Verifier:
    pool = {e.name: e for e in _shipped(namespace)}
    if name not in pool:
        raise InvalidArgument(
            f"name: unknown {_KIND[namespace]} {name!r}; known: {', '.join(known)}{_did_you_mean(name, pool)}"
        )
    return pool[name].create(**kwargs)


# -- the short-name API of each namespace ------------------------------------------------------


def builtin_names() -> list[str]:
    """Short names of the built-in verifiers, in registry order."""
    return list(BUILTIN_VERIFIERS)


def builtin_verifiers() -> list[Verifier]:
    """A fresh instance of every built-in verifier."""
    return [load_verifier(name) for name in BUILTIN_VERIFIERS]


def broken_names() -> list[str]:
    """Short names of the broken verifiers (the slips, without the inconsistent ones), in library order."""
    return list(BROKEN_VERIFIERS)


def load_broken(name: str) -> Verifier:
    """A fresh instance of the broken (or inconsistent) verifier called ``name``."""
    return _namespace_loader("broken", name, list(BROKEN_VERIFIERS) + list(INCONSISTENT_VERIFIERS))


def broken_verifiers() -> list[Verifier]:
    """A fresh instance of every broken verifier (the slips)."""
    return [load_broken(name) for name in BROKEN_VERIFIERS]


def historic_names() -> list[str]:
    """Short names of the historic-bug verifiers, in backlog order."""
    return list(HISTORIC_VERIFIERS)


def load_historic(name: str) -> Verifier:
    """A fresh instance of the historic-bug verifier called ``name``.

    Raises
    ------
    InvalidArgument
        For an unknown name, or ``block-tokenwise-residual`` when
        ``spectr_audit.verifiers.block`` is not available.
    """
    return _namespace_loader("historic", name, list(HISTORIC_VERIFIERS))


def tree_names() -> list[str]:
    """Short names of the built-in tree verifiers, in registry order."""
    return list(TREE_VERIFIERS)


def tree_verifiers() -> list[TreeVerifier]:
    """A fresh instance of every built-in tree verifier (as tree verifiers, not chain wrappers)."""
    return [load_tree_verifier(name) for name in TREE_VERIFIERS]


def engine_names() -> list[str]:
    """Short names of the engine adapters."""
    return list(ENGINES)


def load_engine(name: str, **kwargs: Any) -> Verifier:
    """Build the engine adapter called ``name`` (keyword arguments go to its constructor).

    Raises
    ------
    InvalidArgument
        For an unknown name, or when the engine is not installed (the message names the extra).
    """
    return _namespace_loader("engine", name, list(ENGINES), **kwargs)


# ---------------------------------------------------------------------------------------------
# Loading by name, import string or object
# ---------------------------------------------------------------------------------------------


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(path: Path, argument: str, target: str) -> Any:
    """Import a Python file as a module, its folder on ``sys.path`` meanwhile (so it can import its neighbours)."""
    resolved = path.resolve()
    mod_name = f"_spectr_audit_user_{abs(hash(str(resolved)))}"
    spec_obj = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec_obj is None or spec_obj.loader is None:
        raise InvalidArgument(f"{argument}: cannot load {target!r} as a Python file")
    module = importlib.util.module_from_spec(spec_obj)
    folder = str(resolved.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    sys.modules[mod_name] = module
    try:
        spec_obj.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise InvalidArgument(f"{argument}: importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def load_object(spec: str, argument: str = "verifier") -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` (``attr`` may be dotted).

    A file is imported with its folder on ``sys.path``, so it may import the modules beside it.
    """
    if ":" not in spec:
        if spec.endswith(".py") or Path(spec).is_file():
            raise InvalidArgument(
                f"{argument}: {spec!r} names a file but not the verifier in it; add ':attr', "
                f"e.g. '{spec}:MyVerifier'"
            )
        raise InvalidArgument(
            f"{argument}: {spec!r} is neither a built-in name ({', '.join(BUILTIN_VERIFIERS)}) nor a registered "
            f"one nor an import string 'package.module:attr' or 'path/to/file.py:attr'"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise InvalidArgument(f"{argument}: malformed import string {spec!r}")
    if _is_path(target):
        path = Path(target)
        if not path.is_file():
            raise InvalidArgument(f"{argument}: file {target!r} does not exist")
        module = _import_file(path, argument, target)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise InvalidArgument(f"{argument}: cannot import module {target!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidArgument(f"{argument}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_verifier(spec: Any) -> Verifier:
    """Return a :class:`Verifier` for a registered name, an import string, or an object.

    Parameters
    ----------
    spec : str or object
        A short name of any namespace (``"kseq"``, ``"always-accept"``, a plugin's name),
        ``"namespace:name"``, ``"package.module:attr"``, ``"path/to/file.py:attr"``, or a
        verifier object, class or function (see :func:`~spectr_audit.contract.convert.as_verifier`).

    Raises
    ------
    InvalidArgument
        For a name that is registered nowhere (with the closest registered names) and is not an
        import string, or an import that fails.

    Examples
    --------
    >>> load_verifier("kseq").name
    'kseq'
    >>> load_verifier("historic:inclusive-coin").name
    'inclusive-coin'
    """
    if not isinstance(spec, str):
        return as_verifier(spec)
    entry = _registered(spec, "verifier")
    if entry is not None:
        return entry.create()
    try:
        return _named(load_object(spec), spec.rpartition(":")[2])
    except InvalidArgument as exc:
        hint = _suggestion(spec)
        if not hint:
            raise
        raise InvalidArgument(f"{exc}{hint} (spectr-audit list shows every name)") from None


def _named(obj: Any, default_name: str) -> Verifier:
    if _is_tree_object(obj):
        return _tree_as_chain(_named_tree(obj, default_name), f"tree verifier {default_name!r}")
    verifier = as_verifier(obj)
    if not verifier.name:
        verifier.name = default_name
    return verifier


def load_tree_verifier(spec: Any) -> TreeVerifier:
    """Return a :class:`~spectr_audit.contract.tree_verifier.TreeVerifier` for a name, an import string or an object.

    Names resolve as in :func:`load_verifier`.  A tree verifier is returned as it is; a chain
    verifier comes as :class:`~spectr_audit.contract.chain_trees.ChainVerifierAsTree` (it runs on
    chain trees, ``DraftTree.chains(K, L)``); a chain wrapper of a tree verifier is unwrapped.

    Examples
    --------
    >>> load_tree_verifier("tree-rrs").draft_schemes
    ('iid',)
    >>> kseq = load_tree_verifier("kseq")       # a chain verifier: chain trees only
    >>> from spectr_audit.contract.tree import DraftTree
    >>> kseq.supports_tree(DraftTree.chains(2, 1)), kseq.supports_tree(DraftTree.from_paths([(0,), (0, 0)]))
    (True, False)
    """
    if not isinstance(spec, str):
        return as_tree_verifier(spec)
    entry = _registered(spec, "verifier")
    if entry is not None:
        return entry.create_tree()
    try:
        return _named_tree(load_object(spec), spec.rpartition(":")[2])
    except InvalidArgument as exc:
        hint = _suggestion(spec)
        if not hint:
            raise
        raise InvalidArgument(f"{exc}{hint} (spectr-audit list shows every name)") from None


# ---------------------------------------------------------------------------------------------
# What each verifier supports (for ``spectr-audit list``)
# ---------------------------------------------------------------------------------------------


def _tree_columns(draft_schemes: tuple, any_tree: bool) -> dict:
    """``trees`` (which draft trees the verifier takes) and ``tree_draft_schemes``, for :func:`describe`."""
    return {"trees": "any" if any_tree else "chains", "tree_draft_schemes": ",".join(draft_schemes)}


def _describe_tree(entry: RegistryEntry, row: dict, obj: Any) -> dict:
    """A tree verifier's row: its tree draft schemes, and K, L as a chain verifier where it is one."""
    if entry.namespace == "engine" and isinstance(obj, type):
        # described from the class: building an engine adapter imports the engine
        info: Any = obj
        exact = obj._tree_output_probs is not TreeVerifier._tree_output_probs
        doc = (obj.__doc__ or "").strip()
        description = obj.__dict__.get("description") or (doc.splitlines()[0] if doc else obj.description)
    else:
        info = entry.create_tree()
        exact, description = info.has_tree_law, info.description
    schemes = tuple(info.draft_schemes)
    # as a chain verifier (TreeVerifierAsChain): i.i.d. chains, or one token drawn without replacement
    chain_scheme = next((s for s in ("iid", "without_replacement") if s in schemes), None)
    row.update(
        num_drafts="[1, inf)" if chain_scheme else "-",
        draft_len=("[1, inf)" if chain_scheme == "iid" else "[1, 1]") if chain_scheme else "-",
        draft_scheme=chain_scheme or "-",
        exact_law=bool(exact),
        expected=info.expected,
        description=description,
        extra=entry.extra,
        **_tree_columns(schemes, True),
    )
    return row


def describe(entry: RegistryEntry) -> dict:
    """What a registered verifier supports: K, L, draft scheme, trees, exact law, declared verdict, logits.

    ``takes_logits`` says whether it is handed raw logits and sampling parameters (docs/sampling.md)
    rather than processed probabilities.

    ``trees`` is ``"any"`` for a tree verifier and ``"chains"`` for a chain verifier (it runs on
    ``DraftTree.chains(K, L)``); ``tree_draft_schemes`` lists the draft schemes it takes trees
    under.  Engine adapters are described from their class, without building them (which imports
    the engine); others are instantiated.  A verifier that cannot be loaded gets ``error`` instead.
    """
    row: dict = {"namespace": entry.namespace, "name": entry.name}
    try:
        obj = entry.load()
        if _is_tree_object(obj):
            return _describe_tree(entry, row, obj)
        if entry.namespace == "engine" and isinstance(obj, type) and issubclass(obj, Verifier):
            info: Any = obj
            exact = (obj._output_probs_logits is not LogitsVerifier._output_probs_logits if issubclass(obj, LogitsVerifier)
                     else obj._output_probs is not Verifier._output_probs)
            # A variant that only passes its base other constructor arguments says what it is in its docstring.
            doc = (obj.__doc__ or "").strip()
            description = obj.__dict__.get("description") or (doc.splitlines()[0] if doc else obj.description)
        else:
            info = entry.create()
            exact = info.has_exact_law
            description = info.description
    except InvalidArgument as exc:
        return {**row, "error": str(exc), "extra": entry.extra}
    row.update(
        num_drafts=Verifier.drafts_range(info),
        draft_len=Verifier.draft_len_range(info),
        draft_scheme=info.draft_scheme,
        exact_law=bool(exact),
        expected=info.expected,
        description=description,
        extra=entry.extra,
        takes_logits=bool(getattr(info, "takes_logits", False)),
        **_tree_columns((info.draft_scheme,), False),
    )
    return row
