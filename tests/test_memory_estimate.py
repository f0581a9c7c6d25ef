"""The NVIDIA estimate (``grpax.plan.memory_estimate``) of the paged rollout engine, and the 8B plan.

The estimate's KV row is the engine's own pool (``paging.pool_pages`` / ``paging.abstract_pool``), counted here by
hand; the rollout phase is that pool plus temporaries that do not depend on its size. The H200 measurement of
67.04 GiB (docs/benchmarks.md, "On an H200") was of the static engine this replaced, so no test claims it now.
"""

import re

from grpax.cli.main import main
from grpax.config import build_config
from grpax.plan.memory_estimate import GPUS, estimate_job, sampler_terms
from grpax.rl.train_config import TrainConfig

GIB = 2**30

# llama3.2-3b in bfloat16 on one H200: L=28 layers of K=8 kv heads of H=128, V=128256; 8 prompts x 8 completions,
# prompts of 128 tokens, completions of 256.
JOB = dict(
    model_name="llama3.2-3b", batch_size=8, num_generations=8, max_prefill_predict_length=128,
    max_target_length=384, beta=0.04, weight_dtype="bfloat16", dtype="bfloat16", remat_policy="full",
    num_batches=10, reference_memory="device",
)  # fmt: skip
PAGE = 28 * 2 * 8 * 128 * 2  # bytes of one token in the pool: L x (k, v) x K x H x bfloat16


def _estimate(gpu: str = "h200", **keys):
    cfg = build_config(TrainConfig, [f"{k}={v}" for k, v in {**JOB, **keys}.items()])
    return estimate_job(cfg, GPUS[gpu], 1, f"{gpu}-1")


def test_the_kv_row_is_the_engines_pool_for_any_num_pages_and_page_size():
    """Default pages: 1 scratch + 64 slots x ceil(384 / page_size); num_pages as given."""
    for num_pages, page_size, pages in [(0, 32, 1 + 64 * 12), (0, 16, 1 + 64 * 24), (0, 48, 1 + 64 * 8),
                                        (1000, 32, 1000), (200, 64, 200)]:  # fmt: skip
        report = _estimate(num_pages=num_pages, page_size=page_size)
        assert report.kv_pool == (pages, page_size)
        assert report.kv_cache == pages * page_size * PAGE


def test_the_rollout_phase_grows_with_num_pages_by_exactly_the_pools_bytes():
    """The engine holds one pool, donated to and updated in place by both programs (the static engine held a
    prefill cache and a decode phase's input and grown output: about three caches of P + C slots per row)."""
    reports = [_estimate(num_pages=n) for n in (0, 100, 1000, 3000)]
    rest = {r.phases["rollout"] - r.kv_cache for r in reports}
    assert len(rest) == 1 and {r.kv_cache for r in reports} == {769 * 32 * PAGE, 100 * 32 * PAGE,
                                                                1000 * 32 * PAGE, 3000 * 32 * PAGE}  # fmt: skip
    assert reports[0].phases["rollout"] == reports[0].kv_cache + max(
        reports[0].functions["prefill"].temporaries, reports[0].functions["decode"].temporaries
    )


def test_the_rollouts_temporaries_are_the_engines_programs_counted_by_hand():
    """32 prompts x 8 completions (the slots: 256), P = 128, C = 256, one GPU (nothing split).

    prefill: the prompts' dense cache of every layer, then the larger of the write (one layer's keys and values
    for each completion, twice) and the sampling (the 256 rows' float32 logits, three copies). decode: one
    layer's pages gathered for every slot (page tables of 12 pages), twice, against the step's logits (three
    float32 copies); the call's per-step outputs (16 steps: 10 bytes each)."""
    terms = sampler_terms(_job(batch_size=32))
    per_layer = PAGE // 28
    cache = 32 * 128 * PAGE
    write, sampling = 2 * 32 * 8 * 128 * per_layer, 3 * 256 * 128256 * 4
    assert sampling > write and sum(terms["prefill"].values()) == cache + sampling
    gathered, logits = 2 * 256 * 12 * 32 * per_layer, 3 * 256 * 128256 * 4
    assert gathered > logits and sum(terms["decode"].values()) == gathered + 256 * 16 * 10
    wide = _estimate(batch_size=32)
    assert wide.functions["decode"].temporaries == gathered + 256 * 16 * 10
    # the pool (1 + 256 slots x 12 pages) and the prefill, the larger program here
    assert wide.phases["rollout"] == (1 + 256 * 12) * 32 * PAGE + cache + sampling


