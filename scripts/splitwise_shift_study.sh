#!/usr/bin/env bash
# Splitwise under a load shift (issue "The seed's scheduling systems", first figure): the same two
# workers as fixed 1P1D (--mode disaggregated) and as a Splitwise pair (--mode splitwise
# --workers 2: the pool controller lends the prompt worker to the token pool when decode presses,
# and back), replaying scripts/traces/load_shift.jsonl (long prompts with 8-token outputs, then
# 32-token prompts with 256-token outputs) on its own clock.
# Usage: scripts/splitwise_shift_study.sh OUT_DIR [MODEL] [DTYPE]
#   1. SLOs as the goodput study derives them: one colocated replica, isolated requests at the long
#      median (1536 tokens) -> TTFT = 5 x isolated TTFT, TPOT = 2 x isolated TPOT
#   2. RUNS rounds, each serving both arms in a rotated order -> good request throughput (requests
#      meeting both clocks per second) and joint attainment; medians and their ratio in summary.json
# Knobs (env): RUNS (3), TRACE (the committed one), EXTRA_SERVE_ARGS.
set -euo pipefail
out=${1:?out dir}; model=${2:-small}; dtype=${3:-bfloat16}
mkdir -p "$out"
PD=${PD:-.venv/bin/pdserve}
PORT=${PORT:-8014}
RUNS=${RUNS:-3}
TRACE=${TRACE:-scripts/traces/load_shift.jsonl}
engine_args=(--model "$model" --dtype "$dtype" --kv-cache-mb 512)
# shellcheck disable=SC2206
engine_args+=(${EXTRA_SERVE_ARGS:-})

# shellcheck source=scripts/study_server.sh
source "$(dirname "$0")/study_server.sh"

read -r TTFT TPOT < <(derive_slos)
echo "{\"slo_ttft_ms\": $TTFT, \"slo_tpot_ms\": $TPOT, \"trace\": \"$TRACE\"}" | tee "$out/slos.json"

arms=(fixed splitwise)
for run in $(seq 1 "$RUNS"); do
  for k in 0 1; do
    arm=${arms[$(( (k + run - 1) % 2 ))]}
    if [ "$arm" = fixed ]; then shape=(--mode disaggregated --prefill 1 --decode 1); else shape=(--mode splitwise --workers 2); fi
    start_server "$arm.$run" "${shape[@]}" --trace-dir "$out/$arm.$run.trace" --slo-ttft-ms "$TTFT" --slo-tpot-ms "$TPOT"
    $PD bench --endpoint "http://127.0.0.1:$PORT" --trace "$TRACE" --arrival trace --prompt-format ids \
      --slo-ttft-ms "$TTFT" --slo-tpot-ms "$TPOT" --json "$out/$arm.$run.json" --quiet > "$out/$arm.$run.log"
    curl -s "localhost:$PORT/metrics" | grep -E "^pdserve_(pool_moves|role_changes|pd_decisions)" > "$out/$arm.$run.moves" || true
    stop_server
  done
done

python3 - "$out" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
rows = {}
for arm in ("fixed", "splitwise"):
    reports = [json.load(open(f"{out}/{arm}.{r}.json")) for r in range(1, runs + 1)]
    good = [d["good_request_throughput"] for d in reports]
    rows[arm] = {"good_request_throughput": good, "median": statistics.median(good),
                 "joint_attainment": [d.get("attainment_joint", d.get("joint_attainment")) for d in reports],
                 "moves": [open(f"{out}/{arm}.{r}.moves").read().split("\n") for r in range(1, runs + 1)]}
fixed = rows["fixed"]["median"]
rows["splitwise_vs_fixed"] = rows["splitwise"]["median"] / fixed if fixed else None
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps({k: (v if not isinstance(v, dict) else {"median": v["median"], "good": v["good_request_throughput"]})
                  for k, v in rows.items()}, indent=1))
PY
