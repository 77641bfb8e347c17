"""The drafter settings a job may choose: every drafter's name and every bound, stated once,
and the engine's config (`EngineConfig`) built on them.

The job spec's schema (`pipeline.spec.schema.DrafterSpec`) and `EngineConfig` both take their
names and limits from here, so a value the spec accepts is one the engine runs, and a bench or
a test that builds an engine directly meets the same limits. The policy reads the config too,
without importing the engine. Kept free of torch: the spec is validated where no model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

AUTO, NONE = "auto", "none"
DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX = "draft_model", "prompt_lookup", "suffix"
HEAD = "head"  # a draft head on the target's features (`pipeline.decode.head`)
# the drafters `auto` chooses among per row by default; also the head, where a job names one
AUTO_SOURCES = (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX)
AUTO_CHOICES = (*AUTO_SOURCES, HEAD)
DRAFTERS = (AUTO, *AUTO_SOURCES, HEAD, NONE)
# the drafters that need no draft model loaded
MODEL_FREE = (NONE, PROMPT_LOOKUP, SUFFIX, HEAD)

# The longest suffix of a row's text the suffix drafter looks for in its corpus, and so the
# longest match it can demand (`suffix_min_match`).
SUFFIX_MAX_DEPTH = 32

# (lowest, highest) each numeric setting may take; None: no limit that side.
# gamma_max 0 drafts nothing: target-only decoding, as the drafter "none".
BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "gamma_max": (0, 32),
    "ngram_min": (1, 16),
    "ngram_max": (1, 16),
    "draft_vocab": (0, None),
    "guess_tokens": (0, 16),
    "suffix_max_tokens": (0, None),
    "suffix_min_match": (1, SUFFIX_MAX_DEPTH),
    "head_online_share": (0, 4),
    "plain_steps": (1, 64),  # None: the target runner's choice
}


def field_bounds(name: str) -> dict[str, float]:
    """`BOUNDS[name]` as pydantic's Field keywords (ge, le)."""
    low, high = BOUNDS[name]
    return {k: v for k, v in (("ge", low), ("le", high)) if v is not None}


def check(settings: object) -> None:
    """Raise ValueError for the first drafter setting of `settings` outside its bounds or names."""
    drafter = getattr(settings, "drafter", AUTO)
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    for name, (low, high) in BOUNDS.items():
        value = getattr(settings, name)
        if value is None:  # left to the engine
            continue
        if (low is not None and value < low) or (high is not None and value > high):
            shown = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
            raise ValueError(f"{name} must be in {shown}, got {value}")
    sources = settings.auto_sources
    if not sources or not set(sources) <= set(AUTO_CHOICES):
        raise ValueError(f"auto_sources must be a non-empty part of {AUTO_CHOICES}: {tuple(sources)}")


@dataclass(frozen=True)
class EngineConfig:
    """How to speculate. `adaptive=False` always drafts `gamma_max` tokens (fixed gamma).

    Its names and bounds are the ones above (`check`), which the job spec's schema reads too;
    a job's config is `from_spec(spec.drafter)`."""

    drafter: str = "auto"
    gamma_max: int = 8
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    probe_every: int = 32  # rounds without a drafter (draft model, copies) before trying it again
    probe_alpha: float = 0.95  # acceptance a probe hopes for: no probe when even that cannot pay
    probe_budget: float = 0.05  # most a probe may risk on catch-up, as a share of the plain decoding left
    # The draft model proposes among token ids below this (plus prompt tokens and EOS); 0: all.
    draft_vocab: int = 32768
    # Speculate only when the expected rate beats target-only by this much: cost estimates are
    # noisy (a slow spell inflates one measurement), and a marginal gain is not worth the risk.
    min_gain: float = 0.05
    # A lone row's draft model checks this many tokens of a prompt-lookup copy in one pass as a
    # guess at its own next drafts (see `DraftModelDrafter.propose`); 0: one pass per draft.
    guess_tokens: int = 3
    # The suffix drafter's corpus of this engine's earlier outputs keeps at most this many
    # tokens, the oldest dropped first (0: only the row's own text); it proposes nothing where
    # no suffix of at least `suffix_min_match` tokens matches.
    suffix_max_tokens: int = 1 << 20
    suffix_min_match: int = 1
    # The drafters `auto` chooses among: leaving one out measures what it adds to the others.
    auto_sources: tuple[str, ...] = AUTO_SOURCES
    # The draft head learns from the rows it drafts for, between shards (`refine_head`), for
    # this many seconds per second of decoding (`OnlineHead`).
    head_online: bool = False
    head_online_share: float = 0.25
    # A greedy round that drafts nothing runs this many target passes back to back (fewer near
    # the rows' token limit), each row fed its own last choice without the host in between
    # (`BatchedLM.greedy_steps`). None: the target runner's choice (`plain_steps` there: several
    # where passes are captured graphs, whose cost is about the round's around them; one on a
    # CPU, whose passes dwarf the round).
    plain_steps: int | None = None
    # Greedy prompt lookup alone (the drafter `prompt_lookup`) drafts, verifies and accepts this
    # many rounds back to back on the device, the host reading once (`StaticLM.lookup_steps`);
    # 1: every round on the host. Not a job setting yet: at 1 until a GPU measures the loop
    # against host rounds (scripts/gpu_profile.py --lookup-steps, docs/gpu.md).
    lookup_steps: int = 1
    # While a target pass runs on a GPU the host only waits for it: the suffix drafter then does
    # what no round's result changes (rows' reflowed prompts, finished outputs into its corpus)
    # for at most PREPARE_SHARE of a plain pass's time (`SuffixDrafter.prepare`). None: where
    # the host waits on a device (CUDA); True on a CPU too, where it only does that work sooner.
    prepare_in_passes: bool | None = None

    def __post_init__(self) -> None:
        check(self)
        if not 1 <= self.lookup_steps <= 64:
            raise ValueError(f"lookup_steps must be in 1..64, got {self.lookup_steps}")

    @classmethod
    def from_spec(cls, section, drafter: str | None = None) -> EngineConfig:
        """The config a job spec's `drafter` section asks for (any object with its fields):
        every field the two share is copied by name, so a new setting is added in one place.
        `drafter` overrides the section's `kind` (the speedup sample's target-only twin)."""
        shared = {f.name: getattr(section, f.name) for f in fields(cls) if hasattr(section, f.name)}
        shared["auto_sources"] = tuple(shared.get("auto_sources", AUTO_SOURCES))
        return cls(drafter=drafter or section.kind, **shared)
