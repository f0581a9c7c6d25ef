"""MaxText's ``remat_policy=custom`` keys: one per activation the model names (``grpax.models.registry.REMAT_NAMES``,
MaxText's names), each ``remat`` (recomputed in the backward pass, the default), ``device`` (saved in device
memory) or ``offload`` (saved in pinned host memory and copied back for the backward pass:
``jax.checkpoint_policies.save_and_offload_only_these_names``). MaxText's ``rl.yml`` offloads
``decoder_layer_input``, ``query_proj``, ``key_proj`` and ``value_proj``."""

from __future__ import annotations

import dataclasses

from grpax.config import field
from grpax.errors import ConfigError
from grpax.models.registry import REMAT_CHOICES, REMAT_NAMES

_WHAT = {
    "decoder_layer_input": "each layer's input [B, T, D]",
    "query_proj": "the q projection [B*T, N, H]",
    "key_proj": "the k projection [B*T, K, H]",
    "value_proj": "the v projection [B*T, K, H]",
    "context": "the attention's output [B, T, N, H]",
    "out_proj": "the output projection [B*T, D]",
    "mlpwi_0": "the MLP's gate projection [B*T, F]",
    "mlpwi_1": "the MLP's up projection [B*T, F]",
    "mlpwo": "the MLP's down projection [B*T, D]",
}


def _key(name: str):
    return field(
        "remat", f"remat_policy=custom: {_WHAT[name]}: remat (recompute) | device (save) | offload (host)"
    )


@dataclasses.dataclass(frozen=True)
class RematKeys:
    """The custom remat policy's per-activation keys (module docstring)."""

    decoder_layer_input: str = _key("decoder_layer_input")
    query_proj: str = _key("query_proj")
    key_proj: str = _key("key_proj")
    value_proj: str = _key("value_proj")
    context: str = _key("context")
    out_proj: str = _key("out_proj")
    mlpwi_0: str = _key("mlpwi_0")
    mlpwi_1: str = _key("mlpwi_1")
    mlpwo: str = _key("mlpwo")

    def remat_names(self) -> tuple[tuple[str, str], ...]:
        """``ModelConfig.remat_names``: (name, device | offload) of the activations kept."""
        return tuple((name, getattr(self, name)) for name in REMAT_NAMES if getattr(self, name) != "remat")


def check_remat_keys(keys: RematKeys, remat_policy: str) -> None:
    """Raises ConfigError naming the key: a value other than remat, device or offload, or a kept activation
    without ``remat_policy=custom`` (the other policies decide by themselves what they keep)."""
    for name in REMAT_NAMES:
        value = getattr(keys, name)
        if value not in REMAT_CHOICES:
            raise ConfigError(f"{name}={value!r}: expected one of {', '.join(REMAT_CHOICES)}")
        if value != "remat" and remat_policy != "custom":
            raise ConfigError(
                f"{name}={value} names what remat_policy=custom keeps, but remat_policy={remat_policy}: pass "
                f"remat_policy=custom, or drop {name}"
            )