def _job(**keys):
    from jax.sharding import AbstractMesh

    from grpax import sharding
    from grpax.plan.compile_check import build_job

    cfg = build_config(TrainConfig, [f"{k}={v}" for k, v in {**JOB, **keys}.items()])
    one = AbstractMesh((1, 1, 1, 1), sharding.MESH_AXES)
    return build_job(cfg, one, one)


def _row(out: str, name: str) -> int:
    match = re.search(rf"^  {re.escape(name)}\s+[\d.]+ GiB\s+([\d,]+) bytes$", out, re.M)
    assert match, f"no row {name!r} in:\n{out}"
    return int(match.group(1).replace(",", ""))


def test_num_pages_and_page_size_on_the_command_line_change_the_planners_table(capsys):
    args = ["train_rl", *(f"{k}={v}" for k, v in JOB.items()), "compile_topology=h200-1"]
    seen = {}
    for keys, pages, page_size in [([], 769, 32), (["num_pages=300"], 300, 32), (["page_size=64"], 385, 64),
                                   (["num_pages=300", "page_size=64"], 300, 64)]:  # fmt: skip
        assert main([*args, *keys]) == 0
        out = capsys.readouterr().out
        pool = _row(out, f"KV page pool: {pages} pages x {page_size} tokens")
        assert pool == pages * page_size * PAGE
        seen[tuple(keys)] = (pool, _row(out, "rollout phase, beyond the resident arrays"))
    assert len({pool for pool, _ in seen.values()}) == len(seen)  # each key changed what the table says
    assert len({phase - pool for pool, phase in seen.values()}) == 1  # and only by the pool


def test_a_rollout_over_the_memory_names_the_most_pages_that_fit():
    """Completions of 8192 tokens for 128 rows: the default pool (every slot at full length, 113.75 GiB) does not
    fit an H100 beside the params and AdamW's state; the suggested num_pages is the most that does."""
    keys = dict(batch_size=16, max_target_length=8320, beta=0, micro_batch_size=1, gpu="h100")
    report = _estimate(**keys)
    assert report.kv_pool == (1 + 128 * 260, 32) and not report.fits
    from grpax.plan.fit_report import suggestions

    cfg = build_config(TrainConfig, [f"{k}={v}" for k, v in {**JOB, **keys}.items() if k != "gpu"])
    named = [s for s in suggestions(cfg, report, 1) if s.startswith("num_pages=")]
    assert len(named) == 1 and "(now 33281: a KV pool for the rows' real lengths" in named[0], named
    pages = int(named[0].split()[0].removeprefix("num_pages="))
    resident = sum(report.resident.values())
    for n, fits in ((pages, True), (pages + 1, False)):
        rollout = _estimate(**keys, num_pages=n).phases["rollout"]
        assert (resident + rollout <= report.hbm) == fits, (n, resident + rollout, report.hbm)


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


def test_a_mixture_of_experts_lora_job_is_told_of_attention_only_adapters_and_the_expert_split():
    """Qwen3-30B-A3B with LoRA on 8 chips: the suggestions name attention-only adapters (the estimate: 27.04 ->
    22.49 GiB per H100), and the expert split where the TPU compiler's rollout is the peak (docs/scaling.md); a
    dense model gets neither."""
    from grpax.plan.fit_report import suggestions

    keys = ["model_name=qwen3-30b-a3b", "lora_rank=16", "chips_per_vm=8", "rollout_tensor_parallelism=-1"]
    report = estimate_job(build_config(TrainConfig, keys), GPUS["h100"], 8, "h100-8")
    adapted = build_config(TrainConfig, [*keys, "lora_target_modules=q_proj,k_proj,v_proj,o_proj"])
    assert report.num_experts == 128 and estimate_job(adapted, GPUS["h100"], 8, "h100-8").peak < report.peak
    named = suggestions(build_config(TrainConfig, keys), report, 8)
    assert any(
        s.startswith("lora_target_modules=q_proj,k_proj,v_proj,o_proj (adapters on the attention")
        for s in named
    )
    assert not any("ici_expert_parallelism" in s for s in named)  # an estimate: no relayout modelled
    report.estimated, report.phases = (
        False,
        {"rollout": 2, "update": 1},
    )  # as the TPU compiler's report of that job
    compiled = suggestions(build_config(TrainConfig, keys), report, 8)
    assert any(
        s.startswith("ici_fsdp_parallelism=1 ici_expert_parallelism=8 rollout_expert_parallelism=8")
        for s in compiled
    )
    assert not any(
        "expert" in s or "lora_target_modules" in s
        for s in suggestions(build_config(TrainConfig, []), _estimate(), 1)
    )
