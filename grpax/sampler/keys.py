"""MaxText's decode keys -> ``SamplerConfig``: the one builder of ``train_rl``, ``evaluate`` and ``generate``.

The commands name the sampler's budgets as MaxText does (``max_prefill_predict_length``; the completion budget
from ``max_target_length``) and take the stop tokens from the tokenizer and the model
(``grpax.data.tokenizer.stop_token_ids``). A finished row is padded with the model's ``pad_token_id``, else
with its first stop token (else 0): the mask, not this id, marks real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpax.sampler.engine import SamplerConfig


def sampler_config(
    max_prefill_predict_length: int,
    max_completion_length: int,
    stop_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    **sampling: Any,
) -> SamplerConfig:
    """The ``SamplerConfig`` of a command's keys.

    Args:
      max_prefill_predict_length: max prompt tokens (``SamplerConfig.max_prompt_length``).
      max_completion_length: new tokens per row at most (tokens).
      stop_token_ids: ids that end a row.
      pad_token_id: the model's pad id; None: the first stop token, else 0.
      **sampling: the other ``SamplerConfig`` fields (temperature, top_k, top_p, greedy, ...).

    Raises:
      ValueError: a value ``SamplerConfig`` refuses.
    """
    if pad_token_id is None:
        pad_token_id = stop_token_ids[0] if stop_token_ids else 0
    return SamplerConfig(
        max_prompt_length=max_prefill_predict_length,
        max_completion_length=max_completion_length,
        stop_token_ids=tuple(stop_token_ids),
        pad_token_id=pad_token_id,
        **sampling,
    )
