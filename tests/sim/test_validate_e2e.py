"""`pdserve plan --validate` orchestration end to end: the real runtime (tiny model, fp32) and the benchmark.

One colocated worker, a 2-rate ladder, a handful of short requests (~20 s on a 2-core machine).
Checks the bench report is read (joint goodput and the sweep rows) and that the server's whole
process group (router and worker) is gone afterwards.
"""

from __future__ import annotations

import subprocess

from pdserve.sim import validate as v


def _group_commands(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pgid=,args="], capture_output=True, text=True).stdout
    return [line.split(None, 1)[1] for line in out.splitlines() if line.split() and line.split()[0] == str(pgid)]


def test_ladder_brackets_the_prediction():
    assert v.ladder_around(8.0) == [2.0, 4.0, 8.0, 12.0]
    assert v.ladder_around(0.0) == [0.25, 0.5, 1.0, 1.5]


def test_goodput_keys_of_the_bench_report():
    report = {"request_goodput": 2.0, "request_goodput_phase": 3.0, "sweep": [{"rate": 1.0, "attainment_joint": 1.0}],
              "goodput_search": {"ladder": [1.0, 2.0], "joint": {"rate": 2.0, "saturated": True}}}
    m = v._measured(report)
    assert m["measured_goodput_rps"] == 2.0 and m["measured_goodput_phase_rps"] == 3.0
    assert m["measured_saturated"] is True and m["sweep"][0]["rate"] == 1.0


def test_validate_runs_the_tiny_model_and_stops_every_process(monkeypatch):
    seen: dict[str, list[str]] = {}
    stop = v.stop_group

    def recording_stop(proc, *a, **kw):
        seen["before"] = _group_commands(proc.pid)
        stop(proc, *a, **kw)
        seen["after"] = _group_commands(proc.pid)

    monkeypatch.setattr(v, "stop_group", recording_stop)
    config = v.LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=2.0,
                           extra_serve_args=("--dtype", "float32"))
    bench = ["--num-requests", "6", "--input-len", "16", "--output-len", "4", "--slo-ttft-ms", "5000",
             "--slo-tpot-ms", "2000", "--max-bisections", "0", "--prompt-format", "ids", "--seed", "0"]
    rows = v.validate([config], "tiny", bench, rates=[1.0, 2.0])
    row = rows[0]
    assert "error" not in row, row.get("error")
    assert row["measured_goodput_rps"] == 2.0  # loose SLOs: the top of the ladder passes
    assert row["measured_saturated"] is True
    assert [p["rate"] for p in row["sweep"]] == [1.0, 2.0]
    # the server's own process group held the worker, and nothing of it survives the stop
    assert any("pdserve.workers.main" in c for c in seen["before"]), seen["before"]
    assert seen["after"] == []
