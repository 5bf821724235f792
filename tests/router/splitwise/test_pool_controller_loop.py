"""The router process's side of Splitwise (router/process/role_control.py) over a pure router and
a stand-in backend: a lend and a return are router calls (no ChangeRole, no drain, the same
epoch); only an adoption is a role change, and the controller keeps observing while one runs
(here one that never completes: the worker never registers again); the pools are observed over
the LIVE workers while another drains."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import PdPolicy
from pdserve.router.process.role_control import (
    apply_move,
    pool_signals,
    run_pool_controller,
)
from pdserve.router.router import Router
from pdserve.router.splitwise.splitwise import Move, PoolController, Thresholds
from pdserve.router.state.registry import WorkerState
from pdserve.workers import messages as m

ROLE = {"p": "prefill", "d": "decode", "m": "mixed"}


class Backend:
    """What role_control reads and calls on the router process's backend, nothing more."""

    def __init__(self, pending: dict[str, int]):
        self.router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", pd=PdPolicy("always")))
        self.registered, self.loads, self.live, self.sent = {}, {}, {}, []
        for wid, tokens in pending.items():
            self.registered[wid] = SimpleNamespace(role=ROLE[wid[0]], epoch=1)
            self.router.register(WorkerInfo(wid, "h0", Role(ROLE[wid[0]]), 1, 100, "m", "abi"))
            self.router.report_load(wid, 1, WorkerLoad(tokens, 0, 100))
            self.loads[wid] = m.Load(tokens, 0, 0, 100, 0, num_blocks=100)
        registry = CollectorRegistry()
        self.metrics = SimpleNamespace(pool_moves=Counter("moves", "", ["kind"], registry=registry),
                                       role_changes=Counter("changes", "", ["from_role", "to_role"], registry=registry))
        self.control_auth = SimpleNamespace(advance=lambda wid, epoch: None)
        self.on_role_changed = lambda wid, role, epoch: None
        self.failed_workers = lambda: []

    async def _send(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg))  # the worker never registers again: a move that does not end
        return True


def test_a_lend_and_a_return_are_router_calls_without_a_drain_or_a_new_epoch():
    backend = Backend({"p0": 0, "d0": 0, "d1": 0})
    assert apply_move(backend, Move("d0", "prefill", "test")) is None  # done at once
    assert backend.router.lent_to("d0") is Role.PREFILL and backend.router.worker_state("d0") is WorkerState.LIVE
    assert backend.router.snapshot().prefill.worker_ids == ("p0", "d0")
    assert apply_move(backend, Move("d0", "decode", "test", "return")) is None
    assert backend.router.lent_to("d0") is None and backend.router.snapshot().prefill.worker_ids == ("p0",)
    assert backend.sent == [] and backend.registered["d0"].epoch == 1  # no ChangeRole: nothing drained


def test_the_pools_are_observed_over_the_live_workers_while_one_drains():
    backend = Backend({"p0": 4096, "d0": 0, "d1": 0})
    backend.router.drain("d1", 1)
    signals = pool_signals(backend)
    assert signals is not None and set(signals.prompt_queue_s) == {"p0"} and set(signals.kv_used) == {"d0"}
    assert signals.prompt_queue_s["p0"] > 0


async def _observe_through_an_adoption(backend: Backend, controller: PoolController) -> tuple[int, list]:
    seen = []
    observe = controller.observe
    controller.observe = lambda signals, now_s: seen.append(now_s) or observe(signals, now_s)
    loop = asyncio.create_task(run_pool_controller(backend, controller, period_s=0.01))
    deadline = asyncio.get_running_loop().time() + 10
    while not backend.sent:  # lent at once, adopted after adopt_after_s: the ChangeRole goes out
        assert asyncio.get_running_loop().time() < deadline, controller.moves
        await asyncio.sleep(0.01)
    at_change = len(seen)
    await asyncio.sleep(0.5)  # the adoption waits for a registration that never comes
    during = len(seen) - at_change
    loop.cancel()
    return during, [(mv.worker_id, mv.to_role, mv.kind) for mv in controller.moves]


