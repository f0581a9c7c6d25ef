#!/usr/bin/env bash
# Accelerator check for grpax, in one shot on a machine that reaches no package index (docs/benchmarks.md).
#
#   bash benchmarks/make_device_wheels.sh             # here, once: the wheels the device image lacks, into .whl/
#   bash benchmarks/device_check.sh                   # there: llama3.1-8b random init, bfloat16 (no network)
#   DEVICE_CHECK_TINY=1 bash benchmarks/device_check.sh   # a tiny model (automatic when JAX sees no accelerator)
#
# grpax is not installed: the repository goes on PYTHONPATH, with the wheels carried in .whl/ (gguf,
# tensorboardX: pure Python) unpacked beside it. The interpreter is $PYTHON, default `python3` (on the H200
# image the one that holds JAX; `python` there is not). Parts, in order: (1) benchmarks/device_check.py: the
# GRPO update's MFU first, sampled decode, a whole GRPO step, peak memory against the fit check, a profile;
# (2) parity tests: model vs transformers, cached decode == full forward, sharded == unsharded. Figures and the
# log go to $OUT (default runs/device_check). DEVICE_CHECK_TESTS: part 2's pytest selection (empty: none). On an
# H200 it took 410 s (189 + 221); each part has its own timeout (270 + 300 s at most: under the device tool's
# 10 minutes a command) so a hang cannot eat the budget. Exit 0 only if every part passed.
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
if ! "$PYTHON" -c "import grpax, jax; print(f'grpax from {grpax.__path__[0]}, jax {jax.__version__} on {jax.default_backend()}')"; then
  echo "device_check: grpax does not import with $PYTHON; missing packages travel as wheels: run" \
    "bash benchmarks/make_device_wheels.sh here and carry .whl" >&2
  exit 1
fi

echo "== throughput, memory, profile: benchmarks/device_check.py =="
timeout "${DEVICE_CHECK_BENCH_TIMEOUT_S:-270}" "$PYTHON" benchmarks/device_check.py || status=1
echo "device_check.py: $(( $(date +%s) - start )) s, $([ $status -eq 0 ] && echo passed || echo FAILED)"

backend=$("$PYTHON" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo unknown)
# On the H200 the parity tests took 221 s (GPU compiles; the 8-device child runs on its CPU); on a 2-core
# CPU-only machine they take minutes, and there is no device budget to protect.
test_timeout=${DEVICE_CHECK_TEST_TIMEOUT_S:-$([ "$backend" = cpu ] && echo 900 || echo 300)}
read -r -a tests <<<"${DEVICE_CHECK_TESTS-tests/test_model_parity.py tests/test_engine.py tests/test_sharding.py}"
if [ ${#tests[@]} -gt 0 ]; then
  echo "== parity tests on backend '$backend' (float32, highest matmul precision: no TF32 / bf16 passes) =="
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$test_timeout" \
    "$PYTHON" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/parity_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "device_check: $(( $(date +%s) - start )) s in total, exit $status"
exit $status
