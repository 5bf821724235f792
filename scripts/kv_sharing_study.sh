#!/usr/bin/env bash
# Cross-worker prefix fetch on multi-turn chat (issue 19's figure): 2-replica colocated with
# --policy round_robin, so each turn of one conversation lands on the replica that did not serve
# the previous turn; with K/V sharing that replica fetches the history from the other one, with
# --no-kv-sharing it recomputes it.
# Usage: scripts/kv_sharing_study.sh OUT_DIR [MODEL]
#   closed loop (pdserve bench --closed-loop): C conversations of T turns; turn 0 is INPUT tokens
#   of text, each later turn adds the previous answer (OUTPUT tokens, as streamed) and TURN new
#   tokens, so histories run from INPUT to about INPUT + (T-1) x (OUTPUT + TURN) tokens.
#   RUNS rounds, each serving both arms in a rotated order; per run: TTFT p50 over turns >= 1 and
#   the server's pdserve_prefix_hit_tokens_total{where="remote"}; summary.json holds the medians
#   over rounds and their ratio.
# Knobs (env): C (1), T (6), INPUT (1000), TURN (160), OUTPUT (32), RUNS (3), EXTRA_SERVE_ARGS.
set -euo pipefail
out=${1:?out dir}; model=${2:-small}
mkdir -p "$out"
PD=${PD:-.venv/bin/pdserve}
PORT=${PORT:-8017}
C=${C:-1}; T=${T:-6}; INPUT=${INPUT:-1000}; TURN=${TURN:-160}; OUTPUT=${OUTPUT:-32}; RUNS=${RUNS:-3}
# shellcheck disable=SC2206
engine_args=(--model "$model" --mode colocated --replicas 2 --policy round_robin --kv-cache-mb 512 ${EXTRA_SERVE_ARGS:-})
# shellcheck source=scripts/study_server.sh
source "$(dirname "$0")/study_server.sh"

arms=(sharing no_sharing)
for run in $(seq 1 "$RUNS"); do
  for k in 0 1; do
    arm=${arms[$(( (k + run - 1) % 2 ))]}
    flags=(); [ "$arm" = no_sharing ] && flags=(--no-kv-sharing)
    start_server "$arm.$run" --trace-dir "$out/$arm.$run.trace" "${flags[@]}"
    $PD bench --endpoint "http://127.0.0.1:$PORT" --closed-loop --num-conversations "$C" --num-turns "$T" \
      --input-len "$INPUT" --turn-len "$TURN" --output-len "$OUTPUT" --seed "$run" --json "$out/$arm.$run.json" \
      > "$out/$arm.$run.log"
    curl -sf "localhost:$PORT/metrics" > "$out/$arm.$run.metrics"
    stop_server
  done
done

python3 - "$out" "$RUNS" <<'PY'
import json, re, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
summary = {}
for arm in ("sharing", "no_sharing"):
    p50s, remote, fetched = [], [], []
    for run in range(1, runs + 1):
        report = json.load(open(f"{out}/{arm}.{run}.json"))
        p50s.append(report["later_turns"]["ttft_p50_s"])
        text = open(f"{out}/{arm}.{run}.metrics").read()
        hit = re.search(r'^pdserve_prefix_hit_tokens_total\{where="remote"\} (\S+)$', text, re.M)
        nbytes = re.search(r"^pdserve_kv_fetch_bytes_total (\S+)$", text, re.M)
        remote.append(float(hit.group(1)) if hit else 0.0)
        fetched.append(float(nbytes.group(1)) if nbytes else 0.0)
    lines = [json.loads(l) for run in range(1, runs + 1) for l in open(f"{out}/{arm}.{run}.trace/requests.jsonl")]
    summary[arm] = {"later_turn_ttft_p50_s_per_run": p50s, "median_later_turn_ttft_p50_s": statistics.median(p50s),
                    "remote_hit_tokens_per_run": remote, "fetch_bytes_per_run": fetched,
                    "prompt_tokens_range": [min(l.get("prompt_tokens", 0) for l in lines),
                                            max(l.get("prompt_tokens", 0) for l in lines)]}
summary["ttft_ratio_no_sharing_over_sharing"] = (summary["no_sharing"]["median_later_turn_ttft_p50_s"]
                                                 / summary["sharing"]["median_later_turn_ttft_p50_s"])
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
