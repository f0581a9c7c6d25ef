#!/usr/bin/env bash
# Llama 3.1 8B GRPO with LoRA on an nf4 base on one TPU v5e, the seed's keys: the plan, 3 measured steps
# (benchmarks/v5e_8b_qlora_step.py; docs/benchmarks.md, "Llama 3.1 8B QLoRA on one v5e"). On the device machine:
#
#   bash benchmarks/v5e_8b_qlora_step.sh              # figures under $OUT (default runs/v5e_8b_qlora_step)
#   V5E_8B_QLORA_STEP_ARGS="--no_fit_check max_target_length=384" bash benchmarks/v5e_8b_qlora_step.sh
#   V5E_8B_QLORA_STEP_ARGS=--tiny JAX_PLATFORMS=cpu bash benchmarks/v5e_8b_qlora_step.sh   # a CPU proof
#
# PYTHONPATH is added to, never replaced (the machine's JAX stays first): /tmp/site where it exists (flax, optax,
# orbax, ... installed there), the wheels carried in .whl/ (unpacked to a temporary folder), then this repository.
# No qwix: the nf4 base is quantised by grpax itself (qwix is imported for lora_base_dtype=int8 only).
# One command under the device tool's 10 minutes: the script's own timeout (V5E_8B_QLORA_STEP_TIMEOUT_S, 540 s)
# keeps the table it wrote so far.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/runs/v5e_8b_qlora_step}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
add_path() { case ":${PYTHONPATH:-}:" in *":$1:"*) ;; *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$1" ;; esac; }
if [ -d /tmp/site ]; then add_path /tmp/site; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/grpax-wheels.XXXXXX")
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "v5e_8b_qlora_step: the carried wheels in .whl/ did not install" >&2; exit 1; }
  add_path "$site"
fi
add_path "$PWD"
# shellcheck disable=SC2086  # the arguments split on spaces
timeout "${V5E_8B_QLORA_STEP_TIMEOUT_S:-540}" "$PYTHON" benchmarks/v5e_8b_qlora_step.py ${V5E_8B_QLORA_STEP_ARGS:-} 2>&1 \
  | tee "$OUT/v5e_8b_qlora_step.log"
exit "${PIPESTATUS[0]}"
