"""`pdserve plan --validate`: run planned configurations on this machine and measure them.

Contract: for each configuration (the recommendation and the runner-up) start
`pdserve serve` as a subprocess on a free port, wait until GET /v1/models answers (or fail with
a clear error naming the command and its last output), run `pdserve bench --sweep --json`
against it, stop the server, and report predicted vs measured goodput. Only the local runtime
is supported (replicas, not TP/PP, are what `pdserve serve` varies here).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LocalConfig:
    """One deployment `pdserve serve` can start on this machine."""

    name: str
    mode: str  # "colocated" | "disaggregated"
    replicas: int = 1
    prefill: int = 1
    decode: int = 1
    predicted_goodput_rps: float = 0.0

    def serve_args(self, model: str, port: int) -> list[str]:
        shape = (["--replicas", str(self.replicas)] if self.mode == "colocated"
                 else ["--prefill", str(self.prefill), "--decode", str(self.decode)])
        return ["serve", "--mode", self.mode, *shape, "--model", model, "--port", str(port)]


class ServerDidNotStart(RuntimeError):
    """The server exited or never answered; the message carries its command and output tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        except OSError:
            time.sleep(0.5)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    state = f"exited with {proc.returncode}" if proc.poll() is not None else f"no answer within {timeout_s:.0f} s"
    raise ServerDidNotStart(f"server did not come up ({state}): {' '.join(command)}\n{tail}")


def measure(config: LocalConfig, model: str, bench_args: list[str], timeout_s: float = 300.0) -> dict:
    """Start, benchmark (goodput sweep) and stop one configuration; returns the bench report."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", *config.serve_args(model, port)]
    with tempfile.TemporaryDirectory() as tmp:
        log, report = Path(tmp) / "serve.log", Path(tmp) / "bench.json"
        with log.open("w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, timeout_s, log, command)
            bench = [sys.executable, "-m", "pdserve.cli", "bench", "--endpoint", f"http://127.0.0.1:{port}",
                     "--sweep", "--json", str(report), "--quiet", *bench_args]
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            return json.loads(report.read_text())
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def validate(configs: list[LocalConfig], model: str, bench_args: list[str]) -> list[dict]:
    """Predicted vs measured goodput for each configuration (errors reported per row)."""
    rows = []
    for config in configs:
        row = {"name": config.name, "mode": config.mode, "predicted_goodput_rps": config.predicted_goodput_rps}
        try:
            report = measure(config, model, bench_args)
            row["measured_goodput_rps"] = _goodput(report)
        except (ServerDidNotStart, subprocess.CalledProcessError, OSError, ValueError) as exc:
            row["error"] = str(exc)
        rows.append(row)
    return rows


def _goodput(report: dict) -> float | None:
    """The joint goodput from a bench JSON report (key names tolerated across versions)."""
    for key in ("request_goodput", "goodput_rps"):
        if key in report:
            return report[key]
    goodput = report.get("goodput", {})
    joint = goodput.get("joint") if isinstance(goodput, dict) else None
    return joint.get("rate") if isinstance(joint, dict) else joint
