"""pdserve's planner against aiconfigurator over a grid of cases (issue 40): per-GPU goodput and verdicts.

    python scripts/aic_sweep.py [--jobs N] [--cases NAME,...] [--aic-cache FILE] \
        [--csv docs/figures/aic_sweep.csv] [--plot docs/figures/aic_sweep.svg]

Each case runs `aiconfigurator cli default` (its Python API, `cli_default`) and `pdserve plan
--latency-model aic:SYSTEM --margin 0 --json` on the same model, GPUs, ISL/OSL and SLOs, and
prints both systems' aggregated/colocated and disaggregated req/s per GPU (aiconfigurator: its
best configuration's tokens/s per GPU of the cluster over OSL), the ratio of each pdserve figure to
aiconfigurator's, each system's disagg/colocated ratio and verdict, and the tie rule's reading
(`pdserve.search.decision.tie_reading`). aiconfigurator's answers depend on its database only, so
`--aic-cache` keeps them in a JSON file and reruns only pdserve. The CSV has one row per case,
with each phase per instance on both sides and pdserve's disaggregated plan re-counted (each phase
held to its capacity; then also under aiconfigurator's rate-matching factors) to attribute its
error (docs/planner_agreement.md, the term table); the plot (matplotlib's SVG when it is
installed, else an SVG written here) has one point per case and mode, pdserve against
aiconfigurator, on log axes with the 1:1 and +-20% lines.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import logging
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.search.decision import TIE_BAND, tie_reading

MODELS = {"L8": "meta-llama/Meta-Llama-3.1-8B", "Q8": "Qwen/Qwen3-8B", "Q32": "Qwen/Qwen3-32B",
          "L70": "meta-llama/Meta-Llama-3.1-70B"}
GPUS = {"L8": (8,), "Q8": (8,), "Q32": (8, 16), "L70": (16, 32)}
SYSTEMS = ("h100_sxm", "h200_sxm")
# (name, ISL, OSL, TTFT ms, TPOT ms): chat to long context, each with a tight and a loose SLO
WORKLOADS = (("chat-tight", 500, 200, 300, 15), ("chat-loose", 500, 200, 1000, 40),
             ("mid-tight", 2000, 500, 800, 20), ("mid-loose", 2000, 500, 2000, 40),
             ("long-tight", 8000, 300, 2000, 30), ("long-loose", 8000, 300, 5000, 60))
WITHIN = 0.2
# aiconfigurator's disaggregated corrections (aiconfigurator/sdk/task_v2.py, picking.py; "calibrated against
# silicon", "empirical"): prefill and decode latencies x1.1 and x1.08 (the decode batch is the largest whose
# corrected step meets TPOT), then prefill throughput x0.9 and decode x0.92; its aggregated mode applies none
AIC_PREFILL_LATENCY, AIC_DECODE_LATENCY = 1.1, 1.08
AIC_PREFILL_MATCH, AIC_DECODE_MATCH = 0.9, 0.92


@dataclass(frozen=True)
class Case:
    model: str  # a MODELS key
    system: str
    gpus: int
    workload: str
    isl: int
    osl: int
    ttft_ms: float
    tpot_ms: float

    @property
    def name(self) -> str:
        return f"{self.model}-{self.system.split('_')[0]}-{self.gpus}g-{self.workload}"


def grid() -> list[Case]:
    """32 cases: each model x system takes four of the six workloads (rotating), each model its GPU counts in turn."""
    out = []
    for i, (model, system) in enumerate((m, s) for m in MODELS for s in SYSTEMS):
        for k in range(4):
            name, isl, osl, ttft, tpot = WORKLOADS[(i + k) % len(WORKLOADS)]
            gpus = GPUS[model][k % len(GPUS[model])]
            out.append(Case(model, system, gpus, name, isl, osl, ttft, tpot))
    return out


def run_aic(case: Case) -> dict:
    """aiconfigurator's best agg and disagg req/s per GPU (None: no configuration meets the SLOs)."""
    from aiconfigurator.cli.api import cli_default

    logging.disable(logging.WARNING)
    result = cli_default(MODELS[case.model], case.gpus, case.system, isl=case.isl, osl=case.osl,
                         ttft=case.ttft_ms, tpot=case.tpot_ms)
    out = {}
    for mode in ("agg", "disagg"):
        df = result.best_configs.get(mode)
        top = None if df is None or len(df) == 0 else df.iloc[0]
        out[mode] = None if top is None else float(top["tokens/s/gpu_cluster"]) / case.osl
        out[f"{mode}_config"] = None if top is None else _aic_label(mode, top)
        if mode == "disagg":  # per worker, its latency corrections applied, before rate matching's 0.9 / 0.92
            out["prefill_worker_rps"] = None if top is None else float(top["(p)seq/s/worker"])
            out["decode_worker_rps"] = None if top is None else float(top["(d)seq/s/worker"])
    return out


