"""Live disable/enable of disaggregation and the rollback drill on a running 1P1D cluster (tiny
model), through the admin HTTP endpoints: requests in flight when the switch happens finish with
the tokens a single engine produces, the prefill worker changes role under a new epoch (the
handoff fence's), later requests run whole, the rollback runs the spec's order, and nothing leaks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.api.app import create_app
from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.ledger.release import ROLLBACK_ORDER
from pdserve.workers import messages as m
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline
from tests.runtime.shared_cluster import SharedCluster
from tests.runtime.tcp_links import accepted

TOKEN = "s3cret-admin"
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
PROMPTS = [prompt(40 + 7 * i, 500 + i) for i in range(6)]
LONG = prompt(4000, 600)  # eight prefill chunks: its transfer streams from the first and publishes after the last


@pytest.fixture(scope="module")
def reference():
    return Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))


@pytest.fixture(scope="module")
def expected(reference):
    return [list(out.output_ids) for out in reference.generate([list(p) for p in PROMPTS], PARAMS)]  # batch-invariant


@pytest.fixture(scope="module")
def fresh_1p1d():
    """A `config()` cluster for the admin-token test, which changes nothing, and then the switch
    test (its last user: it moves the prefill worker to epoch 3)."""
    served = SharedCluster(config())
    yield served
    served.close()


def admin(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pdserve",
                             headers={"Authorization": f"Bearer {TOKEN}"})


async def run_all(backend, tag: str) -> list:
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(backend, f"{tag}{i}", p, PARAMS) for i, p in enumerate(PROMPTS))), 120)
    return results


def routes(backend, tag: str) -> list[tuple[str, str]]:
    return [(line["prefill"], line["decode"]) for line in backend.trace.recent if line["request_id"].startswith(tag)]


def roles(backend) -> dict[str, tuple[str, int, str]]:
    return {w.id: (w.role, w.epoch, w.state) for w in backend.workers()}


async def _auth_scenario(backend):
    app = create_app(backend, admin_token=TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://pdserve") as anon:
        missing = await anon.post("/admin/disaggregation", json={"enabled": False})
        wrong = await anon.get("/admin/state", headers={"Authorization": "Bearer nope"})
    async with admin(app) as client:
        malformed = await client.post("/admin/disaggregation", json={"enabled": "sometimes", "extra": 1})
        state = (await client.get("/admin/state")).json()
    plain = create_app(backend)  # no token: no admin endpoints at all
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://pdserve") as c:
        unmounted = await c.get("/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
    return missing, wrong, malformed, state, unmounted, roles(backend)


def test_admin_endpoints_need_the_token_and_refuse_bad_bodies_without_changing_anything(fresh_1p1d):
    missing, wrong, malformed, state, unmounted, after = fresh_1p1d.run(_auth_scenario(fresh_1p1d.backend))
    for answer in (missing, wrong):
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_admin_token"
    assert malformed.status_code == 400 and "error" in malformed.json()
    assert unmounted.status_code == 404
    assert state["state"] == "ACTIVE" and state["disaggregation"] is True
    assert after == {"prefill-0": ("prefill", 1, "live"), "decode-0": ("decode", 1, "live")}


async def _switch_scenario(backend):
    app = create_app(backend, admin_token=TOKEN)
    async with admin(app) as client:
        in_flight = asyncio.create_task(run_all(backend, "a"))
        await asyncio.sleep(0.2)
        off = (await client.post("/admin/disaggregation", json={"enabled": False})).json()
        during = await in_flight
        after_off = await run_all(backend, "b")
        roles_off, routes_off = roles(backend), routes(backend, "b")
        again = (await client.post("/admin/disaggregation", json={"enabled": False})).json()
        on = (await client.post("/admin/disaggregation", json={"enabled": True})).json()
        after_on = await run_all(backend, "c")
        state = (await client.get("/admin/state")).json()
    await wait_baseline(backend)
    backend.router.assert_no_leaks()
    return dict(off=off, during=during, after_off=after_off, roles_off=roles_off, routes_off=routes_off, again=again,
                on=on, after_on=after_on, routes_on=routes(backend, "c"), roles_on=roles(backend), state=state,
                metrics=backend.metrics_text().decode())


def test_disable_and_enable_switch_a_running_cluster_without_losing_a_token(expected, fresh_1p1d):
    r = fresh_1p1d.run(_switch_scenario(fresh_1p1d.backend))
    for results in (r["during"], r["after_off"], r["after_on"]):
        assert all(isinstance(event, FinishEvent) for _, event in results)
        assert [ids for ids, _ in results] == expected
    assert r["off"]["state"] == "PINNED"
    assert [(c["worker_id"], c["from_role"], c["to_role"], c["from_epoch"], c["to_epoch"]) for c in r["off"]["role_changes"]] \
        == [("prefill-0", "prefill", "colocated", 1, 2)]
    assert r["roles_off"] == {"prefill-0": ("colocated", 2, "live"), "decode-0": ("decode", 1, "live")}
    assert all(p == d for p, d in r["routes_off"])  # whole requests: no handoff
    assert (r["again"]["state"], r["again"]["role_changes"]) == ("PINNED", [])  # already off: roles checked, none changed
    assert r["on"]["state"] == "ACTIVE"
    assert [(c["from_role"], c["to_role"], c["to_epoch"]) for c in r["on"]["role_changes"]] == [("colocated", "prefill", 3)]
    assert r["roles_on"]["prefill-0"] == ("prefill", 3, "live")
    assert r["routes_on"] == [("prefill-0", "decode-0")] * len(PROMPTS)
    assert [h["state"] for h in r["state"]["history"]] == ["ACTIVE", "PINNED", "ACTIVE"]
    assert 'pdserve_role_changes_total{from_role="prefill",to_role="colocated"} 1.0' in r["metrics"]
    assert 'pdserve_role_changes_total{from_role="colocated",to_role="prefill"} 1.0' in r["metrics"]


async def _rollback_scenario():
    async with cluster(config()) as (backend, _):
        app = create_app(backend, admin_token=TOKEN)
        app.state.release.drain_window_s = 0.0  # abort every transfer still unpublished: the drain's order shows
        async with admin(app) as client:
            # the rollback starts while a transfer is surely unpublished: the long prompt's link is
            # open (admitted under route epoch 1: the margin lets the decode worker read and check
            # its manifest, and costs at most a chunk or two) with most of its prompt still to
            # compute, so it is still streaming when the drain comes (short prompts' transfers may
            # all publish, or be refused under the new route epoch and recomputed, before the
            # drain: a rollback with nothing to abort)
            long = asyncio.create_task(collect(backend, "L0", LONG, PARAMS))
            handoff_port = backend.registered["decode-0"].handoff_address[1]
            while not accepted(handoff_port):
                assert not long.done(), "the long request published before the rollback could start"
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
            in_flight = asyncio.create_task(run_all(backend, "a"))
            rolled = (await client.post("/admin/rollback")).json()
            during = await in_flight
            long_result = await asyncio.wait_for(long, 120)
            after = await run_all(backend, "b")
            twice = await client.post("/admin/rollback")
            # a message of the prefill worker's retired epoch is dropped and counted
            stale_before = backend.metrics.stale_messages._value.get()
            await backend._on_message(m.Heartbeat("prefill-0", 1, m.Load(0, 0, 0, 0, 0)))
            stale = backend.metrics.stale_messages._value.get() - stale_before
            state = (await client.get("/admin/state")).json()
            handoff = backend.router.handoff_enabled
            # enabled again after the rollback: handoffs verify under the new key (epoch 2) and route epoch 2
            again = (await client.post("/admin/disaggregation", json={"enabled": True})).json()
            later = await run_all(backend, "c")
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        return dict(rolled=rolled, during=during, after=after, twice=twice, state=state, routes=routes(backend, "b"),
                    handoff=handoff, metrics=backend.metrics_text().decode(), again=again, later=later,
                    later_routes=routes(backend, "c"), stale=stale, long=long_result)


def test_rollback_acts_in_the_spec_order_on_the_workers_and_every_request_finishes(expected, reference):
    """The effects, timed by the workers themselves: every worker holds the new route epoch before
    any transfer is cancelled; each aborted transfer is cancelled at its source before its
    destination frees the blocks; the role change completes after every free, and every worker
    installs the new key after it. Requests in flight finish with the single engine's tokens."""
    r = asyncio.run(_rollback_scenario())
    steps = {s["name"]: s for s in r["rolled"]["steps"]}
    assert list(steps) == list(ROLLBACK_ORDER) and r["rolled"]["state"] == "ROLLED_BACK"
    epoch_at = steps["ADVANCE_ROUTE_EPOCH"]["detail"]["installed_at_s"]
    drain = steps["DRAIN_OR_ABORT_TRANSFERS"]["detail"]
    key_at = steps["REVOKE_CAPABILITIES"]["detail"]["installed_at_s"]
    assert steps["ADVANCE_ROUTE_EPOCH"]["detail"]["route_epoch"] == 2 and sorted(epoch_at) == ["decode-0", "prefill-0"]
    assert drain["aborted"] >= 1 and len(drain["aborts"]) == drain["aborted"]
    for abort in drain["aborts"]:
        assert (abort["source"], abort["destination"]) == ("prefill-0", "decode-0")
        assert max(epoch_at.values()) <= abort["source_cancelled_at_s"] <= abort["destination_freed_at_s"]
    last_free = max(a["destination_freed_at_s"] for a in drain["aborts"])
    assert last_free <= steps["ENABLE_COLOCATED_FALLBACK"]["at_s"]
    assert steps["ENABLE_COLOCATED_FALLBACK"]["detail"]["role_changes"] == ["prefill-0:prefill->colocated@2"]
    assert steps["REVOKE_CAPABILITIES"]["detail"]["key_epoch"] == 2 and sorted(key_at) == ["decode-0", "prefill-0"]
    assert steps["ENABLE_COLOCATED_FALLBACK"]["at_s"] <= min(key_at.values())
    assert max(key_at.values()) <= steps["RECLAIM_UNPUBLISHED"]["at_s"]
    assert steps["RECLAIM_UNPUBLISHED"]["detail"] == {"unpublished": 0, "staging_holds": 0}
    assert r["state"]["state"] == "ROLLED_BACK" and r["state"]["route_epoch"] == 2
    assert r["again"]["state"] == "ACTIVE"
    assert r["later_routes"] == [("prefill-0", "decode-0")] * len(PROMPTS)
    for results in (r["during"], r["after"], r["later"]):
        assert [ids for ids, _ in results] == expected
    assert isinstance(r["long"][1], FinishEvent)
    assert r["long"][0] == list(reference.generate([list(LONG)], PARAMS)[0].output_ids)
    assert all(p == d for p, d in r["routes"]) and r["handoff"] is False
    assert r["twice"].status_code == 409 and r["twice"].json()["error"]["code"] == "illegal_release_transition"
    assert r["stale"] == 1  # late messages of aborted transfers may be counted too, before it
    assert "pdserve_rollback_seconds_count 1.0" in r["metrics"]


