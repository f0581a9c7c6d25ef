"""``grpax train_rl`` on two JAX processes (localhost, gloo) equals the same run on one process.

Two processes with 2 CPU devices each run a short GRPO run (a tiny random Llama with SmolLM2's tokenizer,
the real GSM8K files, beta > 0, a checkpoint) on the mesh (data=2 across processes, fsdp=2 within). One
process with 4 devices runs the same config on the same mesh shape (ici data=2 x fsdp=2). The final params
agree to 1e-5 (float32), the metrics.jsonl rewards are identical, only process 0 wrote logs and metrics,
and the two-process checkpoint restores onto a different mesh (tensor=4) with the same values.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_run_keys

from grpax.checkpoint.orbax import restore_params

TIMEOUT_S = 600

CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    keys, address, num_processes, process_id, out = sys.argv[1:6]
    keys = json.loads(keys)
    if int(num_processes) > 1:
        from grpax import distributed
        assert distributed.maybe_initialize(False, address, int(num_processes), int(process_id))
    import jax
    from grpax.rl.train_config import TrainConfig
    from grpax.rl.trainer import train
    results = train(TrainConfig(**keys))
    if len(sys.argv) > 6:  # restore another run's checkpoint onto a tensor=4 mesh
        from grpax import sharding as sh
        from grpax.checkpoint.orbax import load_model
        from grpax.checkpoint.train_state import TrainCheckpointer
        from grpax.rl.optim import optimizer_from_config
        cfg = TrainConfig(**keys)
        params, model_cfg, _ = load_model(cfg.load_parameters_path, scan_layers=cfg.scan_layers)
        mesh = sh.create_mesh(sh.MeshConfig(ici_fsdp_parallelism=1, ici_tensor_parallelism=4))
        params = sh.shard_params(params, model_cfg, mesh)
        optimizer, _ = optimizer_from_config(cfg.grpo(), cfg.num_batches)
        opt_state = sh.init_optimizer_state(optimizer, params, mesh)
        checkpointer = TrainCheckpointer(sys.argv[6])
        step = checkpointer.latest_step()
        restored, restored_opt, meta = checkpointer.restore(step, params, opt_state)
        leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
        np.savez(out, step=step, optimizer_step=meta["optimizer_step"],
                 mesh=np.array([dict(mesh.shape)[a] for a in ("data", "fsdp", "tensor")]),
                 embed_spec=str(restored["embed"].sharding.spec),
                 opt_finite=all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(restored_opt)),
                 **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
        checkpointer.close()
    print("RESULT", json.dumps({"process": jax.process_index(), "actor_path": results["actor_path"]}))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keys(ckpt: Path, out: Path, **overrides) -> dict:
    # 2 steps on a data=2 sampler mesh, otherwise the tiny run of tests/test_trainer.py. No warmup: both steps
    # at the full learning rate, and both must move the weights.
    defaults = dict(
        num_batches=2, warmup_ratio=0.0, rollout_data_parallelism=2, rollout_tensor_parallelism=-1
    )
    return tiny_run_keys(ckpt, out, **{**defaults, **overrides})


def _launch(script: Path, keys: dict, num_processes: int, devices: int, out: Path, *extra: str) -> list[str]:
    """Runs ``num_processes`` children with ``devices`` CPU devices each; returns their logs."""
    address = f"127.0.0.1:{_free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                json.dumps(keys),
                address,
                str(num_processes),
                str(i),
                str(out),
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)
    return logs


def _rewards(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "accuracy", "completion_length/mean", "truncated_fraction")
    return [
        {k: v for k, v in r.items() if k.startswith(("rewards/", "advantages/", "eval/")) or k in keep}
        for r in records
    ]


def _losses(run_dir: Path) -> np.ndarray:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "kl", "entropy", "grad_norm", "ratio_mean")
    return np.array([[r[k] for k in keys] for r in records if "loss" in r], np.float64)


@pytest.mark.slow
def test_two_processes_match_one(tiny_checkpoint, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    two = tmp_path / "two"
    logs = _launch(script, _keys(tiny_checkpoint, two), 2, 2, tmp_path / "unused.npz")
    run_two = two / "run"
    # Process 0 alone logs the run; both processes took part in the checkpoint.
    assert "grpax.train" not in logs[1] and "eval after" in logs[0]
    assert sorted(p.name for p in (run_two / "checkpoints" / "actor").iterdir()) == ["2"]
    for name in ("config.json", "metrics.jsonl", "results.json", "tensorboard", "eval"):
        assert (run_two / name).exists(), name

    one = tmp_path / "one"
    keys = _keys(tiny_checkpoint, one, ici_data_parallelism=2, ici_fsdp_parallelism=-1)
    restored_npz = tmp_path / "restored.npz"
    _launch(script, keys, 1, 4, restored_npz, str(run_two / "checkpoints"))
    run_one = one / "run"

    assert _rewards(run_two) == _rewards(run_one)
    # The evaluation's greedy completions, text for text.
    results = "eval/after/results.jsonl"
    assert (run_two / results).read_text() == (run_one / results).read_text()
    losses = [_losses(run) for run in (run_two, run_one)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4, atol=1e-7)
    assert len(_rewards(run_one)) == 3  # 2 steps + the final evaluation
    params_two = restore_params(run_two / "checkpoints" / "actor" / "2" / "model_params")
    params_one = restore_params(run_one / "checkpoints" / "actor" / "2" / "model_params")
    initial = restore_params(tiny_checkpoint)
    for a, b in zip(jax.tree.leaves(params_two), jax.tree.leaves(params_one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert any(
        not np.allclose(np.asarray(a), np.asarray(c), atol=1e-5)
        for a, c in zip(jax.tree.leaves(params_two), jax.tree.leaves(initial), strict=True)
    )

    # The two-process checkpoint on a one-process tensor=4 mesh: the same values, the new layout.
    restored = np.load(restored_npz)
    assert int(restored["step"]) == 2 and int(restored["optimizer_step"]) == 2
    np.testing.assert_array_equal(restored["mesh"], [1, 1, 4])
    assert "tensor" in str(restored["embed_spec"]) and bool(restored["opt_finite"])
    for path, x in jax.tree_util.tree_flatten_with_path(params_two)[0]:
        np.testing.assert_array_equal(restored[jax.tree_util.keystr(path)], np.asarray(x))


@pytest.mark.slow
def test_two_processes_train_lora_adapters_on_a_frozen_base(tiny_checkpoint, tmp_path):
    """LoRA on two processes (data=2 across them, fsdp=2 within), the rollout on the adapters sampler (the base
    and its adapters copied to the sampler's data=2 mesh across processes), against the same run on one process:
    the adapters move (B leaves zero) and agree to 1e-5, the checkpoint holds only them, and the base they were
    trained on is the checkpoint's, unchanged (its fingerprint, recomputed from the files, is the one recorded)."""
    from test_tasks_train import _data

    from grpax.checkpoint.digests import fingerprint

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "length.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"
    )
    lora = dict(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, lora_sampler="adapters")
    # rewarded by length (tests/test_lora.py's end-to-end run): the groups have spread, the adapters a gradient
    lora |= dict(dataset_name=str(_data(tmp_path)), task="custom", prompt_field="instruction",
                 answer_field="target", prompt_preset="plain", reward_functions_path=str(tmp_path / "length.py"),
                 reward_functions=["length"])  # fmt: skip
    two = tmp_path / "two"
    _launch(script, _keys(tiny_checkpoint, two, **lora), 2, 2, tmp_path / "unused.npz")
    one = tmp_path / "one"
    keys = _keys(tiny_checkpoint, one, ici_data_parallelism=2, ici_fsdp_parallelism=-1, **lora)
    _launch(script, keys, 1, 4, tmp_path / "unused1.npz")
    assert _rewards(two / "run") == _rewards(one / "run")
    step = two / "run" / "checkpoints" / "actor" / "2"
    adapters = restore_params(step / "model_params")
    assert set(adapters) == {"layers"} and set(adapters["layers"]["wq"]) == {"a", "b"}  # no base weight
    assert all(np.abs(np.asarray(ad["b"])).max() > 0 for ad in adapters["layers"].values())  # all trained
    single = restore_params(one / "run" / "checkpoints" / "actor" / "2" / "model_params")
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    meta = json.loads((step / "train_meta" / "metadata").read_text())["lora"]
    assert meta["base_fingerprint"] == fingerprint(restore_params(tiny_checkpoint))
