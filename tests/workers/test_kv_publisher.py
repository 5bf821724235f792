"""The vLLM KV-events publisher's edges (workers/kv_publisher.py): `pdserve serve` refuses
endpoint flags whose per-worker port ranges collide before any worker starts."""

from __future__ import annotations

import pytest

import pdserve.api.server as server
from pdserve.api.server import ServeConfig
from pdserve.cli import main

PUB, REP = "--kv-events-endpoint", "--kv-events-replay-endpoint"


def test_overlapping_port_ranges_are_refused_at_the_flags(monkeypatch, capsys):
    """Two workers at 5640+i and replay at 5641+i share port 5641: one worker would die binding it
    and the start would wait out its registration timeout without naming why."""
    def started(config):
        raise AssertionError("the server started with overlapping KV-events ports")

    monkeypatch.setattr(server, "serve", started)
    argv = ["serve", "--model", "tiny", "--mode", "colocated", "--replicas", "2",
            PUB, "tcp://127.0.0.1:5640", REP, "tcp://127.0.0.1:5641"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and PUB in err[0] and REP in err[0], err
    assert "5640..5641" in err[0] and "5641..5642" in err[0]


@pytest.mark.parametrize("pub, rep, replicas", [
    ("tcp://127.0.0.1:5640", "tcp://127.0.0.1:5642", 2),  # adjacent ranges
    ("tcp://127.0.0.1:5643", "tcp://127.0.0.1:5640", 3),  # replay below
    ("tcp://127.0.0.1:5640", None, 4),
])
def test_disjoint_ranges_are_accepted(pub, rep, replicas):
    ServeConfig(mode="colocated", replicas=replicas, kv_events_endpoint=pub, kv_events_replay_endpoint=rep)


@pytest.mark.parametrize("pub, rep, replicas, said", [
    ("tcp://127.0.0.1:5643", "tcp://127.0.0.1:5640", 4, "overlap"),
    ("tcp://127.0.0.1:5640", "tcp://127.0.0.1:5640", 1, "overlap"),
    ("tcp://127.0.0.1:65535", None, 2, "outside 1..65535"),
    ("tcp://127.0.0.1", None, 1, "tcp://HOST:PORT"),
])
def test_colliding_or_impossible_ranges_are_refused(pub, rep, replicas, said):
    with pytest.raises(ValueError, match=said):
        ServeConfig(mode="colocated", replicas=replicas, kv_events_endpoint=pub, kv_events_replay_endpoint=rep)
