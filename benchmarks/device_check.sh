#!/usr/bin/env bash
# Accelerator check for grpax, in one shot on a machine that reaches no package index (docs/benchmarks.md).
#
#   bash benchmarks/make_device_wheels.sh             # here, once: the wheels the device image lacks, into .whl/
#   bash benchmarks/device_check.sh                   # there: llama3.2-3b random init, bfloat16 (no network)
#   DEVICE_CHECK_TINY=1 bash benchmarks/device_check.sh   # a tiny model (automatic when JAX sees no accelerator)
#
# grpax is not installed: the repository goes on PYTHONPATH, with the wheels carried in .whl/ (gguf,
# tensorboardX, qwix: pure Python) unpacked beside it. The interpreter is $PYTHON, default `python3` (on the H200
# image the one that holds JAX; `python` there is not). Parts, in order: (1) benchmarks/device_check.py: the
# GRPO update's MFU and HFU, its profile as text, the sampler's top-k threshold checked on the device, sampled
# decode at 64 and 256 rows, the decode's profile as text, a whole GRPO step, peak memory against the fit check,
# then the variants side by side (device_check.py's VARIANTS: command buffers with WHILE/CONDITIONAL, one decode
# phase, main's top-k, remat, cuDNN attention, ...), ending with one table that compares them; (2) parity tests:
# model vs transformers, cached decode == full forward, sharded == unsharded, when time is left. Figures, the
# profiles and the log go to $OUT (default runs/device_check).
#
# The time budget (one H200 lease: 15 minutes with the machine's start, no compilation cache): device_check.py
# starts no part that its H200 estimate would end after DEVICE_CHECK_BUDGET_S (480 s; its timeout
# DEVICE_CHECK_BENCH_TIMEOUT_S, 560 s, kills it if an estimate is wrong: the table is rewritten after every
# part). The estimates come from the first H200 run (decode programs compiled in ~35 s per row count, the
# update in ~23 s): the measured parts ~235 s, then variants of 30-45 s each, the likeliest first. The parity
# tests (DEVICE_CHECK_TESTS, empty: none; 104-221 s on the H200) run only if DEVICE_CHECK_TOTAL_S (570 s) leaves
# them 120 s, so with the defaults the whole command ends inside the device tool's 10 minutes:
#   DEVICE_CHECK_TESTS= bash benchmarks/device_check.sh     # the figures only (docs/benchmarks.md, "On an H200")
# DEVICE_CHECK_SKIP leaves parts out by name (comma-separated: "grpo step,memory"; "variants": all of them).
# The 8B GRPO step on one H200 has its own command (benchmarks/h200_8b_step.py, not part of this one).
# Exit 0 only if every part that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
status=0
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/runs/device_check}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/grpax-wheels.XXXXXX")
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "device_check: the carried wheels in .whl/ did not install" >&2; exit 1; }
  export PYTHONPATH="$PYTHONPATH:$site"
fi
if ! found=$("$PYTHON" -c "import grpax, jax; print(f'grpax from {grpax.__path__[0]}, jax {jax.__version__} on {jax.default_backend()}')"); then
  echo "device_check: grpax does not import with $PYTHON; missing packages travel as wheels: run" \
    "bash benchmarks/make_device_wheels.sh here and carry .whl" >&2
  exit 1
fi
echo "$found"
backend=${found##* on }
cpu=$([ "$backend" = cpu ] && echo 1 || echo 0)  # a CPU: no lease to protect, minutes per part
# XLA's optimised HLO of the decode's programs, read to name a CPU trace's thunks (a GPU's kernels carry names).
dump=$(mktemp -d "${TMPDIR:-/tmp}/grpax-hlo.XXXXXX")
echo "== throughput, profiles, memory, variants: benchmarks/device_check.py =="
DEVICE_CHECK_HLO_DUMP="$dump" \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(retire_phase|_decode).*" \
  timeout "${DEVICE_CHECK_BENCH_TIMEOUT_S:-$([ $cpu = 1 ] && echo 1800 || echo 560)}" \
  "$PYTHON" benchmarks/device_check.py || status=1
rm -rf "$dump"
echo "device_check.py: $(( $(date +%s) - start )) s, $([ $status -eq 0 ] && echo passed || echo FAILED)"

# On the H200 the parity tests took 104-221 s (GPU compiles; the 8-device child runs on its CPU); on a 2-core
# CPU-only machine they take minutes, and there is no device budget to protect.
test_timeout=${DEVICE_CHECK_TEST_TIMEOUT_S:-$([ $cpu = 1 ] && echo 900 || echo 300)}
left=$(( ${DEVICE_CHECK_TOTAL_S:-$([ $cpu = 1 ] && echo 100000 || echo 570)} - ($(date +%s) - start) ))
[ "$test_timeout" -le "$left" ] || test_timeout=$left
read -r -a tests <<<"${DEVICE_CHECK_TESTS-tests/test_model_parity.py tests/test_engine.py tests/test_sharding.py}"
if [ ${#tests[@]} -gt 0 ] && [ "$test_timeout" -lt 120 ]; then
  echo "== parity tests skipped: ${left} s left of DEVICE_CHECK_TOTAL_S (they need 120 s or more) =="
elif [ ${#tests[@]} -gt 0 ]; then
  echo "== parity tests on backend '$backend' (float32, highest matmul precision: no TF32 / bf16 passes) =="
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$test_timeout" \
    "$PYTHON" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/parity_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "device_check: $(( $(date +%s) - start )) s in total, exit $status"
exit $status
