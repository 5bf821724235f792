"""Calibrate a profiled latency model against the live runtime just before a validation run.

Why: on a shared CPU the engine's speed drifts by 10-20% over minutes, and a served engine also
shares its cores with the router/API process and the benchmark client; goodput near saturation
moves 2-2.5x as much as the step time does. A profile taken earlier, with the engine alone, is
therefore not what a measurement minutes later sees. Calibration measures what it does see.

Two methods, both through the server that is about to be benchmarked:

Contract (load): `load_replay` replays a short Poisson workload of the plan's own length
distribution on another seed (other lengths, arrivals and prompt content, so no prefix-cache
hits) at about half the deployment's predicted goodput, and compares each request's TTFT and
TPOT with the simulator's clocks for the very same requests and arrivals on the same deployment;
`fit_load` finds the factors with which the scaled simulation matches the
measured clocks request by request (median ratio 1, by bisection; re-simulated, so queueing
scales as it does on the server). Requests overlap, batch and queue as they will in
the benchmark, so the factors carry the CPU the router/API process and the client take under
load, and a request-by-request comparison cancels the workload's own variance.

Contract (burst): `burst_requests` replays a few bursts of as many requests as the deployment has worker
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
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.records import RequestRecord
from pdserve.latency.profiled import ProfiledLatency


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


@dataclass(frozen=True)
class LoadCalibration:
    """Per-request clocks of a Poisson replay through the server against the simulator's clocks
    for the same requests and arrivals: the factors that make the scaled simulation match (the
    median per-request ratio crosses 1, see `fit_load`)."""

    requests: int
    rate_rps: float
    seed: int
    prefill_factor: float
    decode_factor: float
    measured_ttft_s: float  # medians, for the report
    measured_tpot_s: float
    predicted_ttft_s: float  # medians of the simulation with the fitted factors
    predicted_tpot_s: float

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "method": "load"}


BURST_RATE = 1000.0  # req/s: the requests of one burst arrive 1 ms apart
CALIBRATION_SEED = 7_919_000  # prompt content of its own, never a benchmark's (prefix-cache hits)
PLAUSIBLE_FACTORS = (0.25, 4.0)  # outside: the calibration measured something else than the profile


def check_plausible(cal: Calibration | LoadCalibration) -> None:
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
                   repeats: int = 3, timeout_s: float = 900.0, content_salt: int = 0) -> Calibration:
    """Replay `repeats` bursts of `burst` requests (1 ms apart, one burst after the other) through
    the server and compare the median clocks with `predicted` = (TTFT s, TPOT s), the medians the
    simulator gives for one such burst on the deployment. A burst as large as the deployment's
    worker count keeps every worker busy at once, as load does, so the factors include the CPU
    the router, API process and client take from busy workers, which an isolated request (with an
    idle core to spare) does not see. A later calibration of the same server passes its own
    `content_salt`, so its prompts are not answered from this one's prefix cache."""
    ttfts, tpots = [], []
    for k in range(repeats):  # a seed per burst: a repeated prompt would be answered from the prefix cache
        lengths = ["--input-len", str(prompt_tokens), "--output-len", str(output_tokens), "--arrival", "constant"]
        measured = _bench(url, lengths, burst, BURST_RATE, timeout_s, CALIBRATION_SEED + 1 + k, content_salt=content_salt)
        ttfts.append(measured["p50_ttft_ms"] / 1e3)
        tpots.append(measured["p50_tpot_ms"] / 1e3)
    return Calibration(prompt_tokens, output_tokens, statistics.median(ttfts), statistics.median(tpots), *predicted)


LOAD_FRACTION = 0.5  # of the uncalibrated prediction: overlap and batching as under load, no saturation
LOAD_MAX_SPAN_S = 300.0  # arrivals span at most this long (a faster rate for slow deployments)
LOAD_MAX_REQUESTS = 12


def load_plan(predicted_rps: float, workers: int, fraction: float = LOAD_FRACTION,
              most: int = LOAD_MAX_REQUESTS) -> tuple[int, float]:
    """(requests, rate) of a load calibration: `fraction` of the prediction, 2 per worker to
    `most` requests, arrivals spanning at most LOAD_MAX_SPAN_S."""
    if predicted_rps <= 0:
        raise ValueError("a load calibration needs a positive predicted goodput")
    if not 0 < fraction <= 1 or most < 1:
        raise ValueError(f"a load calibration needs a fraction in (0, 1] and >= 1 request, got {fraction}, {most}")
    rate = fraction * predicted_rps
    count = max(2 * workers, min(most, round(rate * LOAD_MAX_SPAN_S)))
    return count, max(rate, count / LOAD_MAX_SPAN_S)


def load_replay(url: str, workload_args: list[str], num_requests: int, rate: float, seed: int = CALIBRATION_SEED,
                timeout_s: float = 1800.0, content_salt: int = 0) -> list[dict]:
    """Replay `num_requests` of the workload (`workload_args`: the bench's length/arrival flags)
    with `seed` at `rate` through the server; the benchmark's per-request records. `content_salt`
    changes the prompts only (lengths and arrivals, hence the simulator's clocks, stay the same)."""
    return _bench(url, workload_args, num_requests, rate, timeout_s, seed, records=True,
                  content_salt=content_salt)["records"]


