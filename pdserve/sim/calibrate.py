"""Calibrate a profiled latency model against the live runtime just before a validation run.

Why: on a shared CPU the engine's speed drifts by 10-20% over minutes, and a served engine also
shares its cores with the router/API process and the benchmark client; goodput near saturation
moves 2-2.5x as much as the step time does. A profile taken earlier, with the engine alone, is
therefore not what a measurement minutes later sees. Calibration measures what it does see.

Contract: `burst_requests` replays a few bursts of as many requests as the deployment has worker
processes (arriving 1 ms apart, one burst after the other) through the server that is about to be
benchmarked, with `pdserve bench`; `Calibration` compares their median TTFT and TPOT with the
medians the simulator gives for the same burst on the same deployment (`planner.burst_clocks`)
and yields one factor per phase; `check_plausible` refuses factors no drift explains. `scaled`
returns the profiled model with its prefill terms (and the colocated mixed step, which is costed
from them) times the prefill factor and its decode terms times the decode factor. The factors
are reported next to the calibrated prediction, so a reader can see how far the profile had
drifted.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.sim.profiled import ProfiledLatency


@dataclass(frozen=True)
class Calibration:
    """Median clocks of calibration requests through the server vs the prediction for the same requests."""

    prompt_tokens: int
    output_tokens: int
    measured_ttft_s: float
    measured_tpot_s: float
    predicted_ttft_s: float
    predicted_tpot_s: float

    @property
    def prefill_factor(self) -> float:
        return self.measured_ttft_s / self.predicted_ttft_s

    @property
    def decode_factor(self) -> float:
        return self.measured_tpot_s / self.predicted_tpot_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "prefill_factor": self.prefill_factor, "decode_factor": self.decode_factor}


PLAUSIBLE_FACTORS = (0.25, 4.0)  # outside: the calibration measured something else than the profile


def check_plausible(cal: Calibration) -> None:
    """Refuse factors no drift explains (a prompt answered from the prefix cache, a stalled server)."""
    lo, hi = PLAUSIBLE_FACTORS
    for name, factor in (("prefill", cal.prefill_factor), ("decode", cal.decode_factor)):
        if not lo <= factor <= hi:
            raise RuntimeError(f"calibration {name} factor {factor:.3g} is outside [{lo}, {hi}]: measured "
                               f"{cal.measured_ttft_s:.3g} s TTFT / {cal.measured_tpot_s:.3g} s TPOT against predicted "
                               f"{cal.predicted_ttft_s:.3g} s / {cal.predicted_tpot_s:.3g} s")


def scaled(model: ProfiledLatency, prefill_factor: float, decode_factor: float) -> ProfiledLatency:
    """The profile with every prefill term x prefill_factor and every decode term x decode_factor."""
    if prefill_factor <= 0 or decode_factor <= 0:
        raise ValueError("calibration factors must be positive")
    return dataclasses.replace(
        model,
        prefill_coef=tuple(c * prefill_factor for c in model.prefill_coef),
        decode_coef=tuple(c * decode_factor for c in model.decode_coef),
        decode_batch_base=tuple((b, t * decode_factor) for b, t in model.decode_batch_base),
        decode_context_s=model.decode_context_s * decode_factor,
    )


def burst_requests(url: str, predicted: tuple[float, float], prompt_tokens: int, output_tokens: int, burst: int,
                   repeats: int = 3, timeout_s: float = 900.0) -> Calibration:
    """Replay `repeats` bursts of `burst` requests (1 ms apart, one burst after the other) through
    the server and compare the median clocks with `predicted` = (TTFT s, TPOT s), the medians the
    simulator gives for one such burst on the deployment. A burst as large as the deployment's
    worker count keeps every worker busy at once, as load does, so the factors include the CPU
    the router, API process and client take from busy workers, which an isolated request (with an
    idle core to spare) does not see."""
    ttfts, tpots = [], []
    for k in range(repeats):  # a seed per burst: a repeated prompt would be answered from the prefix cache
        measured = _bench(url, prompt_tokens, output_tokens, burst, BURST_RATE, timeout_s, CALIBRATION_SEED + 1 + k)
        ttfts.append(measured["p50_ttft_ms"] / 1e3)
        tpots.append(measured["p50_tpot_ms"] / 1e3)
    return Calibration(prompt_tokens, output_tokens, statistics.median(ttfts), statistics.median(tpots), *predicted)


BURST_RATE = 1000.0  # req/s: the requests of one burst arrive 1 ms apart
CALIBRATION_SEED = 7_919_000  # prompt content of its own, never a benchmark's (prefix-cache hits)


def _bench(url: str, prompt_tokens: int, output_tokens: int, num_requests: int, rate: float, timeout_s: float,
           seed: int) -> dict:
    """`pdserve bench` at constant arrivals with objectives nobody misses; its JSON report."""
    with tempfile.TemporaryDirectory(prefix="pdserve-calibrate-") as tmp:
        report = Path(tmp) / "calibrate.json"
        command = [sys.executable, "-m", "pdserve.cli", "bench", "--endpoint", url, "--num-requests", str(num_requests),
                   "--rate", f"{rate:.6g}", "--arrival", "constant", "--input-len", str(prompt_tokens),
                   "--output-len", str(output_tokens), "--prompt-format", "ids", "--slo-ttft-ms", "1e9",
                   "--slo-tpot-ms", "1e9", "--seed", str(seed), "--json", str(report), "--quiet"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"calibration bench exited with {done.returncode}: {' '.join(command)}\n"
                               f"{(done.stdout + done.stderr)[-2000:]}")
        measured = json.loads(report.read_text())
    if measured.get("completed") != num_requests:
        raise RuntimeError(f"calibration: {measured.get('completed')} of {num_requests} requests completed")
    return measured
