"""FLOPs and HBM bytes of one GRPO step, counted from the shapes, and the step time they imply at a chip's peak.

Why a count and not the compiler's ``cost_analysis()``: XLA counts the body of a loop once, and every phase of a
GRPO step is a loop (the layers are scanned, the micro-batches are scanned, the decode is a ``while_loop`` of
up to C steps), so its figures are low by factors of L, M and C. The count follows the code as it runs:

* prefill: each prompt's P tokens through the layers (attention over the full P x P square, as computed);
* decode: the paged engine's (``grpax.sampler.engine``): the rows (prompts x G) pass through its decode slots
  (``max_num_seqs``, or every row) in waves of C - 1 steps each (the prefill samples each row's first token),
  every row running to its length limit C: an upper bound on the steps and pages, as real rows stop early and
  free their slots and pages sooner. A step runs the layers
  and the vocabulary projection on every slot of the call (``call_slots``: the last wave on the smallest slot
  count that holds it), reads the weights once, and reads the pages its attention reads: where it gathers them
  (XLA), every slot's page table cut to the longest sequence's pages at the call's end rounded up to
  ``decode_phase_length`` (``gathered_width``); Pallas's ragged kernel (TPU), each sequence's filled pages;
* reference / old / teacher logprobs: ``forward_grouped`` (each prompt once, its G completions on top) + the
  vocabulary projection of the completion tokens (a distillation teacher's: of its own sizes);
* update: forward + backward (2x forward) of the same, + one more forward of the layers with
  ``remat_policy=full`` or ``custom`` (what custom keeps is not recomputed: an upper bound) and of the vocabulary
  projection (it is always rematerialised).

With LoRA (``StepShape.adapter_params > 0``) the backward computes the activations' gradients through the frozen
weights (1x forward) and the weights' gradients of the adapters only; each pass adds the adapters' own matmuls
(``x @ A``, then ``@ B``: 2 FLOPs per adapter parameter per token); the optimizer reads and writes the adapters and
their moments only; and with the merged sampler each rollout first merges them (``lora.merge``: ``W + s * A @ B``
of every adapted weight, 2r FLOPs per adapted parameter; it reads the base and writes the merged copy), while the
adapters sampler (``StepShape.sampler_adapters``) merges nothing and its prefill and decode add the adapters'
matmuls per token, and the decode reads the adapters (in the compute dtype) at every step beside the weights.

A matmul of an [a, b] by [b, c] is 2abc FLOPs. Bytes per chip count the weights each chip reads per pass
(whole, except the ``tensor`` split: FSDP gathers them; a mixture of experts' experts split on ``expert`` too,
each chip reading its own), the KV cache it reads per decode step, and the
optimizer's read and write of params, gradients and both moments; activations are left out, so the time is
a lower bound: ``sum over phases of max(FLOPs / (chips * peak), bytes per chip / bandwidth)`` (the decode's sum
over its steps). Every prompt is counted at P tokens (the longest bucket) and the KV pool as holding every
slot's sequence (no preemption).
"""

from __future__ import annotations

import dataclasses

from grpax.models.registry import ModelConfig
from grpax.sampler.keys import SamplerConfig, call_pages, call_slots, gathered_width

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # of each dtype a model key names


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a GRPO step: FLOPs over the whole slice, HBM bytes per chip, and its roofline seconds."""

    name: str
    flops: float
    bytes_per_chip: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The sizes of one step: prompts, G, prompt and completion tokens, micro-batches, iterations, beta > 0."""

    num_prompts: int
    num_generations: int
    prompt_length: int  # P (the longest prompt bucket)
    completion_length: int  # C
    num_micro_batches: int
    num_iterations: int
    with_reference: bool
    with_old_logprobs: bool  # GRPOConfig.needs_old_logprobs: the pi_old pass of the sampling params
    adapter_params: int = 0  # LoRA: the adapters' parameters (0: a full fine-tune)
    adapted_params: int = 0  # LoRA: the base parameters of the adapted weights (merged each rollout)
    lora_rank: int = 0  # LoRA: r
    sampler_adapters: bool = False  # LoRA: the sampler reads the base and its adapters (no merge)
    reference_dtype: str = ""  # the reference copy's dtype (rounded to the compute dtype); "": weight_dtype
    decode_slots: int = 0  # the engine's decode slots (SamplerConfig.decode_slots of the rows); 0: every row
    # the engine's keys as the run's sampler takes them: page_size, decode_steps_per_call, decode_phase_length,
    # retire_rows and slot_count_step shape the decode's gathers and slot ladder
    sampler: SamplerConfig = SamplerConfig()
    reads_filled_pages: bool = False  # the sampler backend's: its attention reads only filled pages