def ratios(measured: list[dict], simulated: list[RequestRecord]) -> tuple[float, float, tuple[float, ...]]:
    """(median measured/simulated TTFT, median measured/simulated TPOT, (median measured TTFT,
    TPOT, simulated TTFT, TPOT)) over the requests that succeeded in both, paired by request id."""
    by_id = {r.request_id: r for r in simulated}
    ttft, tpot, clocks = [], [], ([], [], [], [])
    for row in measured:
        sim = by_id.get(row["request_id"])
        if sim is None or not row["success"] or not sim.success or not row["ttft_s"] or not sim.ttft_s:
            continue
        ttft.append(row["ttft_s"] / sim.ttft_s)
        clocks[0].append(row["ttft_s"])
        clocks[2].append(sim.ttft_s)
        if row.get("tpot_s") and sim.tpot_s:
            tpot.append(row["tpot_s"] / sim.tpot_s)
            clocks[1].append(row["tpot_s"])
            clocks[3].append(sim.tpot_s)
    if not ttft or not tpot:
        raise RuntimeError(f"load calibration: no request to compare ({len(measured)} records)")
    med = statistics.median
    return med(ttft), med(tpot), tuple(med(c) for c in clocks)


LOAD_FIT_ROUNDS = 3  # alternate prefill and decode; each affects the other's clock a little
LOAD_FIT_STEPS = 24  # bisection steps per factor, in log space over PLAUSIBLE_FACTORS


def fit_load(measured: list[dict], simulate_scaled: Callable[[float, float], list[RequestRecord]], seed: int,
             rate: float) -> LoadCalibration:
    """The factors with which the simulator's clocks for the replayed requests match the measured
    ones request by request: each factor is where the median measured/simulated ratio of its
    clock crosses 1, found by bisection (the ratio falls as the factor grows), re-simulating with
    the scaled profile at every step. Re-simulating matters under load: a 20% slower prefill can
    double a queued request's TTFT, so one ratio of TTFTs would overstate the factor. A factor
    outside PLAUSIBLE_FACTORS stops at the bound (check_plausible then refuses it)."""
    factors = [1.0, 1.0]  # prefill, decode
    for _ in range(LOAD_FIT_ROUNDS):
        for which in (0, 1):
            def ratio(f: float, which=which) -> float:
                trial = list(factors)
                trial[which] = f
                return ratios(measured, simulate_scaled(*trial))[which]
            factors[which] = _crossing(ratio)
    _, _, clocks = ratios(measured, simulate_scaled(*factors))
    return LoadCalibration(len(measured), rate, seed, factors[0], factors[1], *clocks)


def _crossing(ratio: Callable[[float], float]) -> float:
    """The factor where a non-increasing `ratio(factor)` crosses 1, within PLAUSIBLE_FACTORS."""
    lo, hi = (math.log(f) for f in PLAUSIBLE_FACTORS)
    if ratio(math.exp(lo)) <= 1.0:
        return math.exp(lo)
    if ratio(math.exp(hi)) >= 1.0:
        return math.exp(hi)
    for _ in range(LOAD_FIT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(math.exp(mid)) > 1.0 else (lo, mid)
    return math.exp((lo + hi) / 2)


def _bench(url: str, workload_args: list[str], num_requests: int, rate: float, timeout_s: float, seed: int,
           records: bool = False, content_salt: int = 0) -> dict:
    """`pdserve bench` of `workload_args` (lengths, arrivals) with objectives nobody misses; its
    JSON report (with per-request records when asked)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-calibrate-") as tmp:
        report = Path(tmp) / "calibrate.json"
        command = [sys.executable, "-m", "pdserve.cli", "bench", "--endpoint", url, "--num-requests", str(num_requests),
                   "--rate", f"{rate:.6g}", *workload_args, "--prompt-format", "ids", "--slo-ttft-ms", "1e9",
                   "--slo-tpot-ms", "1e9", "--seed", str(seed), "--json", str(report), "--quiet"]
        command += ["--include-records"] if records else []
        command += ["--content-salt", str(content_salt)] if content_salt else []
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"calibration bench exited with {done.returncode}: {' '.join(command)}\n"
                               f"{(done.stdout + done.stderr)[-2000:]}")
        measured = json.loads(report.read_text())
    if measured.get("completed") != num_requests:
        raise RuntimeError(f"calibration: {measured.get('completed')} of {num_requests} requests completed")
    return measured


ELASTICITY_STEP = 1.10  # both phases 10% slower: well above the goodput search's 1% resolution


def goodput_elasticity(goodput_at: Callable[[float], float], step: float = ELASTICITY_STEP) -> float | None:
    """How many times as much as the engine's speed the goodput moves: d ln(goodput) / d ln(time
    per step), estimated by slowing both phases by `step` (`goodput_at(scale)` is the simulated
    goodput with every calibrated factor times `scale`). Near saturation it is 2-4, so a +-T
    check needs the machine's speed steady to about T / elasticity. None when a goodput is 0."""
    base, slower = goodput_at(1.0), goodput_at(step)
    if base <= 0 or slower <= 0:
        return None
    return math.log(base / slower) / math.log(step)

