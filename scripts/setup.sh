#!/usr/bin/env bash
# Create .venv (if missing) and install pdserve with its test extras.
# torch is installed first, pinned to the CPU build these machines carry, only when absent:
# the package itself keeps a loose torch requirement for users.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q "torch==${PDSERVE_TORCH_VERSION:-2.13.0}"
fi
if ! .venv/bin/python -c "import pdserve, transformers, hypothesis, numba, schemathesis, cryptography, aiconfigurator_core, xdist" >/dev/null 2>&1 || [ "${PDSERVE_REINSTALL:-0}" = 1 ]; then
  .venv/bin/pip install -q -e ".[test,aic]"  # aic: aiconfigurator (no torch), for the aic latency model
fi
