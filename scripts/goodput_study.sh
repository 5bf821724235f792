#!/usr/bin/env bash
# Goodput of 1P1D disaggregated vs 2-replica colocated serving, on a long-prompt and a short-prompt
# workload, with SLOs derived from single-request latency (issue: "when does disaggregation pay?").
# Usage: scripts/goodput_study.sh OUT_DIR [MODEL] [DTYPE] [COMPUTE_DTYPE]
#   1. calibrate: on one colocated replica with nothing else running, three requests one at a time
#      at the median prompt length of each workload -> isolated TTFT (prefill) and TPOT (decode step)
#   2. SLOs: TTFT = 5 x isolated TTFT, TPOT = 2 x isolated TPOT (per workload)
#   3. for each configuration and workload: `pdserve bench --sweep` (ladder + bisection, seeded
#      Poisson arrivals) -> goodput (joint and per-phase), JSON and plots in OUT_DIR/<config>.<workload>/
# Knobs (env): LONG_N, SHORT_N requests per rate point; LONG_RATES, SHORT_RATES ladders; BISECT;
# EXTRA_SERVE_ARGS for every server (e.g. --no-batch-invariant).
set -euo pipefail
out=${1:?out dir}; model=${2:-small}; dtype=${3:-float32}; compute=${4:-}
mkdir -p "$out"
PD=${PD:-.venv/bin/pdserve}
PORT=${PORT:-8011}
engine_args=(--model "$model" --dtype "$dtype" --kv-cache-mb 512)
[[ -n "$compute" ]] && engine_args+=(--compute-dtype "$compute")
# shellcheck disable=SC2206
engine_args+=(${EXTRA_SERVE_ARGS:-})  # e.g. --no-batch-invariant

# shellcheck source=scripts/study_server.sh
source "$(dirname "$0")/study_server.sh"

workload_args() {  # long | short
  if [[ $1 == long ]]; then echo "--input-dist uniform:1024,2048 --output-dist uniform:64,128 --seed 1"
  else echo "--input-dist uniform:64,128 --output-dist uniform:64,128 --seed 2"; fi
}
median_len() { [[ $1 == long ]] && echo 1536 || echo 96; }

calibrate() {  # workload -> "ttft_ms tpot_ms" (medians of 3 isolated requests)
  local w=$1
  $PD bench --endpoint "http://127.0.0.1:$PORT" --num-requests 3 --rate "${CAL_RATE:-0.05}" --arrival constant \
    --input-len "$(median_len "$w")" --output-len 32 --prompt-format ids --slo-ttft-ms 1e9 --slo-tpot-ms 1e9 \
    --json "$out/calibrate.$w.json" --quiet > "$out/calibrate.$w.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['p50_ttft_ms'], d['p50_tpot_ms'])" "$out/calibrate.$w.json"
}

# 1-2: calibrate on one colocated replica
start_server calibrate --mode colocated --replicas 1
read -r long_ttft long_tpot < <(calibrate long)
read -r short_ttft short_tpot < <(calibrate short)
stop_server
slo() { python3 -c "print(round($1 * $2, 1))"; }
LONG_TTFT=$(slo 5 "$long_ttft"); LONG_TPOT=$(slo 2 "$long_tpot")
SHORT_TTFT=$(slo 5 "$short_ttft"); SHORT_TPOT=$(slo 2 "$short_tpot")
printf '{"long": {"slo_ttft_ms": %s, "slo_tpot_ms": %s}, "short": {"slo_ttft_ms": %s, "slo_tpot_ms": %s}}\n' \
  "$LONG_TTFT" "$LONG_TPOT" "$SHORT_TTFT" "$SHORT_TPOT" > "$out/slos.json"
cat "$out/slos.json"

sweep() {  # config workload
  local c=$1 w=$2 n rates ttft tpot
  if [[ $w == long ]]; then n=${LONG_N:-8}; rates=${LONG_RATES:-0.025,0.05,0.1,0.2}; ttft=$LONG_TTFT; tpot=$LONG_TPOT
  else n=${SHORT_N:-24}; rates=${SHORT_RATES:-0.25,0.5,1,2,4}; ttft=$SHORT_TTFT; tpot=$SHORT_TPOT; fi
  mkdir -p "$out/$c.$w"
  # shellcheck disable=SC2046
  $PD bench --endpoint "http://127.0.0.1:$PORT" --num-requests "$n" --sweep --sweep-rates "$rates" \
    --max-bisections "${BISECT:-2}" --arrival poisson $(workload_args "$w") --prompt-format ids \
    --slo-ttft-ms "$ttft" --slo-tpot-ms "$tpot" --json "$out/$c.$w/report.json" --plot-dir "$out/$c.$w" --quiet \
    > "$out/$c.$w/bench.log"
}

for config in disagg coloc; do
  if [[ $config == disagg ]]; then start_server disagg --mode disaggregated --prefill 1 --decode 1
  else start_server coloc --mode colocated --replicas 2; fi
  sweep "$config" short
  sweep "$config" long
  stop_server
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for c in ("disagg", "coloc"):
    for w in ("long", "short"):
        d = json.load(open(f"{out}/{c}.{w}/report.json"))
        rows[f"{c}.{w}"] = {k: d.get(k) for k in ("request_goodput", "request_goodput_phase")}
for w in ("long", "short"):
    a, b = rows[f"disagg.{w}"]["request_goodput"], rows[f"coloc.{w}"]["request_goodput"]
    rows[f"ratio.{w}"] = (a / b) if a and b else None
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
