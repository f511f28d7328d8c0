#!/usr/bin/env bash
# Download the wheels a lent GPU machine lacks into .whl/ (ignored by git; name it in the
# device call's `carry`). That machine (the device tool's "cuda" image) has Python 3.12,
# torch 2.11 (CUDA 13), triton, transformers, tensorboard, sentencepiece, safetensors, pyyaml,
# ml_dtypes, numpy, pytest (+ xdist, timeout), packaging, pillow, scikit-learn, matplotlib,
# and no network. It lacks:
#   megatron-core 0.16.1  the version pinned in requirements.txt; runtime Requires-Dist:
#                         torch>=2.6, numpy, packaging>=24.2 (there; packaging's version
#                         not checked)
#   torchao 0.17.0        built against torch 2.11 (its import wants torch >= 2.11.0; 0.18.0
#                         was built months later, for a newer torch); no runtime Requires-Dist
#
# On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Usage (from the repository root, needs the package index): bash tools/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MEGATRON=$(sed -n 's/^megatron-core==//p' requirements.txt)
WHEELS=("megatron-core==${MEGATRON}" "torchao==0.17.0")

mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
    # Both are manylinux wheels; a pure-Python one (py3-none-any) would need --platform any.
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$wheel"
done

ls -l .whl
du -ch .whl/*.whl | tail -n 1
