"""Presenting a plan: the JSON summary, a readable table, and the goodput-vs-rate plot.

Contract: `plan_summary` is the one JSON shape `pdserve plan --json` prints (decision,
decided_by and its reason, colocated, disaggregated, net_margin, search statistics); `plan_table`
renders the same facts for a terminal, the deciding test on the line under the decision, and
the disaggregated plan's routing (`pd_decision`; under "margin" the share of its requests kept on
their decode worker at its simulated goodput, `pd_local_share`), and, where the end-to-end run
passed above the rate the deployment sustains, both figures (`planner.EndToEnd`); `plot_plan`
draws joint attainment vs offered rate for the top candidates of each kind with the attainment
target and each curve's goodput marked. A verdict whose disaggregated/colocated ratio lies within
`decision.TIE_BAND` of 1 is reported as a tie (`tie_terms`: the terms that decide it, each with its
figure), not as a confident verdict.
"""

from __future__ import annotations

import math

from pdserve.search.decision import TIE_BAND, is_tie
from pdserve.search.phase_search import Score
from pdserve.search.planner import PlanResult, counted_gpus
from pdserve.search.plans import ColocatedPlan, DisaggPlan


def _phase(score: Score, replicas: int) -> dict:
    return {"tp": score.par.tp, "pp": score.par.pp, "replicas": replicas, "goodput_per_replica_rps": score.goodput_rps}


def colocated_summary(plan: ColocatedPlan | None, e2e) -> dict | None:
    if plan is None:
        return None
    s = plan.score
    return {
        "config": {"tp": s.par.tp, "pp": s.par.pp, "chunk_tokens": s.chunk_tokens, "replicas": plan.replicas},
        "goodput_rps": plan.goodput_rps, "goodput_per_gpu": plan.goodput_per_gpu, "gpus": plan.gpus,
        "goodput_per_replica_rps": s.goodput_rps, "residency_bytes": plan.residency_bytes,
        **_end_to_end(e2e),
    }


def _end_to_end(e2e) -> dict:
    """The end-to-end figure (`simulated_goodput_rps`, held to the deployment's sustained rate), the
    finite run's own (`simulated_run_rps`) and the cap (`sustained_rps`; None: not held)."""
    return {"simulated_goodput_rps": e2e.rate if e2e else None,
            "simulated_run_rps": e2e.search.rate if e2e else None,
            "sustained_rps": e2e.sustained_rps if e2e else None}


def disagg_summary(plan: DisaggPlan | None, e2e) -> dict | None:
    if plan is None:
        return None
    return {
        "affinity": plan.affinity, "node_segments": plan.segments or None,
        "prefill": _phase(plan.prefill, plan.n_prefill), "decode": _phase(plan.decode, plan.n_decode),
        "goodput_rps": plan.goodput_rps, "goodput_per_gpu": plan.goodput_per_gpu, "gpus": plan.gpus,
        "kv_demand_bytes_per_s": plan.kv_demand_bytes_per_s, "link_capacity_bytes_per_s": plan.link_capacity_bytes_per_s,
        "link_ok": plan.link_ok, "residency_bytes": plan.residency_bytes,
        **_end_to_end(e2e),
    }


def tie_terms(result: PlanResult) -> list[str] | None:
    """The terms deciding a tie (None: not a tie): which disaggregated pool binds and what the other
    leaves idle, the GPUs each plan leaves out of the budget, and the end-to-end check of each."""
    verdict, colo, dis = result.verdict, result.colocated, result.disaggregated
    if verdict is None or colo is None or dis is None or not is_tie(verdict.goodput_gain):
        return None
    pre, dec = dis.n_prefill * dis.prefill.goodput_rps, dis.n_decode * dis.decode.goodput_rps
    binding, idle = ("prefill", 1 - pre / dec) if pre <= dec else ("decode", 1 - dec / pre)
    e2e = lambda name, p: (f"{name} end to end {result.end_to_end[name].rate:.3g} rps vs planned {p.goodput_rps:.3g}"  # noqa: E731
                           if name in result.end_to_end else f"{name} not re-simulated")
    return [f"rate matching: the {binding} pool binds ({pre:.3g} rps prefill vs {dec:.3g} rps decode), "
            f"{idle:.0%} of the other pool's capacity idle",
            f"GPUs: colocated {colo.gpus}, disaggregated {dis.gpus} ({dis.prefill_gpus} P + {dis.decode_gpus} D) of "
            f"{result.inputs.gpus}",
            f"decode batch: {dis.decode.par} at {dis.decode.goodput_rps:.3g} rps per instance; colocated "
            f"{colo.score.label} at {colo.score.goodput_rps:.3g} rps per instance",
            e2e("colocated", colo), e2e("disaggregated", dis)]


