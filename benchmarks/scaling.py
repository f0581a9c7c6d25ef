"""The scaling table of docs/scaling.md: each model compiled for each TPU slice with ``compile_topology``.

Runs ``grpax train_rl model_name=M compile_topology=T <the seed's keys> <the model's settings>`` once per row, in
a subprocess (no TPU and no weights needed: the ``tpu`` extra), and prints one markdown row per run: the
settings, per-chip peak and HBM, fits or not, the counted step time lower bound and the compile time. Results
are appended to a JSON-lines file (``--results``) and rows already there are skipped, so an interrupted run
resumes; ``--table`` only prints the table of what the file holds.

    python benchmarks/scaling.py                                  # every row (8B-class compiles take minutes)
    python benchmarks/scaling.py --models llama3.1-8b-Instruct --topologies v6e-8
    python benchmarks/scaling.py --table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# The seed's keys (README, "The 8B workflow"); everything else is grpax's default (4 prompts x 4 completions,
# 256 prompt + 256 completion tokens, full remat, one micro-batch, beta 0.04); the llama3 preset's dtypes:
# float32 weights (the master copy AdamW updates), bfloat16 compute.
SEED = "chips_per_vm=8 num_batches=50 rollout_data_parallelism=1 rollout_tensor_parallelism=-1"
# Per model: the settings that make it fit, beyond the seed's keys ("" = the defaults fit).
SETTINGS = {
    "llama3.2-1b-Instruct": "",
    "llama3.2-3b-Instruct": "",
    "llama3.1-8b-Instruct": "",
    "llama3.1-70b-Instruct": "",
    "qwen3-8b": "",
    "gemma3-12b-it": "",
}
TOPOLOGIES = ("v5e-8", "v6e-8", "v5p-8")
# 70B: its sampler unrolls 80 layers, a compile too long for this table, so its rows are the analytical
# estimate of grpax.plan.memory_estimate (exact resident arrays, formula temporaries) on the slice's chips. On
# slices of several 4-chip hosts FSDP spans the hosts (dcn_fsdp_parallelism=-1) and the sampler has one
# replica per host (tensor parallelism stays within a host).
MULTI_HOST = "dcn_data_parallelism=1 dcn_fsdp_parallelism=-1"
ESTIMATE_ROWS = (
    ("llama3.1-70b-Instruct", "v5e-8", ""),
    ("llama3.1-70b-Instruct", "v5p-8", ""),
    ("llama3.1-70b-Instruct", "v6e-8", ""),
    ("llama3.1-70b-Instruct", "v5p-32", f"{MULTI_HOST} rollout_data_parallelism=4"),
    ("llama3.1-70b-Instruct", "v5p-32", f"{MULTI_HOST} rollout_data_parallelism=4 beta=0"),
    ("llama3.1-70b-Instruct", "v5p-64", f"{MULTI_HOST} rollout_data_parallelism=8"),
    ("llama3.1-70b-Instruct", "v6e-64", f"{MULTI_HOST} rollout_data_parallelism=16"),
)


def rows(models: list[str], topologies: list[str]) -> list[tuple[str, str, str]]:
    """The compiled rows (every model but 70B on every slice)."""
    return [(m, t, SETTINGS[m]) for m in models for t in topologies if m != "llama3.1-70b-Instruct"]


def estimate_one(model: str, topology: str, settings: str) -> dict:
    """A row from ``grpax.plan.memory_estimate`` with the slice's chip figures (no compile)."""
    from grpax.config import build_config
    from grpax.plan.fit_report import format_report
    from grpax.plan.memory_estimate import estimate_job
    from grpax.plan.topology import CHIPS, TOPOLOGIES
    from grpax.rl.train_config import TrainConfig

    generation, grid = TOPOLOGIES[topology]
    chips = 1
    for d in grid.split(":")[1].split("x"):
        chips *= int(d)
    cfg = build_config(TrainConfig, [f"model_name={model}", *keys_for(topology, settings).split()])
    report = estimate_job(cfg, CHIPS[generation], chips, f"{topology} ({chips} x {CHIPS[generation].name})")
    out = format_report(cfg, report, chips)
    result = parse(model, topology, settings, out, 0 if report.fits else 1, 0.0, "")
    return {**result, "estimated": True}


