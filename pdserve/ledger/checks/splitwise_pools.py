"""Check: Splitwise prompt/token/mixed pools (spec 0x08F-0x08I).

Covers pending-token JSQ with K/V headroom and mixed spill, static vs mixed capacity, FCFS
prompt batching under a token cap, the mixed-machine preemption guard, per-layer visibility
vs serialized completion, transfer-method choice and role-epoch transitions.
"""

from __future__ import annotations

from typing import Any

from pdserve.ledger.checks.common import expect_equal, expect_rounded, get, ledger_errors, number, require_synthetic
from pdserve.ledger.splitwise import (
    RoleState,
    WorkerLoad,
    admits_assignment,
    choose_mixed_phase,
    enter_mixed,
    fcfs_prompt_batch,
    jsq_by_pending_tokens,
    layer_visibility_s,
    leave_mixed,
    mixed_capacity,
    serialized_completion_s,
    static_capacity_rps,
    transfer_method,
)


def _workers(rows: list[dict]) -> list[WorkerLoad]:
    return [WorkerLoad(r["name"], r["pending_tokens"], r.get("kv_free_bytes", 0)) for r in rows]


def _route(case: dict) -> dict[str, str | None]:
    prompt = jsq_by_pending_tokens(_workers(case["prompt_pool"]))
    if prompt is None or prompt.pending_tokens > case["spill_threshold_tokens"]:
        prompt = jsq_by_pending_tokens(_workers(case["mixed_pool"]))
    token = jsq_by_pending_tokens(_workers(case["token_pool"]), case["kv_reservation_bytes"])
    return {"prompt": prompt and prompt.name, "token": token and token.name}


def _capacity(fx: dict) -> dict[str, float]:
    c = get(fx, "capacity", dict)
    with ledger_errors():
        mixed = mixed_capacity(c["prompt_machines"], c["prompt_rps"], c["token_machines"], c["token_rps"], c["borrowed"], c["mixed_rps"])
    derived = {
        "static_rps": static_capacity_rps(c["prompt_machines"], c["prompt_rps"], c["token_machines"], c["token_rps"]),
        "mixed_prompt_side_rps": mixed.prompt_side_rps,
        "mixed_token_side_rps": mixed.token_side_rps,
        "mixed_rps": mixed.system_rps,
    }
    for key, value in derived.items():
        expect_rounded(f"capacity.{key}", value, number(fx, f"capacity.expected.{key}"), 6)
    return derived


def _batching(fx: dict) -> dict[str, int]:
    queue, cap = get(fx, "batching.queue_tokens", list), get(fx, "batching.token_cap", int)
    admitted = fcfs_prompt_batch(queue, cap)
    used = sum(queue[:admitted])
    derived = {"admitted": admitted, "admitted_tokens": used, "residual_tokens": cap - used}
    for key, value in derived.items():
        expect_equal(f"batching.{key}", value, get(fx, f"batching.expected.{key}"))
    return derived


def _preemption(fx: dict) -> list[str]:
    age_ms, cap = number(fx, "preemption.age_override_ms", 0), get(fx, "preemption.max_preemptions", int)
    out = []
    for case in get(fx, "preemption.cases", list):
        chosen = choose_mixed_phase(case["prompt_pending"], case["age_ms"], case["preemptions"], age_ms, cap)
        expect_equal(f"preemption case {case['name']!r}", chosen, case["expected"])
        out.append(chosen)
    return out


def _layer_transfer(fx: dict) -> dict[str, Any]:
    ready, xfer = get(fx, "layer_transfer.ready_ms", list), get(fx, "layer_transfer.transfer_ms", list)
    with ledger_errors():
        visible = layer_visibility_s(ready, xfer)
        serialized = serialized_completion_s(ready, xfer)
    derived = {
        "visible_ms": visible,
        "serialized_ms": serialized,
        "exposed_after_prefill_ms": visible[-1] - ready[-1],
        "hidden_ms": serialized - visible[-1],
    }
    for key, value in derived.items():
        expect_equal(f"layer_transfer.{key}", value, get(fx, f"layer_transfer.expected.{key}"))
    return derived


def _roles(fx: dict) -> list[dict]:
    initial = get(fx, "roles.initial", dict)
    state = RoleState(initial["role"], initial["epoch"], initial.get("origin"))
    trail = []
    for step in get(fx, "roles.transitions", list):
        with ledger_errors():
            state = {"enter_mixed": enter_mixed, "leave_mixed": leave_mixed}[step["action"]](state)
        expected = step["expected"]
        got = {"role": state.role, "epoch": state.epoch, **({"origin": state.origin} if state.origin else {})}
        expect_equal(f"role transition {step['action']}", got, expected)
        trail.append(got)
    for item in get(fx, "roles.assignments", list):
        decision = "admit" if admits_assignment(RoleState("ANY", item["admit_at_epoch"]), item["assigned_epoch"]) else "reject"
        expect_equal(f"assignment {item['request']} (epoch {item['assigned_epoch']})", decision, item["expected"])
    return trail


def check(fx: dict) -> dict[str, Any]:
    require_synthetic(fx)
    routes = []
    for case in get(fx, "routing_cases", list):
        route = _route(case)
        expect_equal(f"route {case['name']!r}", route, case["expected"])
        routes.append(route)
    methods = []
    threshold = get(fx, "transfer_method.per_layer_threshold_tokens", int)
    for case in get(fx, "transfer_method.cases", list):
        method = transfer_method(case["prompt_tokens"], threshold)
        expect_equal(f"transfer method for {case['prompt_tokens']} tokens", method, case["expected"])
        methods.append(method)
    return {
        "routes": routes,
        "capacity": _capacity(fx),
        "batching": _batching(fx),
        "preemption": _preemption(fx),
        "layer_transfer": _layer_transfer(fx),
        "transfer_methods": methods,
        "roles": _roles(fx),
    }