def _verdict_per_gpu(result: PlanResult) -> dict:
    """Each plan's goodput per counted GPU (`planner.counted_gpus`), the figures the verdict compares."""
    out = {}
    for name, plan in (("colocated", result.colocated), ("disaggregated", result.disaggregated)):
        if plan is not None:
            out[name] = {"gpus_counted": counted_gpus(result.inputs, plan), "goodput_per_gpu": plan.goodput_rps / counted_gpus(result.inputs, plan)}
    return out


def _affinity(dis: dict) -> str:
    """"high", or "low" with its node segments when the phases' layers span more than one node."""
    segments = dis.get("node_segments")
    return f"low, {segments} nodes" if segments and segments > 1 else dis["affinity"]


def plan_summary(result: PlanResult) -> dict:
    """The `pdserve plan --json` object."""
    inputs, margin = result.inputs, result.margin
    verdict = result.verdict
    return {
        "decision": result.decision,
        "decided_by": verdict.decided_by if verdict else None,
        "decision_reason": verdict.explain(inputs.margin) if verdict else None,
        "goodput_per_gpu_gain": verdict.goodput_gain if verdict else None,
        "net_margin_agrees": verdict.agrees if verdict else None,
        "tie_band": TIE_BAND, "tie_terms": tie_terms(result),
        "model": inputs.model.name, "hardware": inputs.hardware.name, "gpus": inputs.gpus,
        "latency_model": inputs.latency_label,
        "colocated_scheduler": "mixed" if inputs.mixed_batches else "prefill-first",
        "decode_token_cap": inputs.decode_token_cap, "prefill_batch": inputs.prefill_max_batch,
        "max_context": inputs.model.max_context,
        "target_rate": inputs.target_rps, "decision_margin": inputs.margin, "goodput_definition": inputs.definition,
        "verdict_per_gpu": _verdict_per_gpu(result),
        "colocated": colocated_summary(result.colocated, result.end_to_end.get("colocated")),
        "disaggregated": disagg_summary(result.disaggregated, result.end_to_end.get("disaggregated")),
        "alternatives": [disagg_summary(p, None) for p in result.alternatives if p is not result.disaggregated],
        "net_margin": None if margin is None else {"delta_t_s": result.net_margin_s, **vars(margin)},
        "pd_decision": result.pd_decision, "pd_decision_asked": inputs.pd_decision,
        "pd_local_share": result.local_share,
        "num_candidates": result.num_candidates,
        "num_simulated": sum(s.status == "simulated" for v in result.scores.values() for s in v),
        "search_s": result.elapsed_s,
    }


def plan_table(summary: dict) -> str:
    """A readable multi-line rendering of `plan_summary`."""
    lines = [f"decision: {summary['decision'].upper()}  ({summary['model']} on {summary['gpus']} x {summary['hardware']}, "
             f"{summary.get('latency_model', 'roofline')} step times)"]
    if summary.get("decided_by"):
        lines.append(f"decided by {summary['decided_by']}: {summary['decision_reason']}")
    if summary.get("tie_terms"):
        lines.append(f"a TIE: disaggregated vs colocated within +-{summary['tie_band']:.0%}; the terms that decide it:")
        lines.extend(f"  {term}" for term in summary["tie_terms"])
    colo, dis = summary["colocated"], summary["disaggregated"]
    lines.append(f"{'plan':<16}{'layout':<44}{'goodput rps':>12}{'per GPU':>10}{'sim rps':>10}")
    if colo:
        c = colo["config"]
        layout = f"{c['replicas']} x tp{c['tp']}pp{c['pp']} chunk {c['chunk_tokens']}"
        lines.append(f"{'colocated':<16}{layout:<44}{colo['goodput_rps']:>12.3g}{colo['goodput_per_gpu']:>10.3g}{_num(colo['simulated_goodput_rps']):>10}")
    if dis:
        p, d = dis["prefill"], dis["decode"]
        layout = f"P {p['replicas']} x tp{p['tp']}pp{p['pp']} + D {d['replicas']} x tp{d['tp']}pp{d['pp']} ({_affinity(dis)})"
        lines.append(f"{'disaggregated':<16}{layout:<44}{dis['goodput_rps']:>12.3g}{dis['goodput_per_gpu']:>10.3g}{_num(dis['simulated_goodput_rps']):>10}")
        if (dis.get("simulated_run_rps") or 0) > (dis["simulated_goodput_rps"] or 0):
            lines.append(f"end to end: the finite run passed {dis['simulated_run_rps']:.3g} rps; sim rps is held to the "
                         f"{dis['sustained_rps']:.3g} rps the deployment sustains")
        lines.append(_routing_line(summary))
        lines.append(f"K/V demand {dis['kv_demand_bytes_per_s'] / 1e9:.3g} GB/s vs link {dis['link_capacity_bytes_per_s'] / 1e9:.3g} GB/s: "
                     + ("ok" if dis["link_ok"] else "INFEASIBLE"))
    if summary["net_margin"]:
        lines.append(f"net margin dT = {summary['net_margin']['delta_t_s'] * 1e3:+.1f} ms/request at matched load "
                     "(> 0: a request finishes sooner disaggregated; reported, the decision is goodput per GPU)")
    lines.append(f"{summary['num_candidates']} candidates, {summary['num_simulated']} simulated, {summary['search_s']:.1f} s")
    if summary.get("validation") is not None:
        lines.extend(validation_lines(summary["validation"]))
    return "\n".join(lines)


