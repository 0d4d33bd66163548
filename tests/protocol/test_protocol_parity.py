"""The job protocol's generation fields are the engine's SamplingParams, by the same names and defaults."""

from __future__ import annotations

import pytest

from protocol.models import GenerationParams
from worker import SamplingParams


def test_generation_fields_match_sampling_params():
    assert list(GenerationParams.model_fields) == SamplingParams.field_names()
    # the protocol's defaults, handed to the engine, are the engine's own defaults
    assert SamplingParams(**GenerationParams().model_dump()).to_dict() == SamplingParams().to_dict()


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0}, {"top_k": -1},
                                 {"min_p": 1.5}, {"presence_penalty": 3}, {"logprobs": 21}])
def test_both_sides_refuse_the_same_values(bad):
    with pytest.raises(ValueError):
        GenerationParams(**bad)
    with pytest.raises(ValueError):
        SamplingParams(**bad)
