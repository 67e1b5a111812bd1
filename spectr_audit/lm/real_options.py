"""The ``real-lm`` suite's options and prompts: :class:`RealLMOptions` (the documented run and the
``--quick`` preset) and the shipped prompts, :file:`prompts.toml`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

from spectr_audit import defaults
from spectr_audit.errors import InvalidArgument
from spectr_audit.lm.smollm import DEFAULT_SKIP_LAYERS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Prompt", "RealLMOptions", "load_prompts"]


@dataclasses.dataclass(frozen=True)
class RealLMOptions:
    """Knobs of the real-LM suite; the defaults are the documented ``real-lm`` run.

    Attributes
    ----------
    temperature : float
        Sampling temperature of both draft and target.
    skip_layers : tuple of int
        Layers the self-speculative draft skips.
    num_prompts : int or None
        Use the first this many prompts of :file:`prompts.toml` (None: all 24).
    positions_per_prompt : int
        Token-level contexts per prompt (consecutive positions of a target-sampled answer).
    token_num_drafts : tuple of int
        K values of the token-level tables.
    token_verifiers : tuple of str
        Token-level verifiers (``speculative`` runs at K = 1 only).
    rb_draws : int
        Draft tuples drawn per context for the Rao-Blackwellised and sampled tests (>= 2 gives
        the unbiased L2 estimate).
    kseq_rb_contexts : int
        K-SEQ's exact law costs K bisections over V per draw: its Rao-Blackwellised
        acceptance and fidelity use only the first this many contexts, at ``kseq_rb_num_drafts``.
    kseq_rb_num_drafts : tuple of int
    seq_methods : tuple of str
        Sequence-level verifiers (short names).
    seq_num_drafts, seq_draft_lens : tuple of int
        The (K, L) grid; single-draft methods run at K = 1 only, the SpecTr tree at K >= 2
        (at K = 1 it is token-by-token speculative sampling).
    iterations : int
        Decoding iterations per (method, K, L), spread evenly over the prompts.
    num_cells : int
        Most cells of the ratio partition used by the fidelity tests (fewer when a test has
        too few draws for them, see :func:`spectr_audit.lm.fidelity.planned_num_cells`).
    seed : int
    alpha : float
        False-alarm rate of one result's checks (Holm within the result).
    power : float
        Power used to state the sampled test's minimum detectable TV.
    min_detectable_tv : float
        The minimum detectable TV planned: a result whose sampled test rejects nothing while
        detecting only larger TVs is INCONCLUSIVE (the ``--quick`` preset reaches about 0.6).
    dtype : {"auto", "bfloat16", "float32"}
    num_threads : int or None
        ``torch.set_num_threads`` for the run (None: leave torch's setting).
    max_tree_rows : int
        Rows decoded together are capped so that ``rows * K * (L + 1) <= max_tree_rows``
        (memory: each such row is a V-long float64 distribution).
    """

    temperature: float = 1.0
    skip_layers: tuple = DEFAULT_SKIP_LAYERS
    num_prompts: Optional[int] = None
    positions_per_prompt: int = 4
    token_num_drafts: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    token_verifiers: tuple = ("speculative", "kseq", "rrs")
    rb_draws: int = 2
    kseq_rb_contexts: int = 24
    kseq_rb_num_drafts: tuple = (1, 2, 4, 8)
    seq_methods: tuple = ("speculative", "block", "spectr-tree", "multi-block", "spectr-gbv-published")
    seq_num_drafts: tuple = (1, 2, 4, 8)
    seq_draft_lens: tuple = (2, 4, 8)
    iterations: int = 96
    num_cells: int = 8
    seed: int = defaults.SEED
    alpha: float = defaults.ALPHA
    power: float = defaults.POWER
    min_detectable_tv: float = defaults.MIN_DETECTABLE_TV
    dtype: str = "auto"
    num_threads: Optional[int] = None
    max_tree_rows: int = 576

    @classmethod
    def quick(cls, **overrides) -> "RealLMOptions":
        """A small preset for smoke tests and CI (about 1.5 minutes on 2 cores, model cached)."""
        base = dict(num_prompts=4, positions_per_prompt=3, token_num_drafts=(1, 2, 4), kseq_rb_contexts=6,
                    kseq_rb_num_drafts=(2,), seq_num_drafts=(1, 2), seq_draft_lens=(2,), iterations=16)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self):
        if not self.temperature > 0:
            raise InvalidArgument(f"temperature: must be > 0, got {self.temperature}")
        if self.rb_draws < 1 or self.positions_per_prompt < 1 or self.iterations < 1:
            raise InvalidArgument("rb_draws, positions_per_prompt, iterations: must be >= 1")
        if self.num_cells < 2:
            raise InvalidArgument(f"num_cells: must be >= 2, got {self.num_cells}")
        for name in ("token_num_drafts", "seq_num_drafts", "seq_draft_lens", "kseq_rb_num_drafts"):
            values = getattr(self, name)
            if not values or any(int(v) < 1 for v in values):
                raise InvalidArgument(f"{name}: expected positive integers, got {values!r}")
        if not 0 < self.alpha < 1 or not 0 < self.power < 1:
            raise InvalidArgument(f"alpha, power: must lie in (0, 1), got {self.alpha}, {self.power}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One shipped prompt: a name and the user message."""

    name: str
    text: str


def load_prompts(path: Optional[Path] = None) -> tuple[list[Prompt], str]:
    """The prompts shipped as :file:`spectr_audit/lm/prompts.toml` and the chat format string.

    Examples
    --------
    >>> prompts, template = load_prompts()
    >>> len(prompts), "{text}" in template
    (24, True)
    """
    path = Path(path) if path is not None else Path(__file__).with_name("prompts.toml")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    prompts = [Prompt(str(p["name"]), str(p["text"])) for p in data.get("prompt", [])]
    if not prompts:
        raise InvalidArgument(f"prompts: {path} holds no [[prompt]] entries")
    return prompts, str(data.get("format", "{text}"))
