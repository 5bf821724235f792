"""Issue 21's TetriInfer figure: concurrent decodes admitted with --reserve dynamic vs static.

Every request asks for max_tokens 1024; its real output is the committed trace's recorded length
(32-128 tokens), delivered by the `scripted_eos_tokens` stand-in for an EOS (engine/sequence.py):
the router and the decode worker see only max_tokens, as they would a real request. Both arms run
`pdserve serve` (1 prefill + 1 decode worker, the same --kv-cache-mb and a --max-num-seqs far
above the pool's capacity), interleaved, `--repeats` times; each arm sends the same N requests at
once and polls /workers for the decode worker's decoding sequences. Printed: the peak and the
time-averaged concurrent decodes (median over repeats), requests completed / failed, outputs of
the trace's length, and the dynamic arm's reservation growths and preemptions.

    .venv/bin/python scripts/tetri_reserve_figure.py [--model small --kv-cache-mb 64 --requests 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "docs" / "traces" / "tetri_lengths.jsonl"
PDSERVE = [sys.executable, "-m", "pdserve.cli"] if not (Path(sys.executable).parent / "pdserve").exists() else [
    str(Path(sys.executable).parent / "pdserve")]


def free_port() -> int:
    from pdserve.ports import free_local_port

    return free_local_port()


def start_server(args, arm: str, predictor: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [*PDSERVE, "serve", "--model", args.model, "--prefill", "1", "--decode", "1",
           "--kv-cache-mb", str(args.kv_cache_mb), "--max-num-seqs", str(args.max_num_seqs),
           "--pd-decision", "always", "--pd-profile", "none", "--admission-wait-s", "3000", "--slo-ttft-ms", "600000",
           "--reserve", arm, "--predictor", str(predictor), "--port", str(port)]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def one_request(url: str, model: str, entry: dict, out: list, i: int) -> None:
    body = {"model": model, "prompt": entry["prompt"], "max_tokens": 1024, "temperature": 0.0,
            "scripted_eos_tokens": entry["output_len"]}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
        js = r.json()
        ok = r.status_code == 200
        out[i] = (ok, js["usage"]["completion_tokens"] if ok else 0, js["choices"][0]["finish_reason"] if ok else r.status_code)
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        out[i] = (False, 0, repr(exc))


def run_arm(args, arm: str, predictor: Path, entries: list[dict], logdir: Path, rep: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, arm, predictor, port, logdir / f"{arm}-{rep}.log")
    try:
        wait_ready(url, proc)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results: list = [None] * len(entries)
        threads = [threading.Thread(target=one_request, args=(url, model, e, results, i)) for i, e in enumerate(entries)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        samples = []
        while any(t.is_alive() for t in threads):
            views = httpx.get(f"{url}/workers", timeout=10).json()
            rows = views["workers"] if isinstance(views, dict) else views
            samples.append(sum((w.get("load") or {}).get("active_decode", 0) for w in rows if w["role"] == "decode"))
            time.sleep(0.05)
        wall_s = time.monotonic() - t0
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    busy = [s for s in samples if s > 0] or [0]
    lengths_ok = sum(1 for (ok, n, _), e in zip(results, entries) if ok and n == e["output_len"])
    return {"arm": arm, "peak": max(samples or [0]), "mean": statistics.fmean(busy), "wall_s": wall_s,
            "completed": sum(1 for ok, _, _ in results if ok), "failed": sum(1 for ok, _, _ in results if not ok),
            "trace_length_outputs": lengths_ok, "growths": _metric(metrics, "pdserve_reservation_growths_total"),
            "preemptions": _metric(metrics, "pdserve_reservation_preemptions_total"),
            "covered": _metric(metrics, 'pdserve_prediction_outcomes_total{outcome="covered"}'),
            "under": _metric(metrics, 'pdserve_prediction_outcomes_total{outcome="under"}')}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--predictor", default=None, help="a trained predictor (default: train one from the trace)")
    args = ap.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="tetri-figure-"))
    predictor = Path(args.predictor) if args.predictor else logdir / "predictor.json"
    if not args.predictor:
        subprocess.run([*PDSERVE, "predictor", "train", str(TRACE), "--out", str(predictor), "--model", args.model],
                       check=True, cwd=ROOT)
    entries = [json.loads(s) for s in TRACE.read_text().splitlines()][-args.requests:]  # the trace's last lines
    runs = []
    for rep in range(args.repeats):
        for arm in ("static", "dynamic") if rep % 2 == 0 else ("dynamic", "static"):
            runs.append(run_arm(args, arm, predictor, entries, logdir, rep))
            print(json.dumps(runs[-1]), flush=True)
    print(f"\nmodel {args.model}, 1P1D, --kv-cache-mb {args.kv_cache_mb}, --max-num-seqs {args.max_num_seqs}, "
          f"{args.requests} requests at once, max_tokens 1024, outputs {min(e['output_len'] for e in entries)}-"
          f"{max(e['output_len'] for e in entries)} tokens (trace), {args.repeats} repeats, logs {logdir}")
    med = {}
    for arm in ("static", "dynamic"):
        rs = [r for r in runs if r["arm"] == arm]
        med[arm] = {k: statistics.median(r[k] for r in rs) for k in ("peak", "mean", "wall_s")}
        print(f"{arm:8s} peak concurrent decodes {med[arm]['peak']:.0f} (runs {[r['peak'] for r in rs]}), "
              f"busy mean {med[arm]['mean']:.1f}, wall {med[arm]['wall_s']:.1f} s, completed "
              f"{sum(r['completed'] for r in rs)}, failed {sum(r['failed'] for r in rs)}, trace-length outputs "
              f"{sum(r['trace_length_outputs'] for r in rs)}, growths {sum(r['growths'] for r in rs):.0f}, "
              f"preemptions {sum(r['preemptions'] for r in rs):.0f}")
    print(f"dynamic / static peak: {med['dynamic']['peak'] / max(med['static']['peak'], 1):.2f}x; "
          f"busy mean: {med['dynamic']['mean'] / max(med['static']['mean'], 1e-9):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
