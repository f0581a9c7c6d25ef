"""Two processes on localhost (2 CPU devices each, gloo collectives) agree with a one-process run.

Each child calls ``grpax.distributed.maybe_initialize`` with a coordinator on a free port, builds the global
mesh (dcn data=2 across the processes x ici fsdp=2, then x ici tensor=2), places the same params, reads only
its own rows of the batch, and runs a sharded forward and a ``psum`` across all 4 devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from grpax import distributed
from grpax.models.llama import forward
from grpax.models.params import init_params
from grpax.models.registry import ModelConfig

CFG = ModelConfig(
    vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
TOKENS = np.arange(4 * 6, dtype=np.int32).reshape(4, 6) * 7 % CFG.vocab_size

CHILD = textwrap.dedent(
    """
    import functools, sys
    import numpy as np
    from grpax import distributed
    assert distributed.maybe_initialize(False, sys.argv[1], 2, int(sys.argv[2]))
    import jax, jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P
    from grpax import sharding as sh
    from grpax.models.llama import forward
    from grpax.models.params import init_params
    from grpax.models.registry import ModelConfig
    cfg = ModelConfig(vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      mlp_dim=64)
    tokens = np.arange(4 * 6, dtype=np.int32).reshape(4, 6) * 7 % cfg.vocab_size
    assert (jax.process_count(), jax.local_device_count(), jax.device_count()) == (2, 2, 4)
    out = {}
    for name, mesh_cfg in [("fsdp", sh.MeshConfig()), ("tensor", sh.MeshConfig(ici_fsdp_parallelism=1,
                                                                              ici_tensor_parallelism=2))]:
        mesh = sh.create_mesh(mesh_cfg)
        params = sh.shard_params(init_params(cfg, jax.random.key(0)), cfg, mesh)
        batch = sh.shard_batch(tokens[distributed.local_rows(4)], mesh)
        with jax.set_mesh(mesh):
            logits, _ = jax.jit(functools.partial(forward, cfg=cfg))(params, batch)
        out[name + "_shape"] = np.array([dict(mesh.shape)[a] for a in ("data", "fsdp", "tensor")])
        out[name + "_logits"] = multihost_utils.process_allgather(logits, tiled=True)
    mesh = sh.create_mesh(sh.MeshConfig())
    per_device = sh.shard_batch(np.arange(2, dtype=np.float32) + 1 + 10 * jax.process_index(), mesh)
    total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, ("data", "fsdp")), mesh=mesh,
                                  in_specs=P(("data", "fsdp")), out_specs=P()))(per_device)
    out["psum"] = multihost_utils.process_allgather(total, tiled=True)
    out["main"] = np.array(jax.process_index() == 0)
    np.savez(sys.argv[3], **out)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    address = f"127.0.0.1:{_free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip(),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), address, str(i), str(tmp_path / f"out{i}.npz")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)

    expected, _ = forward(init_params(CFG, jax.random.key(0)), TOKENS, CFG)
    for i in range(2):
        out = np.load(tmp_path / f"out{i}.npz")
        assert out["main"] == (i == 0)
        np.testing.assert_array_equal(out["fsdp_shape"], [2, 2, 1])  # dcn data=2 x ici fsdp=2
        np.testing.assert_array_equal(out["tensor_shape"], [2, 1, 2])
        for name in ("fsdp", "tensor"):
            np.testing.assert_allclose(out[name + "_logits"], np.asarray(expected), atol=1e-5, rtol=0)
        # Devices hold 1, 2 (process 0) and 11, 12 (process 1).
        np.testing.assert_array_equal(out["psum"], [26.0])


def test_single_process_helpers(monkeypatch):
    for var in (
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        *distributed._CLUSTER_ENV_VARS,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_on_cloud_tpu", lambda: False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    assert distributed.maybe_initialize(skip=True) is False
    assert distributed.maybe_initialize() is False and not calls
    assert jax.process_count() == 1 and jax.process_index() == 0
    assert distributed.local_rows(8) == slice(0, 8)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="needs coordinator_address, num_processes and process_id together"):
        distributed.maybe_initialize()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.maybe_initialize()
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    # A launcher's variables (or the address alone): JAX's auto-detection supplies the count and the id.
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.maybe_initialize() is True and calls == [{}]
    assert distributed.maybe_initialize(skip=True) is False and len(calls) == 1
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert distributed.maybe_initialize() is True
    assert calls[-1] == dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)


def test_fetch_single_process():
    x = jax.numpy.arange(4.0)
    out = distributed.fetch({"x": x, "n": 3, "a": np.ones(2)})
    assert isinstance(out["x"], np.ndarray) and out["n"] == 3
    np.testing.assert_array_equal(out["x"], [0, 1, 2, 3])
