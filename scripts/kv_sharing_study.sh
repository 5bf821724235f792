#!/usr/bin/env bash
# Cross-worker prefix fetch on multi-turn chat (issue 19's figures), K/V sharing vs --no-kv-sharing.
#   TOPO=colocated (default): 2-replica colocated with --policy round_robin, so each turn of one
#     conversation lands on the replica that did not serve the previous turn; with K/V sharing that
#     replica fetches the history from the other one, with --no-kv-sharing it recomputes it.
#   TOPO=1p2d / 2p2d: disaggregated, 1 or 2 prefill and 2 decode workers, --policy prefix (the
#     cache-aware cost: queue + host-tier promotion + fetch + prefill of the rest); a conversation's
#     decoded history lives on a decode worker and is fetched back to the prefill side (level 3).
# Usage: scripts/kv_sharing_study.sh OUT_DIR [MODEL]
#   closed loop (pdserve bench --closed-loop): C conversations of T turns; turn 0 is SHARED tokens
#   of one system text every conversation shares, then INPUT tokens of its own; each later turn
#   adds the previous answer (OUTPUT tokens, as streamed) and TURN new tokens.
#   RUNS rounds, each serving both arms in a rotated order (uptime recorded before each run); per
#   run: TTFT p50/p90 per turn and over turns >= 1, the server's pdserve_prefix_hit_tokens_total by
#   where (local, remote, host), fetched bytes, and the prompt tokens recomputed (prompt - cached,
#   from the trace lines); summary.json holds the medians over rounds, the ratio of the arms'
#   medians over turns >= 1, and the ratio paired per round (no sharing / sharing in one round)
#   with its median.
# Knobs (env): TOPO (colocated), C (1), T (6), INPUT (1000), SHARED (0), TURN (160), OUTPUT (32),
#   RUNS (3), KV_MB (512, each worker's pool), HOST_MB (0: the sharing arm's --host-kv-mb),
#   POLICY (round_robin colocated, prefix otherwise), EXTRA_SERVE_ARGS, PYTHON (python3: the
#   summary's interpreter; one with matplotlib also draws ttft_per_turn.png).
set -euo pipefail
out=${1:?out dir}; model=${2:-small}
mkdir -p "$out"
PD=${PD:-.venv/bin/pdserve}
PORT=${PORT:-8017}
C=${C:-1}; T=${T:-6}; INPUT=${INPUT:-1000}; TURN=${TURN:-160}; OUTPUT=${OUTPUT:-32}; RUNS=${RUNS:-3}
TOPO=${TOPO:-colocated}; SHARED=${SHARED:-0}; KV_MB=${KV_MB:-512}; HOST_MB=${HOST_MB:-0}
case $TOPO in
  colocated) topo=(--mode colocated --replicas 2); POLICY=${POLICY:-round_robin} ;;
  1p2d) topo=(--mode disaggregated --prefill 1 --decode 2); POLICY=${POLICY:-prefix} ;;
  2p2d) topo=(--mode disaggregated --prefill 2 --decode 2); POLICY=${POLICY:-prefix} ;;
  *) echo "TOPO must be colocated, 1p2d or 2p2d" >&2; exit 2 ;;
esac
# shellcheck disable=SC2206
engine_args=(--model "$model" "${topo[@]}" --policy "$POLICY" --kv-cache-mb "$KV_MB" ${EXTRA_SERVE_ARGS:-})
# shellcheck source=scripts/study_server.sh
source "$(dirname "$0")/study_server.sh"

arms=(sharing no_sharing)
for run in $(seq 1 "$RUNS"); do
  for k in 0 1; do
    arm=${arms[$(( (k + run - 1) % 2 ))]}
    flags=(); [ "$arm" = no_sharing ] && flags=(--no-kv-sharing)
    [ "$arm" = sharing ] && [ "$HOST_MB" != 0 ] && flags=(--host-kv-mb "$HOST_MB")
    uptime > "$out/$arm.$run.uptime"
    start_server "$arm.$run" --trace-dir "$out/$arm.$run.trace" "${flags[@]}"
    $PD bench --endpoint "http://127.0.0.1:$PORT" --closed-loop --num-conversations "$C" --num-turns "$T" \
      --input-len "$INPUT" --shared-prefix-len "$SHARED" --turn-len "$TURN" --output-len "$OUTPUT" --seed "$run" \
      --json "$out/$arm.$run.json" > "$out/$arm.$run.log"
    uptime >> "$out/$arm.$run.uptime"
    curl -sf "localhost:$PORT/metrics" > "$out/$arm.$run.metrics"
    stop_server
  done
