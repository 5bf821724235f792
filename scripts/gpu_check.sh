#!/usr/bin/env bash
# The one prepared device check (issue 37): on a GPU machine with no registry, install the carried
# wheels (scripts/gpu_wheels.sh fetched them into .whl/), run the GPU tests, then the figures, into
# one JSON at ${OUT:-.}/gpu_check.json (and the tests' log beside it). Budget: under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
timeout 190 python3 -m pytest -q -p no:cacheprovider tests/gpu -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 160 python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_figures.log" | tail -60
