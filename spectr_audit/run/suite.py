"""Audit suites as TOML files.

A suite is a list of cases; each case names a draft and a target model, K, L,
and which checks to run.  Built-in suites ship in the wheel as
``spectr_audit/suites/<name>.toml``; ``load_suite`` takes such a name or a path.

Format::

    [suite]
    name = "my-suite"
    description = "..."
    verifiers = ["kseq", "rrs"]        # optional: default, every compatible built-in

    [[case]]
    name = "spectr-example"
    draft = [0.6, 0.4]                 # a list: a context-free distribution
    target = [0.3, 0.7]
    num_drafts = 2                     # an int, or a list to expand into several cases
    draft_len = 1                      # optional, default 1 (int or list)
    checks = ["exact", "optimality"]   # optional
    prefix = []                        # optional context before the step

    [[case]]
    name = "dirichlet-v8"
    num_drafts = [2, 4]
    draft = { dirichlet = { vocab_size = 8, concentration = 1.0, seed = 1 } }
    target = { dirichlet = { vocab_size = 8, seed = 2 } }

    [[case]]
    name = "markov-v3"
    num_drafts = 2
    draft_len = 2
    draft = { markov = { vocab_size = 3, order = 1, seed = 1, concentration = 1.0, temperature = 1.0 } }
    target = { markov = { vocab_size = 3, order = 1, seed = 2 } }
    # explicit tables: { table = [[...], ...], order = 1 }   (rows: (V+1)^order states, V = start)
    # logits: { logits = [...], temperature = 0.5 }         (context-free softmax(logits / T))

    [[case]]
    name = "eagle-like"                # a draft-tree case: no num_drafts / draft_len (the tree has them)
    draft = [0.5, 0.3, 0.2]
    target = [0.2, 0.3, 0.5]
    tree = "paths:[[0],[1],[0,0]]"     # or a builder: "cartesian:2,2", "topk_depth:2,3", "chains:2,3",
                                       # "parents:-1,0,0,1", or the path list itself: [[0], [1], [0, 0]]
    draft_scheme = ["iid", "topk"]     # optional (a string or a list to expand); default: each
                                       # verifier's own first scheme

Tree cases run the tree verifiers (the ``tree`` namespace, and the chain built-ins on chain
trees); chain cases run the chain verifiers, as before.

Sampling parameters (docs/sampling.md)::

    [[case]]
    name = "engine-sampler"
    inputs = "logits"                  # draft and target lists are raw logits ("probs", the default:
                                       # probabilities, whose logs stand for the logits)
    draft = [1.2, 0.3, -0.5, 0.9]
    target = [0.2, 1.1, 0.4, -0.8]
    num_drafts = 1
    draft_len = 2
    temperature = [0.5, 1.0, 1.5]      # scalars, or lists to expand into one case per value
    top_k = 3                          # 0 disables
    top_p = 0.9                        # 1 disables
    min_p = 0.0                        # 0 disables
    order = "vllm"                     # the engine's processing order: vllm, sglang, transformers, eagle

A case with any of these holds the verifier to the law the engine's non-speculative sampler
draws from with them (``process_logits``); a verifier that takes logits is handed the raw logits
and the parameters.  Expanded cases are named ``name/temperature=0.5`` and so on.

Generation audits of whole engines (``spectr-audit generation --suite NAME``; the format in
:mod:`spectr_audit.generation.checks`)::

    [[generation]]
    name = "toy-shared-stream"
    engine = "toy:shared-stream"       # toy | toy:SLIP | package.module:factory | path/file.py:factory
    expected = "finding"               # pass | finding
    max_new_tokens = 16
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np

from spectr_audit import defaults
from spectr_audit._validation import as_distribution
from spectr_audit.contract.sampling import SamplingParams, processing_order
from spectr_audit.contract.tree import DraftTree, TREE_DRAFT_SCHEMES
from spectr_audit.drafting.models import ContextFreeModel, MarkovModel, Model, random_markov
from spectr_audit.drafting.processed import ContextFreeLogitsModel, processed_model, sampling_summary
from spectr_audit.errors import InvalidArgument
from spectr_audit.run.budget import check_model_spec
from spectr_audit.generation.cases import parse_generation_cases
from spectr_audit.run.selection import parse_values

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Case", "Suite", "CHECKS", "SAMPLING_KEYS", "load_suite", "parse_suite", "builtin_suites", "model_from_spec",
           "tree_from_spec", "describe_tree_case", "with_sampling", "parse_values", "select_cases", "case_selection",
           "fits_selection"]

#: Every check a case may ask for.
CHECKS = ("exact", "optimality", "block-lp", "statistical", "sampler", "multi-iteration")
DEFAULT_CHECKS = ("exact", "optimality", "block-lp", "statistical", "multi-iteration")


@dataclasses.dataclass(frozen=True)
class Case:
    """One audit case: models, K, L, the context before the step and the checks to run."""

    name: str
    draft_model: Model
    target_model: Model
    num_drafts: int
    draft_len: int = 1
    prefix: tuple = ()
    checks: tuple = DEFAULT_CHECKS
    #: Built-in verifier names this case is for; ``None``: every compatible verifier.
    verifiers: Optional[tuple] = None
    #: Tokens generated by the multi-iteration audit; ``None``: L + 1 (one full block, later iterations
    #: included whenever the first emits fewer).
    num_tokens: Optional[int] = None
    description: str = ""
    #: A draft-tree case: the tree (``num_drafts`` is then its root's children, ``draft_len`` its depth).
    tree: Optional[Any] = None
    #: The tree's draft scheme; ``None``: each verifier's first.
    draft_scheme: Optional[str] = None
    #: The tree as the suite wrote it (for reports).
    tree_spec: str = ""
    #: Sampling parameters (one setting): the models are raw and the verifier is held to the processed
    #: target law (docs/sampling.md); ``None``: the models' laws as they are.
    params: Optional[Any] = dataclasses.field(default=None, hash=False)
    #: The engine's processing order the parameters are applied with.
    order: str = "vllm"
    #: How the suite gave the draft and target: ``"probs"`` or ``"logits"`` (for reports).
    inputs: str = "probs"

    @property
    def sampling(self) -> Optional[dict]:
        """The case's sampling setting as reports give it (``None`` without parameters)."""
        if self.params is None:
            return None
        return {"params": self.params.describe(), "order": self.order, "inputs": self.inputs,
                "summary": sampling_summary(self.params, self.order)}

    def laws(self) -> "Case":
        """The case with the processed laws as its models and no parameters (itself without parameters):
        what the bounds, the block LP and the probability checks are computed on."""
        if self.params is None:
            return self
        return dataclasses.replace(self, draft_model=processed_model(self.draft_model, self.params, self.order),
                                   target_model=processed_model(self.target_model, self.params, self.order),
                                   params=None)

    @property
    def vocab_size(self) -> int:
        return self.draft_model.vocab_size


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    cases: tuple
    description: str = ""
    verifiers: Optional[tuple] = None
    source: str = ""
    #: The suite's ``[[generation]]`` cases (:class:`~spectr_audit.generation.checks.GenerationCase`): generation
    #: audits of engines, run by ``spectr-audit generation --suite`` (not by ``run``).
    generation: tuple = ()


