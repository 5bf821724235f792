"""The HTTP edge's limits as configuration (api/edge/limits.py): bad values are refused with the
flag's name, and the open-file limit is raised to fit the connection cap or the start is refused."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from pdserve.api.edge.limits import FD_RESERVE, EdgeLimits
from tests.api.served_cli import ROOT, TINY_SERVE


@pytest.mark.parametrize("kw, flag", [({"max_connections": 0}, "--max-connections"),
                                      ({"header_timeout_s": 0.0}, "--request-header-timeout-s"),
                                      ({"body_timeout_s": -1.0}, "--request-body-timeout-s"),
                                      ({"write_timeout_s": 0.0}, "--response-write-timeout-s")])
def test_a_bad_limit_names_its_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        EdgeLimits(**kw)


def fit_under(soft: int, hard: int, max_connections: int) -> str:
    """`fit_fd_limit` in a child whose open-file limit is (soft, hard): its new soft limit, or its error."""
    code = ("import resource; from pdserve.api.edge.limits import EdgeLimits, fit_fd_limit\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
            f"try: fit_fd_limit(EdgeLimits(max_connections={max_connections})); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
            "except ValueError as exc: print(exc)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout


def test_the_open_file_limit_is_raised_to_fit_the_cap_or_the_start_is_refused():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-file limit is {hard}")
    assert fit_under(300, 2048, 512).strip() == str(512 + FD_RESERVE)
    assert fit_under(1024, 2048, 512).strip() == "1024"  # already enough: left as it is
    refused = fit_under(300, 600, 512)
    assert "--max-connections 512 needs 768 open files" in refused and "hard limit is 600" in refused


def test_serve_refuses_a_bad_limit_before_it_starts_anything():
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", *TINY_SERVE, "--max-connections", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "--max-connections must be >= 1" in run.stderr
