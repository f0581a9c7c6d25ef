"""The per-chip memory table of a GRPO job (``grpax.plan.compile_check``, ``grpax.plan.memory_estimate``): its
data, the verdict against the chip's HBM, the keys to change when it does not fit, and its printed form.

The peak is what is resident for the whole step (params, optimizer state, reference params; with LoRA the frozen
base, the adapters and their optimizer state, and no reference copy) plus the largest of the phases (LoRA's merge,
rollout, reference logprobs, update), each counted as the bytes its function adds beyond what is already counted:
its other arguments, its temporaries and its new (not aliased) outputs.
"""

from __future__ import annotations

import dataclasses
import math

from grpax.plan.collectives import Collective
from grpax.rl.train_config import TrainConfig

GIB = 2**30


@dataclasses.dataclass
class Compiled:
    """One compiled function: its per-chip memory (bytes) and compile seconds."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    seconds: float
    over_hbm: bool = False  # the compiler refused it: arguments + temporaries exceed the chip's HBM
    collectives: dict[str, Collective] | None = (
        None  # kind -> per chip, loop trips counted (None: not counted)
    )
    fsdp_minimum: float = (
        0.0  # bytes per chip of FSDP's minimum for this function (``collectives.fsdp_minimum``)
    )


@dataclasses.dataclass
class Report:
    """Per-chip bytes of the resident arrays and of each compiled function, and the fit against ``hbm``."""

    target: str  # e.g. "v6e-8 (8 x TPU v6e)"
    hbm: int
    resident: dict[str, int]  # params, optimizer state, reference params
    kv_cache: int  # the rollout engine's KV page pool, per chip
    rollout_copy: int  # the params copied to the sampler's layout (0 when it is the trainer's)
    functions: dict[str, Compiled]
    phases: dict[str, int]  # phase -> bytes beyond the resident arrays
    flops: list  # step_cost.Phase
    estimated: bool = False  # temporaries from formulas (grpax.plan.memory_estimate), not from a compiler
    rollout_chips: int = 0  # rollout_devices: the sampler's own chips (0: colocated with the trainer)
    merged_copy: int = (
        0  # LoRA: the merged weights the sampler reads, held by the rollout and reference phases
    )
    kv_pool: tuple[int, int] = (0, 0)  # (pages, tokens per page) of that pool (``paging.pool_pages``)
    num_experts: int = 0  # the model's routed experts (0: dense), for the expert-parallel suggestions

    @property
    def trainer_peak(self) -> int:
        """The trainer's chips: resident arrays plus the largest phase they run (all of them, colocated)."""
        phases = [b for name, b in self.phases.items() if not (self.rollout_chips and name == "rollout")]
        return sum(self.resident.values()) + max(phases)

    @property
    def sampler_peak(self) -> int:
        """The sampler's own chips (rollout_devices): its copy of the params, the cache and the decode's
        temporaries (the rollout phase); 0 when colocated."""
        return self.phases.get("rollout", 0) if self.rollout_chips else 0

    ici_bandwidth: float = 0.0  # bytes/s per chip over ICI (0: unknown, no ICI time)

    @property
    def peak(self) -> int:
        return max(self.trainer_peak, self.sampler_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.hbm and not any(c.over_hbm for c in self.functions.values())


def _divisor_at_most(n: int, limit: float) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (at least 1)."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(limit, 1))


def _fewer_pages(cfg: TrainConfig, report: Report, resident: int) -> int:
    """The most pages of the KV pool that leave the rollout phase fitting beside ``resident`` bytes; 0 when even
    the fewest that hold one sequence (1 + ceil(max_target_length / page_size)) do not."""
    pages, page_size = report.kv_pool
    if not pages:
        return 0
    over = report.phases["rollout"] - max(report.hbm - resident, 0)
    fewer = pages - -(-over * pages // report.kv_cache)  # each page's bytes: kv_cache / pages
    return fewer if 1 + -(-cfg.max_target_length // page_size) <= fewer < pages else 0


def suggestions(cfg: TrainConfig, report: Report, num_chips: int) -> list[str]:
    """Keys that shrink the largest part of the peak, with values to try (scaled to the room left)."""
    out = []
    phase = max(report.phases, key=report.phases.get)
    resident = sum(report.resident.values())
    # < 1: the largest phase must shrink by this factor to fit beside the resident arrays.
    room = max(report.hbm - resident, 0) / max(report.phases[phase], 1)
    if resident > report.hbm / 2:
        if cfg.lora_rank and cfg.weight_dtype == "float32":
            out.append("weight_dtype=bfloat16 (the frozen base in half the memory)")
        if not cfg.lora_rank and not cfg.mu_dtype and cfg.weight_dtype == "float32":
            out.append("mu_dtype=bfloat16 (AdamW's first moment in half the memory)")
        if cfg.beta > 0 and not cfg.lora_rank:
            if cfg.reference_dtype != "compute":
                out.append("reference_dtype=compute (the reference copy rounded as the forward reads it)")
            if not cfg.reference_on_host:
                out.append(
                    "reference_memory=pinned_host (the reference copy in host memory, on the devices for its pass)"
                )
            out.append("beta=0 (no reference copy of the params)")
        if cfg.distillation_coef > 0 and not cfg.teacher_on_host:
            out.append("teacher_memory=pinned_host (the teacher in host memory, on the devices for its pass)")
        out.append(
            f"a larger compile_topology than {num_chips} chips (params and optimizer state split wider)"
        )
    out += _expert_suggestions(cfg, report, num_chips, phase)
    if phase in ("update", "reference logprobs", "teacher logprobs"):
        prompts = cfg.batch_size // cfg.micro_batches
        if prompts > 1:
            fit = _divisor_at_most(cfg.batch_size, prompts * room)
            out.append(f"micro_batch_size={min(fit, prompts // 2)} (now {prompts} prompts per micro-batch)")
        if cfg.remat != "full":
            kept = " ".join(f"{name}=remat" for name, _ in cfg.remat_names())
            out.append(f"remat_policy=full (now {cfg.remat}){f' {kept}' if kept else ''}")
    if phase in ("rollout", "reference logprobs", "merge") and report.merged_copy:
        out.append(
            f"lora_sampler=adapters (no merged weights for the sampler: {report.merged_copy / GIB:.2f} GiB per "
            "chip, held from the merge to the reference pass)"
            + (", or weight_dtype=bfloat16" if cfg.weight_dtype == "float32" else "")
        )
    if phase == "rollout":
        if report.rollout_copy:
            out.append(
                "rollout_data_parallelism / rollout_tensor_parallelism matching the trainer's layout "
                "(no copy of the params for the sampler)"
            )
        pages = _fewer_pages(cfg, report, 0 if report.rollout_chips else resident)
        if pages:
            out.append(
                f"num_pages={pages} (now {report.kv_pool[0]}: a KV pool for the rows' real lengths, not all at "
                "max_target_length; the newest sequence is preempted and restarted when it runs out)"
            )
        fit = _divisor_at_most(cfg.batch_size, cfg.batch_size * room)
        out.append(
            f"batch_size={min(fit, cfg.batch_size // 2) or 1} or fewer num_generations (decode slots and KV "
            "pages)"
        )
    out.append(
        f"max_target_length={cfg.max_target_length // 2} / max_prefill_predict_length (shorter rows and cache)"
    )
    return out


def _expert_suggestions(cfg: TrainConfig, report: Report, num_chips: int, phase: str) -> list[str]:
    """A mixture of experts': LoRA adapters on the attention only; and where the TPU compiler's rollout is the
    peak, the experts split over the chips in training and sampling alike, which spares the decode the experts'
    relayout and the sampler its copy (docs/scaling.md: Qwen3-30B-A3B on v6e-8, 37.97 -> 17.25 GiB; the GPU
    estimate models no relayout, and there the split's whole attention weights per chip cost more)."""
    ways = math.gcd(report.num_experts, num_chips)
    out = []
    split = cfg.ici_expert_parallelism * cfg.dcn_expert_parallelism > 1
    if ways > 1 and not split and phase == "rollout" and not report.estimated:
        out.append(
            f"ici_fsdp_parallelism=1 ici_expert_parallelism={ways} rollout_expert_parallelism={ways} "
            f"rollout_tensor_parallelism=1 (each chip holds 1/{ways} of the {report.num_experts} experts in "
            "training and sampling; the sampler reads the trainer's arrays)"
        )
    if report.num_experts and cfg.lora_rank and set(cfg.lora_target_modules) - set(_ATTENTION):
        out.append(
            f"lora_target_modules={','.join(_ATTENTION)} (adapters on the attention only: none on the experts, "
            "which are not trained)"
        )
    return out


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _collective_lines(report: Report) -> list[str]:
    """The collectives of each compiled function, per chip, their ICI time, and FSDP's minimum beside them."""
    counted = {name: c for name, c in report.functions.items() if c.collectives is not None}
    if not counted:
        return []
    ici = report.ici_bandwidth
    lines = [
        "chip-to-chip traffic of the compiled programs, per chip (from their HLO, loop trips counted"
        + (f"; ICI time at {ici / 1e9:.0f} GB/s per chip" if ici else "")
        + "; FSDP's minimum: each weight gathered once per pass, the gradient reduce-scattered once):"
    ]
    for name, c in counted.items():
        total = sum(x.bytes_per_chip for x in c.collectives.values())
        kinds = ", ".join(
            f"{k} {x.count} x {x.bytes_per_chip / 1e9:.2f} GB" for k, x in c.collectives.items()
        )
        time = f" {total / ici:.3f} s ICI" if ici else ""
        minimum = (
            f"; FSDP's minimum {c.fsdp_minimum / 1e9:.2f} GB ({total / c.fsdp_minimum:.2f}x)"
            if c.fsdp_minimum
            else ""
        )
        lines.append(f"  {name:<20}{total / 1e9:>9.2f} GB{time}{minimum}: {kinds or 'none'}")
    return lines


def format_report(cfg: TrainConfig, report: Report, num_chips: int) -> str:
    """The per-chip table, the verdict, the step's FLOPs and bytes, the compile times."""
    rows = [(name, b) for name, b in report.resident.items()]
    rows.append((f"KV page pool: {report.kv_pool[0]} pages x {report.kv_pool[1]} tokens", report.kv_cache))
    if report.merged_copy:
        rows.append(("merged weights for the sampler (LoRA: lora.merge)", report.merged_copy))
    if report.rollout_copy:
        rows.append(("params copied to the sampler's layout", report.rollout_copy))
    rows += [
        (f"{name} temporaries" + (" (refused: > HBM)" if c.over_hbm else ""), c.temporaries)
        for name, c in report.functions.items()
    ]
    rows += [(f"{name} phase, beyond the resident arrays", b) for name, b in report.phases.items()]
    if report.rollout_chips:
        trainer_chips = num_chips - report.rollout_chips
        rows += [
            (f"peak on the trainer's {trainer_chips} chips (update, reference)", report.trainer_peak),
            (f"peak on the sampler's {report.rollout_chips} chips (rollout_devices)", report.sampler_peak),
        ]
    else:
        rows.append(("peak, all colocated", report.peak))
    rows.append(("chip HBM", report.hbm))
    lines = [f"per-chip memory of train_rl on {report.target}, model {cfg.model_name or '(checkpoint)'}:"]
    if report.estimated:
        lines[0] = "ESTIMATE (analytical; this JAX cannot compile for an absent GPU): " + lines[0]
    lines += [f"  {name:<54}{b / GIB:>9.2f} GiB {b:>16,d} bytes" for name, b in rows]
    verdict = "fits" if report.fits else "does not fit"
    lines.append(f"{verdict}: peak {report.peak / GIB:.2f} GiB of {report.hbm / GIB:.2f} GiB per chip "
                 f"({100 * report.peak / report.hbm:.0f}%)")  # fmt: skip
    if not report.fits:
        lines.append("to make it fit, try: " + "; ".join(suggestions(cfg, report, num_chips)))
    if report.flops:
        total = sum(p.seconds for p in report.flops)
        lines.append(
            "one GRPO step, counted from the shapes (the compiler's cost analysis counts a loop body once: layers, "
            "micro-batches and decode steps are loops):"
        )
        for p in report.flops:
            lines.append(f"  {p.name:<20}{p.flops / 1e12:>11.1f} TFLOP {p.bytes_per_chip / GIB:>9.1f} GiB/chip "
                         f"{p.seconds:>9.3f} s")  # fmt: skip
        flops = sum(p.flops for p in report.flops)
        lines.append(f"  {'total':<20}{flops / 1e12:>11.1f} TFLOP {'':>17}{total:>9.3f} s: the lower bound of a step "
                     "at the chips' peak FLOP/s and HBM bandwidth, completions at full length")  # fmt: skip
    lines += _collective_lines(report)
    if not report.estimated:
        times = ", ".join(f"{c.name} {c.seconds:.1f} s" for c in report.functions.values())
        lines.append(f"compile time: {times}")
    return "\n".join(lines)