def _routing_line(summary: dict) -> str:
    """How the disaggregated plan routes each request, and what margin routing kept local."""
    mode, asked = summary.get("pd_decision", "always"), summary.get("pd_decision_asked", "always")
    if mode == "margin":
        share = summary.get("pd_local_share")
        kept = "" if share is None else f": {share:.0%} of requests prefilled on their decode worker at the sim rps"
        return (f"P/D routing: margin (the router's per-request decision, as pdserve serve runs it; the verdict "
                f"weighs sim rps per GPU){kept}")
    why = " (margin needs a profiled --latency-model: simulated as always)" if asked == "margin" else ""
    return f"P/D routing: always (every request handed off){why}"


def validation_lines(rows: list[dict]) -> list[str]:
    """Predicted (plan, end-to-end simulation) vs measured (local runtime) goodput per configuration."""
    lines = ["validation (local runtime, pdserve bench --sweep):",
             f"{'plan':<16}{'layout':<20}{'predicted rps':>14}{'sim rps':>10}{'measured rps':>14}{'phase rps':>11}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<16}{r['layout']:<20}{r['predicted_goodput_rps']:>14.3g}{_num(r.get('simulated_goodput_rps')):>10}"
                         f"  ERROR: {r['error'].splitlines()[0]}")
            continue
        sat = " (saturated: >=)" if r.get("measured_saturated") else ""
        lines.append(f"{r['name']:<16}{r['layout']:<20}{r['predicted_goodput_rps']:>14.3g}{_num(r.get('simulated_goodput_rps')):>10}"
                     f"{_num(r.get('measured_goodput_rps')):>14}{_num(r.get('measured_goodput_phase_rps')):>11}{sat}")
        sweep = ", ".join(f"{p['rate']:g}:{_num(p.get('attainment_joint'))}" for p in r.get("sweep", r.get("points", [])))
        lines.append(f"{'':<16}joint attainment by rate: {sweep}")
        for p in r.get("points", []):  # --validate-recalibrate: each point's own calibration
            c = p["calibration"]
            lines.append(f"{'':<16}point {p['point']}: calibrated (prefill x{c.get('prefill_factor', 0):.3f}, decode "
                         f"x{c.get('decode_factor', 0):.3f}) {_num(p['calibrated_goodput_rps'])} rps -> bench at "
                         f"{p['rate']:g}: {'pass' if p['passed'] else 'fail'}" + _window_text(p))
        if r.get("sample_goodput_rps") is not None:
            lines.append(f"{'':<16}simulated on the benchmark's own requests: {_num(r['sample_goodput_rps'])} rps")
        if "calibration" in r and "points" not in r:
            c = r["calibration"]
            lines.append(f"{'':<16}calibrated on the live server (prefill x{c['prefill_factor']:.3f}, decode "
                         f"x{c['decode_factor']:.3f}): {_num(r['calibrated_goodput_rps'])} rps")
        if r.get("method") == "windows":
            lo, hi = r["error_bounds"]
            verdict = "within" if r["within_tolerance"] else "NOT within"
            lines.append(f"{'':<16}predicted/measured in each bench's own window: ({lo:.3g}, {_num(hi)}]: "
                         f"{r['measured_vs_prediction']} -> prediction {verdict} {r['tolerance']:.0%}")
            if r.get("reference_interval_rps"):
                a, b = r["reference_interval_rps"]
                lines.append(f"{'':<16}measured goodput at the profile's machine speed: {a:.3g}..{_num(b)} rps")
        elif "within_tolerance" in r:
            lo, hi = r["bracket_rps"]
            verdict = "within" if r["within_tolerance"] else "NOT within"
            lines.append(f"{'':<16}bracket {lo:.3g}..{_num(hi)} rps: measured goodput {r['measured_vs_prediction']}"
                         f" -> prediction {verdict} {r.get('tolerance', 0):.0%} of the measurement")
        if "stability_needed" in r:
            drift = (f"; the calibrations drifted {r['machine_drift']:.1%} between the points: "
                     f"{'conclusive' if r['conclusive'] else 'NOT conclusive'}") if "machine_drift" in r else ""
            lines.append(f"{'':<16}a {r.get('tolerance', 0):.0%} check needs the machine's speed steady to "
                         f"{r['stability_needed']:.1%}{drift}")
    ok = [r for r in rows if r.get("measured_goodput_rps") is not None]
    if any("within_tolerance" in r for r in rows):
        lines.append(f"measured better: {bracket_ranking(rows) or 'undecided (measured intervals overlap)'}")
        return lines
    if len(ok) >= 2:
        best = max(ok, key=lambda r: r["measured_goodput_rps"])
        lines.append(f"measured better: {best['name']}")
    return lines


