"""`pdserve drill`: the release drill — disable, enable, then roll back disaggregation under load.

Contract: `run_drill(config, spec)` serves `config` (a disaggregated cluster) with the admin
endpoints on a free local port and sends the chaos load (api/exercises/chaos.py: seeded streaming requests,
each classified completed / error / hung / cut) for `spec.duration_s`. At a quarter of the time it
POSTs /admin/disaggregation {"enabled": false}, at half {"enabled": true}, at three quarters
/admin/rollback, each over HTTP with the admin token, and records the answer and how long it
took. After the load it waits for the workers to be idle and reports leaked blocks and router
holds. A healthy drill: every admin call answered 200, nothing hung or cut, nothing leaked.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace

import httpx

from pdserve.api.exercises.chaos import ChaosSpec, Tally, _load, _router_clean, _settle
from pdserve.api.server import ServeConfig, cluster, model_name
from pdserve.ports import free_local_port

STEPS = (("disable", "/admin/disaggregation", {"enabled": False}), ("enable", "/admin/disaggregation", {"enabled": True}),
         ("rollback", "/admin/rollback", None))


async def _operator(base: str, token: str, spec: ChaosSpec, t0: float) -> list[dict]:
    """The three admin calls at 1/4, 1/2 and 3/4 of the load."""
    done = []
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(None, connect=10.0)) as client:
        for k, (name, path, body) in enumerate(STEPS, start=1):
            await asyncio.sleep(max(0.0, t0 + spec.duration_s * k / 4 - time.monotonic()))
            sent = time.monotonic()
            answer = await (client.post(path, json=body) if body is not None else client.post(path))
            record = {"op": name, "at_s": round(sent - t0, 2), "status": answer.status_code,
                      "seconds": round(time.monotonic() - sent, 3)}
            if answer.status_code == 200:
                result = answer.json()
                record["state"] = result.get("state")
                if name == "rollback":
                    record["steps"] = [(s["name"], round(s["elapsed_s"], 3)) for s in result["steps"]]
            done.append(record)
    return done


async def run_drill(config: ServeConfig, spec: ChaosSpec) -> dict:
    import uvicorn

    from pdserve.api.app import create_app
    from pdserve.model.config import load_config
    from pdserve.model.default import resolve_model

    vocab, model, port, tally = load_config(resolve_model(config.engine.model)).vocab_size, model_name(config), free_local_port(), Tally()
    token = secrets.token_hex(16)
    async with cluster(replace(config, port=port)) as (backend, _launcher):
        app = create_app(backend, admin_token=token)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        first_epoch = {w.id: w.epoch for w in backend.workers()}
        t0 = time.monotonic()
        operator = asyncio.create_task(_operator(f"http://127.0.0.1:{port}", token, spec, t0))
        await _load(f"http://127.0.0.1:{port}/v1/completions", spec, vocab, model, tally)
        ops = await operator
        settled = await _settle(backend, set(), first_epoch, spec.settle_s)
        holds_ok = _router_clean(backend)
        roles = {w.id: (w.role, w.epoch) for w in backend.workers()}
        server.should_exit = True
        await serving
    total = sum(tally.counts.values())
    return {"requests": total, **tally.counts, "completed_ratio": tally.counts["completed"] / total if total else 0.0,
            "operations": ops, "router_holds_clean": holds_ok, "leaked_workers": settled["leaked_workers"],
            "roles_after": roles, "error_kinds": dict(sorted(tally.errors.items(), key=lambda kv: -kv[1])[:8]),
            "duration_s": spec.duration_s, "rate": spec.rate}


def healthy(report: dict) -> bool:
    return (report["hung"] == 0 and report["cut"] == 0 and not report["leaked_workers"] and report["router_holds_clean"]
            and [op["status"] for op in report["operations"]] == [200, 200, 200])