def keys_for(topology: str, settings: str) -> str:
    """The seed's keys, adjusted to the slice's hosts (v5p and v6e-32 have 4 chips per host)."""
    keys = SEED if topology in ("v5e-8", "v6e-8") else SEED.replace("chips_per_vm=8", "chips_per_vm=0")
    return f"{keys} {settings}".strip()


def _bytes(out: str, name: str) -> int | None:
    match = re.search(rf"^  {re.escape(name)}\s+[\d.]+ GiB\s+([\d,]+) bytes$", out, re.M)
    return int(match.group(1).replace(",", "")) if match else None


def run_one(model: str, topology: str, settings: str) -> dict:
    keys = keys_for(topology, settings)
    cmd = [sys.executable, "-m", "grpax", "train_rl", f"model_name={model}", f"compile_topology={topology}"]
    cmd += keys.split()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    seconds = time.perf_counter() - start
    error = proc.stderr.strip().splitlines()[-1] if proc.returncode not in (0, 1) else ""
    return parse(model, topology, settings, proc.stdout, proc.returncode, seconds, error)


def parse(model: str, topology: str, settings: str, out: str, exit: int, seconds: float, error: str) -> dict:
    """One result from the command's printed table."""
    step = re.search(r"^  total\s+([\d.]+) TFLOP\s+([\d.]+) s", out, re.M)
    compiled = re.search(r"^total compile time ([\d.]+) s", out, re.M)
    return {
        "model": model,
        "topology": topology,
        "keys": keys_for(topology, settings),
        "settings": settings,
        "exit": exit,
        "fits": exit == 0,
        "peak": _bytes(out, "peak, all colocated"),
        "hbm": _bytes(out, "chip HBM"),
        "params": _bytes(out, "params"),
        "step_tflop": float(step.group(1)) if step else None,
        "step_s": float(step.group(2)) if step else None,
        "seconds": float(compiled.group(1)) if compiled else round(seconds, 1),
        "error": error,
        "table": out,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| model | slice | settings beyond the seed's | peak / chip | HBM / chip | fits | step lower bound | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    models, slices = list(SETTINGS), [*TOPOLOGIES, *(t for _, t, _ in ESTIMATE_ROWS)]

    def order(r):
        return (
            models.index(r["model"]),
            slices.index(r["topology"]) if r["topology"] in slices else 99,
        )

    for r in sorted(results, key=order):
        settings = r["settings"] or "(defaults)"
        gib = lambda b: f"{b / 2**30:.1f} GiB" if b else "-"  # noqa: E731
        fits = "yes" if r["fits"] else ("no" if r["exit"] == 1 else f"error: {r['error'][:60]}")
        fits += " (estimate)" if r.get("estimated") else ""
        step = f"{r['step_s']:.2f} s" if r["step_s"] is not None else "-"
        compile_s = "-" if r.get("estimated") else f"{r['seconds']:.0f} s"
        lines.append(
            f"| {r['model']} | {r['topology']} | {settings} | {gib(r['peak'])} | {gib(r['hbm'])} | {fits} | "
            f"{step} | {compile_s} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=list(SETTINGS))
    parser.add_argument("--topologies", nargs="*", default=list(TOPOLOGIES))
    parser.add_argument("--results", default="benchmarks/results/scaling.jsonl")
    parser.add_argument("--table", action="store_true", help="only print the table of the results file")
    args = parser.parse_args()
    path = Path(args.results)
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not args.table:
        path.parent.mkdir(parents=True, exist_ok=True)
        for model, topology, settings in rows(args.models, args.topologies):
            keys = keys_for(topology, settings)
            if any(r["model"] == model and r["topology"] == topology and r["keys"] == keys for r in done):
                continue
            print(f"compiling {model} for {topology} ({keys}) ...", flush=True)
            result = run_one(model, topology, settings)
            print(result["table"] or result["error"], flush=True)
            with path.open("a") as f:
                f.write(json.dumps(result) + "\n")
            done.append(result)
        for model, topology, settings in ESTIMATE_ROWS:
            if model in args.models and not any(
                r["model"] == model and r["topology"] == topology and r["settings"] == settings for r in done
            ):
                result = estimate_one(model, topology, settings)
                with path.open("a") as f:
                    f.write(json.dumps(result) + "\n")
                done.append(result)
    print(table(done))


if __name__ == "__main__":
    main()
