"""The drafter settings a job may choose: every drafter's name and every bound, stated once.

The job spec's schema (`pipeline.spec.schema.DrafterSpec`) and the engine's own config
(`pipeline.decode.engine.EngineConfig`) both take their names and limits from here, so a value
the spec accepts is one the engine runs, and a bench or a test that builds an engine directly
meets the same limits. Kept free of torch: the spec is validated where no model is loaded.
"""

from __future__ import annotations

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
        if (low is not None and value < low) or (high is not None and value > high):
            shown = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
            raise ValueError(f"{name} must be in {shown}, got {value}")
    sources = settings.auto_sources
    if not sources or not set(sources) <= set(AUTO_CHOICES):
        raise ValueError(f"auto_sources must be a non-empty part of {AUTO_CHOICES}: {tuple(sources)}")
