"""The TPU compiler's own figures for a run's programs, side by side for two trees, with no TPU attached.

Builds the run's abstract job from ``train_rl`` keys (``compile_check.build_job``: the arrays as the run holds
them, the run's own update and sampler programs), compiles for a TPU topology with libtpu on this host each
quantised projection of a layer at the decode's and a logprob pass's rows and, with ``--programs``, the sampler's
prefill and decode and the update, and prints per program the compiler's estimate of its run time
(``cost_analysis()['optimal_seconds']``; a loop's is unknown), the bytes it moves and its temporaries. With
``--against REV`` it runs itself once more on a checkout of that commit (a temporary ``git worktree``) and
prints both side by side: a change to the programs measured by the compiler before a chip is lent.

    python benchmarks/tpu_program_cost.py --against HEAD~1              # the seed's 8B QLoRA projections, v5e-1
    python benchmarks/tpu_program_cost.py --layers 2 --programs decode update --against HEAD~1

Defaults: the seed's 8B command with ``lora_rank=16 lora_base_dtype=nf4`` on ``compile_topology=v5e-1`` (as
``benchmarks/v5e_8b_qlora_step.py``), all 32 layers (``--layers N`` compiles the first N: each layer's programs
are the same, so the per-layer figures hold). The estimate is the compiler's cost model, not a measurement: on
the chip the 8B nf4 decode step measured 380 ms, this script estimates its projections at 329 ms
(docs/benchmarks.md, "nf4 in halves").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = dict(
    model_name="llama3.1-8b-Instruct", compile_topology="v5e-1", chips_per_vm=1, num_batches=50,
    rollout_data_parallelism=1, rollout_tensor_parallelism=-1, lora_rank=16, lora_base_dtype="nf4",
    remat_policy="full", base_output_directory="/tmp/grpax_tpu_program_cost", run_name="cost",
)  # fmt: skip
PROGRAMS = ("prefill", "decode", "update")


def measure(keys: list[str], layers: int, programs: list[str]) -> dict:
    """{program: figures} compiled in this process (grpax from ``sys.path``: this tree or ``--against``'s)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compiler only: no TPU is needed
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    from grpax import sharding
    from grpax.config import build_config
    from grpax.plan import compile_check
    from grpax.plan.topology import get_topology
    from grpax.rl.train_config import TrainConfig
    from grpax.sampler import program_set

    cfg = build_config(TrainConfig, [*(f"{k}={v}" for k, v in KEYS.items()), *keys])
    model_cfg = compile_check.model_config(cfg)
    if layers:
        model_cfg = dataclasses.replace(model_cfg, num_layers=layers)
    devices = get_topology(cfg.compile_topology, chips_per_vm=cfg.chips_per_vm).devices
    mesh_cfg = dataclasses.replace(cfg.mesh(), chips_per_vm=0)
    job = compile_check.build_job(cfg, *sharding.create_meshes(mesh_cfg, devices), model_cfg)
    lowered = {}
    with jax.set_mesh(job.rollout_mesh):
        sampler = program_set.abstract_programs(
            job.rollout_params, model_cfg, job.sampler_cfg, job.sampler_backend, cfg.batch_size,
            cfg.num_generations,
        )  # fmt: skip
        for name, (fn, args, kwargs) in sampler.items():
            if name in programs:
                lowered[name] = lambda fn=fn, args=args, kwargs=kwargs: fn.lower(*args, **kwargs)
    if "update" in programs:
        step = job.train_step
        if job.lora is None:
            lowered["update"] = lambda: step.lower(job.state, job.batch)
        else:
            lowered["update"] = lambda: step.func.lower(job.state, job.batch, base=job.base)
    found = {} if not cfg.lora_base_dtype else projections(cfg, job, devices[0])
    for name, lower in lowered.items():
        with jax.set_mesh(job.mesh if name == "update" else job.rollout_mesh):
            found[name] = figures(lower())
    return dict(
        model=f"{cfg.model_name} ({model_cfg.num_layers} layers), LoRA rank {cfg.lora_rank} on a "
        f"{cfg.lora_base_dtype or 'dense'} base, {cfg.batch_size} x {cfg.num_generations} rows of "
        f"{cfg.max_prefill_predict_length} + {cfg.max_completion_length}, {cfg.compile_topology}",
        decode_steps=job.sampler_cfg.decode_steps_per_call,
        programs=found,
    )


def projections(cfg, job, device) -> dict:
    """Each quantised projection of a layer of the run's frozen base (``job.base``, as ``lora.frozen_base`` holds
    it), ``x @ w`` compiled alone for ``device`` at the decode's rows (one step: batch_size x num_generations)
    and at a logprob pass's (the reference's: a micro-batch's tokens), times the layers. The decode program's
    loop hides its run time from the cost model; its projections are a quantised base's decode step (380 ms
    measured on the chip, 329 ms estimated)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from grpax.models import quantize as quant

    place = SingleDeviceSharding(device)
    dtype = jnp.dtype(job.model_cfg.dtype)
    layers = job.base["layers"]
    first = (
        layers[0]
        if isinstance(layers, list)
        else jax.eval_shape(lambda t: jax.tree.map(lambda a: a[0], t), layers)
    )
    L = job.model_cfg.num_layers
    decode_rows = cfg.batch_size * cfg.num_generations
    logprob_rows = (
        decode_rows // cfg.micro_batches * (cfg.max_prefill_predict_length + cfg.max_completion_length)
    )
    out = {}
    for label, rows in (("decode", decode_rows), ("logprobs", logprob_rows)):
        for name, w in first.items():
            if not isinstance(w, quant.QuantizedWeight):
                continue
            w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place), w)
            fan_in = math.prod(w.shape[: w.ndim - w.num_out_axes])
            x = jax.ShapeDtypeStruct((rows, fan_in), dtype, sharding=place)

            def product(x, w, fan_in=fan_in):
                return x @ w.astype(dtype).reshape(fan_in, -1)

            out[f"{label} {name} x{L}"] = figures(jax.jit(product).lower(x, w), L)
    return out


def figures(lowered, times: int = 1) -> dict:
    """The compiler's figures for a lowered program, ``times`` over (NaN: the cost model gave no estimate, as for
    a loop or some of libtpu's custom calls)."""
    compiled = lowered.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    estimate = float(cost.get("optimal_seconds", -1.0))
    return dict(
        estimate_ms=1e3 * times * estimate if estimate >= 0 else float("nan"),
        bytes_gb=times * float(cost.get("bytes accessed", 0.0)) / 1e9,
        temporaries_gib=compiled.memory_analysis().temp_size_in_bytes / 2**30,
    )


def other_tree(rev: str, argv: list[str]) -> dict:
    """This script's figures for commit ``rev``: its grpax from a temporary worktree, this script's code."""
    with tempfile.TemporaryDirectory(prefix="grpax-cost-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)  # fmt: skip
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(
                [sys.executable, __file__, "--json", *argv], env=env, cwd=tree, check=True, capture_output=True,
                text=True,
            )  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=0, help="compile the first N layers (0: all)")
    parser.add_argument("--programs", nargs="*", default=[], choices=PROGRAMS, help="whole programs too")
    parser.add_argument("--against", help="a commit to compare with (e.g. HEAD~1)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("keys", nargs="*", help="train_rl keys, key=value (over the defaults above)")
    args = parser.parse_args()
    argv = [f"--layers={args.layers}", "--programs", *args.programs, *args.keys]
    this = measure(args.keys, args.layers, args.programs)
    if args.json:
        print(json.dumps(this))
        return 0
    runs = {"this tree": this}
    if args.against:
        runs = {args.against: other_tree(args.against, argv), "this tree": this}
    print(this["model"], f"; {this['decode_steps']} decode steps a call (the compiler's figures, no chip)")
    head = "".join(f" | {tree[:12]:>12}: est ms  GB moved  temp GiB" for tree in runs)
    print(f"{'program':<22}{head}" + (" | ratio" if len(runs) == 2 else ""))
    for name in this["programs"]:
        row = [run["programs"].get(name) for run in runs.values()]
        cells = "".join(
            f" | {f['estimate_ms']:20.2f} {f['bytes_gb']:8.2f} {f['temporaries_gib']:9.3f}" for f in row if f
        )
        known = len(row) == 2 and all(row) and not any(math.isnan(f["estimate_ms"]) for f in row)
        ratio = f" | {row[0]['estimate_ms'] / row[1]['estimate_ms']:5.2f}x" if known else ""
        print(f"{name:<22}{cells}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
