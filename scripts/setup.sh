#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment at .venv in the repo root and
# installs entr_megatron with its test dependencies into it.
#
# CPU machines: torch 2.13.0 (CPU build) and megatron-core 0.16.1 are pinned by
# requirements/constraints-cpu.txt. Re-running is cheap: the install is skipped
# while pyproject.toml and the constraints are unchanged.
#
#   PYTHON=python3.12 bash scripts/setup.sh     # another interpreter (>= 3.10)
#   EXTRAS=dev,cluster bash scripts/setup.sh    # other extras (default: dev)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev}
CONSTRAINTS=requirements/constraints-cpu.txt

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.entr-megatron-setup
want=$(cat pyproject.toml "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)-$EXTRAS
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import entr_megatron, torch, megatron.core" 2>/dev/null; then
  echo "[setup] .venv is up to date"
  exit 0
fi

pip_install() {
  # pip warns about missing local mirror folders on some machines; keep real errors.
  .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | grep -v -e "is ignored: it is neither a file nor a directory" || true
  return "${PIPESTATUS[0]}"
}

echo "[setup] installing torch (CPU build) and megatron-core"
pip_install -c "$CONSTRAINTS" torch megatron-core
echo "[setup] installing entr_megatron[$EXTRAS] (editable)"
pip_install -c "$CONSTRAINTS" -e ".[$EXTRAS]"
.venv/bin/python -c "import torch, megatron.core, entr_megatron; print('[setup] torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
echo "$want" > "$stamp"
