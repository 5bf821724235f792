"""`pdserve ledger`, `pdserve check` and `pdserve trace analyze` end to end (in process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mutation_tools import mutated

from pdserve.cli import main
from pdserve.ledger.checks import CHECKS, load_fixture

GEOMETRY = ["--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--bytes", "2"]


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_kv_bytes(capsys):
    out = run_json(capsys, ["ledger", "kv-bytes", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--bytes", "2", "--tokens", "1", "--json"])
    assert out == {"bytes": 131072}


def test_handoff(capsys):
    argv = ["ledger", "handoff", "--prompt-blocks", "8", "--prefill-reuse", "3", "--decode-visible", "1", "--block-tokens", "4", *GEOMETRY, "--json"]
    assert run_json(capsys, argv) == {"compute_blocks": 5, "transfer_blocks": 7, "logical_bytes": 7168}


def test_phase_cost(capsys):
    argv = ["ledger", "phase-cost", *GEOMETRY, "--d-model", "64", "--d-ff", "160", "--q-heads", "8", "--prefill-new", "16",
            "--prefill-visible", "8", "--decode-lengths", "48,49,50", "--flops", "1e12", "--mem-bw", "1e11", "--json"]
    out = run_json(capsys, argv)
    assert [round(out[k] * 1e6, 3) for k in ("prefill_lb_s", "decode_lb_s", "mixed_lb_s")] == [5.513, 3.661, 6.647]
    assert round(out["dilation"], 3) == 1.816


def test_plain_table_and_bad_input(capsys):
    assert main(["ledger", "kv-bytes", *GEOMETRY, "--tokens", "3"]) == 0
    assert capsys.readouterr().out.split() == ["bytes", "768"]
    assert main(["ledger", "handoff", "--prompt-blocks", "2", "--prefill-reuse", "3", "--block-tokens", "4", *GEOMETRY]) == 2
    assert "prefill_reuse" in capsys.readouterr().out


def test_check_list_and_shipped_fixtures(capsys):
    assert main(["check", "--list"]) == 0
    listed = [row.split()[0] for row in capsys.readouterr().out.splitlines()]
    assert listed == list(CHECKS)
    for name in CHECKS:
        assert main(["check", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"] is True


def test_check_rejects_a_mutated_fixture_file(tmp_path: Path, capsys):
    bad = mutated(load_fixture("transfer-protocol"), "manifest.credit_window_bytes", 1024)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert main(["check", "transfer-protocol", str(path)]) == 1
    assert "byte credits" in capsys.readouterr().out
    assert main(["check", "no-such-check"]) == 1


def test_trace_analyze(tmp_path: Path, capsys):
    events = load_fixture("transfer-trace")["events"]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    out = run_json(capsys, ["trace", "analyze", str(path), "--layers", "2", "--json"])
    (txn,) = out["transactions"]
    assert out["ok"] and txn["status"] == "published" and txn["retries"] == 1
    assert round(txn["exposed_stall_s"] * 1e6, 3) == 60
    assert main(["trace", "analyze", str(path), "--layers", "3"]) == 1
    assert "REJECTED xfer-0001" in capsys.readouterr().out
    path.write_text("garbage\n")
    assert main(["trace", "analyze", str(path)]) == 2


def test_trace_analyze_summarises_p_d_decisions_by_prompt_length(tmp_path: Path, capsys):
    lines = [{"request_id": f"r{i}", "prompt_tokens": n, "pd_decision": d}
             for i, (n, d) in enumerate([(20, "local"), (63, "local"), (64, "disaggregate"), (2000, "disaggregate"),
                                         (5000, "local")])]
    lines.append({"request_id": "x", "rejected": "no_route", "detail": ""})  # no decision: left out
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = run_json(capsys, ["trace", "analyze", str(path), "--json"])
    assert out["pd_decisions"] == {"0-63": {"local": 2}, "64-255": {"disaggregate": 1}, "1024-4095": {"disaggregate": 1},
                                   "4096+": {"local": 1}}
    assert main(["trace", "analyze", str(path)]) == 0
    assert "disaggregate" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["ledger"], ["trace"]])
def test_bare_group_prints_help(argv, capsys):
    assert main(argv) == 2


def test_ledger_code_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, pdserve.ledger, pdserve.ledger.checks, pdserve.ledger.trace, pdserve.ledger.release, "
        "pdserve.commands.ledger, pdserve.commands.check, pdserve.commands.trace\n"
        "from pdserve.ledger.checks import CHECKS, load_fixture, run_check\n"
        "[run_check(n, load_fixture(n)) for n in CHECKS]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