def _window_text(p: dict) -> str:
    if "window_goodput_rps" not in p:
        return ""
    dp, dd = p["drift"]
    return (f"; engine speed since the calibration x{dp:.3f} prefill, x{dd:.3f} decode -> window prediction "
            f"{p['window_goodput_rps']:.3g} rps, predicted/measured {'<=' if p['passed'] else '>'} {p['error_bound']:.3g}")


def measured_interval(row: dict) -> tuple[float, float] | None:
    """[low, high) req/s that a bracket check places the measured goodput in. With a calibration
    before each point (--validate-recalibrate) the upper rate can come out below the lower one
    when the machine slowed between them (each point still agrees with its own prediction); the
    interval is then their hull, so a ranking never leans on the drift. A window check
    (validate_windows.py) gives its interval at the profile's machine speed instead."""
    if row.get("method") == "windows":
        ref = row.get("reference_interval_rps")
        return None if ref is None else (ref[0], math.inf if ref[1] is None else ref[1])
    lo, hi = row["bracket_rps"]
    if row["measured_vs_prediction"] == "within":
        return min(lo, hi), max(lo, hi)
    return {"below": (0.0, lo), "above": (hi, float("inf"))}.get(row["measured_vs_prediction"])


def bracket_ranking(rows: list[dict]) -> str | None:
    """The configuration whose measured interval lies wholly above every other's, if one does."""
    intervals = {r["name"]: measured_interval(r) for r in rows if "within_tolerance" in r}
    if len(intervals) < 2 or None in intervals.values():
        return None
    for name, (lo, _) in intervals.items():
        if all(lo >= other_hi for other, (_, other_hi) in intervals.items() if other != name):
            return name
    return None


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def plot_plan(result: PlanResult, path: str, top: int = 3) -> None:
    """Joint attainment vs offered rate for the top `top` candidates of each phase kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _curves(axes[0], [s for s in result.scores["colocated"] if s.points][:top], "colocated instance", result)
    e2e = result.end_to_end
    for name, search in e2e.items():
        rates = sorted(search.points)
        held = f", the run {search.search.rate:.3g}" if search.held else ""  # held to the sustained rate
        axes[1].plot(rates, [search.points[r].joint for r in rates], marker="o", label=f"{name} ({search.rate:.3g} rps{held})")
    _decorate(axes[1], "planned deployments (end to end)", result)
    fig.suptitle(f"{result.inputs.model.name} on {result.inputs.gpus} x {result.inputs.hardware.name}: decision {result.decision}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curves(ax, scores: list[Score], title: str, result: PlanResult) -> None:
    for s in scores:
        rates = [r for r, _ in s.points]
        ax.plot(rates, [a.joint for _, a in s.points], marker="o", label=f"{s.label} ({s.goodput_rps:.3g} rps)")
    _decorate(ax, title, result)


def _decorate(ax, title: str, result: PlanResult) -> None:
    ax.axhline(result.inputs.slo.attainment, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("joint SLO attainment")
    ax.set_title(title)
    ax.legend(fontsize=8)
