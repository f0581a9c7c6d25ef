"""``remat_policy=auto`` and ``reference_memory=auto``: the cheapest setting the memory plan fits with a margin."""

import dataclasses
import math

import pytest

from grpax.config import ConfigError, build_config
from grpax.plan import memory_plan
from grpax.plan.memory_estimate import GPUS, estimate_job
from grpax.rl.train_config import TrainConfig, validate

# SmolLM2-135M in bfloat16 compute with float32 weights, 4 prompts x 4 of 128 + 128 tokens, beta 0.04.
KEYS = [
    "model_name=smollm2-135m", "dtype=bfloat16", "batch_size=4", "num_generations=4",
    "max_prefill_predict_length=128", "max_target_length=256", "compile_topology=h100-1",
]  # fmt: skip


def _cfg(*keys: str) -> TrainConfig:
    return build_config(TrainConfig, [*KEYS, *keys])


def _peak(cfg: TrainConfig, **keys) -> int:
    return estimate_job(dataclasses.replace(cfg, **keys), GPUS["h100"], 1, "").peak


def _on(hbm: float):
    """An H100 whose memory is ``hbm`` bytes (rounded up)."""
    return dataclasses.replace(GPUS["h100"], hbm_bytes=math.ceil(hbm) + 1)


def test_less_recompute_keeps_more_activations_in_the_plan():
    cfg = _cfg("reference_memory=device")
    peaks = [_peak(cfg, remat_policy=p) for p in ("none", "minimal", "dots", "full")]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[2] > peaks[3]


def test_auto_takes_no_remat_when_memory_is_ample_and_full_remat_when_it_is_tight():
    cfg = _cfg("reference_memory=device")
    assert cfg.remat_policy == "auto"  # the default
    ample = memory_plan.choose(cfg, _on(80 * 2**30), 1, "gpu")
    assert (ample.remat_policy, ample.reference_memory) == ("none", "device")
    full = _peak(cfg, remat_policy="full")
    tight = memory_plan.choose(cfg, _on(full / (1 - memory_plan.MARGIN)), 1, "gpu")  # full alone leaves 10%
    assert tight.remat_policy == "full"
    dots = _peak(cfg, remat_policy="dots")
    between = memory_plan.choose(cfg, _on(dots / (1 - memory_plan.MARGIN)), 1, "gpu")
    assert between.remat_policy == "dots"  # none and minimal keep more than dots: the next cheapest that fits


def test_auto_moves_the_reference_to_host_memory_only_when_the_devices_cannot_hold_it_with_the_margin():
    cfg = _cfg()
    on_device = _peak(cfg, remat_policy="full", reference_memory="device")
    on_host = _peak(cfg, remat_policy="full", reference_memory="pinned_host")
    assert on_host < on_device
    roomy = memory_plan.choose(cfg, _on(on_device / (1 - memory_plan.MARGIN)), 1, "gpu")
    assert (roomy.remat_policy, roomy.reference_memory) == ("full", "device")
    short = memory_plan.choose(cfg, _on(on_host / (1 - memory_plan.MARGIN)), 1, "gpu")
    assert (short.remat_policy, short.reference_memory) == ("full", "pinned_host")
    # Nothing leaves the margin: the least memory.
    least = memory_plan.choose(cfg, _on(on_host / 2), 1, "gpu")
    assert (least.remat_policy, least.reference_memory) == ("full", "pinned_host")


def test_a_key_set_by_hand_is_kept_and_a_cpu_takes_full_remat_on_the_devices():
    cfg = _cfg("remat_policy=dots", "reference_memory=pinned_host", "teacher_memory=device")
    assert memory_plan.candidates(cfg) == [cfg]
    assert memory_plan.choose(cfg, _on(2**20), 1, "gpu") == cfg
    auto = memory_plan.choose(_cfg(), _on(2**40), 1, "cpu")
    assert (auto.remat_policy, auto.reference_memory) == ("full", "device")
    # beta = 0 or LoRA: no reference copy, nothing to place
    assert [c.reference_memory for c in memory_plan.candidates(_cfg("beta=0"))] == ["device"] * 4


