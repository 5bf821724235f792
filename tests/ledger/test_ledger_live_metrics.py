"""The runtime-release check against a live /metrics: `exposed_metric_names` reads a Prometheus
text exposition and `pdserve check runtime-release --metrics` replaces the fixture's
observability list with it."""

from __future__ import annotations

from pdserve.cli import main
from pdserve.ledger.checks.runtime_release import REQUIRED_METRICS, exposed_metric_names

EXPOSITION = """\
# HELP pdserve_pd_route_total Route decisions
# TYPE pdserve_pd_route_total counter
pdserve_pd_route_total{policy="slo",result="routed"} 3.0
# TYPE pdserve_kv_publication_rejects_total counter
# TYPE pdserve_kv_transfer_exposed_seconds histogram
pdserve_kv_transfer_exposed_seconds_bucket{le="+Inf"} 0.0
pdserve_kv_transfer_exposed_seconds_count 0.0
# TYPE pdserve_slo_attainment gauge
other_metric 1.0
"""


def test_names_cover_families_samples_and_counters_without_children():
    names = exposed_metric_names(EXPOSITION)
    assert {"pd_route", "pd_route_total", "kv_publication_rejects", "kv_publication_rejects_total",
            "kv_transfer_exposed_seconds", "kv_transfer_exposed_seconds_count", "slo_attainment"} <= names
    assert not any(n.startswith("other") for n in names)  # only the pdserve_ prefix counts
    assert REQUIRED_METRICS - names == {"kv_transfer_bytes", "kv_transfer_attempts_total", "capability_denials_total",
                                        "fallback_total", "rollback_seconds"}


def test_check_cli_reads_a_saved_metrics_text(tmp_path, capsys):
    from pdserve.router.process.metrics import RuntimeMetrics

    full, partial = tmp_path / "full.prom", tmp_path / "partial.prom"
    full.write_bytes(RuntimeMetrics().text())
    partial.write_text(EXPOSITION)
    assert main(["check", "runtime-release", "--metrics", str(full)]) == 0
    assert main(["check", "runtime-release", "--metrics", str(partial)]) == 1
    assert "observability lacks" in capsys.readouterr().out
    assert main(["check", "handoff-manifest", "--metrics", str(full)]) == 1
