# Shared by the study scripts (sourced): start and stop one `pdserve serve`, and derive the
# goodput study's SLOs. Reads the caller's PD (the pdserve command), PORT, out (the output
# folder) and engine_args (the flags every server of the study gets).

start_server() {  # name, serve args... -> SERVER (pid), once /health answers
  local name=$1; shift
  $PD serve "${engine_args[@]}" --port "$PORT" "$@" > "$out/$name.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1200); do curl -sf "localhost:$PORT/health" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "server $name did not come up" >&2; return 1
}

stop_server() { kill -INT "$SERVER"; wait "$SERVER" || true; }

derive_slos() {  # [prompt tokens, 1536] -> "ttft_ms tpot_ms": 5 x / 2 x the isolated TTFT / TPOT of such requests on one colocated replica
  start_server calibrate --mode colocated --replicas 1
  $PD bench --endpoint "http://127.0.0.1:$PORT" --num-requests 3 --rate 0.05 --arrival constant --input-len "${1:-1536}" \
    --output-len 32 --prompt-format ids --slo-ttft-ms 1e9 --slo-tpot-ms 1e9 --json "$out/calibrate.json" --quiet \
    > "$out/calibrate.log"
  stop_server
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(5*d['p50_ttft_ms'],1), round(2*d['p50_tpot_ms'],1))" "$out/calibrate.json"
}