def test_a_short_drill_under_steady_load_ends_every_request_and_leaks_nothing():
    from pdserve.api.exercises.chaos import ChaosSpec
    from pdserve.api.exercises.drill import healthy, run_drill

    """The admin calls at 3, 6 and 9 s of a 12 s load: the rollback, the slowest (0.1 s on 2 idle
    cores, 3 s on 2 cores shared with other work: the prefill worker drains before it turns
    colocated), still runs under load."""
    spec = ChaosSpec(duration_s=12.0, kill_every_s=12.0, rate=2.0, max_in_flight=8, max_prompt=96, max_output=16,
                     hang_s=60.0, settle_s=120.0, seed=3)
    report = asyncio.run(run_drill(config(), spec))
    assert [(op["op"], op["status"], op.get("state")) for op in report["operations"]] == [
        ("disable", 200, "PINNED"), ("enable", 200, "ACTIVE"), ("rollback", 200, "ROLLED_BACK")]
    assert [name for name, _ in report["operations"][2]["steps"]] == list(ROLLBACK_ORDER)
    assert report["hung"] == 0 and report["cut"] == 0 and report["requests"] > 0
    assert report["completed"] + report["error"] == report["requests"]
    assert not report["leaked_workers"] and report["router_holds_clean"] and healthy(report)
    assert report["roles_after"] == {"prefill-0": ("colocated", 4), "decode-0": ("decode", 1)}