def builtin_suites() -> list[str]:
    """Names of the suites shipped with spectr-audit."""
    files = resources.files("spectr_audit.suites")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".toml"))


def load_suite(name_or_path: str, *, max_memory: Any = None, sampling: Optional[dict] = None) -> Suite:
    """Load a built-in suite by name, or a suite file by path.

    ``max_memory`` (bytes, or a size such as ``"4GiB"``; default a fraction of the machine's
    memory) bounds the model tables the suite may build (:mod:`spectr_audit.run.budget`).
    ``sampling`` (keys of :data:`SAMPLING_KEYS`: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``order``, ``inputs``) overrides those keys of every chain case (the CLI's ``--temperature``
    and the rest).
    """
    path = Path(name_or_path)
    if name_or_path in builtin_suites():
        text = resources.files("spectr_audit.suites").joinpath(f"{name_or_path}.toml").read_text()
        source = f"built-in suite {name_or_path!r}"
        base = None
    elif path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise InvalidArgument(f"suite: file {name_or_path!r} does not exist")
        text = path.read_text()
        source = f"suite file {name_or_path!r}"
        base = path.resolve().parent
    else:
        raise InvalidArgument(
            f"suite: {name_or_path!r} is neither a built-in suite ({', '.join(builtin_suites())}) nor a .toml file"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{source}: not valid TOML: {exc}") from exc
    return parse_suite(data, source=source, default_name=path.stem, max_memory=max_memory, sampling=sampling, base=base)


def _fail(where: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {message}")


def _int_list(value: Any, where: str, key: str, minimum: int) -> list[int]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in values):
        raise _fail(where, f"{key}: expected an integer >= {minimum} or a list of them, got {value!r}")
    return values


def _dirichlet(spec: dict, where: str) -> ContextFreeModel:
    allowed = {"vocab_size", "concentration", "seed", "temperature"}
    _check_keys(spec, allowed, where)
    vocab_size = spec.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise _fail(where, f"vocab_size: expected a positive integer, got {vocab_size!r}")
    concentration = float(spec.get("concentration", 1.0))
    temperature = float(spec.get("temperature", 1.0))
    if concentration <= 0 or temperature <= 0:
        raise _fail(where, "concentration and temperature must be > 0")
    rng = np.random.default_rng(int(spec.get("seed", 0)))
    probs = rng.dirichlet(np.full(vocab_size, concentration))
    logits = np.log(np.clip(probs, 1e-300, None)) / temperature
    probs = np.exp(logits - logits.max())
    return ContextFreeModel(probs / probs.sum())


def _check_keys(spec: dict, allowed: set, where: str) -> None:
    unknown = set(spec) - allowed
    if unknown:
        raise _fail(where, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def model_from_spec(spec: Any, where: str, *, max_memory: Any = None, inputs: str = "probs") -> Model:
    """Build a model from its TOML description (see the module docstring).

    A random model's tables are checked against ``max_memory`` before they are allocated
    (:class:`~spectr_audit.run.budget.MemoryBudgetExceeded`, naming the size and the budget).
    With ``inputs="logits"`` a list is a context-free model's raw logits (``-inf`` allowed) and
    a table's rows are logits.
    """
    if inputs not in INPUTS:
        raise _fail(where, f"inputs: expected one of {list(INPUTS)}, got {inputs!r}")
    check_model_spec(spec, where, max_memory)
    try:
        if isinstance(spec, list) and inputs == "logits":
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec):
                raise _fail(where, f"expected a list of logits (numbers, -inf allowed), got {spec!r}")
            return ContextFreeLogitsModel(spec)
        if isinstance(spec, list):
            return ContextFreeModel(as_distribution(spec, where))
        if not isinstance(spec, dict) or len(spec) == 0:
            raise _fail(where, f"expected a list of probabilities or a table, got {spec!r}")
        if "dirichlet" in spec:
            return _dirichlet(spec["dirichlet"], f"{where}.dirichlet")
        if "markov" in spec:
            m = spec["markov"]
            _check_keys(m, {"vocab_size", "order", "seed", "concentration", "temperature"}, f"{where}.markov")
            if not isinstance(m.get("vocab_size"), int):
                raise _fail(f"{where}.markov", f"vocab_size: expected an integer, got {m.get('vocab_size')!r}")
            return random_markov(
                m["vocab_size"],
                int(m.get("order", 1)),
                concentration=float(m.get("concentration", 1.0)),
                temperature=float(m.get("temperature", 1.0)),
                seed=int(m.get("seed", 0)),
            )
        if "table" in spec:
            _check_keys(spec, {"table", "order"}, where)
            order = int(spec.get("order", 1))
            table = np.asarray(spec["table"], dtype=np.float64)
            if inputs == "logits":  # rows of logits: their softmax (its log stands for them)
                table = np.exp(table - table.max(-1, keepdims=True))
                table = table / table.sum(-1, keepdims=True)
            vocab_size = table.shape[-1]
            return MarkovModel(table.reshape((vocab_size + 1,) * order + (vocab_size,)), order)
        if "logits" in spec:
            _check_keys(spec, {"logits", "temperature"}, where)
            logits = np.asarray(spec["logits"], dtype=np.float64) / float(spec.get("temperature", 1.0))
            probs = np.exp(logits - logits.max())
            return ContextFreeModel(probs / probs.sum())
        raise _fail(where, f"unknown model kind {sorted(spec)}; expected dirichlet, markov, table or logits")
    except InvalidArgument as exc:
        msg = str(exc)
        raise InvalidArgument(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except (TypeError, ValueError) as exc:
        raise _fail(where, f"{type(exc).__name__}: {exc}") from None


#: The sampling keys of a case (docs/sampling.md); the first four may be lists, expanded into cases.
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "order", "inputs")
_PARAM_KEYS = SAMPLING_KEYS[:4]
#: How a case may give its draft and target.
INPUTS = ("probs", "logits")

_CASE_KEYS = {
    "name", "description", "draft", "target", "num_drafts", "draft_len", "checks", "prefix", "verifiers", "num_tokens",
    "tree", "draft_scheme", *SAMPLING_KEYS,
}

#: Tree builders a spec may name, with their integer arguments.
_TREE_BUILDERS = ("paths", "parents", "cartesian", "topk_depth", "chains")


def tree_from_spec(spec: Any, where: str = "tree") -> Any:
    """Build a :class:`~spectr_audit.contract.tree.DraftTree` from a suite or CLI spec.

    ``"paths:[[0],[1],[0,0]]"`` (or the bare list, a string or a TOML array) is EAGLE's and
    Medusa's path-list format; ``"cartesian:2,2"`` Medusa's cartesian candidates;
    ``"topk_depth:2,3"`` the top-k x depth tree; ``"chains:2,3"`` K chains of L;
    ``"parents:-1,0,0,1"`` a parent list in any topological order.

    Examples
    --------
    >>> tree_from_spec("paths:[[0],[1],[0,0]]").parents
    (-1, 0, 0, 1)
    >>> tree_from_spec("topk_depth:2,2").num_draft_nodes, tree_from_spec("chains:2,3").as_chains()
    (6, (2, 3))
    >>> tree_from_spec("cartesian:2,0")
    Traceback (most recent call last):
    ...
    spectr_audit.errors.InvalidArgument: tree: topk_per_head: expected a non-empty list of integers >= 1, got [2, 0]
    """
    import json

    if isinstance(spec, DraftTree):
        return spec
    try:
        if isinstance(spec, list):
            return DraftTree.from_paths(spec)
        if not isinstance(spec, str) or not spec.strip():
            raise _fail(where, f"expected a path list or a spec string such as 'cartesian:2,2', got {spec!r}")
        text = spec.strip()
        if text.startswith("["):
            kind, rest = "paths", text
        else:
            kind, sep, rest = text.partition(":")
            kind = kind.strip().replace("-", "_")
            if not sep or kind not in _TREE_BUILDERS:
                raise _fail(where, f"expected 'kind:arguments' with kind one of {', '.join(_TREE_BUILDERS)} "
                                   f"(e.g. 'paths:[[0],[1],[0,0]]', 'cartesian:2,2'), got {spec!r}")
        if kind == "paths":
            try:
                paths = json.loads(rest)
            except json.JSONDecodeError as exc:
                raise _fail(where, f"paths: not a JSON list of lists ({exc}): {rest!r}") from None
            return DraftTree.from_paths(paths)
        try:
            numbers = [int(x) for x in rest.split(",") if x.strip()]
        except ValueError:
            raise _fail(where, f"{kind}: expected comma-separated integers, got {rest!r}") from None
        if kind == "parents":
            return DraftTree.from_parents(numbers)
        if kind == "cartesian":
            return DraftTree.cartesian(numbers)
        if len(numbers) != 2:
            raise _fail(where, f"{kind}: expected two integers, got {rest!r}")
        return DraftTree.topk_depth(*numbers) if kind == "topk_depth" else DraftTree.chains(*numbers)
    except InvalidArgument as exc:
        msg = str(exc)
        raise InvalidArgument(msg if msg.startswith(where) else f"{where}: {msg}") from None


def describe_tree_case(case: "Case") -> dict:
    """The tree of a tree case as the reports describe it: spec, one-line description, paths, parents, scheme."""
    tree = case.tree
    return {
        "spec": case.tree_spec,
        "description": tree.describe(),
        "paths": [list(p) for p in tree.to_paths()],
        "parents": list(tree.parents),
        "num_draft_nodes": tree.num_draft_nodes,
        "max_depth": tree.max_depth,
        "draft_scheme": case.draft_scheme,
    }


def _tree_spec_text(spec: Any) -> str:
    return spec if isinstance(spec, str) else "paths:" + str([list(p) for p in spec]).replace(" ", "")


def _tree_cases(raw, where, name, seen, draft_model, target_model, checks, prefix, verifiers, num_tokens) -> list:
    """The cases of one ``[[case]]`` with a ``tree``: one per draft scheme listed (or one for each verifier's own)."""
    for key in ("num_drafts", "draft_len"):
        if key in raw:
            raise _fail(where, f"{key}: a tree case takes it from its tree (the root's children, the depth); remove it")
    if num_tokens is not None:
        raise _fail(where, "num_tokens: a tree case audits one step (max_depth + 1 tokens); remove it")
    tree = tree_from_spec(raw["tree"], f"{where} tree")
    schemes = raw.get("draft_scheme")
    schemes = [None] if schemes is None else (schemes if isinstance(schemes, list) else [schemes])
    if not schemes or any(s is not None and s not in TREE_DRAFT_SCHEMES for s in schemes):
        raise _fail(where, f"draft_scheme: expected one of {list(TREE_DRAFT_SCHEMES)} or a list of them, "
                           f"got {raw.get('draft_scheme')!r}")
    out = []
    for scheme in schemes:
        label = name + (f"/{scheme}" if len(schemes) > 1 else "")
        if label in seen:
            raise _fail(where, f"name: duplicate case name {label!r}")
        seen.add(label)
        out.append(Case(
            name=label, draft_model=draft_model, target_model=target_model, num_drafts=len(tree.children[0]),
            draft_len=tree.max_depth, prefix=tuple(prefix), checks=tuple(checks),
            verifiers=tuple(verifiers) if verifiers is not None else None, description=str(raw.get("description", "")),
            tree=tree, draft_scheme=scheme, tree_spec=_tree_spec_text(raw["tree"]),
        ))
    return out


def _sampling_value(value: Any, key: str, where: str) -> list:
    values = value if isinstance(value, list) else [value]
    integer = key == "top_k"
    ok = [isinstance(v, int if integer else (int, float)) and not isinstance(v, bool) for v in values]
    if not values or not all(ok):
        kind = "an integer" if integer else "a number"
        raise _fail(where, f"{key}: expected {kind} or a list of them, got {value!r}")
    return values


def _sampling_settings(raw: dict, where: str, overrides: Optional[dict]) -> list:
    """The sampling settings of one ``[[case]]``: ``(label suffix, params or None, order, inputs)`` for each
    combination of its listed values (``overrides`` replace the case's keys)."""
    given = {key: raw[key] for key in SAMPLING_KEYS if key in raw}
    given.update({key: value for key, value in (overrides or {}).items() if value is not None})
    unknown = set(overrides or {}) - set(SAMPLING_KEYS)
    if unknown:
        raise _fail(where, f"sampling: unknown key(s) {sorted(unknown)}; allowed: {list(SAMPLING_KEYS)}")
    inputs = given.get("inputs", "probs")
    if inputs not in INPUTS:
        raise _fail(where, f"inputs: expected one of {list(INPUTS)}, got {inputs!r}")
    order = given.get("order", "vllm")
    if not isinstance(order, str):
        raise _fail(where, f"order: expected the name of a processing order, got {order!r}")
    try:
        processing_order(order)
    except InvalidArgument as exc:
        raise _fail(where, str(exc)) from None
    if not given:
        return [("", None, "vllm", "probs")]
    lists = {key: _sampling_value(given[key], key, where) for key in _PARAM_KEYS if key in given}
    expanded = [key for key in _PARAM_KEYS if isinstance(given.get(key), list) and len(given[key]) > 1]
    settings = []
    for combo in itertools.product(*lists.values()):
        values = dict(zip(lists, combo))
        try:
            params = SamplingParams(**values)
        except InvalidArgument as exc:
            raise _fail(where, str(exc)) from None
        suffix = "".join(f"/{key}={values[key]:g}" for key in expanded)
        settings.append((suffix, params, order, inputs))
    return settings


def with_sampling(suite: "Suite", params: Any = None, order: Optional[str] = None) -> "Suite":
    """``suite`` with ``params`` (and ``order``) on every chain case (tree cases are kept as they are).

    ``params`` ``None`` keeps each case's own parameters (``order`` then only changes those of the
    cases that have parameters).
    """
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
    if params is not None and params.batch_size is not None:
        raise InvalidArgument("params: a suite takes one setting for all its rows; give scalars")
    if order is not None:
        processing_order(order)
    cases = []
    for case in suite.cases:
        if getattr(case, "tree", None) is None and (params is not None or case.params is not None):
            case = dataclasses.replace(case, params=params if params is not None else case.params,
                                       order=order or case.order)
        cases.append(case)
    return dataclasses.replace(suite, cases=tuple(cases))


def _suite_verifiers(header: dict, source: str) -> Optional[list]:
    """The ``[suite]`` table's ``verifiers`` (None: every compatible verifier)."""
    suite_verifiers = header.get("verifiers")
    if suite_verifiers is not None and not (
        isinstance(suite_verifiers, list) and all(isinstance(v, str) for v in suite_verifiers)
    ):
        raise _fail(f"{source} [suite]", f"verifiers: expected a list of names, got {suite_verifiers!r}")
    return suite_verifiers


def _case_tables(raw, where: str, suite_verifiers, sampling, max_memory, seen: set) -> list:
    """The cases of one ``[[case]]`` table: its keys validated, its models built, its grid expanded."""
    if not isinstance(raw, dict):
        raise _fail(where, "expected a table")
    if "name" in raw:
        where = f"{where} ({raw['name']!r})"
    _check_keys(raw, _CASE_KEYS, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(where, "name: expected a non-empty string")
    for key in ("draft", "target"):
        if key not in raw:
            raise _fail(where, f"{key}: missing")
    settings = _sampling_settings(raw, where, None if "tree" in raw else sampling)
    inputs = settings[0][3]
    draft_model = model_from_spec(raw["draft"], f"{where} draft", max_memory=max_memory, inputs=inputs)
    target_model = model_from_spec(raw["target"], f"{where} target", max_memory=max_memory, inputs=inputs)
    if draft_model.vocab_size != target_model.vocab_size:
        raise _fail(
            where, f"draft and target have different vocab sizes ({draft_model.vocab_size} vs {target_model.vocab_size})"
        )
    checks = raw.get("checks", list(DEFAULT_CHECKS))
    if not isinstance(checks, list) or not all(c in CHECKS for c in checks):
        raise _fail(where, f"checks: expected a list drawn from {list(CHECKS)}, got {checks!r}")
    prefix = raw.get("prefix", [])
    if not isinstance(prefix, list) or not all(
        isinstance(t, int) and 0 <= t < draft_model.vocab_size for t in prefix
    ):
        raise _fail(where, f"prefix: expected a list of token ids in [0, {draft_model.vocab_size}), got {prefix!r}")
    verifiers = raw.get("verifiers", suite_verifiers)
    if verifiers is not None and not (isinstance(verifiers, list) and all(isinstance(v, str) for v in verifiers)):
        raise _fail(where, f"verifiers: expected a list of names, got {verifiers!r}")
    num_tokens = raw.get("num_tokens")
    if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 1):
        raise _fail(where, f"num_tokens: expected a positive integer, got {num_tokens!r}")
    if "tree" in raw:
        if settings[0][1] is not None:
            raise _fail(where, "temperature, top_k, top_p, min_p: sampling parameters are for chain cases; "
                               "remove them from this tree case")
        return _tree_cases(raw, where, name, seen, draft_model, target_model, checks, prefix, verifiers, num_tokens)
    if "draft_scheme" in raw:
        raise _fail(where, "draft_scheme: only for a tree case (with tree = ...); a chain verifier declares its own")
    common = dict(draft_model=draft_model, target_model=target_model, prefix=tuple(prefix), checks=tuple(checks),
                  verifiers=tuple(verifiers) if verifiers is not None else None, num_tokens=num_tokens,
                  description=str(raw.get("description", "")))
    return _chain_grid(raw, where, name, settings, seen, common)


def _chain_grid(raw: dict, where: str, name: str, settings: list, seen: set, common: dict) -> list:
    """A chain table's cases: one per (K, L, sampling setting), named ``name/K=k/L=l`` and the setting's suffix
    (a part only where the table lists more than one value)."""
    ks = _int_list(raw.get("num_drafts"), where, "num_drafts", 1)
    ls = _int_list(raw.get("draft_len", 1), where, "draft_len", 1)
    cases = []
    for (k, length), (suffix, params, order, inputs) in itertools.product(itertools.product(ks, ls), settings):
        label = name
        if len(ks) > 1:
            label += f"/K={k}"
        if len(ls) > 1:
            label += f"/L={length}"
        label += suffix
        if label in seen:
            raise _fail(where, f"name: duplicate case name {label!r}")
        seen.add(label)
        cases.append(Case(name=label, num_drafts=k, draft_len=length, params=params, order=order, inputs=inputs,
                          **common))
    return cases


def parse_suite(data: dict, source: str = "suite", default_name: str = "suite", *, max_memory: Any = None,
                sampling: Optional[dict] = None, base: Any = None) -> Suite:
    """Validate a parsed TOML document and build its :class:`Suite` (models within ``max_memory``;
    ``sampling`` overrides the sampling keys of every chain case, see :func:`load_suite`).

    ``[[generation]]`` tables are generation-audit cases (:mod:`spectr_audit.generation.checks`; a
    relative factory file is looked up in ``base``, the suite file's folder); a suite may hold
    only those, only ``[[case]]`` tables, or both.
    """
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: expected a TOML table at the top level")
    _check_keys(data, {"suite", "case", "generation"}, source)
    header = data.get("suite", {})
    if not isinstance(header, dict):
        raise _fail(source, "[suite] must be a table")
    _check_keys(header, {"name", "description", "verifiers"}, f"{source} [suite]")
    generation: tuple = ()
    if "generation" in data:
        generation = parse_generation_cases(data["generation"], source, base)
    raw_cases = data.get("case")
    if generation and "case" not in data:
        raw_cases = []
    elif not isinstance(raw_cases, list) or not raw_cases:
        raise _fail(source, "expected at least one [[case]] (or [[generation]] for generation audits)")
    suite_verifiers = _suite_verifiers(header, source)
    cases: list = []
    seen: set = set()
    for i, raw in enumerate(raw_cases):
        cases.extend(_case_tables(raw, f"{source} case[{i}]", suite_verifiers, sampling, max_memory, seen))
    return Suite(
        name=str(header.get("name", default_name)),
        cases=tuple(cases),
        description=str(header.get("description", "")),
        verifiers=tuple(suite_verifiers) if suite_verifiers else None,
        source=source,
        generation=generation,
    )


# ---------------------------------------------------------------------------------------------
# Which cases a verifier is audited on
# ---------------------------------------------------------------------------------------------


def _shape_text(values: Optional[tuple]) -> str:
    return "any" if values is None else ", ".join(map(str, values))


def select_cases(suite: Suite, num_drafts: Any = None, draft_len: Any = None) -> Suite:
    """The suite with only its cases of K in ``num_drafts`` and L in ``draft_len`` (``None``: any).

    A tree case counts by its root's children and its depth.  Raises :class:`InvalidArgument` naming the
    arguments and the K and L the suite has when no case is left.
    """
    ks = None if num_drafts is None else parse_values(num_drafts, "num_drafts")
    ls = None if draft_len is None else parse_values(draft_len, "draft_len")
    if ks is None and ls is None:
        return suite
    cases = tuple(c for c in suite.cases if (ks is None or c.num_drafts in ks) and (ls is None or c.draft_len in ls))
    if suite.cases and not cases:
        have_k = sorted({c.num_drafts for c in suite.cases})
        have_l = sorted({c.draft_len for c in suite.cases})
        raise InvalidArgument(
            f"num_drafts, draft_len: no case of suite {suite.name!r} has K in {{{_shape_text(ks)}}} and L in "
            f"{{{_shape_text(ls)}}}; its cases have K in {{{_shape_text(tuple(have_k))}}} and L in "
            f"{{{_shape_text(tuple(have_l))}}}")
    return dataclasses.replace(suite, cases=cases)


def case_selection(verifier: Any, num_drafts: Any = None, draft_len: Any = None) -> tuple:
    """The K and L values (``None``: any) a suite run audits ``verifier`` at: those selected, and for a verifier
    that declares none of its (K, L) (a plain function: ``declares_shape`` false) the stated default
    :data:`spectr_audit.defaults.UNDECLARED_NUM_DRAFTS` / :data:`~spectr_audit.defaults.UNDECLARED_DRAFT_LEN` in
    each one not selected.  A declared verifier runs at every selected (K, L) it supports."""
    ks = None if num_drafts is None else parse_values(num_drafts, "num_drafts")
    ls = None if draft_len is None else parse_values(draft_len, "draft_len")
    if not getattr(verifier, "declares_shape", True):
        ks = defaults.UNDECLARED_NUM_DRAFTS if ks is None else ks
        ls = defaults.UNDECLARED_DRAFT_LEN if ls is None else ls
    return ks, ls


def fits_selection(case: Case, selection: tuple) -> bool:
    """Whether ``case`` has its K and L among ``selection`` (from :func:`case_selection`)."""
    ks, ls = selection
    return (ks is None or case.num_drafts in ks) and (ls is None or case.draft_len in ls)
