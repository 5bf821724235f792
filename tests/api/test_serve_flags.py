"""`pdserve serve` refuses a flag value no deployment can run with: exit 2 and one `error:` line
naming the flag, before any worker, fit or socket starts. Before these checks each of them
started the cluster and then misbehaved: a port past 65535 printed "serving on :99999" and never
bound, a 0 MB pool or 0 sequences served requests that could never run, and a block size of 0,
a 0-token step budget, a TP size that does not divide the heads or a missing checkpoint ended in
a traceback (some after a worker had crashed and been restarted into the same error)."""

from __future__ import annotations

import pytest

from pdserve.cli import main

BAD = [
    (("--port", "99999"), "--port must be in 1..65535"),
    (("--port", "0"), "--port must be in 1..65535"),
    (("--kv-cache-mb", "0"), "(--kv-cache-mb) must be > 0"),
    (("--host-kv-mb", "-1"), "(--host-kv-mb) must be >= 0"),
    (("--block-size", "0"), "(--block-size) must be >= 1"),
    (("--max-num-seqs", "0"), "(--max-num-seqs) must be >= 1"),
    (("--max-num-batched-tokens", "0"), "(--max-num-batched-tokens) must be >= 1"),
    (("--max-tenant-roots", "0"), "(--max-tenant-roots) must be >= 1"),
    (("--threads-per-worker", "0"), "--threads-per-worker must be >= 1"),
    (("--slo-ttft-ms", "-1"), "--slo-ttft-ms must be > 0"),
    (("--slo-tpot-ms", "0"), "--slo-tpot-ms must be > 0"),
    (("--admission-wait-s", "-1"), "--admission-wait-s must be >= 0"),
    (("--tp", "3"), "tensor-parallel size 3 does not divide the model's 8 query heads"),
    (("--decode-tp", "3"), "tensor-parallel size 3 does not divide"),
    (("--model", "/nonexistent/checkpoint"), "model directory does not exist"),
    (("--mode", "colocated", "--replicas", "-1"), "worker counts must be >= 0, got --replicas -1"),  # not "--prefill 0 ..."
]


@pytest.mark.parametrize("flags, said", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_a_value_no_deployment_can_run_with_is_refused_before_anything_starts(flags, said, capsys):
    assert main(["serve", "--model", "tiny", "--port", "18999", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err
