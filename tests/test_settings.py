"""The drafter settings are named and bounded once (`pipeline.decode.settings`): the job spec
and the engine accept exactly the same values, and a job's engine config is its spec's."""

from dataclasses import fields

import pydantic
import pytest

from pipeline.decode import settings
from pipeline.decode.settings import EngineConfig
from pipeline.spec.schema import DrafterSpec


@pytest.mark.parametrize("name", sorted(settings.BOUNDS))
def test_spec_and_engine_share_every_bound(name):
    low, high = settings.BOUNDS[name]
    base = {"ngram_min": 1, "ngram_max": 16} if name.startswith("ngram") else {}
    for value, fine in (
        (low, True),
        (high, True),
        (low - 1, False),
        (None if high is None else high + 1, False),
    ):
        if value is None:
            continue
        values = {**base, name: value}
        if fine:
            DrafterSpec(**values)
            EngineConfig(**values)
            continue
        with pytest.raises(pydantic.ValidationError):
            DrafterSpec(**values)
        with pytest.raises(ValueError, match=name):
            EngineConfig(**values)


def test_names_are_the_spec_choices():
    for kind in settings.DRAFTERS:
        head = "/heads/h" if kind == settings.HEAD else None  # a head is named where it is asked for
        assert EngineConfig.from_spec(DrafterSpec(kind=kind, head=head)).drafter == kind
    with pytest.raises(pydantic.ValidationError):
        DrafterSpec(kind="medusa")
    with pytest.raises(pydantic.ValidationError, match="drafter.kind is 'head'"):
        DrafterSpec(kind="head")
    with pytest.raises(ValueError, match="drafter"):
        EngineConfig(drafter="medusa")
    with pytest.raises(ValueError, match="auto_sources"):
        EngineConfig(auto_sources=("medusa",))


def test_from_spec_copies_every_shared_field():
    spec = DrafterSpec(
        kind="auto",
        gamma_max=5,
        adaptive=False,
        ngram_min=2,
        ngram_max=7,
        draft_vocab=0,
        guess_tokens=9,
        suffix_max_tokens=123,
        suffix_min_match=3,
        auto_sources=["suffix", "prompt_lookup", "head"],
        head="heads/mine",
        head_online=True,
        head_online_share=1.5,
        plain_steps=2,
    )
    config = EngineConfig.from_spec(spec)
    shared = [f.name for f in fields(EngineConfig) if f.name in DrafterSpec.model_fields]
    assert len(shared) == 12  # every drafter setting but `kind`, the head's and the warm start's URLs
    for name in shared:
        expected = getattr(spec, name)
        assert getattr(config, name) == (tuple(expected) if isinstance(expected, list) else expected)
    assert config.drafter == "auto" and config.head_online_share == 1.5 and config.plain_steps == 2
    assert EngineConfig.from_spec(DrafterSpec()).plain_steps is None  # unset: the runner's choice
    assert EngineConfig.from_spec(spec, "none").drafter == "none"  # the target-only twin
