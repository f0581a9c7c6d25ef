"""Shared fixtures: a tiny random Llama with SmolLM2's real tokenizer, saved as a converted checkpoint."""

import json

import jax
import pytest

from grpax.checkpoint.gguf import read_gguf
from grpax.checkpoint.orbax import save_params
from grpax.data.tokenizer import save_tokenizer
from grpax.models.params import init_params
from grpax.models.registry import get_model_config, to_hf_config


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer random model with SmolLM2's vocabulary and tokenizer, converted layout: <dir>/0/items."""
    folder = tmp_path_factory.mktemp("tiny")
    cfg = get_model_config(
        "smollm2-135m-Instruct",
        hidden_dim=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
    )
    save_params(init_params(cfg, jax.random.key(0)), folder / "0" / "items")
    (folder / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
    save_tokenizer(read_gguf().tokenizer(), folder)
    return folder / "0" / "items"
