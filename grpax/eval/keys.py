"""The evaluation keys that ``grpax train_rl`` and ``grpax evaluate`` share (``EvalKeys``), and their checks.

``EVAL_STRATEGIES`` are MaxText rl.yml's default ``generation_configs``: the sampler settings an
``eval_sampling_strategy`` name selects; the key ``generation_configs`` changes them or adds names
(``eval_sampling``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpax.config import field
from grpax.errors import ConfigError
from grpax.eval.metrics import EVAL_MODES

EVAL_STRATEGIES = {  # MaxText rl.yml generation_configs
    "greedy": dict(greedy=True, temperature=1.0, top_k=0, top_p=1.0),
    "standard": dict(greedy=False, temperature=0.7, top_k=50, top_p=0.95),
    "liberal": dict(greedy=False, temperature=0.85, top_k=2000, top_p=1.0),
}


# MaxText's generation_configs entry keys -> SamplerConfig fields
GENERATION_KEYS = {"eval_temperature": "temperature", "eval_top_k": "top_k", "eval_top_p": "top_p"}
GENERATION_CONFIGS_HELP = (
    "MaxText's sampling of each eval_sampling_strategy name, {name: {eval_temperature: T, eval_top_k: K, "
    "eval_top_p: P}}, over the built-in greedy / standard / liberal (its defaults; eval_top_k 1 = greedy) or "
    "adding names"
)


@dataclasses.dataclass(frozen=True)
class EvalKeys:
    """How an evaluation samples and scores each question, in train_rl's evaluations and ``grpax evaluate``
    alike (checked by ``validate_eval_keys``; how many questions, and from where, are each command's keys)."""

    num_eval_passes: int = field(1, "samples per evaluation question (k of pass@k and maj@k)")
    eval_sampling_strategy: str = field(
        "greedy",
        "greedy | standard (T 0.7, top-k 50, top-p 0.95) | liberal (MaxText rl.yml), or a name given in "
        "generation_configs",
    )
    generation_configs: dict = field({}, GENERATION_CONFIGS_HELP)
    eval_mode: str = field(
        "pass",
        "the evaluation's score (MaxText key): pass = pass@k (any of the num_eval_passes samples correct), "
        "maj = maj@k (the majority answer correct), pass_at_1 = accuracy (the fraction of samples correct)",
    )


def eval_sampling(cfg: Any) -> dict[str, Any]:
    """The ``SamplerConfig`` fields of ``cfg.eval_sampling_strategy``: ``EVAL_STRATEGIES``' with the
    ``generation_configs`` entry of that name over them (a new name's unset values: temperature 1, no top-k or
    top-p; ``validate_eval_keys`` has passed); top-k 1 is greedy decoding (MaxText's greedy entry: temperature
    0.01, top-k 1)."""
    name = cfg.eval_sampling_strategy
    fields = dict(EVAL_STRATEGIES.get(name, dict(greedy=False, temperature=1.0, top_k=0, top_p=1.0)))
    given = (cfg.generation_configs or {}).get(name) or {}
    # as the sampler takes them: eval_top_k 50.0 (a whole number, accepted) is the integer 50
    fields.update({GENERATION_KEYS[k]: (int if k == "eval_top_k" else float)(v) for k, v in given.items()})
    if fields["top_k"] == 1:
        return dict(EVAL_STRATEGIES["greedy"])
    return {**fields, "greedy": False} if given else fields


# each entry key's type, range and the range's words
_GENERATION_RANGES = {
    "eval_temperature": (float, lambda v: v > 0, "> 0"),
    "eval_top_k": (int, lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "eval_top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
}


def _validate_generation_configs(configs: Any) -> None:
    for name, entry in (configs or {}).items():
        where = f"generation_configs.{name}"
        if not isinstance(entry, dict) or set(entry) - set(GENERATION_KEYS):
            raise ConfigError(f"{where}={entry!r}: expected a mapping of {', '.join(GENERATION_KEYS)}")
        for key, value in entry.items():
            kind, in_range, need = _GENERATION_RANGES[key]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and value == kind(value) and in_range(value)):
                raise ConfigError(f"{where}.{key}={value!r}: expected {need}")


def validate_eval_keys(cfg: Any, *, allow_no_eval: bool) -> None:
    """Checks the evaluation keys that ``grpax train_rl`` and ``grpax evaluate`` share.

    Args:
      allow_no_eval: accept num_test_batches=0, no evaluation (train_rl; evaluating nothing is no evaluate run).

    Raises:
      ConfigError: num_test_batches not >= 1 or -1 (or 0 with allow_no_eval), eval_batch_size or
        num_eval_passes < 1, an unknown eval_sampling_strategy or eval_mode (the key, value and accepted values
        named), or a generation_configs entry with other keys or values out of range.
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
    _validate_generation_configs(cfg.generation_configs)
    names = {**EVAL_STRATEGIES, **(cfg.generation_configs or {})}
    if cfg.eval_sampling_strategy not in names:
        raise ConfigError(
            f"eval_sampling_strategy={cfg.eval_sampling_strategy!r}: expected one of {', '.join(names)} (or a name "
            "given in generation_configs)"
        )
    if cfg.eval_mode not in EVAL_MODES:
        raise ConfigError(
            f"eval_mode={cfg.eval_mode!r}: expected one of "
            f"{', '.join(f'{mode} ({metric})' for mode, metric in EVAL_MODES.items())}"
        )
