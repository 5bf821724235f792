#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), the cp312 manylinux wheels that pdserve needs and the GPU machine's
# image lacks (its python3 is 3.12 with torch, Triton, transformers, numpy, tokenizers, safetensors;
# no registry there). scripts/gpu_check.sh installs them on the GPU machine with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p .whl
PKGS=(msgspec pyzmq fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions uvicorn cryptography cffi pycparser opentelemetry-api importlib-metadata)
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_26_x86_64 manylinux_2_5_x86_64; do
  PLAT+=(--platform "$p")
done
for pkg in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    --platform any -d .whl "$pkg" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl
