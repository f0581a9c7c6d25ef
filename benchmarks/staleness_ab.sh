#!/usr/bin/env bash
# The GRPO step time of two checkouts side by side (docs/benchmarks.md, "Rollout": the paged engine against the
# static one at max_staleness=0 and 1). Both arms of one max_staleness start together, so they share the
# machine's load; each imports its own tree (PYTHONPATH) and runs in it (dataset ../shared/data/gsm8k from the
# tree's root). The demo's shape: SmolLM2-135M-Instruct from <base params> on GSM8K, 3 steps (step 1 compiles).
#
#   bash benchmarks/staleness_ab.sh <paged tree> <static tree> <base params> <max_staleness> <out dir>   (absolute paths)
#
# Prints the load average before and after and each step's time/* metrics (from <out dir>/<arm>_s<S>/grpo/
# metrics.jsonl).
set -uo pipefail
PAGED=$1 STATIC=$2 BASE=$3 S=$4 OUT=$5
arm() {  # tree name
  mkdir -p "$OUT/$2_s$S"
  (cd "$1" && PYTHONPATH="$1" timeout 3000 python3 -P -m grpax train_rl model_name=smollm2-135m-Instruct \
    load_parameters_path="$BASE" dataset_name=../shared/data/gsm8k learning_rate=3e-5 max_target_length=448 \
    mu_dtype=bfloat16 num_test_batches=0 num_batches=3 max_staleness="$S" \
    base_output_directory="$OUT/$2_s$S" run_name=grpo >"$OUT/$2_s$S/log.txt" 2>&1)
}
uptime
arm "$PAGED" paged &
arm "$STATIC" static &
wait
uptime
python3 - "$OUT" "$S" <<'PY'
import json, sys
out, s = sys.argv[1:]
for name in ("paged", "static"):
    for line in open(f"{out}/{name}_s{s}/grpo/metrics.jsonl"):
        m = json.loads(line)
        if "time/step_s" in m:
            print(name, m["step"], " ".join(f"{k[5:]}={v:.1f}" for k, v in m.items() if k.startswith("time/")))
PY
