#!/usr/bin/env bash
# Fill tools/gpu_wheels/ with what tools/gpu_check.sh installs on a GPU machine that has
# PyTorch but no network: megatron-core built for that machine's Python, the pure-Python
# dependencies its image may lack, and this package as a wheel. Run it where pip can reach
# an index; the folder is carried to the GPU machine, not committed (.gitignore).
#
#     bash tools/gpu_wheels.sh                      # for CPython 3.12 on x86-64 (the H200 image)
#     GPU_PY_VERSION=3.11 bash tools/gpu_wheels.sh  # for another interpreter there
#
# Everything else our package needs (torch, numpy, psutil, pyyaml, transformers, safetensors,
# tokenizers, tensorboard, tqdm) is in the H200 image already (its package list as read in
# 2026-11); pip there resolves against it and fails loudly if that stops being so.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then
    PY=.venv/bin/python
fi
PY_VERSION="${GPU_PY_VERSION:-3.12}"
ABI="cp${PY_VERSION/./}"
DEST=tools/gpu_wheels

# One version of each name: two would make the offline install there ambiguous.
MEGATRON_CORE="megatron-core==0.16.1"
# megatron-core 0.16.1 declares packaging>=24.2; the image's may be older. Pure Python.
PURE_PYTHON=("packaging==26.4")
# The fused output benchmark's GPU baselines, pure Python over the image's torch and triton:
# Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy, at the versions the CPU
# tests check the benchmark's calls of (requirements/constraints-cpu.txt).
mapfile -t BASELINES < <(grep -E '^(liger-kernel|cut-cross-entropy)==' requirements/constraints-cpu.txt)
if [ "${#BASELINES[@]}" -ne 2 ]; then
    echo "requirements/constraints-cpu.txt: want one liger-kernel== and one cut-cross-entropy== pin" >&2
    exit 1
fi

rm -rf "$DEST"
mkdir -p "$DEST"

# megatron-core ships a compiled extension: ask for the GPU machine's interpreter and
# platform, not this one's. pip matches manylinux_2_N tags exactly, hence the list.
"$PY" -m pip download --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp --abi "$ABI" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d "$DEST" "$MEGATRON_CORE"

"$PY" -m pip download --no-deps --only-binary=:all: -d "$DEST" "${PURE_PYTHON[@]}"
"$PY" -m pip download --no-deps --only-binary=:all: -d "$DEST" "${BASELINES[@]}"

# Our package, pure Python, built from a copy of its sources: setuptools leaves build/lib behind
# and reuses it next time, so a module deleted here could reach the wheel. Without build
# isolation when setuptools is here already, so that building needs no index.
SRC="$(mktemp -d /tmp/entr_wheel_src.XXXXXX)"
trap 'rm -rf "$SRC"' EXIT
cp -r pyproject.toml README.md entr_megatron "$SRC"/
ISOLATION=()
if "$PY" -c 'import setuptools, wheel' 2>/dev/null; then
    ISOLATION=(--no-build-isolation)
fi
"$PY" -m pip wheel --no-deps "${ISOLATION[@]}" -w "$DEST" "$SRC"

echo
echo "$DEST (carry it to the GPU machine):"
ls -l "$DEST"
du -sh "$DEST"
