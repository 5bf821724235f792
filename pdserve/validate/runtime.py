"""`pdserve plan --validate`: run planned configurations on this machine and measure them.

Contract: for each configuration (the recommendation and the runner-up) start
`pdserve serve` as a subprocess in its own process group on a free port, wait until GET /health
answers 200 (or fail with a clear error naming the command and its last output), run
`pdserve bench --sweep --json` against it, stop the whole process group (router and workers:
SIGINT, then SIGTERM, then SIGKILL), and report predicted vs measured goodput. Only the local
runtime is supported (replicas, not TP/PP, are what `pdserve serve` varies here).

The bench ladder is either given (`rates`) or centred on each configuration's prediction
(`ladder_around`, around `checked_rps`), so a short sweep still brackets the predicted goodput. With a tolerance T
(`bracket`) the ladder is exactly the two rates pred / (1 + T) and pred / (1 - T) and no bisection:
the prediction is within T of the measured goodput when the first rate passes and the second
fails, which two bench runs decide (the lower one first; a failure there ends the check).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pdserve.ports import free_local_port

BeforeBench = Callable[[str], "list[float] | None"]  # server url -> the ladder to use (None: the default)
Calibrator = Callable[["LocalConfig", str, int], "tuple[dict, float]"]  # (config, url, round) -> (details, rps)

LADDER_FACTORS = (0.25, 0.5, 1.0, 1.5)


@dataclass(frozen=True)
class LocalConfig:
    """One deployment `pdserve serve` can start on this machine."""

    name: str
    mode: str  # "colocated" | "disaggregated"
    replicas: int = 1
    prefill: int = 1
    decode: int = 1
    predicted_goodput_rps: float = 0.0
    simulated_goodput_rps: float | None = None
    sample_goodput_rps: float | None = None  # simulated on exactly the requests the bench replays
    extra_serve_args: tuple[str, ...] = field(default=())  # e.g. --dtype, --max-num-batched-tokens

    @property
    def checked_rps(self) -> float:
        """The prediction a measurement is held to: the deployment simulated on the very requests
        the bench replays when known, else its steady-state simulation, else the planner's estimate."""
        return self.sample_goodput_rps or self.simulated_goodput_rps or self.predicted_goodput_rps

    @property
    def workers(self) -> int:
        return self.replicas if self.mode == "colocated" else self.prefill + self.decode

    @property
    def layout(self) -> str:
        return f"{self.replicas} x colocated" if self.mode == "colocated" else f"{self.prefill}P{self.decode}D"

    def serve_args(self, model: str, port: int) -> list[str]:
        shape = (["--replicas", str(self.replicas)] if self.mode == "colocated"
                 else ["--prefill", str(self.prefill), "--decode", str(self.decode)])
        return ["serve", "--mode", self.mode, *shape, "--model", model, "--host", "127.0.0.1", "--port", str(port),
                *self.extra_serve_args]


class ServerDidNotStart(RuntimeError):
    """The server exited or never answered; the message carries its command and output tail."""


class BenchFailed(RuntimeError):
    """`pdserve bench` exited non-zero; the message carries its command and output tail."""


def ladder_around(predicted_rps: float, factors: tuple[float, ...] = LADDER_FACTORS) -> list[float]:
    """A short sweep ladder bracketing a predicted goodput (a default one if there is none)."""
    base = predicted_rps if predicted_rps and predicted_rps > 0 else 1.0
    return sorted({float(f"{base * f:.3g}") for f in factors})


def bracket(predicted_rps: float, tolerance: float) -> list[float]:
    """The two rates whose pass/fail decides |predicted - measured| <= tolerance * measured."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    if not predicted_rps or predicted_rps <= 0:
        raise ValueError("no positive predicted goodput to bracket")
    return [float(f"{predicted_rps / (1 + tolerance):.4g}"), float(f"{predicted_rps / (1 - tolerance):.4g}")]


def bracket_verdict(rates: list[float], report: dict) -> dict:
    """Where the measured goodput lies relative to a bracket, from the bench's sweep points."""
    lo, hi = rates
    target = report.get("slo_attainment", 0.9)
    passed = {p["rate"]: p.get("attainment_joint") is not None and p["attainment_joint"] >= target
              for p in report.get("sweep", [])}
    if passed.get(lo) is False:
        return {"bracket_rps": rates, "within_tolerance": False, "measured_vs_prediction": "below"}
    if passed.get(hi) is True:
        return {"bracket_rps": rates, "within_tolerance": False, "measured_vs_prediction": "above"}
    inside = passed.get(lo) is True and passed.get(hi) is False
    return {"bracket_rps": rates, "within_tolerance": inside, "measured_vs_prediction": "within" if inside else "unknown"}


