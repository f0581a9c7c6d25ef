#!/usr/bin/env bash
# Accelerator check for grpax: parity tests on the device, then decode / train throughput vs the roofline.
#
#   benchmarks/device_check.sh                       # GPU or TPU: llama3.1-8b random init, bf16 (no network)
#   DEVICE_CHECK_TINY=1 benchmarks/device_check.sh   # a tiny model (automatic when JAX sees no accelerator)
#
# Parts: (1) model parity vs transformers, cached decode == full forward (tests/test_engine.py), sharded ==
# unsharded (tests/test_sharding.py, fake CPU devices); (2) benchmarks/device_check.py prints one table.
# Designed to finish within 8 minutes; each part has its own timeout so a hang cannot eat the budget.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
status=0

backend=$(python -c "import jax; print(jax.default_backend())" 2>/dev/null || echo unknown)
# On an accelerator machine (16+ host cores) the parity tests take well under 150 s; on a 2-core CPU-only
# machine they take minutes, and there is no 8-minute device budget to protect.
test_timeout=${DEVICE_CHECK_TEST_TIMEOUT_S:-$([ "$backend" = cpu ] && echo 900 || echo 150)}
echo "== parity tests on backend '$backend' (float32, highest matmul precision: no TF32 / bf16 passes) =="
JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$test_timeout" \
  python -m pytest -q -p no:cacheprovider tests/test_model_parity.py tests/test_engine.py tests/test_sharding.py \
  || status=1
echo "parity tests: $(( $(date +%s) - start )) s, $([ $status -eq 0 ] && echo passed || echo FAILED)"

echo "== throughput =="
timeout "${DEVICE_CHECK_BENCH_TIMEOUT_S:-320}" python benchmarks/device_check.py || status=1
echo "device_check: $(( $(date +%s) - start )) s in total, exit $status"
exit $status
