"""An analytical estimate of a GRPO job's per-GPU memory, for NVIDIA targets that JAX cannot compile for here.

JAX compiles for a TPU slice without the TPU (``grpax.plan.compile_check``), but this JAX has no way to compile
for an absent GPU, so ``compile_topology=h100-8`` (``GPUS``) gets the same table as an ESTIMATE. What is exact:
the resident arrays (params, optimizer state, the reference's copy as the trainer stores it: rounded to the
compute dtype, or in host memory), the params copied for the sampler and the rollout engine's KV page pool (the
engine's own ``paging.pool_pages`` and ``paging.abstract_pool``: ``num_pages`` pages of ``page_size`` tokens,
replicated over the rollout mesh's data axis, heads split over its tensor axis), all placed on an
``AbstractMesh`` of the run's mesh keys. What is estimated are the temporaries of each function, from the shapes
of what it holds at its largest:

* update: the gradients (params-shaped, float32), two layers' gathered weights (FSDP: one in use, one prefetched), the
  residual stream saved at each layer boundary (``remat_policy=full``), one layer's recomputed activations
  (attention inputs and MLP hidden, the longer of them), three chunks of logits (``logits_chunk_bytes``); with
  micro-batches, a second gradient tree (the running sum); with a cheaper remat policy, what the backward keeps
  beyond full's, traced from the model's own ``jax.vjp`` (``remat_extra``);
* reference logprobs: one layer's gathered weights (the reference's copy: rounded to the compute dtype), its
  activations, three chunks of logits, the output; a reference in host memory is on the devices for this pass;
* the rollout engine's two programs (``sampler_terms``), beside the pool they update in place: the prefill's dense
  cache of the prompts, then one layer's keys and values written for each of the G completions (twice) or the
  first tokens' float32 logits (three copies), the larger; the decode's one layer of pages gathered for every
  slot (the XLA paged attention, twice) or the step's float32 logits (three copies), the larger, and a copy of
  the weights in the compute dtype only where wider weights reach it unrounded (``prepare_decode``). The rollout
  phase is the pool plus the larger program: it grows with ``num_pages`` by exactly the pool's bytes.

The H200 measurement (docs/benchmarks.md, "On an H200": a peak of 67.04 GiB for 32 x 8 rows of llama3.2-3b beside
the params and AdamW's state) was of the static engine this replaced, which held three KV caches of P + C slots
per row at its last decode phase (24.5 GiB there); this estimated 66.88 GiB for it. The paged engine holds one
pool (10.5 GiB for those rows at the default ``num_pages``) and is not measured on a GPU yet.

Against the TPU compiler's plans of the engine's programs for the same jobs (``benchmarks/sampler_memory.py``,
the decode with the XLA paged attention a GPU runs; 32 x 8 rows, P = 256, C = 1024; docs/scaling.md): prefill
0.398 vs 0.359 GiB (llama3.2-1b, v6e-8, tensor 8), 0.508 vs 0.517 (llama3.1-8b cut to 2 layers, v6e-8, data 8),
0.563 vs 0.658 (a 2-layer model of 8 kv heads of 128, one v6e chip) and 0.516 vs 1.252 on v5e:2x2, data 4 (the
TPU's schedule holds two layers' all-gathered keys and values with their copies); decode 0.313 vs 0.472 (8B, 2
layers: the gathered pages, 0.31 GiB, in both; the TPU's relayout copies of the attention weights beside them)
and 0.367 vs 3.141 for llama3.2-1b at tensor 8, whose pools the TPU pads (2 kv rows of 64 per chip) and copies:
the TPU's layouts, not a GPU's. The update and reference rows against the compiler's for the seed's 8B job on
v6e-8 (docs/scaling.md): peak 11.35 vs 11.41 GiB, update temporaries 3.23 vs 2.99 GiB, reference logprobs 0.60
vs 0.99 (measured with the static engine's sampler).

With LoRA the resident rows are the frozen base (``compile_check.base_bytes_per_param`` bytes per parameter),
the float32 adapters and their optimizer state, and no reference copy (all exact); the update's gradients are
the adapters' (float32) and the weights it gathers are the base's; the merged weights the sampler reads
(``lora.merge``, ``lora_sampler=merged``) are exact and held by the merge, the rollout and the reference pass;
the merge's temporaries are, with a 16-bit base, the float32 sums of every adapted weight, all layers (the TPU
compiler's plan of Llama 3.1 70B's bfloat16 merge on v6e-8 holds 33.39 GiB of temporaries; this gives 31.9), and
none with a float32 base (the compiler's plan of 8B's float32 merge: 0). With ``lora_sampler=adapters`` (auto's
choice on GPUs) there is no merge and no merged copy: the decode reads the base in place and rounds the
float32 adapters to the compute dtype (``prepare_decode``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from grpax import sharding
from grpax.config import ConfigError
from grpax.models.llama import forward_grouped
from grpax.models.lora import adapted_weights
from grpax.models.params import abstract_params
from grpax.models.quantize import QuantizedWeight
from grpax.models.registry import ModelConfig
from grpax.plan import compile_check
from grpax.plan.compile_check import base_bytes_per_param, build_job, step_count
from grpax.plan.fit_report import Compiled, Report, format_report
from grpax.plan.step_cost import BYTES
from grpax.plan.topology import Chip
from grpax.rl.train_config import TrainConfig
from grpax.rl.train_step import logits_chunk_bytes
from grpax.sampler import keys

# Per GPU: HBM as nvidia-smi reports it (MiB), bf16 dense FLOP/s and HBM bandwidth (NVIDIA's SXM data sheets).
_MIB = 2**20
GPUS: dict[str, Chip] = {
    "a100": Chip("NVIDIA A100 80GB", 81920 * _MIB, 312e12, 2.039e12, 8, host_bandwidth=32e9),  # PCIe Gen4 x16
    "h100": Chip("NVIDIA H100 SXM", 81559 * _MIB, 989e12, 3.35e12, 8, host_bandwidth=64e9),  # PCIe Gen5 x16
    "h200": Chip("NVIDIA H200 SXM", 143771 * _MIB, 989e12, 4.8e12, 8, host_bandwidth=64e9),
}


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


@functools.cache
def _residual_bytes(cfg: ModelConfig, prompts: int, rows: int, P: int, C: int) -> int:
    """Bytes ``jax.vjp`` of the update's forward (``forward_grouped``) keeps for its backward under
    ``cfg.remat_policy``: its residuals, traced (``jax.make_jaxpr``: nothing is computed or allocated), less the
    params themselves (resident, counted apart)."""
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def pullback(p, prompt_ids, prompt_mask, completion_ids):
        forward = lambda q: forward_grouped(q, prompt_ids, prompt_mask, completion_ids, cfg).sum()  # noqa: E731
        return jax.vjp(forward, p)[1]

    traced = jax.make_jaxpr(pullback)(abstract_params(cfg), ints(prompts, P), ints(prompts, P), ints(rows, C))
    inputs = set(traced.jaxpr.invars)
    saved = {v for v in traced.jaxpr.outvars if isinstance(v, jax.extend.core.Var) and v not in inputs}
    return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in saved)


@functools.cache
def remat_extra(cfg: ModelConfig, prompts: int, rows: int, P: int, C: int, tensor: int, share: float) -> int:
    """Bytes per device per layer the update's backward keeps under ``cfg.remat_policy`` beyond what
    ``remat_policy=full`` keeps (each layer's input): 0 for full.

    Traced from the model itself (``_residual_bytes`` of two layers less one): what JAX's autodiff saves, e.g.
    with ``none`` every layer's activations and its weights rounded to the compute dtype. ``prompts`` and
    ``rows`` are a micro-batch's; each device holds its ``tensor``-way share of the heads and the MLP, ``share``
    of the activations (its tokens over the micro-batch's: those that double with the rows), and the weights
    whole (FSDP's gathered copy: an upper bound where the compiler keeps them sharded).
    """
    if cfg.remat_policy == "full":
        return 0
    if cfg.remat_policy == "custom":  # what it offloads is in host memory: traced as recomputed
        cfg = dataclasses.replace(
            cfg, remat_names=tuple(kept for kept in cfg.remat_names if kept[1] == "device")
        )
    split = lambda n: n // tensor if n % tensor == 0 else n  # noqa: E731  (the rules table: else replicated)
    local = dataclasses.replace(
        cfg, vocab_size=128, num_heads=split(cfg.num_heads), num_kv_heads=split(cfg.num_kv_heads),
        mlp_dim=split(cfg.mlp_dim), scan_layers=False,
    )  # fmt: skip

    def layer(policy: str, times: int) -> int:
        one, two = (
            dataclasses.replace(local, remat_policy=policy, num_layers=n, layer_types=cfg.layer_types[:n])
            for n in (1, 2)
        )
        batch = (times * prompts, times * rows, P, C)
        return _residual_bytes(two, *batch) - _residual_bytes(one, *batch)

    def per_device(policy: str) -> float:
        once, twice = layer(policy, 1), layer(policy, 2)
        return (2 * once - twice) + (twice - once) * share  # the weights' + this device's activations

    return max(int(per_device(cfg.remat_policy) - per_device("full")), 0)


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
    ici = sharding.ici_shape(mesh_cfg, num_gpus, "the number of GPUs")
    ep = mesh_cfg.rollout_expert_parallelism
    dp, tp = sharding.rollout_parallelism(mesh_cfg, num_gpus // ep)
    mesh = AbstractMesh(ici, sharding.MESH_AXES)
    job = build_job(cfg, mesh, AbstractMesh((dp, 1, tp, ep), sharding.MESH_AXES))
    update, reference = _trainer_temporaries(cfg, job, ici[0] * ici[1] * ici[3], ici[2], ici[3])
    prefill, decode = _sampler_temporaries(job)
    estimates = [("update", update)]
    if job.merged_copy:
        estimates.append(("merge", _merge_temporaries(job)))
    if job.shape.with_reference or job.shape.with_old_logprobs:
        estimates.append(("reference logprobs", reference))
    if job.teacher is not None:  # the reference pass's temporaries of the teacher's model and params
        as_teacher = dataclasses.replace(job, model_cfg=job.teacher_cfg, reference=job.teacher)
        teacher = _trainer_temporaries(cfg, as_teacher, ici[0] * ici[1] * ici[3], ici[2], ici[3])[1]
        estimates.append(("teacher logprobs", teacher))
    estimates += [("prefill", prefill), ("decode", decode)]
    functions = {name: Compiled(name, 0, 0, 0, int(b), 0.0) for name, b in estimates}
    batch = sharding.per_chip_bytes(job.batch)
    # A reference held in host memory is on the devices during its own pass only.
    copied = sharding.per_chip_bytes(job.reference) if job.reference_on_host else 0
    phases = {
        "update": int(update + batch),
        "rollout": int(job.merged_copy + job.rollout_copy + job.kv_cache + max(prefill, decode)),
    }
    if "merge" in functions:
        phases["merge"] = int(job.merged_copy + functions["merge"].temporaries)
    if "reference logprobs" in functions:
        phases["reference logprobs"] = int(job.merged_copy + copied + reference + batch)
    if "teacher logprobs" in functions:
        on_host = sharding.per_chip_bytes(job.teacher) if job.teacher_on_host else 0  # on the devices for it
        phases["teacher logprobs"] = int(
            job.merged_copy + on_host + functions["teacher logprobs"].temporaries + batch
        )
    flops = step_count(job, num_gpus, chip.peak_flops, chip.hbm_bandwidth, chip.host_bandwidth)
    report = Report(
        target, chip.hbm_bytes, job.resident, job.kv_cache, job.rollout_copy, functions, phases, flops,
        merged_copy=job.merged_copy, kv_pool=(job.num_pages, job.sampler_cfg.page_size),
        num_experts=job.model_cfg.num_experts,
    )  # fmt: skip
    report.estimated = True
    return report


def _trainer_temporaries(cfg: TrainConfig, job, data: int, tensor: int, expert: int) -> tuple[float, float]:
    """Bytes per GPU of the update's and the reference pass's temporaries on a (data x fsdp x expert, tensor)
    mesh (a mixture of experts' experts split ``expert`` ways)."""
    m, s = job.model_cfg, job.shape
    act, w = BYTES[m.dtype], BYTES[m.weight_dtype]
    layer, widest = _layer_sizes(m, expert)
    # The weights the forward reads (LoRA: the frozen base), gathered a layer at a time.
    gathered = layer * base_bytes_per_param(cfg, m) / tensor
    M = s.num_micro_batches
    prompts, rows = _share(s.num_prompts // M, data), _share(s.num_prompts * s.num_generations // M, data)
    tokens = prompts * s.prompt_length + rows * s.completion_length
    widest /= tensor
    activations = tokens * widest * act
    logits = 3 * logits_chunk_bytes(-(-m.vocab_size // tensor))  # at most; the vocabulary split over tensor
    trained = sharding.per_chip_bytes(job.state.params)
    # float32 gradients whatever the trained dtype (summed in float32): the params', or the adapters' (float32)
    grads = trained * 4 / (w if job.lora is None else 4)
    update = grads * (2 if M > 1 else 1) + 2 * gathered + m.num_layers * tokens * m.hidden_dim * act
    update += activations + logits
    P, C = s.prompt_length, s.completion_length
    micro = (s.num_prompts // M, s.num_prompts * s.num_generations // M)  # a micro-batch's prompts and rows
    share = tokens / (micro[0] * P + micro[1] * C)  # this device's tokens of it
    update += m.num_layers * remat_extra(m, *micro, P, C, tensor, share)
    outputs = rows * M * s.completion_length * 4
    # The reference pass gathers the reference's copy (rounded to the compute dtype: half of float32 weights).
    read = 1.0 if job.reference is None else compile_check.largest_leaf(job.reference).dtype.itemsize / w
    reference = gathered * read + tokens * m.hidden_dim * act * 2 + activations + logits + outputs
    return update, reference


def sampler_terms(job) -> dict[str, dict[str, float]]:
    """Bytes per GPU the rollout engine's two programs hold beside their arguments (the params and the page
    pool, donated and updated in place) at their largest moment, term by term: {"prefill": {term: bytes},
    "decode": {term: bytes}}; each program's temporaries are the sum of its terms.

    The programs are those ``program_set.abstract_programs`` compiles (``grpax.sampler.decode``). ``admit`` prefills
    N = ``keys.prefill_prompts`` prompts (batch_size, or the groups that fill max_num_seqs slots; rounded up
    to a power of two) of P = max_prompt_length tokens into a dense cache
    (the model's activation constraints split the prompts over the rollout mesh's data axes where they divide),
    then writes each layer's keys and values into the pages for each of the G completions (the pool is
    replicated over the data axes: every chip writes every page, so it holds all N x G x P of one layer: the
    values written, and their keys and values stacked by ``write_pages``), and samples the first tokens (the
    N x G rows' float32 logits, replicated). Its largest moment is the write or the sampling, whichever holds
    more. ``decode`` runs S = ``decode_slots`` slots (split over the data axes where they divide) over page
    tables of ``pages_per_sequence`` pages: the XLA paged attention gathers one layer's pages of every slot and
    splits them into keys and values (two copies), or the step's logits and the sampling's float32 copies (three),
    whichever is more; beside them a copy of weights wider than the compute dtype (``prepare_decode``) and the
    call's per-step outputs. Heads are split over the ``tensor`` axis as the pool's are.
    """
    m, sc, s = job.model_cfg, job.sampler_cfg, job.shape
    act, V, L = BYTES[m.dtype], m.vocab_size, m.num_layers
    mesh = dict(job.rollout_mesh.shape)
    rows_ways, tensor = mesh["data"] * mesh["fsdp"] * mesh["expert"], mesh["tensor"]
    G, P = s.num_generations, sc.max_prompt_length
    N = keys.prefill_prompts(sc, s.num_prompts, G)
    S = _share(sc.decode_slots(s.num_prompts * G), rows_ways)
    # the pool's bytes per token of one layer on a chip (its keys and values, heads split as the pool's)
    per_token = job.kv_cache / (job.num_pages * sc.page_size * L)
    widest = _layer_sizes(m, mesh["expert"])[1] / tensor
    prompts = _share(N, rows_ways)
    cache = prompts * P * per_token * L
    forward = cache + prompts * P * (widest + 2 * m.hidden_dim) * act
    write = cache + 2 * N * G * P * per_token
    sampling = 3 * N * G * V * 4
    prefill = {"prompts' dense cache (all layers)": cache}
    if write - cache >= max(sampling, forward - cache):
        prefill["one layer's keys and values for every completion, twice (the write)"] = write - cache
    elif sampling >= forward - cache:
        prefill["first tokens' logits, three float32 copies (the sampling)"] = sampling
    else:
        prefill["one layer's activations (the forward)"] = forward - cache
    # The decode reads each layer's weights in place; only weights wider than the compute dtype that reached
    # the sampler unrounded (no copy to its layout) are rounded into a copy first (``prepare_decode``).
    quantised = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731  (QLoRA's: read as they are)
    rounded = sum(
        sharding.per_chip_bytes([x]) * act / x.dtype.itemsize
        for x in jax.tree.leaves(job.rollout_params, is_leaf=quantised)
        if not quantised(x) and x.dtype.itemsize > act
    )
    logits = 3 * S * V * 4
    gathered = 0.0
    if not job.sampler_backend.reads_filled_pages:
        gathered = 2 * S * sc.pages_per_sequence() * sc.page_size * per_token
    decode = {
        "weights rounded to the compute dtype (prepare_decode)": rounded,
        "per-step outputs (tokens, logprobs, flags)": S * sc.decode_steps_per_call * 10,
    }
    if gathered > logits:
        decode["one layer's pages gathered for every slot, twice (the attention)"] = gathered
    else:
        decode["the step's logits, three float32 copies (the sampling)"] = logits
    return {"prefill": prefill, "decode": decode}


def _sampler_temporaries(job) -> tuple[float, float]:
    """Bytes per GPU of the prefill's and the decode's temporaries (``sampler_terms`` summed)."""
    terms = sampler_terms(job)
    return sum(terms["prefill"].values()), sum(terms["decode"].values())


def _merge_temporaries(job) -> float:
    """LoRA's merge: the float32 W + s * A @ B of every adapted weight, all layers at once. A float32 base takes
    the sum in place (the TPU compiler fuses it: 0 bytes for 8B); a narrower one holds the float32 sums before
    rounding them (QLoRA: of the dequantised weights, in weight_dtype)."""
    w = BYTES[job.model_cfg.weight_dtype]
    layers = job.dense_base["layers"]
    stacked = lambda name: layers[name] if isinstance(layers, dict) else [x[name] for x in layers]  # noqa: E731
    adapted = sum(sharding.per_chip_bytes(stacked(name)) for name in adapted_weights(job.model_cfg, job.lora))
    return adapted * 4 / w if w < 4 else 0


def run(cfg: TrainConfig) -> int:
    """``grpax train_rl ... compile_topology=h100-8``: the estimated table; 0 if it fits, else 1."""
    chip, count = gpu_target(cfg.compile_topology)
    report = estimate_job(cfg, chip, count, f"{cfg.compile_topology} ({count} x {chip.name})")
    print(format_report(cfg, report, count))
    return 0 if report.fits else 1
