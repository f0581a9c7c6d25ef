"""The MaxText decode keys -> SamplerConfig builder (grpax.sampler.keys) of train_rl, evaluate, generate."""

import pytest

from grpax.sampler.keys import sampler_config


def test_budgets_stops_and_the_pad_fallback():
    sc = sampler_config(256, 128, [2, 7], 5, temperature=0.7, top_k=50)
    assert (sc.max_prompt_length, sc.max_completion_length) == (256, 128)
    assert (sc.stop_token_ids, sc.pad_token_id, sc.temperature, sc.top_k) == ((2, 7), 5, 0.7, 50)
    assert (
        sampler_config(8, 4, [2, 7], None).pad_token_id == 2
    )  # no pad id in the model: the first stop token
    assert sampler_config(8, 4, [2, 7], 0).pad_token_id == 0  # a model pad id of 0 is kept
    assert sampler_config(8, 4).pad_token_id == 0  # neither


def test_a_refused_value_is_the_sampler_configs_error():
    with pytest.raises(ValueError, match="top_p=0.0 must be in"):
        sampler_config(8, 4, top_p=0.0)
