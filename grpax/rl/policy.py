"""What a GRPO run trains, and the params the sampler and the reference read: all the weights, or LoRA adapters.

A full fine-tune trains the params themselves. With LoRA (``lora_rank > 0``, ``grpax.models.lora``) the
update trains only the adapters, and only they have optimizer state; the base weights are frozen and held once:
the update reads them beside the adapters (``lora.apply``, never donated), the reference pass reads them as they
are (beta > 0: the reference policy is the base, the adapters switched off, with no second copy), and the
sampler reads one of two (``lora_sampler``, ``sampler_mode``): ``merged``, ``lora.merge(base, adapters)`` built
once per rollout and dropped after it, a whole copy of the weights that every sampler backend decodes at the
base's speed; or ``adapters``, ``lora.apply(base, adapters)``, nothing copied, each decoded token computing
``x @ W + s * (x @ A) @ B`` in every adapted layer. ``auto`` is ``adapters`` on accelerators, where the decode
is bound by reading the weights (the adapters add r (in + out) / (in out) of each adapted weight's bytes, under 1%
at r = 16 for Llama 3.1 8B) and the merged copy is a whole second copy of the base in device memory (70B on a
v6e-8 fits only without it: docs/scaling.md, "LoRA"), and wherever the compute dtype is 16-bit; ``merged`` only
on CPU devices computing in float32 (measured faster there, and the CPU backend's kernels take plain weights
only: docs/benchmarks.md, "LoRA"). A merged sampler in a 16-bit compute dtype samples a policy that lags the
trained one: the sum W + s B A is rounded to the compute dtype, whose ulp at |W| is far above a young
adapter's contribution (|s B A| / |W| ~ 1e-4 after a few steps), so the sampler's weights lose most of the
adapters' update while the trainer keeps the adapter path apart (``tests/test_lora.py`` measures it).
The checkpoint's ``train_meta`` records the base's path and
fingerprint (``grpax.checkpoint.digests.fingerprint``): a resume or an export against other base weights is refused.

QLoRA (``base_dtype`` int8 or nf4, ``grpax.models.quantize``): the base's projection weights are quantised once
here, at load, and only the quantised base is kept. The update dequantises them in each matmul; the reference is
that quantised base, the adapters off; a ``merged`` sampler reads ``lora.merge``, the dequantised base plus the
adapters in the base's loaded dtype, built per rollout as for LoRA: the decode then runs every sampler backend at
the base's speed (the CPU backend's kernels take plain weights only) instead of dequantising every layer at every
decoded token, at the cost of one unquantised copy of the projections while the rollout runs; an ``adapters``
sampler reads the quantised base as the update does, dequantising each layer's weights at each token. The
fingerprint
digests the quantisation too, and ``train_meta`` records it: a resume with another ``lora_base_dtype`` is
refused.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax

from grpax import sharding
from grpax.checkpoint import digests
from grpax.errors import ConfigError
from grpax.models import lora as lora_lib
from grpax.models.registry import ModelConfig

log = logging.getLogger("grpax.train")


LORA_SAMPLERS = ("auto", "merged", "adapters")


def sampler_mode(lora_sampler: str, platform: str, compute_dtype: str = "float32") -> str:
    """What a LoRA policy's sampler reads: "merged" or "adapters" (``lora_sampler``; "auto": merged where
    ``platform``, the base's devices', is "cpu" and ``compute_dtype`` is float32, else adapters: the module
    docstring's reasons)."""
    assert lora_sampler in LORA_SAMPLERS, lora_sampler
    if lora_sampler != "auto":
        return lora_sampler
    return "merged" if platform == "cpu" and compute_dtype == "float32" else "adapters"


def _platform(tree: Any) -> str:
    """The platform of the devices holding ``tree``'s first leaf (host arrays: JAX's default backend)."""
    leaf = jax.tree.leaves(tree)[0]
    sharding_ = getattr(leaf, "sharding", None)
    return next(iter(sharding_.device_set)).platform if sharding_ is not None else jax.default_backend()


@functools.partial(jax.jit, static_argnames=("lora",))
def merge_adapters(base, adapters, lora):
    """``lora.merge`` jitted: the merged sampler's weights (``Policy.sampler_params``; the plan compiles it)."""
    return lora_lib.merge(base, adapters, lora)


