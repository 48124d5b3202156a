#!/usr/bin/env bash
# Creates (or refreshes) .venv-sglang in the repo root: SGLang 0.5.23 for CPU servers
# (rollout.engine: sglang with launcher.device: cpu, rollout.sglang.python: .venv-sglang/bin/python).
#
# SGLang pins torch 2.14.1 (ours is 2.13.0+cpu), so it gets a venv of its own. The packages are
# requirements/sglang-cpu.txt: sglang's full resolution less its GPU-only kernels, each pinned to a
# version and a wheel hash, installed without resolution (--no-deps --require-hashes); then our
# pure-torch stand-in for sgl_kernel's CPU ops (sglang_cpu/sgl_kernel) is copied in. Why each
# step: docs/SGLANG_ON_CPU.md. 3-7 minutes and 7 GB on a fresh machine; re-running is cheap
# (skipped while the list and the stand-in are unchanged).
#
# The pinned wheels are CPython 3.11, x86_64 Linux (the resolution was made there); another
# interpreter fails at pip with the wheel it cannot take.
#
#   bash scripts/setup_sglang_cpu.sh
#   PYTHON=python3.11 VENV=/tmp/sgl bash scripts/setup_sglang_cpu.sh   # another interpreter / place
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# One set-up at a time (two test sessions may start it at once): a lock on this script's file.
exec 9<"${BASH_SOURCE[0]}"
flock 9

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-sglang}
REQUIREMENTS=requirements/sglang-cpu.txt
STAND_IN=sglang_cpu/sgl_kernel

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-sglang] creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi

stamp=$VENV/.entr-megatron-sglang-setup
want=$(cat "$REQUIREMENTS" "$STAND_IN"/*.py | sha256sum | cut -d' ' -f1)
check() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sgl_kernel, torch; \
print('[setup-sglang] sglang', m.version('sglang'), '| torch', torch.__version__, '| sgl_kernel', sgl_kernel.__version__)"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && check 2>/dev/null; then
  echo "[setup-sglang] $VENV is up to date"
  exit 0
fi

echo "[setup-sglang] installing $(grep -c '^[a-z0-9].*==' "$REQUIREMENTS") pinned packages into $VENV (no dependency resolution)"
# pip warns about missing local mirror folders on some machines; keep real errors.
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps --require-hashes -r "$REQUIREMENTS" 2>&1 \
    | { grep -v -e "is ignored: it is neither a file nor a directory" || true; }; then
  echo "[setup-sglang] pip failed (above); $VENV is not usable" >&2
  exit 1
fi

site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "[setup-sglang] installing the CPU stand-in for sgl_kernel into $site"
rm -rf "$site/sgl_kernel"
cp -r "$STAND_IN" "$site/sgl_kernel"
find "$site/sgl_kernel" -name __pycache__ -prune -exec rm -rf {} +
check
echo "$want" > "$stamp"
