"""The NVIDIA estimate (``grpax.plan.memory_estimate``) against what was measured on an H200, and the 8B plan."""

import re

from grpax.cli.main import main
from grpax.config import build_config
from grpax.plan.memory_estimate import GPUS, estimate_job, rollout_cache_slots
from grpax.rl.train_config import TrainConfig

GIB = 2**30

# The device check's job when it measured the H200 (docs/benchmarks.md, "On an H200", main b600d5a): llama3.2-3b
# random init in bfloat16, 8 prompts x 8, prompts of 128 tokens, completions of 256, its table's
# "memory: peak_gib 67.037": the device's peak_bytes_in_use over the whole check.
MEASURED_JOB = dict(
    model_name="llama3.2-3b", batch_size=8, num_generations=8, max_prefill_predict_length=128,
    max_target_length=384, beta=0.04, temperature=0.9, decode_sampling_top_k=50, weight_dtype="bfloat16",
    dtype="bfloat16", remat_policy="full", num_batches=10, learning_rate=1e-6, reference_memory="device",
)  # fmt: skip
MEASURED_PEAK_GIB = 67.037


def _estimate(**keys):
    cfg = build_config(TrainConfig, [f"{k}={v}" for k, v in {**MEASURED_JOB, **keys}.items()])
    return estimate_job(cfg, GPUS["h200"], 1, "h200-1")


def test_a_rollout_holds_the_prefills_cache_and_its_last_phases_input_and_output():
    # P=128, C=256 in phases of 64: the prefill's 128 + 64 slots (kept by generate_padded through the decode),
    # the last phase's input (128 + 192) and its grown output (128 + 256).
    assert rollout_cache_slots(128, 256, 64) == 192 + 320 + 384
    # one phase: the prefill's cache and the decode loop's copy of it
    assert rollout_cache_slots(128, 256, 0) == rollout_cache_slots(128, 256, 256) == 2 * 384
    assert rollout_cache_slots(128, 256, 128) == 256 + 256 + 384  # two phases: the first's input twice


def test_the_estimate_of_the_measured_h200_job_is_within_3_percent_of_its_measured_peak():
    """The device check ran, in order: the update on the job's batch (params and AdamW state on the device),
    sampling at 8 x 8 and at 32 x 8 rows, then GRPO steps with the reference copy. The device's peak is the
    largest of them: the 32 x 8 rollout (256 rows x 896 cache slots, 24.5 GiB) beside the state, 66.88 GiB
    estimated for 67.04 measured. The fit check's own job (8 x 8, its peak the update's) is below it."""
    job, wide = _estimate(), _estimate(batch_size=32)
    state = (
        job.resident["params"] + job.resident["optimizer state"]
    )  # before the grpo step makes the reference
    parts = {
        "update": state + job.phases["update"],
        "decode 32x8": state + wide.phases["rollout"],
        "grpo step 8x8": job.peak,
    }
    assert max(parts, key=parts.get) == "decode 32x8"
    assert abs(max(parts.values()) / GIB / MEASURED_PEAK_GIB - 1) < 0.03
    kv = 2 * 28 * 8 * 128 * 2  # bytes per row and slot: (k, v) x L x K x H x bfloat16
    assert wide.kv_cache == 256 * 384 * kv and wide.phases["rollout"] >= 256 * 896 * kv
    assert (
        job.peak / GIB < 0.97 * MEASURED_PEAK_GIB
    )  # the job alone: not what the device check's peak measured


def _peak(out: str) -> tuple[float, float]:
    match = re.search(r"^fits: peak ([\d.]+) GiB of ([\d.]+) GiB per chip", out, re.M)
    assert match, out
    return float(match.group(1)), float(match.group(2))


SEED_8B = [
    "train_rl", "model_name=llama3.1-8b-Instruct", "chips_per_vm=1", "num_batches=50", "rollout_data_parallelism=1",
    "rollout_tensor_parallelism=-1", "compile_topology=h200-1",
]  # fmt: skip


def test_the_seeds_8b_job_fits_one_h200_with_a_tenth_of_it_free(capsys):
    """Full-parameter GRPO of Llama 3.1 8B with the seed's keys (beta 0.04, AdamW, float32 weights, bfloat16
    compute) on one H200: the reference copy in bfloat16 (as the forward reads it) and, auto, in host memory."""
    assert main(SEED_8B) == 0
    out = capsys.readouterr().out
    peak, hbm = _peak(out)
    assert peak <= 0.9 * hbm and "reference_memory=auto -> pinned_host" in out
    assert re.search(
        r"^  reference from host +0.0 TFLOP +15.0 GiB/chip +0.251 s$", out, re.M
    )  # 16 GB at 64 GB/s
    # On the device, the bfloat16 copy fits without the margin; float32 (as before) does not fit at all.
    assert main([*SEED_8B, "reference_memory=device"]) == 0
    assert 0.9 * hbm < _peak(capsys.readouterr().out)[0] <= hbm
    assert main([*SEED_8B, "reference_memory=device", "reference_dtype=weight"]) == 1
    tries = capsys.readouterr().out.split("to make it fit, try: ")[1]
    assert tries.startswith(
        "mu_dtype=bfloat16 (AdamW's first moment in half the memory); reference_dtype=compute"
    )
    assert "; reference_memory=pinned_host (the reference copy in host memory" in tries