class Policy:
    """The trainable tree and how to turn it into model params.

    Args:
      lora: the adapters' config, or None (full fine-tune).
      base: the frozen base params (LoRA only; on the trainer's mesh).
      base_path: where the base was loaded from (recorded in checkpoints).
      base_dtype: QLoRA: "int8" or "nf4", the base's projection weights quantised here (``self.base`` then
        holds only the quantised base); "" keeps them as loaded.
      sampler: ``lora_sampler``: "auto", "merged" or "adapters" (``sampler_mode``); ``self.sampler`` holds the
        resolved one (LoRA only).
      model_cfg: the model: its compute dtype ``dtype`` (auto picks the adapters sampler when it is 16-bit), and
        the base is held as the forward reads it (``lora.frozen_base``: its other weights rounded to that
        dtype); None: float32 compute, the base's weights as loaded.
    """

    def __init__(
        self,
        lora: lora_lib.LoraConfig | None = None,
        base: Any = None,
        base_path: str = "",
        base_dtype: str = "",
        sampler: str = "auto",
        model_cfg: ModelConfig | None = None,
    ):
        self.lora, self.base, self.base_path, self.base_dtype = lora, base, base_path, base_dtype
        compute_dtype = model_cfg.dtype if model_cfg is not None else "float32"
        self.sampler = sampler_mode(sampler, _platform(base), compute_dtype) if lora is not None else ""
        if lora is not None:
            log.info(
                "LoRA sampler: %s (lora_sampler=%s, compute dtype %s)", self.sampler, sampler, compute_dtype
            )
        if self.sampler == "merged" and compute_dtype != "float32":
            log.warning(
                "lora_sampler=merged with dtype=%s: the merged weights W + s B A are rounded to %s, which drops "
                "most of a young adapter's update, so the rollouts sample a policy that lags the trained one; "
                "lora_sampler=adapters (or auto) samples what the update trains",
                compute_dtype,
                compute_dtype,
            )
        self.base_fingerprint = digests.fingerprint(base, base_dtype) if lora is not None else ""
        self.weight_dtype = str(jax.tree.leaves(base)[0].dtype) if lora is not None else ""
        if lora is not None and (base_dtype or model_cfg is not None):
            before = _nbytes(base)
            self.base = lora_lib.frozen_base(base, base_dtype, model_cfg) if model_cfg else lora_lib.quantize_base(
                base, base_dtype
            )
            log.info(
                "LoRA's frozen base: %s%s: %.3f GB -> %.3f GB",
                f"the layers' projections quantised to {base_dtype}, " if base_dtype else "",
                f"the rest held in the compute dtype {compute_dtype}" if model_cfg else "the rest as loaded",
                before / 1e9,
                _nbytes(self.base) / 1e9,
            )

    def init_trainable(self, params: Any, model_cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int) -> Any:
        """The tree the optimizer trains: ``params`` (full), or fresh adapters placed on ``mesh``."""
        if self.lora is None:
            return params
        adapters = lora_lib.init_adapters(model_cfg, self.lora, jax.random.key(seed))
        axes = lora_lib.adapter_logical_axes(model_cfg, self.lora)
        shardings = sharding.logical_to_sharding(axes, mesh, shapes=adapters)
        return jax.tree.map(jax.device_put, adapters, shardings)

    def sampler_params(self, trainable: Any) -> Any:
        """The params the sampler and the evaluation read: ``trainable`` itself (full fine-tune), the merged
        weights (``sampler == "merged"``) or the base with its adapters (``"adapters"``: ``lora.apply``)."""
        if self.lora is None:
            return trainable
        if self.sampler == "merged":
            return merge_adapters(self.base, trainable, self.lora)
        return lora_lib.apply(self.base, trainable, self.lora)

    def forward_params(self, trainable: Any) -> Any:
        """The params ``forward`` runs: ``trainable``, or the base with its adapters (``lora.apply``)."""
        return trainable if self.lora is None else lora_lib.apply(self.base, trainable, self.lora)

    def meta(self) -> dict:
        """The checkpoint's record of the adapters and their base (empty for a full fine-tune)."""
        if self.lora is None:
            return {}
        lora = self.lora
        return {
            "lora": {
                "rank": lora.rank,
                "alpha": lora.alpha,
                "target_modules": list(lora.target_modules),
                "use_rslora": lora.use_rslora,
                "base_path": self.base_path,
                "base_dtype": self.weight_dtype,
                "base_quantization": self.base_dtype,
                "base_fingerprint": self.base_fingerprint,
            }
        }

    def check_resume(self, meta: dict, where: str) -> None:
        """Raises one ConfigError line when checkpoint ``meta`` was trained on another base or another mode."""
        saved = meta.get("lora")
        if (saved is None) != (self.lora is None):
            have = "LoRA adapters" if saved else "full weights"
            raise ConfigError(
                f"{where} holds {have} but lora_rank={self.lora.rank if self.lora else 0}: resume with the lora_rank "
                "it was trained with, or pass a new run_name"
            )
        if saved and self.lora is not None:
            keys = {"lora_rank": "rank", "lora_alpha": "alpha", "use_rslora": "use_rslora"}
            now = {"rank": self.lora.rank, "alpha": self.lora.alpha, "use_rslora": self.lora.use_rslora}
            changed = [k for k, m in keys.items() if m in saved and saved[m] != now[m]]
            if changed:
                listed = ", ".join(f"{k}={saved[keys[k]]!r} (now {now[keys[k]]!r})" for k in changed)
                raise ConfigError(
                    f"{where} holds adapters trained with {listed}: these set the adapters' shape and scale "
                    "(lora_alpha / lora_rank, or / sqrt(lora_rank) with use_rslora), so a resume cannot change "
                    "them; resume with the values it was trained with, or pass a new run_name"
                )
        if saved and saved.get("base_quantization", "") != self.base_dtype:
            raise ConfigError(
                f"{where} holds adapters trained on the base quantised as lora_base_dtype="
                f"{saved.get('base_quantization') or '<unset>'}, but this run has lora_base_dtype="
                f"{self.base_dtype or '<unset>'}: resume with the lora_base_dtype it was trained with, or pass a "
                "new run_name"
            )
        if saved and saved["base_fingerprint"] != self.base_fingerprint:
            raise ConfigError(
                f"{where} holds adapters trained on the base {saved['base_path']} (fingerprint "
                f"{saved['base_fingerprint']}), but load_parameters_path={self.base_path} has other weights "
                f"(fingerprint {self.base_fingerprint}): pass the base it was trained on, or a new run_name"
            )


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))