def test_the_controller_keeps_observing_while_an_adoption_runs():
    backend = Backend({"p0": 1_000_000, "d0": 0, "d1": 0})  # a lasting prompt backlog, idle decode workers
    marks = Thresholds(prompt_high_s=1e-6, prompt_low_s=0.0, kv_high=0.99, kv_low=0.9, hold=1, cooldown_s=0.0,
                       adopt_after_s=0.05)
    controller = PoolController(marks)
    during, moves = asyncio.run(_observe_through_an_adoption(backend, controller))
    # both decode workers lent at once (they keep decoding); the older loan adopted, the other
    # stays a loan: d1 is the token pool's last LIVE worker while d0 drains
    assert moves == [("d0", "prefill", "lend"), ("d1", "prefill", "lend"), ("d0", "prefill", "change")]
    assert [(wid, type(msg).__name__, msg.role, msg.epoch) for wid, msg in backend.sent] == [("d0", "ChangeRole", "prefill", 2)]
    assert backend.router.worker_state("d0") is WorkerState.DRAINING  # the one role-change mechanism, still waiting
    assert during >= 10  # observed all along (every 0.01 s for 0.5 s), not blocked on the move


async def _lend_then_restart(backend: Backend, controller: PoolController) -> tuple[dict, dict]:
    loop = asyncio.create_task(run_pool_controller(backend, controller, period_s=0.01))
    while not controller.loans:
        await asyncio.sleep(0.01)
    lent = dict(controller.loans)
    backend.registered["d0"].epoch = 2  # d0 restarts: its supervisor brings it back in its launch role
    backend.router.register(WorkerInfo("d0", "h0", Role.DECODE, 2, 100, "m", "abi"))
    backend.router.report_load("d0", 2, WorkerLoad(0, 0, 100))
    for _ in range(50):
        await asyncio.sleep(0.01)
    loop.cancel()
    return lent, dict(controller.loans)


def test_a_loan_the_router_no_longer_holds_is_forgotten():
    backend = Backend({"p0": 1_000_000, "d0": 0, "d1": 0})
    marks = Thresholds(prompt_high_s=1e-6, prompt_low_s=0.0, kv_high=0.99, kv_low=0.9, hold=1, cooldown_s=3600.0)
    lent, after = asyncio.run(_lend_then_restart(backend, PoolController(marks)))
    assert set(lent) == {"d0"} and after == {} and backend.router.lent_to("d0") is None


async def _observe(backend: Backend, controller: PoolController, n: int) -> None:
    """Run the controller loop for `n` observations."""
    seen = []
    observe = controller.observe
    controller.observe = lambda signals, now_s: seen.append(now_s) or observe(signals, now_s)
    loop = asyncio.create_task(run_pool_controller(backend, controller, period_s=0.005))
    while len(seen) < n:
        await asyncio.sleep(0.005)
    loop.cancel()
    controller.observe = observe


def test_a_prompt_backlog_goes_to_an_idle_mixed_worker_before_a_decode_worker_is_lent():
    backend = Backend({"p0": 1_000_000, "d0": 0, "d1": 0, "m0": 0})  # m0: mixed, idle
    marks = Thresholds(prompt_high_s=1.0, prompt_low_s=0.1, kv_high=0.99, kv_low=0.9, hold=2, cooldown_s=0.0)
    controller = PoolController(marks)
    assert pool_signals(backend).mixed_kv_used == {"m0": 0.0}
    asyncio.run(_observe(backend, controller, 8))
    assert backend.router.mixed_offer.prefill and controller.moves == []
    assert [backend.router.lent_to(w) for w in ("d0", "d1")] == [None, None]
    backend.loads["m0"] = m.Load(1_000_000, 0, 0, 100, 0, num_blocks=100)  # m0's own queue is full now
    asyncio.run(_observe(backend, controller, 8))
    assert [(mv.worker_id, mv.to_role, mv.kind) for mv in controller.moves][:1] == [("d0", "prefill", "lend")]
    assert backend.router.lent_to("d0") is Role.PREFILL


def test_a_prefill_workers_k_v_in_use_is_observed_for_the_token_pool_it_may_be_lent_to():
    backend = Backend({"p0": 0, "p1": 0, "d0": 0})
    backend.loads["p1"] = m.Load(0, 0, 0, 25, 0, num_blocks=100)  # 75 of its 100 blocks in use
    controller = PoolController(Thresholds(kv_high=0.8, kv_low=0.5, hold=1, cooldown_s=0.0))
    controller.loans["p1"] = ("prefill", 0.0)  # lent to the token pool
    signals = pool_signals(backend)
    assert signals.prefill_kv_used == {"p0": 0.0, "p1": 0.75} and signals.kv_used == {"d0": 0.0}
    assert controller.observe(signals, 1.0) is None and controller.loans == {"p1": ("prefill", 0.0)}  # 75%: not calm
