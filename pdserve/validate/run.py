"""`pdserve plan --validate`'s driver: each planned configuration served, benchmarked and judged.

Contract: `validate` returns one row per configuration (predicted, simulated and measured
goodput, or the error that stopped it) and never raises for one configuration's failure. Plain
runs and single-calibration brackets go through `runtime.measure`; recalibrated brackets through
`points.recalibrated_row`; per-window checks through `windows.check_windows`. This module sits on
top of the three: `runtime` knows nothing of the others, and `points` and `windows` import only
`runtime` (one-way).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from pdserve.validate.points import recalibrated_row, stability
from pdserve.validate.runtime import (
    BenchFailed,
    Calibrator,
    LocalConfig,
    ServerDidNotStart,
    bracket,
    bracket_verdict,
    ladder_around,
    measure,
)
from pdserve.validate.windows import check_windows


def validate(configs: list[LocalConfig], model: str, bench_args: list[str], rates: list[float] | None = None,
             progress=lambda _msg: None, tolerance: float | None = None, calibrator: Calibrator | None = None,
             keep_dir: Path | None = None, recalibrate: bool = False, live=None, max_points: int = 4) -> list[dict]:
    """Predicted vs measured goodput for each configuration (errors reported per row). With a
    `tolerance`, each configuration is checked on its `bracket` instead of a sweep. With a
    `calibrator(config, url, round) -> (details, prediction)`, the prediction is re-made against
    the running server just before its benchmark and the bracket (or ladder) centred on it; with
    `recalibrate` as well, before each of the bracket's two points (validate_points.py); with a
    `live` model (validate_windows.LiveModel) too, each point is held to the prediction for its
    own window, read from the engine's step logs (validate_windows.py, up to `max_points`)."""
    if recalibrate and (tolerance is None or calibrator is None):
        raise ValueError("recalibrating before each point needs a tolerance and a calibrator")
    rows = []
    if tolerance is not None:
        bench_args = [*bench_args, "--max-bisections", "0"]  # the last one given wins
    for config in configs:
        row = {"name": config.name, "mode": config.mode, "layout": config.layout, "workers": config.workers,
               "predicted_goodput_rps": config.predicted_goodput_rps,
               "simulated_goodput_rps": config.simulated_goodput_rps,
               "sample_goodput_rps": config.sample_goodput_rps}
        progress(f"validate {config.name} ({config.layout}): serving {model}, predicted {config.checked_rps:.3g} rps")
        started = time.monotonic()

        def before_bench(url: str, config: LocalConfig = config, row: dict = row) -> list[float] | None:
            checked = config.checked_rps
            if calibrator is not None:
                details, checked = calibrator(config, url, 0)
                row["calibration"], row["calibrated_goodput_rps"] = details, checked
                progress(f"validate {config.name}: calibrated prediction {checked:.3g} rps")
            if tolerance is not None:
                return bracket(checked, tolerance)
            return None if calibrator is None or rates else ladder_around(checked)

        kept = None if keep_dir is None else keep_dir / config.name
        try:
            if recalibrate and live is not None:
                row.update(check_windows(config, model, bench_args, calibrator, live, tolerance, max_points,
                                         progress, kept))
            elif recalibrate:
                row.update(recalibrated_row(config, model, bench_args, calibrator, tolerance, progress, kept))
            else:
                report = measure(config, model, bench_args, rates, before_bench=before_bench, keep_dir=kept)
                row.update(_measured(report))
                if tolerance is not None:
                    row.update(bracket_verdict(report["validate_ladder"], report), tolerance=tolerance)
                    row.update(_stability_of(row, tolerance))
        except (ServerDidNotStart, BenchFailed, RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
            row["error"] = str(exc)
        row["wall_s"] = round(time.monotonic() - started, 1)
        progress(f"validate {config.name}: measured {row.get('measured_goodput_rps')} rps"
                 + (f" (error: {row['error'].splitlines()[0]})" if "error" in row else ""))
        rows.append(row)
    return rows


def _stability_of(row: dict, tolerance: float) -> dict:
    """For a single calibration: how steady the machine must be for the check (validate_points)."""
    if "calibration" not in row:
        return {}
    return stability([{"calibration": row["calibration"]}], tolerance)


def _measured(report: dict) -> dict:
    search = report.get("goodput_search") or {}
    joint = search.get("joint") or {}
    return {
        "measured_goodput_rps": _goodput(report),
        "measured_goodput_phase_rps": report.get("request_goodput_phase"),
        "measured_saturated": joint.get("saturated"),
        "ladder": search.get("ladder"),
        "sweep": [{k: p.get(k) for k in ("rate", "attainment_joint", "attainment_ttft", "attainment_tpot",
                                          "p99_ttft_ms", "p99_tpot_ms", "failed")} for p in report.get("sweep", [])],
    }


def _goodput(report: dict) -> float | None:
    """The joint goodput from a bench JSON report (`request_goodput`; older key names tolerated)."""
    for key in ("request_goodput", "goodput_rps"):
        if key in report:
            return report[key]
    goodput = report.get("goodput", {})
    joint = goodput.get("joint") if isinstance(goodput, dict) else None
    return joint.get("rate") if isinstance(joint, dict) else joint
