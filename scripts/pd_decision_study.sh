#!/usr/bin/env bash
# Per-request P/D decision on a mixed workload (issue "Per-request P/D decision"): 1P1D with
# --pd-decision always | never | margin, the same seeded trace and offered rate, interleaved runs.
# Usage: scripts/pd_decision_study.sh OUT_DIR [MODEL] [DTYPE]
#   1. the trace: N requests, half 32-128-token prompts, half 1024-2048-token prompts (shuffled,
#      seeded), outputs 64-128 tokens; WORKLOAD=short or long: all of one kind (the pure workloads);
#      WORKLOAD=turns: N/3 conversations of three turns (`pdserve bench --num-conversations`): first
#      turns half 1024-1536-token prompts, half 32-128 (chats), each later turn 32-128 new tokens
#      after its history (every earlier turn and a reply as long as its output), outputs 64-128
#   2. SLOs as the goodput study derives them: on one colocated replica, isolated requests at the
#      long median (1536; short workload: 80) -> TTFT = 5 x isolated TTFT, TPOT = 2 x isolated TPOT
#   3. RUNS rounds; each round serves the three modes in a rotated order and sends the trace at
#      RATE req/s (Poisson, the same seed) -> good request throughput (requests meeting both clocks
#      per second, vLLM's per-run goodput) and joint attainment; medians over rounds in summary.json
#      `uptime` before each served mode goes to OUT_DIR/uptime.log (the machine's load per arm)
#   The servers run as `pdserve serve` does by default: the decision's SLO targets are the ones the
#   server derives from its profile (SERVE_SLOS=1 gives every server the derived SLOs as flags
#   instead); the bench scores every arm against the derived SLOs.
# Knobs (env): N (24), RATE (0.15), RUNS (3), WORKLOAD (mixed | short | long | turns), MODES ("always never
# margin"; the summary's ratios need all three), PORT, SERVE_SLOS (0), EXTRA_SERVE_ARGS, SLOS ("TTFT_MS TPOT_MS":
# fixed targets instead of step 2's calibration, so that studies of two code versions score alike).
set -euo pipefail
out=${1:?out dir}; model=${2:-small}; dtype=${3:-bfloat16}
mkdir -p "$out"
PD=${PD:-.venv/bin/pdserve}
PORT=${PORT:-8013}
N=${N:-24}; RATE=${RATE:-0.15}; RUNS=${RUNS:-3}; WORKLOAD=${WORKLOAD:-mixed}
engine_args=(--model "$model" --dtype "$dtype" --kv-cache-mb 512)
# shellcheck disable=SC2206
engine_args+=(${EXTRA_SERVE_ARGS:-})

python3 - "$out/mixed.jsonl" "$N" "$WORKLOAD" <<'PY'
import json, random, sys
path, n, workload = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(7)
if workload == "turns":  # rows [0, C) are first turns, then each conversation's later turns (bench's order)
    c = n // 3
    first = ["short"] * (c // 2) + ["long"] * (c - c // 2)
    rng.shuffle(first)
    rows = [rng.randint(32, 128) if k == "short" else rng.randint(1024, 1536) for k in first]
    rows += [rng.randint(32, 128) for _ in range(n - c)]
else:
    kinds = {"mixed": ["short"] * (n // 2) + ["long"] * (n - n // 2), "short": ["short"] * n, "long": ["long"] * n}[workload]
    rng.shuffle(kinds)
    rows = [rng.randint(32, 128) if k == "short" else rng.randint(1024, 2048) for k in kinds]
with open(path, "w") as f:
    for prompt in rows:
        f.write(json.dumps({"prompt_len": prompt, "output_len": rng.randint(64, 128)}) + "\n")
PY

# shellcheck source=scripts/study_server.sh
source "$(dirname "$0")/study_server.sh"

if [[ -n ${SLOS:-} ]]; then read -r TTFT TPOT <<< "$SLOS"  # fixed targets: runs of one machine compare
else read -r TTFT TPOT < <(derive_slos "$([[ $WORKLOAD == short ]] && echo 80 || echo 1536)"); fi
echo "{\"slo_ttft_ms\": $TTFT, \"slo_tpot_ms\": $TPOT, \"rate\": $RATE, \"n\": $N, \"workload\": \"$WORKLOAD\"}" | tee "$out/slos.json"

serve_slos=(); [[ ${SERVE_SLOS:-0} == 1 ]] && serve_slos=(--slo-ttft-ms "$TTFT" --slo-tpot-ms "$TPOT")
turns=(); [[ $WORKLOAD == turns ]] && turns=(--num-conversations $(( N / 3 )))
read -r -a modes <<< "${MODES:-always never margin}"
for run in $(seq 1 "$RUNS"); do
  for k in $(seq 0 $(( ${#modes[@]} - 1 ))); do
    mode=${modes[$(( (k + run - 1) % ${#modes[@]} ))]}
    echo "$mode.$run $(date -u +%H:%M:%S) $(uptime)" >> "$out/uptime.log"
    start_server "$mode.$run" --mode disaggregated --prefill 1 --decode 1 --pd-decision "$mode" \
      --trace-dir "$out/$mode.$run.trace" "${serve_slos[@]}"
    $PD bench --endpoint "http://127.0.0.1:$PORT" --trace "$out/mixed.jsonl" --rate "$RATE" --arrival poisson \
      --seed 11 --prompt-format ids --slo-ttft-ms "$TTFT" --slo-tpot-ms "$TPOT" --json "$out/$mode.$run.json" --include-records "${turns[@]}" \
      --quiet > "$out/$mode.$run.log"
    stop_server
  done
done

[[ ${#modes[@]} == 3 ]] || exit 0
python3 - "$out" "$RUNS" <<'PY'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
rows = {}


def peak_decodes(report):
    """The most requests decoding at once (first token to end; 1P1D: all on the decode worker)."""
    edges = sorted(e for r in report.get("records", []) if r["success"] and r["ttft_s"] is not None
                   for e in ((r["arrival_s"] + r["ttft_s"], 1), (r["arrival_s"] + r["e2e_s"], -1)))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


for mode in ("always", "never", "margin"):
    reports = [json.load(open(f"{out}/{mode}.{r}.json")) for r in range(1, runs + 1)]
    good = [d["good_request_throughput"] for d in reports]
    rows[mode] = {"good_request_throughput": good, "median": statistics.median(good),
                  "joint_attainment": [d.get("attainment_joint", d.get("joint_attainment")) for d in reports],
                  "peak_concurrent_decodes": [peak_decodes(d) for d in reports]}
best = max(rows["always"]["median"], rows["never"]["median"])
worst = min(rows["always"]["median"], rows["never"]["median"])
m = rows["margin"]["median"]
rows["margin_vs_best"] = m / best if best else None
rows["margin_vs_worst"] = m / worst if worst else None
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
