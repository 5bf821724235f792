#!/usr/bin/env bash
# Where the served path's time and memory go (issue 39, part 2): one colocated `pdserve serve`
# (2 threads, pinned to CORES), a closed loop of 512/128-token requests at concurrency 8 and then
# 32 (`pdserve bench --rate inf --max-concurrency C`, 2C requests, each run its own prompt text),
# and py-spy sampling the serving process and the worker for 25 s of each run (100 Hz, raw stacks).
# After each run: the processes' RSS and the worker's K/V blocks by state (`/metrics`).
# Usage: scripts/profile_served.sh CKPT OUT_DIR [CORES]   (py-spy: `pip install py-spy`)
# Then: python scripts/profile_served.py OUT_DIR  (the shares of the samples, per process and run)
set -euo pipefail
ckpt=${1:?checkpoint dir or built-in name}; out=${2:?out dir}; cores=${3:-0,1}
mkdir -p "$out"
PY=${PY:-.venv/bin/python}; SPY=${SPY:-$(dirname "$PY")/py-spy}; PORT=${PORT:-8030}
taskset -c "$cores" "$PY" -m pdserve.cli serve --model "$ckpt" --dtype bfloat16 --port "$PORT" --kv-cache-mb 1024 \
  --max-num-seqs 64 --mode colocated --replicas 1 --threads-per-worker 2 > "$out/serve.log" 2>&1 &
serve=$!
trap 'kill -INT $serve 2>/dev/null || true' EXIT
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
# the worker: the serving process's descendant with the most resident memory (the warm-start
# template that forks it holds less)
worker=$("$PY" - "$serve" <<'PY'
import sys
sys.path.insert(0, "scripts")
from process_memory import tree
root = int(sys.argv[1])
rss = {pid: int(open(f"/proc/{pid}/statm").read().split()[1]) for pid in tree(root) if pid != root}
print(max(rss, key=rss.get))
PY
)
echo "serve $serve worker $worker" > "$out/pids"
snapshot() {  # NAME: RSS of every process of the tree, and the K/V blocks by state
  "$PY" scripts/process_memory.py "$serve" --top 0 > "$out/memory.$1.txt" || true
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^pdserve_kv_tier_blocks|^pdserve_free_blocks' > "$out/blocks.$1.txt" || true
}
snapshot idle
bench=("$PY" -m pdserve.cli bench --endpoint "http://127.0.0.1:$PORT" --rate inf --input-len 512 --slo-ttft-ms 2000
       --slo-tpot-ms 100 --quiet)
"${bench[@]}" --max-concurrency 2 --num-requests 2 --output-len 16 --content-salt 99 > /dev/null  # warm-up
for c in 8 32; do
  "${bench[@]}" --max-concurrency "$c" --num-requests $((2 * c)) --output-len 128 --content-salt "$c" \
    --json "$out/bench.c$c.json" > "$out/bench.c$c.log" 2>&1 &
  run=$!
  sleep 15  # past the first prompts, into the steady state
  "$SPY" record -p "$serve" -r 100 -f raw -d 25 --nonblocking -o "$out/serve.c$c.txt" > /dev/null 2>&1 &
  "$SPY" record -p "$worker" -r 100 -f raw -d 25 --nonblocking -o "$out/worker.c$c.txt" > /dev/null 2>&1
  wait "$run"
  snapshot "c$c"
done
