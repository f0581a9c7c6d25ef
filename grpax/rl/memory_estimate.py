"""An analytical estimate of a GRPO job's per-GPU memory, for NVIDIA targets that JAX cannot compile for here.

JAX compiles for a TPU slice without the TPU (``grpax.rl.compile_check``), but this JAX has no way to compile
for an absent GPU, so ``compile_topology=h100-8`` (``GPUS``) gets the same table as an ESTIMATE. What is exact:
the resident arrays (params, optimizer state, reference), the params copied for the sampler and the KV cache,
all placed by the rules table on an ``AbstractMesh`` of the run's mesh keys. What is estimated are the
temporaries of each function, from the shapes of what it holds at its largest:

* update: the gradients (params-shaped, float32), two layers' gathered weights (FSDP: one in use, one prefetched), the
  residual stream saved at each layer boundary (remat), one layer's recomputed activations (attention
  inputs and MLP hidden, the longer of them), three chunks of logits (``_LOGITS_CHUNK_ELEMENTS``); with
  micro-batches, a second gradient tree (the running sum);
* reference logprobs: one layer's gathered weights, its activations, three chunks of logits, the output;
* prefill: the cache of the prompts and one layer's activations; decode: a copy of the weights in the
  compute dtype only where wider weights reach it unrounded (``prepare_decode``: no copy to the sampler's
  layout, which rounds them), the grown cache, the rows' logits (float32, three copies).

With LoRA the resident rows are the frozen base (``compile_check.base_bytes_per_param`` bytes per parameter),
the float32 adapters and their optimizer state, and no reference copy (all exact); the update's gradients are
the adapters' (float32) and the weights it gathers are the base's; the merged weights the sampler reads
(``lora.merge``, ``lora_sampler=merged``) are exact and held by the merge, the rollout and the reference pass;
the merge's temporaries are, with a 16-bit base, the float32 sums of every adapted weight, all layers (the TPU
compiler's plan of Llama 3.1 70B's bfloat16 merge on v6e-8 holds 33.39 GiB of temporaries; this gives 31.9), and
none with a float32 base (the compiler's plan of 8B's float32 merge: 0). With ``lora_sampler=adapters`` (auto's
choice on GPUs) there is no merge and no merged copy: the decode reads the base in place and rounds the
float32 adapters to the compute dtype (``prepare_decode``).

Against the TPU compiler's figures for the seed's 8B job on v6e-8 (docs/scaling.md): peak 11.35 vs 11.41 GiB,
update temporaries 3.23 vs 2.99 GiB, decode 2.00 vs 1.98, reference logprobs 0.60 vs 0.99, prefill 0.14 vs 0.09.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AbstractMesh

from grpax import sharding
from grpax.config import ConfigError
from grpax.models.lora import adapted_weights
from grpax.models.quantize import QuantizedWeight
from grpax.models.registry import ModelConfig
from grpax.rl import compile_check
from grpax.rl.compile_check import base_bytes_per_param, build_job, step_count
from grpax.rl.fit_report import Compiled, Report, format_report
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import _LOGITS_CHUNK_ELEMENTS
from grpax.topology import Chip

# Per GPU: HBM as nvidia-smi reports it (MiB), bf16 dense FLOP/s and HBM bandwidth (NVIDIA's SXM data sheets).
_MIB = 2**20
GPUS: dict[str, Chip] = {
    "a100": Chip("NVIDIA A100 80GB", 81920 * _MIB, 312e12, 2.039e12, 8),
    "h100": Chip("NVIDIA H100 SXM", 81559 * _MIB, 989e12, 3.35e12, 8),
    "h200": Chip("NVIDIA H200 SXM", 143771 * _MIB, 989e12, 4.8e12, 8),
}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def gpu_target(name: str) -> tuple[Chip, int] | None:
    """(the GPU, how many) for names like ``h100-8``; None for any other name."""
    kind, _, count = name.partition("-")
    if kind in GPUS and count.isdigit() and int(count) > 0:
        return GPUS[kind], int(count)
    return None


def _share(n: int, ways: int) -> float:
    """Rows per device: split ``ways`` ways when they divide, else replicated (the rules table's policy)."""
    return n / ways if n % ways == 0 else n


def _layer_sizes(m: ModelConfig, experts_ways: int) -> tuple[int, int]:
    """(one layer's matrix parameters on a chip before the tensor split: a mixture of experts' E / ep experts,
    the widest activation of a token in values: its k experts' for a mixture of experts)."""
    attention = (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim * m.hidden_dim
    qkv_width = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim * 2
    if not m.num_experts:
        return attention + 3 * m.hidden_dim * m.mlp_dim, max(m.mlp_dim * 3, qkv_width)
    experts = 3 * m.hidden_dim * m.moe_mlp_dim * m.num_experts // experts_ways
    return attention + experts, max(3 * m.moe_mlp_dim * m.num_experts_per_tok, qkv_width)


def estimate_job(cfg: TrainConfig, chip: Chip, num_gpus: int, target: str) -> Report:
    """The per-GPU table of ``compile_check`` with estimated temporaries (module docstring).

    Raises:
      ConfigError: mesh keys that do not fit ``num_gpus`` one-host devices (``grpax.sharding``).
    """
    if cfg.rollout_devices:
        raise ConfigError(
            f"rollout_devices={cfg.rollout_devices}: the NVIDIA estimate covers colocated jobs only; estimate with "
            "rollout_devices=0, or compile for a TPU slice (compile_topology=v6e-8 ...)"
        )
    mesh_cfg = cfg.mesh()
    ici = sharding._fill(
        [getattr(mesh_cfg, f"ici_{a}_parallelism") for a in sharding.MESH_AXES],
        num_gpus,
        [f"ici_{a}_parallelism" for a in sharding.MESH_AXES],
        "the number of GPUs",
    )
    ep = mesh_cfg.rollout_expert_parallelism
    dp, tp = sharding.rollout_parallelism(mesh_cfg, num_gpus // ep)
    mesh = AbstractMesh(ici, sharding.MESH_AXES)
    job = build_job(cfg, mesh, AbstractMesh((dp, 1, tp, ep), sharding.MESH_AXES))
    m, s = job.model_cfg, job.shape
    act, w = _BYTES[m.dtype], _BYTES[m.weight_dtype]
    data, tensor = ici[0] * ici[1] * ici[3], ici[2]
    layer, widest = _layer_sizes(m, ici[3])
    # The weights the forward reads (LoRA: the frozen base), gathered a layer at a time.
    gathered = layer * base_bytes_per_param(cfg, m) / tensor
    M = s.num_micro_batches
    prompts, rows = _share(s.num_prompts // M, data), _share(s.num_prompts * s.num_generations // M, data)
    tokens = prompts * s.prompt_length + rows * s.completion_length
    widest /= tensor
    activations = tokens * widest * act
    logits = 3 * _LOGITS_CHUNK_ELEMENTS * 4
    trained = compile_check.per_chip_bytes(job.state.params)
    # float32 gradients whatever the trained dtype (summed in float32): the params', or the adapters' (float32)
    grads = trained * 4 / (w if job.lora is None else 4)
    update = grads * (2 if M > 1 else 1) + 2 * gathered + m.num_layers * tokens * m.hidden_dim * act
    update += activations + logits
    outputs = rows * M * s.completion_length * 4
    reference = gathered + tokens * m.hidden_dim * act * 2 + activations + logits + outputs
    rollout_rows = _share(s.num_prompts * s.num_generations, dp)
    prefill = job.kv_cache * s.prompt_length / (s.prompt_length + s.completion_length)
    prefill += _share(s.num_prompts, dp) * s.prompt_length * widest * act
    # The decode reads each layer's weights in place; only weights wider than the compute dtype that reached
    # the sampler unrounded (no copy to its layout) are rounded into a copy first (``prepare_decode``).
    quantised = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731  (QLoRA's: read as they are)
    decode = sum(
        compile_check.per_chip_bytes([x]) * act / x.dtype.itemsize
        for x in jax.tree.leaves(job.rollout_params, is_leaf=quantised)
        if not quantised(x) and x.dtype.itemsize > act
    )
    decode += job.kv_cache
    decode += 3 * rollout_rows * math.ceil(m.vocab_size / tp) * 4
    estimates = [("update", update)]
    if job.merged_copy:  # the float32 W + s * A @ B of every adapted weight, all layers at once
        layers = job.dense_base["layers"]  # QLoRA: the dequantised weights, in weight_dtype
        stacked = lambda name: layers[name] if isinstance(layers, dict) else [x[name] for x in layers]  # noqa: E731
        names = adapted_weights(m, job.lora)
        adapted = sum(compile_check.per_chip_bytes(stacked(name)) for name in names)
        # A float32 base takes the sum in place (the TPU compiler fuses it: 0 bytes for 8B); a narrower one holds
        # the float32 sums before rounding them.
        estimates.append(("merge", adapted * 4 / w if w < 4 else 0))
    if s.with_reference or s.with_old_logprobs:
        estimates.append(("reference logprobs", reference))
    estimates += [("prefill", prefill), ("decode", decode)]
    functions = {name: Compiled(name, 0, 0, 0, int(b), 0.0) for name, b in estimates}
    batch = compile_check.per_chip_bytes(job.batch)
    phases = {
        "update": int(update + batch),
        "rollout": int(job.merged_copy + job.rollout_copy + max(prefill, decode)),
    }
    if "merge" in functions:
        phases["merge"] = int(job.merged_copy + functions["merge"].temporaries)
    if "reference logprobs" in functions:
        phases["reference logprobs"] = int(job.merged_copy + reference + batch)
    flops = step_count(job, num_gpus, chip.peak_flops, chip.hbm_bandwidth)
    report = Report(
        target, chip.hbm_bytes, job.resident, job.kv_cache, job.rollout_copy, functions, phases, flops,
        merged_copy=job.merged_copy,
    )  # fmt: skip
    report.estimated = True
    return report


def run(cfg: TrainConfig) -> int:
    """``grpax train_rl ... compile_topology=h100-8``: the estimated table; 0 if it fits, else 1."""
    chip, count = gpu_target(cfg.compile_topology)
    report = estimate_job(cfg, chip, count, f"{cfg.compile_topology} ({count} x {chip.name})")
    print(format_report(cfg, report, count))
    return 0 if report.fits else 1