def _aic_label(mode: str, top) -> str:
    if mode == "agg":
        return f"tp{top['tp']}pp{top['pp']} bs{top['bs']}"
    return (f"{top['(p)workers']}P tp{top['(p)tp']}pp{top['(p)pp']} + {top['(d)workers']}D "
            f"tp{top['(d)tp']}pp{top['(d)pp']} bs{top['(d)bs']}")


def run_pdserve(case: Case, extra: tuple[str, ...] = ()) -> dict:
    """`pdserve plan --latency-model aic:SYSTEM --margin 0 --json`, in this process; with the
    disaggregated plan's per-instance goodput of each phase beside its analytic capacity."""
    from pdserve.cli import main

    argv = ["plan", "--model", MODELS[case.model], "--latency-model", f"aic:{case.system}", "--gpus", str(case.gpus),
            "--input-len", str(case.isl), "--output-len", str(case.osl), "--slo-ttft-ms", str(case.ttft_ms),
            "--slo-tpot-ms", str(case.tpot_ms), "--margin", "0", *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--json", "--quiet"])
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    colo, dis = summary.get("colocated") or {}, summary.get("disaggregated") or {}
    counted = summary["verdict_per_gpu"]  # per GPU of the budget, as aiconfigurator's cluster figure
    return {"colo": counted.get("colocated", {}).get("goodput_per_gpu"),
            "disagg": counted.get("disaggregated", {}).get("goodput_per_gpu"),
            "colo_config": _pd_label(colo, "colocated"), "disagg_config": _pd_label(dis, "disaggregated"),
            "decision": summary["decision"], "tie": summary.get("tie_terms"), **_phases(argv, dis)}


def _phases(argv: list[str], dis: dict) -> dict:
    """Each phase of the disaggregated plan: its score per instance (simulated, held to its
    sustained rate), its capacity (`candidates.prefill_bound`: one prompt per stage interval;
    `decode_bound`: the best rate of a batch meeting TPOT, the K/V and --max-seqs), and that capacity
    under aiconfigurator's latency corrections (the step x1.08 or x1.1, so the TPOT batch shrinks
    too), for the attribution."""
    import dataclasses

    from pdserve.cli import build_parser
    from pdserve.commands.plan import plan_inputs
    from pdserve.search.candidates import Parallel, WorkloadShape, decode_bound, latency_for, prefill_bound, tpot_batch
    from pdserve.sim.requests import build_requests

    if not dis:
        return {}
    inputs = plan_inputs(build_parser().parse_args(argv))
    shape = WorkloadShape.of(build_requests(inputs.workload, inputs.prefix_cache, inputs.model.max_context))
    out = {"n_prefill": dis["prefill"]["replicas"], "n_decode": dis["decode"]["replicas"]}
    for phase in ("prefill", "decode"):
        par = Parallel(dis[phase]["tp"], dis[phase]["pp"])
        model = latency_for(inputs.model, inputs.hardware, par, inputs.family)
        if phase == "prefill":
            cap = prefill_bound(model, shape, inputs.slo)[0]
            slower = dataclasses.replace(inputs.slo, ttft_s=inputs.slo.ttft_s / AIC_PREFILL_LATENCY)
            corrected = prefill_bound(model, shape, slower)[0] / AIC_PREFILL_LATENCY
        else:
            cap = decode_bound(model, shape, inputs.slo, inputs.max_seqs)
            out["decode_tpot_batch"] = tpot_batch(model, shape, inputs.slo, inputs.max_seqs)
            slower = dataclasses.replace(inputs.slo, tpot_s=inputs.slo.tpot_s / AIC_DECODE_LATENCY)
            corrected = decode_bound(model, shape, slower, inputs.max_seqs) / AIC_DECODE_LATENCY
        out[f"{phase}_rps"], out[f"{phase}_capacity_rps"] = dis[phase]["goodput_per_replica_rps"], cap
        out[f"{phase}_aic_latency_rps"] = corrected
    return out


def _pd_label(plan: dict, kind: str) -> str | None:
    if not plan:
        return None
    if kind == "colocated":
        c = plan["config"]
        return f"{c['replicas']}x tp{c['tp']}pp{c['pp']} c{c['chunk_tokens']}"
    p, d = plan["prefill"], plan["decode"]
    return f"{p['replicas']}P tp{p['tp']}pp{p['pp']} + {d['replicas']}D tp{d['tp']}pp{d['pp']}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def row(case: Case, aic: dict, pd: dict) -> dict:
    """One CSV row: both systems' figures, pdserve/aic per mode, each system's disagg/colocated ratio."""
    aic_ratio, pd_ratio = _ratio(aic["disagg"], aic["agg"]), _ratio(pd["disagg"], pd["colo"])
    return {**asdict(case), "case": case.name,
            "aic_agg": aic["agg"], "aic_disagg": aic["disagg"], "aic_ratio": aic_ratio,
            "aic_verdict": None if aic_ratio is None else ("disagg" if aic_ratio > 1 else "agg"),
            "pd_colo": pd["colo"], "pd_disagg": pd["disagg"], "pd_ratio": pd_ratio,
            "pd_verdict": "disagg" if pd["decision"] == "disaggregate" else "agg",
            "colo_vs_aic": _ratio(pd["colo"], aic["agg"]), "disagg_vs_aic": _ratio(pd["disagg"], aic["disagg"]),
            "reading": tie_reading(aic_ratio, pd_ratio),
            # per instance / worker: aiconfigurator's (corrected latencies) and pdserve's (simulated, and its capacity)
            "aic_prefill_worker": aic.get("prefill_worker_rps"), "aic_decode_worker": aic.get("decode_worker_rps"),
            "pd_prefill_instance": pd.get("prefill_rps"), "pd_prefill_capacity": pd.get("prefill_capacity_rps"),
            "pd_decode_instance": pd.get("decode_rps"), "pd_decode_capacity": pd.get("decode_capacity_rps"),
            "pd_decode_tpot_batch": pd.get("decode_tpot_batch"),
            "pd_prefill_aic_latency": pd.get("prefill_aic_latency_rps"),
            "pd_decode_aic_latency": pd.get("decode_aic_latency_rps"),
            **_attribution(case, aic, pd),
            "aic_agg_config": aic["agg_config"], "aic_disagg_config": aic["disagg_config"],
            "pd_colo_config": pd["colo_config"], "pd_disagg_config": pd["disagg_config"]}


def _attribution(case: Case, aic: dict, pd: dict) -> dict:
    """pdserve's disaggregated plan re-counted, not re-planned, to attribute its error: each phase held to
    its capacity (`at_capacity`), then at its capacity under aiconfigurator's four factors (`aic_factors`:
    the latency corrections, which also shrink the TPOT batch, and the rate-matching throughputs): each over
    aiconfigurator's disaggregated figure (per GPU of the budget), and the tie rule's reading of the two
    systems' disagg/colocated ratios with it in place of pdserve's."""
    if pd.get("decode_capacity_rps") is None or not aic.get("disagg"):
        return {f"{k}_{v}": None for k in ("at_capacity", "aic_factors") for v in ("vs_aic", "reading")}
    pre = pd["n_prefill"] * min(pd["prefill_rps"], pd["prefill_capacity_rps"])
    dec = pd["n_decode"] * min(pd["decode_rps"], pd["decode_capacity_rps"])
    corrected = {phase: pd.get(f"{phase}_aic_latency_rps") or pd[f"{phase}_capacity_rps"] / latency
                 for phase, latency in (("prefill", AIC_PREFILL_LATENCY), ("decode", AIC_DECODE_LATENCY))}
    factors = min(pd["n_prefill"] * corrected["prefill"] * AIC_PREFILL_MATCH,
                  pd["n_decode"] * corrected["decode"] * AIC_DECODE_MATCH)
    out = {}
    for key, rps in (("at_capacity", min(pre, dec)), ("aic_factors", factors)):
        out[f"{key}_vs_aic"] = rps / case.gpus / aic["disagg"]
        out[f"{key}_reading"] = tie_reading(_ratio(aic["disagg"], aic["agg"]), _ratio(rps / case.gpus, pd["colo"]))
    return out


def summarize(rows: list[dict]) -> dict:
    """The issue's figures: share within 20% and median signed error per mode; verdicts where aic's margin > 10%."""
    out = {}
    for mode in ("colo", "disagg"):
        errs = [r[f"{mode}_vs_aic"] - 1 for r in rows if r[f"{mode}_vs_aic"] is not None]
        out[mode] = {"cases": len(errs), "within_20pct": sum(abs(e) <= WITHIN for e in errs),
                     "median_signed_error": statistics.median(errs) if errs else None}
    clear = [r for r in rows if r["aic_ratio"] is not None and abs(r["aic_ratio"] - 1) > 0.1]
    out["verdict_agree_where_aic_margin_over_10pct"] = (sum(r["aic_verdict"] == r["pd_verdict"] for r in clear), len(clear))
    out["readings"] = {k: sum(r["reading"] == k for r in rows) for k in sorted({r["reading"] for r in rows})}
    over = [r for r in rows if r.get("pd_decode_capacity") and r["pd_decode_instance"] > 1.05 * r["pd_decode_capacity"]]
    out["pd_decode_above_capacity_by_5pct"] = [r["case"] for r in over]
    for key in ("at_capacity_vs_aic", "aic_factors_vs_aic"):  # the disaggregated error with each term taken out
        errs = [r[key] - 1 for r in rows if r.get(key) is not None]
        out[f"disagg_{key}"] = {"cases": len(errs), "within_20pct": sum(abs(e) <= WITHIN for e in errs),
                                "median_signed_error": statistics.median(errs) if errs else None}
        term = key.removesuffix("_vs_aic")
        out[f"readings_{term}"] = {k: sum(r.get(f"{term}_reading") == k for r in rows) for k in ("agree", "tie", "disagree")}
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def print_row(r: dict) -> None:
    print(f"{r['case']:<28} aic agg {_fmt(r['aic_agg']):>6} dis {_fmt(r['aic_disagg']):>6} ({_fmt(r['aic_ratio'])}x "
          f"{r['aic_verdict']}) | pdserve colo {_fmt(r['pd_colo']):>6} ({_fmt(r['colo_vs_aic'])}) dis "
          f"{_fmt(r['pd_disagg']):>6} ({_fmt(r['disagg_vs_aic'])}) ({_fmt(r['pd_ratio'])}x {r['pd_verdict']}) "
          f"| {r['reading']}", flush=True)


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_plot(rows: list[dict], path: Path) -> None:
    """pdserve vs aiconfigurator req/s per GPU, one point per case and mode (log axes, 1:1 and +-20%)."""
    points = [(r["aic_agg"], r["pd_colo"], "colocated") for r in rows if r["aic_agg"] and r["pd_colo"]]
    points += [(r["aic_disagg"], r["pd_disagg"], "disaggregated") for r in rows if r["aic_disagg"] and r["pd_disagg"]]
    if not points:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib
    except ImportError:
        path.write_text(_svg(points))
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo = min(min(a, p) for a, p, _ in points) / 1.5
    hi = max(max(a, p) for a, p, _ in points) * 1.5
    fig, ax = plt.subplots(figsize=(6, 6))
    for kind, marker in (("colocated", "o"), ("disaggregated", "^")):
        xs = [a for a, _, k in points if k == kind]
        ax.scatter(xs, [p for _, p, k in points if k == kind], marker=marker, label=kind, alpha=0.8)
    for factor, style in ((1, "-"), (1 + WITHIN, ":"), (1 - WITHIN, ":")):
        ax.plot([lo, hi], [lo * factor, hi * factor], style, color="grey", linewidth=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="aiconfigurator req/s per GPU",
           ylabel="pdserve (aic: latency model) req/s per GPU", title="per-GPU goodput, one point per case and mode")
    ax.legend()
    fig.savefig(path, format=path.suffix.lstrip(".") or "svg")
    plt.close(fig)


def _svg(points: list[tuple[float, float, str]], size: int = 480, pad: int = 50) -> str:
    lo = math.log10(min(min(a, p) for a, p, _ in points) / 1.5)
    hi = math.log10(max(max(a, p) for a, p, _ in points) * 1.5)
    at = lambda v: pad + (math.log10(v) - lo) / (hi - lo) * (size - 2 * pad)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}">',
             f'<line x1="{pad}" y1="{size - pad}" x2="{size - pad}" y2="{pad}" stroke="grey"/>']
    for a, p, kind in points:
        colour = "#1f77b4" if kind == "colocated" else "#ff7f0e"
        parts.append(f'<circle cx="{at(a):.1f}" cy="{size - at(p):.1f}" r="4" fill="{colour}"/>')
    parts.append(f'<text x="{pad}" y="{size - 10}">aiconfigurator req/s/GPU (x) vs pdserve (y), log axes</text></svg>')
    return "\n".join(parts)


