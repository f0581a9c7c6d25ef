"""Shared fixtures: a tiny random Llama with SmolLM2's real tokenizer, saved as a converted checkpoint."""

import json
from pathlib import Path

import jax
import pytest

from grpax.checkpoint.gguf import read_gguf
from grpax.checkpoint.orbax import save_params
from grpax.data.tokenizer import save_tokenizer
from grpax.models.params import init_params
from grpax.models.registry import get_model_config, to_hf_config

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def tiny_run_keys(ckpt, out, **overrides) -> dict:
    """train_rl keys of a seconds-long run of ``tiny_checkpoint`` on the real GSM8K files."""
    keys = dict(
        model_name="",
        load_parameters_path=str(ckpt),
        base_output_directory=str(out),
        run_name="run",
        dataset_name=str(GSM8K),
        batch_size=2,
        num_generations=2,
        num_batches=3,
        max_target_length=272,
        num_test_batches=1,
        eval_batch_size=2,
        eval_before=False,
        checkpoint_period=2,
        learning_rate=1e-3,
        warmup_ratio=0.25,
        beta=0.04,
    )
    keys.update(overrides)
    return keys


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