def _tail(log: Path, n: int = 2000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path, command: list[str]) -> None:
    """Poll `url` until it answers 200; raise ServerDidNotStart on exit or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # refused, 503 (HTTPError is an OSError) or timeout: not ready yet
            pass
        time.sleep(0.5)
    state = f"exited with {proc.returncode}" if proc.poll() is not None else f"no answer within {timeout_s:.0f} s"
    raise ServerDidNotStart(f"server did not come up ({state}): {' '.join(command)}\n{_tail(log)}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop the server and every process of its group (workers included), escalating to SIGKILL."""
    pgid = proc.pid  # start_new_session=True: the server leads its own group
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if not _group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is not None and not _group_alive(pgid):
                break
            time.sleep(0.1)
    if proc.poll() is None:
        proc.wait(timeout=5)


@contextlib.contextmanager
def serving(config: LocalConfig, model: str, startup_timeout_s: float = 300.0,
            keep_dir: Path | None = None, trace: bool = False) -> Iterator[tuple[str, Path, Path]]:
    """Start `pdserve serve` for `config` on a free port and yield (url, output dir, server log)
    once it is healthy; the whole process group is stopped on exit. With `trace`, the server
    writes its traces and engine step logs to <output dir>/trace."""
    port = free_local_port()
    with tempfile.TemporaryDirectory(prefix="pdserve-validate-") as tmp:
        out_dir = Path(tmp) if keep_dir is None else keep_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pdserve.cli", *config.serve_args(model, port),
                   *(["--trace-dir", str(out_dir / "trace")] if trace else [])]
        log = out_dir / "serve.log"
        with log.open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(f"{url}/health", proc, startup_timeout_s, log, command)
            yield url, out_dir, log
        finally:
            stop_group(proc)


def bench_ladder(url: str, ladder: list[float], bench_args: list[str], out_dir: Path, server_log: Path,
                 timeout_s: float = 1800.0, tag: str = "") -> dict:
    """`pdserve bench --sweep` over `ladder` against a running server; its JSON report plus
    `validate_ladder`. The report and log are written to `out_dir` as bench{tag}.json/.log."""
    report, bench_log = out_dir / f"bench{tag}.json", out_dir / f"bench{tag}.log"
    bench = [sys.executable, "-m", "pdserve.cli", "bench", "--endpoint", url,
             "--sweep", "--sweep-rates", ",".join(f"{r:g}" for r in ladder), "--json", str(report), "--quiet",
             *bench_args]
    with bench_log.open("w") as out:
        done = subprocess.run(bench, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout_s)
    if done.returncode != 0 or not report.exists():
        raise BenchFailed(f"bench exited with {done.returncode}: {' '.join(bench)}\n{_tail(bench_log)}"
                          f"\n--- server log ---\n{_tail(server_log)}")
    return {**json.loads(report.read_text()), "validate_ladder": ladder}


def measure(config: LocalConfig, model: str, bench_args: list[str], rates: list[float] | None = None,
            startup_timeout_s: float = 300.0, bench_timeout_s: float = 1800.0, keep_dir: Path | None = None,
            before_bench: BeforeBench | None = None) -> dict:
    """Start, benchmark (goodput sweep) and stop one configuration; returns the bench report.
    `before_bench(url)` runs once the server is ready and may name the ladder to use instead;
    with `keep_dir` the server log, bench log and bench JSON are kept there."""
    with serving(config, model, startup_timeout_s, keep_dir) as (url, out_dir, log):
        chosen = before_bench(url) if before_bench is not None else None
        ladder = chosen or rates or ladder_around(config.checked_rps)
        return bench_ladder(url, ladder, bench_args, out_dir, log, bench_timeout_s)