def test_when_the_compiler_refuses_an_auto_choice_full_remat_then_host_memory_are_tried():
    cfg = _cfg()
    chosen = dataclasses.replace(cfg, remat_policy="none", reference_memory="device")
    tries = [(c.remat_policy, c.reference_memory) for c in memory_plan.fallbacks(cfg, chosen)]
    assert tries == [("full", "device"), ("full", "pinned_host")]
    assert memory_plan.fallbacks(_cfg("remat_policy=none", "reference_memory=device"), chosen) == []


class _GPU:
    """A device as ``fit_before_run`` reads it: an H200 whose JAX allocator may use 80 GiB."""

    platform, device_kind = "gpu", "NVIDIA H200"

    def memory_stats(self):
        return {"bytes_limit": 80 * 2**30}


def test_before_a_run_the_choice_is_compiled_and_full_remat_taken_where_the_compiler_refuses_it(monkeypatch):
    compiled = []

    def check_before_run(cfg, devices, limit):  # the compiled fit check, refusing all but remat full
        compiled.append((cfg.remat_policy, cfg.reference_memory, limit))
        if cfg.remat_policy != "full":
            raise ConfigError("this run does not fit: peak 90 GiB per device > 80 GiB; try: ...")

    monkeypatch.setattr(memory_plan.compile_check, "check_before_run", check_before_run)
    run = memory_plan.fit_before_run(_cfg(), [_GPU()])
    assert compiled == [("none", "device", 80 * 2**30), ("full", "device", 80 * 2**30)]
    assert (run.remat_policy, run.reference_memory) == ("full", "device")
    # No choice left to fall back on: the compiler's refusal stops the run.
    compiled.clear()
    with pytest.raises(ConfigError, match="this run does not fit"):
        memory_plan.fit_before_run(_cfg("remat_policy=dots", "reference_memory=device"), [_GPU()])
    assert compiled == [("dots", "device", 80 * 2**30)]
    # check_fit=false compiles nothing to check a choice against: full remat on the devices, as before auto.
    compiled.clear()
    unchecked = memory_plan.fit_before_run(_cfg("check_fit=false"), [_GPU()])
    assert (unchecked.remat_policy, unchecked.reference_memory) == ("full", "device")


def test_a_bad_value_is_one_line_naming_the_key():
    for key, value in (("remat_policy", "ful"), ("reference_memory", "host"), ("reference_dtype", "bf16")):
        with pytest.raises(ConfigError, match=rf"^{key}='{value}': expected one of "):
            validate(_cfg(f"{key}={value}"))


@pytest.mark.slow
def test_the_8b_step_script_runs_its_tiny_job_on_cpu(tmp_path):
    """benchmarks/h200_8b_step.py, as the H200 runs it but on a 2-layer model: its plan, two GRPO steps of the
    trainer's objects with the reference in host memory, the reference logprobs from the float32 params equal
    to its bfloat16 copy's."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    args = ["--tiny", "--steps", "2", "--no_fit_check", "reference_memory=pinned_host"]
    subprocess.run([sys.executable, "benchmarks/h200_8b_step.py", *args], env=env, check=True, timeout=900)
    rows = {r["part"]: r for r in json.loads((tmp_path / "h200_8b_step.json").read_text())["rows"]}
    assert list(rows) == ["plan", "setup", "reference", "step 1", "step 2"]
    assert rows["reference"]["max_abs_diff"] == 0.0
    assert "reference_memory=pinned_host" in rows["plan"]["note"]
    assert rows["step 2"]["update_s"] > 0 and rows["step 2"]["tokens_per_s"] > 0


def test_a_tpu_kernel_is_estimated_for_a_tpu_slice_from_this_host():
    """compile_topology=v5e-1 attention=flash: the estimate traces the TPU kernel under the slice's device
    (before, the platform check refused it on this CPU and auto fell back to remat full untraced), and the
    kernel keeps less for the backward than dot_product's scores."""
    pytest.importorskip("libtpu")
    from grpax.plan.topology import get_topology

    topology = get_topology("v5e-1")
    cfg = _cfg("compile_topology=v5e-1", "reference_memory=device")
    peaks = {}
    with memory_plan._traced_for(topology.devices[0]):
        for name in ("dot_product", "flash"):
            option = dataclasses.replace(cfg, attention=name)
            assert memory_plan.choose(option, topology.chip, 1, "tpu").remat_policy == "none"
            peaks[name] = estimate_job(
                dataclasses.replace(option, remat_policy="none"), topology.chip, 1, ""
            ).peak
    assert peaks["flash"] < peaks["dot_product"]
