"""The restart schedule: backoff, epochs, reset after a long life, and refusals."""

from __future__ import annotations

import pytest

from pdserve.workers.process.supervisor import RestartPolicy, RestartSchedule


def test_backoff_doubles_to_its_bound_and_each_restart_takes_the_next_epoch():
    s = RestartSchedule(RestartPolicy(first_delay_s=0.5, max_delay_s=2.0, reset_after_s=30.0))
    s.on_started("decode-0", 1, now=0.0)
    waits = []
    now = 1.0
    for expected_epoch in (2, 3, 4, 5):
        due = s.on_death("decode-0", now)
        waits.append(due - now)
        assert s.due(due - 1e-6) == [] and s.waiting() == ["decode-0"]
        assert s.due(due) == [("decode-0", expected_epoch)]
        s.mark_restarted("decode-0", expected_epoch, due)
        now = due + 1.0  # dies again one second later
    assert waits == [0.5, 1.0, 2.0, 2.0] and s.num_restarts == 4 and s.waiting() == []


def test_a_long_healthy_registration_resets_the_backoff_a_long_load_does_not():
    s = RestartSchedule(RestartPolicy(first_delay_s=0.5, max_delay_s=8.0, reset_after_s=30.0, max_crashes=99))
    s.on_started("prefill-0", 1, now=0.0)
    due = 0.0
    for _ in range(3):
        due = s.on_death("prefill-0", due + 1.0)
        s.mark_restarted("prefill-0", s.due(due)[0][1], due)
    # it loaded for 40 s and crashed before (or just after) registering: the delay keeps growing
    assert s.on_death("prefill-0", due + 40.0) == due + 40.0 + 4.0
    due += 44.0
    epoch = s.due(due)[0][1]
    s.mark_restarted("prefill-0", epoch, due)
    s.on_registered("prefill-0", epoch, due + 35.0)  # a slow load, then registered
    assert s.on_death("prefill-0", due + 36.0) == due + 36.0 + 8.0  # healthy for 1 s only
    due += 44.0
    epoch = s.due(due)[0][1]
    s.mark_restarted("prefill-0", epoch, due)
    s.on_registered("prefill-0", epoch, due + 1.0)
    assert s.on_death("prefill-0", due + 32.0) == due + 32.5  # registered 31 s: first delay again


def test_a_crash_loop_ends_in_failed():
    s = RestartSchedule(RestartPolicy(first_delay_s=0.5, max_delay_s=1.0, max_crashes=3, crash_window_s=60.0))
    s.on_started("decode-0", 1, now=0.0)
    s.on_started("decode-1", 1, now=0.0)
    now = 0.0
    for epoch in (2, 3):
        due = s.on_death("decode-0", now + 1.0)
        s.mark_restarted("decode-0", epoch, due)
        now = due
    assert s.on_death("decode-1", 1.0) is not None  # another worker's deaths are its own
    assert s.on_death("decode-0", now + 1.0) is None  # the third death within 60 s
    assert s.failed() == ["decode-0"] and s.due(1e9) == [("decode-1", 2)] and s.num_restarts == 2
    assert s.on_death("decode-0", now + 2.0) is None  # stays failed


def test_deaths_outside_the_window_do_not_count():
    s = RestartSchedule(RestartPolicy(first_delay_s=0.5, max_delay_s=1.0, max_crashes=2, crash_window_s=10.0))
    s.on_started("decode-0", 1, now=0.0)
    now = 0.0
    for epoch in (2, 3, 4):
        due = s.on_death("decode-0", now + 11.0)
        assert due is not None
        s.mark_restarted("decode-0", epoch, due)
        now = due
    assert s.failed() == []


def test_disabled_policy_schedules_nothing_and_bad_calls_raise():
    off = RestartSchedule(RestartPolicy(enabled=False))
    off.on_started("decode-0", 1, 0.0)
    assert off.on_death("decode-0", 1.0) is None and off.due(100.0) == []
    s = RestartSchedule()
    s.on_started("decode-0", 1, 0.0)
    s.on_death("decode-0", 1.0)
    with pytest.raises(ValueError, match="reported twice"):
        s.on_death("decode-0", 1.1)
    with pytest.raises(ValueError, match="was not scheduled"):
        s.mark_restarted("decode-0", 5, 2.0)
    with pytest.raises(ValueError, match="restart delays"):
        RestartPolicy(first_delay_s=2.0, max_delay_s=1.0)


def test_a_restarted_worker_reaps_only_its_dead_incarnations_pools(tmp_path):
    import os
    import subprocess
    import sys

    from pdserve.shm import reap_dead_pools

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    token = "ab" * 16  # pools are named pdserve-<worker>-<pid>-<token> (unguessable, docs/security.md)
    dead = [f"pdserve-decode-0-{dead_pid}", f"pdserve-decode-0-{dead_pid}-{token}"]
    names = dead + [f"pdserve-decode-0-{os.getpid()}-{token}", f"pdserve-decode-1-{dead_pid}-{token}", "other"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(reap_dead_pools("decode-0", str(tmp_path))) == sorted(dead)
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


def test_a_restart_that_never_registers_is_listed_once_after_the_timeout():
    s = RestartSchedule(RestartPolicy(first_delay_s=1.0, max_delay_s=4.0, register_timeout_s=10.0))
    s.on_started("decode-0", 1, 0.0)
    assert s.unregistered(500.0) == []  # the first start is the cluster's start-up wait's business
    s.on_death("decode-0", 1.0)
    s.mark_restarted("decode-0", 2, 2.0)
    assert s.unregistered(11.9) == [] and s.unregistered(12.0) == [("decode-0", 2)] and s.unregistered(13.0) == []
    s.on_death("decode-0", 13.5)  # ended as hung: a death like any other, restarted under epoch 3
    assert s.due(15.5) == [("decode-0", 3)]
    s.mark_restarted("decode-0", 3, 15.5)
    s.on_registered("decode-0", 3, 20.0)
    assert s.unregistered(100.0) == []  # registered in time: the heartbeat watchdog's from here


def test_a_role_change_epoch_raises_a_live_worker_s_next_restart_not_a_scheduled_one():
    """note_epoch (the router told the worker to switch under a new epoch) lifts a live worker's
    next restart above that epoch; while it is dead its restart keeps the epoch it was scheduled
    under (the supervisor may be starting it under that epoch right now)."""
    s = RestartSchedule(RestartPolicy(first_delay_s=0.5))
    s.on_started("prefill-0", 1, now=0.0)
    s.note_epoch("prefill-0", 2)
    due = s.on_death("prefill-0", 1.0)
    assert s.due(due) == [("prefill-0", 3)]  # above the role change's epoch 2, not a second epoch 2
    s.note_epoch("prefill-0", 3)  # a ChangeRole sent to the dead process: never applied
    assert s.due(due) == [("prefill-0", 3)]
    s.mark_restarted("prefill-0", 3, due)  # before: raised "restart under epoch 3 was not scheduled"
