#!/usr/bin/env bash
# Llama 3.1 8B full-parameter GRPO on one GPU, the seed's keys: the plan, 3 measured steps (docs/benchmarks.md,
# "The 8B step on one H200"). On the device machine, .whl carried as for device_check.sh:
#
#   bash benchmarks/h200_8b_step.sh                   # figures under $OUT (default runs/h200_8b_step)
#   H200_8B_STEP_ARGS="--tiny reference_memory=pinned_host" bash benchmarks/h200_8b_step.sh   # a CPU proof
#
# One command under the device tool's 10 minutes: the script's own timeout (H200_8B_STEP_TIMEOUT_S, 540 s) keeps
# the table it wrote so far.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/runs/h200_8b_step}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/grpax-wheels.XXXXXX")
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "h200_8b_step: the carried wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH="$PYTHONPATH:$site"
fi
# shellcheck disable=SC2086  # the arguments split on spaces
timeout "${H200_8B_STEP_TIMEOUT_S:-540}" "$PYTHON" benchmarks/h200_8b_step.py ${H200_8B_STEP_ARGS:-} 2>&1 \
  | tee "$OUT/h200_8b_step.log"
exit "${PIPESTATUS[0]}"