def _both(case: Case, aic: dict | None, extra: tuple[str, ...]) -> tuple[Case, dict, dict]:
    return case, aic if aic is not None else run_aic(case), run_pdserve(case, extra)


def sweep(cases: list[Case], aic_cache: Path | None = None, jobs: int = 1, extra: tuple[str, ...] = ()) -> list[dict]:
    """Run every case (aiconfigurator from the cache when there), printing each row as it lands."""
    cached = json.loads(aic_cache.read_text()) if aic_cache and aic_cache.exists() else {}
    rows = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for case, aic, pd in pool.map(_both, cases, [cached.get(c.name) for c in cases], [extra] * len(cases)):
            cached[case.name] = aic
            rows.append(row(case, aic, pd))
            print_row(rows[-1])
            if aic_cache:
                aic_cache.write_text(json.dumps(cached, indent=1, sort_keys=True))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: the whole grid)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--aic-cache", type=Path, default=Path("docs/figures/aic_sweep_aic.json"))
    parser.add_argument("--csv", type=Path, default=Path("docs/figures/aic_sweep.csv"))
    parser.add_argument("--plot", type=Path, default=Path("docs/figures/aic_sweep.svg"))
    args = parser.parse_args()
    cases = grid()
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    rows = sweep(cases, args.aic_cache, args.jobs)
    write_csv(rows, args.csv)
    write_plot(rows, args.plot)
    print(json.dumps(summarize(rows), indent=1), f"tie band +-{TIE_BAND:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
