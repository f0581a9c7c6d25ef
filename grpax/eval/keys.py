"""The evaluation keys that ``grpax train_rl`` and ``grpax evaluate`` share, and their checks.

``EVAL_STRATEGIES`` are MaxText rl.yml's ``generation_configs``: the sampler settings an
``eval_sampling_strategy`` name selects.
"""

from __future__ import annotations

from typing import Any

from grpax.errors import ConfigError

EVAL_STRATEGIES = {  # MaxText rl.yml generation_configs
    "greedy": dict(greedy=True, temperature=1.0, top_k=0, top_p=1.0),
    "standard": dict(greedy=False, temperature=0.7, top_k=50, top_p=0.95),
    "liberal": dict(greedy=False, temperature=0.85, top_k=2000, top_p=1.0),
}


def validate_eval_keys(cfg: Any, *, allow_no_eval: bool) -> None:
    """Checks the evaluation keys that ``grpax train_rl`` and ``grpax evaluate`` share.

    Args:
      allow_no_eval: accept num_test_batches=0, no evaluation (train_rl; evaluating nothing is no evaluate run).

    Raises:
      ConfigError: num_test_batches not >= 1 or -1 (or 0 with allow_no_eval), eval_batch_size or
        num_eval_passes < 1, or an unknown eval_sampling_strategy (the key, value and accepted values named).
    """
    if cfg.num_test_batches < (0 if allow_no_eval else 1) and cfg.num_test_batches != -1:
        raise ConfigError(
            f"num_test_batches={cfg.num_test_batches}: expected >= 1 evaluation batches, or -1 for the "
            f"whole {cfg.eval_split!r} split{', or 0 for no evaluation' if allow_no_eval else ''}"
        )
    for key, meaning in (
        ("eval_batch_size", "questions per evaluation batch"),
        ("num_eval_passes", "samples per evaluation question"),
    ):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)}: expected >= 1 ({meaning})")
    if cfg.eval_sampling_strategy not in EVAL_STRATEGIES:
        raise ConfigError(
            f"eval_sampling_strategy={cfg.eval_sampling_strategy!r}: expected one of "
            f"{', '.join(EVAL_STRATEGIES)}"
        )