done

"${PYTHON:-python3}" - "$out" "$RUNS" "$TOPO" <<'PY'
import json, re, statistics, sys
out, runs, topo = sys.argv[1], int(sys.argv[2]), sys.argv[3]
summary = {"topology": topo}


def metric(text, name):
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


for arm in ("sharing", "no_sharing"):
    p50s, p90s, per_turn, hits, fetched, recomputed, loads = [], [], {}, {}, [], [], []
    for run in range(1, runs + 1):
        report = json.load(open(f"{out}/{arm}.{run}.json"))
        p50s.append(report["later_turns"]["ttft_p50_s"])
        p90s.append(report["later_turns"]["ttft_p90_s"])
        for turn, row in report["turns"].items():
            per_turn.setdefault(int(turn), []).append((row["ttft_p50_s"], row["ttft_p90_s"]))
        text = open(f"{out}/{arm}.{run}.metrics").read()
        for where in ("local_device", "local_host", "remote_device", "remote_host"):
            hits.setdefault(where, []).append(metric(text, f'pdserve_prefix_hit_tokens_total{{where="{where}"}}'))
        fetched.append(metric(text, "pdserve_kv_fetch_bytes_total"))
        lines = [json.loads(l) for l in open(f"{out}/{arm}.{run}.trace/requests.jsonl")]
        recomputed.append(sum(l.get("prompt_tokens", 0) - l.get("cached_tokens", 0) for l in lines))
        loads.append(open(f"{out}/{arm}.{run}.uptime").read().split("load average:")[1].split(",")[0].strip())
    lines = [json.loads(l) for run in range(1, runs + 1) for l in open(f"{out}/{arm}.{run}.trace/requests.jsonl")]
    summary[arm] = {"later_turn_ttft_p50_s_per_run": p50s, "median_later_turn_ttft_p50_s": statistics.median(p50s),
                    "median_later_turn_ttft_p90_s": statistics.median(p90s),
                    "per_turn_median_ttft_p50_p90_s": {t: [statistics.median(v[0] for v in rows),
                                                           statistics.median(v[1] for v in rows)]
                                                       for t, rows in sorted(per_turn.items())},
                    "hit_tokens_per_run": hits, "remote_hit_tokens_per_run": [d + h for d, h in zip(hits["remote_device"], hits["remote_host"])],
                    "fetch_bytes_per_run": fetched, "recomputed_prompt_tokens_per_run": recomputed,
                    "load_1min_before_per_run": loads,
                    "prompt_tokens_range": [min(l.get("prompt_tokens", 0) for l in lines),
                                            max(l.get("prompt_tokens", 0) for l in lines)]}
summary["ttft_ratio_no_sharing_over_sharing"] = (summary["no_sharing"]["median_later_turn_ttft_p50_s"]
                                                 / summary["sharing"]["median_later_turn_ttft_p50_s"])
paired = [n / s for n, s in zip(summary["no_sharing"]["later_turn_ttft_p50_s_per_run"],
                                summary["sharing"]["later_turn_ttft_p50_s_per_run"])]
summary["paired_ttft_ratio_per_round"] = paired  # the issue's figure: each round's two arms, then the median
summary["median_paired_ttft_ratio"] = statistics.median(paired)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
try:  # a small plot of TTFT per turn, both arms (skipped without matplotlib)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 3))
    for arm, style in (("sharing", "o-"), ("no_sharing", "s--")):
        rows = summary[arm]["per_turn_median_ttft_p50_p90_s"]
        turns = sorted(rows)
        ax.plot(turns, [rows[t][0] for t in turns], style, label=f"{arm} p50")
        ax.plot(turns, [rows[t][1] for t in turns], style, alpha=0.4, label=f"{arm} p90")
    ax.set(xlabel="turn", ylabel="TTFT (s), median of runs", title=f"K/V sharing, {topo}")
    ax.set_xticks(turns)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/ttft_per_turn.png", dpi=110)
except ImportError:
    pass
PY