def _layer_matmul_params(cfg: ModelConfig) -> int:
    """The matrix parameters each token multiplies by (a mixture of experts: its router and k experts)."""
    D, N, K, H, F = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    mlp = 3 * D * F
    if cfg.num_experts:
        mlp = 3 * D * cfg.moe_mlp_dim * cfg.num_experts_per_tok + D * cfg.num_experts
    return cfg.num_layers * (2 * D * N * H + 2 * D * K * H + mlp)


def _weights_per_chip(cfg: ModelConfig, itemsize: int, tensor: int, expert: int) -> float:
    """Bytes of the weights one chip reads per pass: all of them split on ``tensor``, the experts on ``expert``
    too."""
    experts = cfg.expert_params()
    return (cfg.num_params() - experts) * itemsize / tensor + experts * itemsize / (tensor * expert)


def _attention_flops(cfg: ModelConfig, queries: float, keys: float) -> float:
    """QK^T and PV of ``queries`` x ``keys`` pairs over all layers and heads."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * queries * keys


def grouped_forward_flops(cfg: ModelConfig, s: StepShape) -> tuple[float, float]:
    """(layers, vocabulary projection) FLOPs of one ``forward_grouped`` + completion logprobs of the batch."""
    rows = s.num_prompts * s.num_generations
    P, C = s.prompt_length, s.completion_length
    tokens = s.num_prompts * P + rows * C
    layers = 2.0 * _layer_matmul_params(cfg) * tokens
    layers += _attention_flops(cfg, s.num_prompts * P, P) + _attention_flops(cfg, rows * C, P + C)
    return layers, 2.0 * cfg.hidden_dim * cfg.vocab_size * rows * C


def step_phases(
    cfg: ModelConfig,
    s: StepShape,
    num_chips: int,
    trainer_tensor: int,
    rollout_tensor: int,
    rollout_data: int,
    peak_flops: float,
    hbm_bandwidth: float,
    *,
    trainer_expert: int = 1,
    rollout_expert: int = 1,
    teacher: ModelConfig | None = None,
) -> list[Phase]:
    """The phases of one GRPO step (rollout, reference, old logprobs, update) with their roofline seconds.

    Args:
      cfg: the model (``weight_dtype`` sizes the weights the trainer reads, the narrower of it and ``dtype``
        those the sampler reads, rounded once per rollout; ``dtype`` sizes the KV cache, ``remat_policy`` the
        update).
      s: the step's sizes.
      num_chips: chips of the slice(s); trainer_tensor: the trainer mesh's tensor axis; rollout_tensor,
        rollout_data: the sampler mesh's tensor and data axes; trainer_expert, rollout_expert: the meshes'
        expert axes (each chip reads its own experts; the sampler's rows and cache split on it too).
      peak_flops: FLOP/s per chip; hbm_bandwidth: bytes/s per chip.
      teacher: a distillation teacher's model: its logprob pass (``forward_grouped`` + the completion tokens'
        vocabulary projection of its own sizes, its weights read rounded to its compute dtype) after the
        reference's.
    """
    roof = _Roofline(num_chips, peak_flops, hbm_bandwidth)
    weights = _weights_per_chip(cfg, BYTES[cfg.weight_dtype], rollout_tensor, rollout_expert)
    # The adapters sampler: 2 FLOPs per adapter parameter per token, and the adapters read per pass (split
    # as the weights, for the count: their rank axis is replicated, a few MB).
    adapter_bytes = s.adapter_params * min(4, BYTES[cfg.dtype]) if s.sampler_adapters else 0.0
    P = s.prompt_length
    prefill = 2.0 * _layer_matmul_params(cfg) * s.num_prompts * P + _attention_flops(
        cfg, s.num_prompts * P, P
    )
    prefill += 2.0 * cfg.hidden_dim * cfg.vocab_size * s.num_prompts
    prefill += (2.0 * s.adapter_params if s.sampler_adapters else 0.0) * s.num_prompts * P
    training = _training_phases(cfg, s, roof, trainer_tensor, trainer_expert)
    if teacher is not None:  # after the reference and pi_old passes, before the updates
        itemsize = min(BYTES[teacher.weight_dtype], BYTES[teacher.dtype])
        read = s.num_micro_batches * _weights_per_chip(teacher, itemsize, trainer_tensor, trainer_expert)
        pass_phase = roof.phase("teacher logprobs", sum(grouped_forward_flops(teacher, s)), read)
        training.insert(len(training) - s.num_iterations, pass_phase)
    merge = [p for p in training if p.name == "merge"]  # LoRA's merged sampler: before the rollout
    rollout = [
        roof.phase("prefill", prefill, weights + adapter_bytes / rollout_tensor),
        _decode(cfg, s, roof, rollout_tensor, rollout_data, rollout_expert),
    ]
    return merge + rollout + [p for p in training if p.name != "merge"]


@dataclasses.dataclass(frozen=True)
class _Roofline:
    """A phase's roofline time on ``num_chips`` chips: the larger of its FLOPs at the peak and its bytes per
    chip at the HBM bandwidth."""

    num_chips: int
    peak_flops: float
    hbm_bandwidth: float

    def seconds(self, flops: float, bytes_per_chip: float) -> float:
        return max(flops / (self.num_chips * self.peak_flops), bytes_per_chip / self.hbm_bandwidth)

    def phase(self, name: str, flops: float, bytes_per_chip: float) -> Phase:
        return Phase(name, flops, bytes_per_chip, self.seconds(flops, bytes_per_chip))


def _decode(
    cfg: ModelConfig,
    s: StepShape,
    roof: _Roofline,
    rollout_tensor: int,
    rollout_data: int,
    rollout_expert: int,
) -> Phase:
    """The decode, step by step (see the module docstring): each step reads the sampler's weights (rounded to the
    compute dtype by ``XlaBackend.prepare_decode``; the adapters too with the adapters sampler) and the keys and
    values of the pages its attention reads (``_keys_read``). Per chip the pages' heads are split over
    ``tensor`` where they divide (the pools' placement, ``XlaBackend.page_spec``) and the gathered slots over the
    data and expert axes (Pallas's kernel runs every slot on each chip); each chip reads its own experts."""
    itemsize = min(BYTES[cfg.weight_dtype], BYTES[cfg.dtype])
    sampler_weights = _weights_per_chip(cfg, itemsize, rollout_tensor, rollout_expert)  # per chip
    adapter_flops = 2.0 * s.adapter_params if s.sampler_adapters else 0.0
    if s.sampler_adapters:
        sampler_weights += s.adapter_params * min(4, BYTES[cfg.dtype]) / rollout_tensor
    # every slot of a call runs the layers and the vocabulary projection, an idle one too
    per_slot = 2.0 * _layer_matmul_params(cfg) + 2.0 * cfg.hidden_dim * cfg.vocab_size + adapter_flops
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * BYTES[cfg.dtype]  # all layers' k and v
    heads_split = rollout_tensor if cfg.num_kv_heads % rollout_tensor == 0 else 1
    kv_per_chip = kv_token / heads_split / (1 if s.reads_filled_pages else rollout_data * rollout_expert)
    rows = s.num_prompts * s.num_generations
    num_slots = s.decode_slots or rows
    waves = -(-rows // num_slots)
    flops = per_chip = seconds = 0.0
    # The waves before the last run on every slot (rows wait for one); the last on the slots that hold its rows.
    for count, running, waiting in [(waves - 1, num_slots, True), (1, rows - (waves - 1) * num_slots, False)]:
        if not count:
            continue
        S = call_slots(num_slots, running, waiting, s.sampler.retire_rows, s.sampler.slot_count_step)
        for n in range(1, s.completion_length):  # n: completion tokens before the step
            keys = _keys_read(s, S, running, n)
            step_flops = S * per_slot + _attention_flops(cfg, 1, keys)
            step_bytes = sampler_weights + keys * kv_per_chip
            flops += count * step_flops
            per_chip += count * step_bytes
            seconds += count * roof.seconds(step_flops, step_bytes)
    return Phase("decode", flops, per_chip, seconds)


def _keys_read(s: StepShape, S: int, running: int, n: int) -> int:
    """Key slots (tokens of pages) the attention of one decode step reads over its ``S`` slots, ``running`` of
    them sequences of P prompt and ``n`` completion tokens, which attend P + n keys (the fed token's own
    included).

    Filled pages (``reads_filled_pages``: Pallas's ragged kernel): each sequence's pages of P + n tokens, an idle
    slot's one page (its length 1); the kernel's blocks of several pages are not counted. Gathered (XLA): every
    slot's row of the page table as the engine cut it for the step's call (calls of ``decode_steps_per_call``
    steps, the first at n0 tokens): the pages through the call's last position (``call_pages``), rounded up
    (``gathered_width``)."""
    P, C, ps = s.prompt_length, s.completion_length, s.sampler.page_size
    if s.reads_filled_pages:
        return (running * -(-(P + n) // ps) + (S - running)) * ps
    k = s.sampler.decode_steps_per_call
    n0 = 1 + (n - 1) // k * k
    table_width = -(-(P + C) // ps)
    return (
        S * gathered_width(call_pages(P, n0, k, C, ps), table_width, ps, s.sampler.decode_phase_length) * ps
    )


def _training_phases(
    cfg: ModelConfig, s: StepShape, roof: _Roofline, trainer_tensor: int, trainer_expert: int
) -> list[Phase]:
    """The reference and pi_old logprob passes, LoRA's merge, and the ``num_iterations`` updates."""
    w = BYTES[cfg.weight_dtype]
    weights = cfg.num_params() * w
    phases = []
    layers, vocab = grouped_forward_flops(cfg, s)
    forward_pass_bytes = s.num_micro_batches * _weights_per_chip(cfg, w, trainer_tensor, trainer_expert)
    if s.with_reference:
        read = BYTES[s.reference_dtype] / w if s.reference_dtype else 1.0  # its copy's bytes per weight's
        phases.append(roof.phase("reference logprobs", layers + vocab, forward_pass_bytes * read))
    if s.with_old_logprobs:
        phases.append(roof.phase("old logprobs", layers + vocab, forward_pass_bytes))
    # the forward (and its recomputation: remat full, or custom, which recomputes what it does not keep; counted
    # whole, an upper bound)
    forwards = 2 if cfg.remat_policy in ("full", "custom") else 1
    lora = s.adapter_params > 0
    shard = (s.adapter_params if lora else cfg.num_params()) / roof.num_chips  # trained values per chip
    if lora:
        # Backward = the activations' gradients only (1x forward) + the adapters' (2x their forward FLOPs).
        tokens = s.num_prompts * s.prompt_length + s.num_prompts * s.num_generations * s.completion_length
        adapter = 2.0 * s.adapter_params * tokens
        update_flops = (forwards + 1) * layers + (forwards + 2) * adapter + 3 * vocab
        optimizer_bytes = shard * (2 * 4 + 4 * 5)  # float32 adapters: read + write, grads, mu, nu
        if not s.sampler_adapters:
            merge_flops = 2.0 * s.lora_rank * s.adapted_params
            # Read the base, write the merged copy (every weight: the jitted merge returns them all), on the
            # trainer's mesh.
            phases.insert(0, roof.phase("merge", merge_flops, 2 * weights / roof.num_chips))
    else:
        update_flops = (forwards + 2) * layers + 4 * vocab  # the backward is 2x forward
        # Read + write params, read float32 grads, read + write float32 mu and nu (and a float32 master copy's
        # read and write beside 16-bit params).
        optimizer_bytes = shard * (2 * w + 4 * 5 + (8 if w < 4 else 0))
    update_bytes = (forwards + 1) * forward_pass_bytes + optimizer_bytes  # each pass reads the weights
    for i in range(s.num_iterations):
        name = "update" if s.num_iterations == 1 else f"update {i + 1}"
        phases.append(roof.phase(name, update_flops, update_bytes))
    return phases
