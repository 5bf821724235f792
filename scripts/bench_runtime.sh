#!/usr/bin/env bash
# Disaggregated (1P1D) vs colocated (2 replicas) on the same engine, measured with `pdserve bench`.
# Usage: scripts/bench_runtime.sh OUT_DIR [MODEL] [DTYPE]
# Each configuration is started, benchmarked on a long-prompt and a short-prompt workload at one
# offered rate, and stopped; the JSON reports land in OUT_DIR.
set -euo pipefail
out=${1:?out dir}; model=${2:-small}; dtype=${3:-float32}
mkdir -p "$out"
PD=.venv/bin/pdserve
run_config() {
  local name=$1; shift
  $PD serve --model "$model" --dtype "$dtype" --port 8011 --kv-cache-mb 512 "$@" > "$out/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do curl -sf localhost:8011/health >/dev/null 2>&1 && break; sleep 0.5; done
  $PD bench --endpoint http://127.0.0.1:8011 --num-requests "${LONG_N:-6}" --rate "${LONG_RATE:-0.05}" \
     --arrival poisson --seed 1 --input-dist uniform:1024,2048 --output-dist uniform:64,128 --prompt-format ids \
     --slo-ttft-ms "${LONG_TTFT_MS:-60000}" --slo-tpot-ms "${LONG_TPOT_MS:-500}" --json "$out/$name.long.json" --quiet
  $PD bench --endpoint http://127.0.0.1:8011 --num-requests "${SHORT_N:-16}" --rate "${SHORT_RATE:-0.5}" \
     --arrival poisson --seed 2 --input-dist uniform:64,128 --output-dist uniform:64,128 --prompt-format ids \
     --slo-ttft-ms "${SHORT_TTFT_MS:-5000}" --slo-tpot-ms "${SHORT_TPOT_MS:-500}" --json "$out/$name.short.json" --quiet
  kill -INT $pid; wait $pid || true
}
run_config disagg --mode disaggregated --prefill 1 --decode 1
run_config coloc --mode colocated --replicas 2
