"""The calibrator and live model `pdserve plan --validate-calibrate` builds from a plan result.

Contract: `plan_calibrator(result, num_requests, method, workload_args)` returns a
`SplitCalibrator` (validate_windows.py) for the plan's `fixed_model` (a `pdserve profile` fit):
`measure(config, url, salt, load)` runs the calibration through the live server ('load': a
Poisson replay of the plan's workload on the calibration seed, at `load` = (fraction, most
requests, around rps): the fraction of that rate, default calibrate.LOAD_FRACTION of the
configuration's prediction with LOAD_MAX_REQUESTS; 'burst': bursts of one request per worker,
whatever the load), and `fit(config, measured,
model)` fits the two factors against `model` (None: the plan's profile), re-simulating the
replay with the scaled model, and returns (details, the sample goodput of the configuration's
plan with the scaled model). Splitting the two lets the window check reshape the profile from the
served steps of the calibration's own window before the factors are fitted. `live_model`
returns the `LiveModel` the window check reads step logs against, predicting with the same
scaled-profile goodput.
"""

from __future__ import annotations

import dataclasses
import statistics

from pdserve.validate import calibrate
from pdserve.search.planner import bench_sample, burst_clocks, load_clocks, sample_goodput
from pdserve.latency.profiled import ProfiledLatency
from pdserve.validate.windows import LiveModel, SplitCalibrator


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What a calibration measured through the server, before any fit."""

    method: str
    records: tuple = ()  # load: the replay's per-request records
    count: int = 0
    rate: float = 0.0
    burst: calibrate.Calibration | None = None  # burst: medians against the plan profile's clocks
    burst_size: int = 0


def scaled_goodput(result, num_requests: int):
    """predict(config, prefill x, decode x, model=None): the sample goodput of the configuration's
    plan with `model` (default: the plan's profile) scaled by the two factors."""
    inputs = result.inputs
    plans = {"colocated": result.colocated, "disaggregated": result.disaggregated}

    def predict(config, prefill: float, decode: float, model: ProfiledLatency | None = None) -> float:
        scaled = calibrate.scaled(model or inputs.fixed_model, prefill, decode)
        return sample_goodput(dataclasses.replace(inputs, fixed_model=scaled), plans[config.name], num_requests).rate

    return predict


def live_model(result, num_requests: int) -> LiveModel:
    return LiveModel(result.inputs.fixed_model, scaled_goodput(result, num_requests))


def plan_calibrator(result, num_requests: int, method: str, workload_args: list[str]) -> SplitCalibrator:
    """The calibrator of `plan --validate-calibrate METHOD` (see the module contract)."""
    inputs = result.inputs
    if not isinstance(inputs.fixed_model, ProfiledLatency):
        raise SystemExit("pdserve plan: --validate-calibrate needs --latency-model with a `pdserve profile` fit")
    plans = {"colocated": result.colocated, "disaggregated": result.disaggregated}
    predict = scaled_goodput(result, num_requests)
    sample = bench_sample(inputs, num_requests)
    prompt = int(statistics.median(sample.prompt_tokens))
    output = int(statistics.median(sample.output_tokens))

    def on(model: ProfiledLatency | None):
        return dataclasses.replace(inputs, fixed_model=model or inputs.fixed_model)

    def measure(config, url: str, salt: int, load: tuple[float, int, float] | None = None) -> _Measured:
        if method == "load":
            fraction, most, around = load or (calibrate.LOAD_FRACTION, calibrate.LOAD_MAX_REQUESTS, config.checked_rps)
            count, rate = calibrate.load_plan(around, config.workers, fraction, most)
            records = calibrate.load_replay(url, workload_args, count, rate, calibrate.CALIBRATION_SEED,
                                            content_salt=salt)
            return _Measured("load", tuple(records), count, rate)
        burst = config.workers
        predicted = burst_clocks(inputs, plans[config.name], prompt, output, burst, calibrate.BURST_RATE)
        cal = calibrate.burst_requests(url, predicted, prompt, output, burst, content_salt=salt)
        return _Measured("burst", burst=cal, burst_size=burst)

    def fit(config, measured: _Measured, model: ProfiledLatency | None = None) -> tuple[dict, float]:
        plan_ = plans[config.name]
        if measured.method == "load":
            seed = calibrate.CALIBRATION_SEED

            def simulate_scaled(prefill: float, decode: float) -> list:
                scaled = calibrate.scaled(model or inputs.fixed_model, prefill, decode)
                return load_clocks(dataclasses.replace(inputs, fixed_model=scaled), plan_, measured.count,
                                   measured.rate, seed)

            cal, extra = calibrate.fit_load(list(measured.records), simulate_scaled, seed, measured.rate), {}
        else:
            ttft, tpot = burst_clocks(on(model), plan_, prompt, output, measured.burst_size, calibrate.BURST_RATE)
            cal = dataclasses.replace(measured.burst, predicted_ttft_s=ttft, predicted_tpot_s=tpot)
            extra = {"method": "burst", "burst": measured.burst_size}
        calibrate.check_plausible(cal)

        def goodput_at(scale: float) -> float:
            return predict(config, cal.prefill_factor * scale, cal.decode_factor * scale, model)

        predicted = goodput_at(1.0)
        elasticity = calibrate.goodput_elasticity(lambda scale: predicted if scale == 1.0 else goodput_at(scale))
        return {**cal.to_dict(), **extra, "goodput_elasticity": elasticity}, predicted

    return SplitCalibrator(measure, fit)