def test_a_prefill_worker_retired_during_the_rollback_comes_back_colocated():
    """A prefill worker that does not acknowledge the new route epoch is retired and restarted
    (as prefill: its launch role); the fallback step must still turn it colocated before the
    rollback reports ROLLED_BACK, or it serves nothing afterwards."""
    import os
    import signal

    from pdserve.router.process.release import ReleaseController
    from pdserve.workers.process.supervisor import RestartPolicy

    async def main():
        async with cluster(config(restart=RestartPolicy(first_delay_s=0.2, max_delay_s=1.0))) as (backend, launcher):
            # the stopped worker never answers, so any wait retires it; the live ones must answer in
            # it on a loaded machine (at 2 s, decode-0 was once retired too while the router's own
            # loop stalled for a second)
            control = ReleaseController(backend, ack_timeout_s=6.0)
            stopped = launcher.pid("prefill-0")
            os.kill(stopped, signal.SIGSTOP)  # silent at ADVANCE_ROUTE_EPOCH: retired, ended, restarted
            try:
                rolled = await control.rollback()
            finally:
                if launcher.pid("prefill-0") == stopped:
                    os.kill(stopped, signal.SIGKILL)
            steps = {s["name"]: s["detail"] for s in rolled["steps"]}
            assert sorted(steps["ADVANCE_ROUTE_EPOCH"]["installed_at_s"]) == ["decode-0"]
            assert rolled["state"] == "ROLLED_BACK"
            assert steps["ENABLE_COLOCATED_FALLBACK"]["role_changes"] == ["prefill-0:prefill->colocated@3"]
            assert roles(backend) == {"prefill-0": ("colocated", 3, "live"), "decode-0": ("decode", 1, "live")}
            ids, event = await collect(backend, "after", prompt(24, 2), SamplingParams(max_tokens=8, ignore_eos=True))
            assert isinstance(event, FinishEvent) and len(ids) == 8
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def test_a_worker_stopped_shorter_than_the_heartbeat_timeout_acknowledges_the_rollback_and_stays():
    """The control-ack wait is the heartbeat timeout (--heartbeat-timeout-s, 10 s here): a worker
    frozen for 6.5 s (as in a long engine step: control messages wait for it) at ADVANCE_ROUTE_EPOCH
    is not hung by the heartbeat rule, so the rollback must not retire it either. With a fixed 5 s
    ack wait it was retired (ended) although its heartbeats would have kept it."""
    import os
    import signal

    from pdserve.router.process.release import ReleaseController

    async def main():
        async with cluster(config(heartbeat_timeout_s=10.0)) as (backend, launcher):
            control = ReleaseController(backend)
            stopped = launcher.pid("prefill-0")
            os.kill(stopped, signal.SIGSTOP)
            resume = asyncio.get_running_loop().call_later(6.5, os.kill, stopped, signal.SIGCONT)
            try:
                rolled = await control.rollback()
            finally:
                resume.cancel()
                os.kill(stopped, signal.SIGCONT)
            steps = {s["name"]: s["detail"] for s in rolled["steps"]}
            assert sorted(steps["ADVANCE_ROUTE_EPOCH"]["installed_at_s"]) == ["decode-0", "prefill-0"]
            assert rolled["state"] == "ROLLED_BACK" and launcher.pid("prefill-0") == stopped
            assert roles(backend) == {"prefill-0": ("colocated", 2, "live"), "decode-0": ("decode", 1, "live")}
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
