"""Issue 36, parts 1, 2 and 7, through the server `pdserve serve --model tiny` builds with its
default flags (jsq, margin, the profile timed at start, no SLO flags): a follow-up whose history
only the decode worker holds is prefilled there from its cache; a long prompt is handed off beside
32 running decodes and prefilled locally beside none; and every response's usage says how many
prompt tokens were reused (`prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest
import uvicorn

from pdserve.api.app import create_app
from pdserve.api.backend import FinishEvent
from pdserve.cli import build_parser
from pdserve.commands.serve import serve_config
from pdserve.engine.sequence import SamplingParams
from pdserve.ports import free_local_port
from tests.runtime.conftest import collect, prompt, wait_baseline
from tests.runtime.shared_cluster import SharedCluster

BLOCK = 16


def default_server(port: int = 8000):
    """`pdserve serve --model tiny --kv-cache-mb 48`: every other flag at its default."""
    config = serve_config(build_parser().parse_args(["serve", "--model", "tiny", "--kv-cache-mb", "48"]), port)
    assert (config.policy, config.pd_decision, config.slo_ttft_s, config.slo_tpot_s) == ("jsq", "margin", None, None)
    return replace(config, restart=replace(config.restart, enabled=False))


@pytest.fixture(scope="module")
def served():
    """The default server, shared: each test leaves it at baseline with no leak; prompts differ."""
    shared = SharedCluster(default_server(free_local_port()))
    yield shared
    shared.close()


async def _fresh_reports(backend, count: int = 2) -> None:
    """Wait for `count` more heartbeats from every worker: the router's K/V index then holds the
    blocks of every request finished before (a heartbeat carries its block events)."""
    for _ in range(count):
        seen = {wid: id(load) for wid, load in backend.loads.items()}
        while any(id(backend.loads.get(wid)) == ref for wid, ref in seen.items()):
            await asyncio.sleep(0.02)


def test_a_follow_up_whose_history_only_d_holds_is_prefilled_there_from_its_cache(served):
    async def main(backend):
        first = prompt(BLOCK, 71)
        # turn 1: 1,010 tokens decoded at D after a 16-token prompt; the first 1,024 tokens of the
        # conversation (64 full blocks) are cached at D, P never saw past the prompt
        out, event = await collect(backend, "turn1", first, SamplingParams(max_tokens=1010, ignore_eos=True))
        assert isinstance(event, FinishEvent) and len(out) == 1010
        await wait_baseline(backend)
        await _fresh_reports(backend)  # the router's index holds turn 1's blocks
        follow_up = first + tuple(out[:1008]) + prompt(16, 73)  # the 1,024-token history and 16 new: 1,040
        _, event2 = await collect(backend, "turn2", follow_up, SamplingParams(max_tokens=4, ignore_eos=True))
        views = await wait_baseline(backend)
        slo = next(v.load["pd_slo"] for v in views if v.role == "decode")  # /workers says what the margin reads
        assert (slo["source"], slo["ttft_s"], slo["tpot_s"], slo["profile_scale"]) == ("profile", None, None, 5.0)
        backend.router.assert_no_leaks()
        return event2, {line["request_id"]: line for line in backend.trace.recent}

    event, lines = served.run(main(served.backend))
    turn2 = lines["turn2"]
    assert turn2["prompt_tokens"] == 1040 and turn2["pd_decision"] == "local" and turn2["decode"] == turn2["prefill"]
    # the pair's hits the decision read (jsq's choice too): D's 64 cached blocks, 16 tokens to compute
    # (the margin's arithmetic over them: tests/router/policy/test_pd_sees_caches_and_defaults.py)
    assert turn2["decode_hit_blocks"] == 64
    assert turn2["cached_tokens"] == 1024 and event.cached_tokens == 1024


def test_a_long_prompt_is_handed_off_beside_32_running_decodes_and_kept_beside_none(served):
    async def main(backend):
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        running = [asyncio.create_task(collect(backend, f"run{i}", prompt(16, 100 + i), params)) for i in range(32)]
        while sum(backend.router.heavy_light(next(w.id for w in backend.workers() if w.role == "decode"))) < 32:
            await asyncio.sleep(0.01)
        _, busy = await collect(backend, "busy", prompt(2048, 80), SamplingParams(max_tokens=2, ignore_eos=True))
        await asyncio.gather(*running)
        await wait_baseline(backend)
        await _fresh_reports(backend)
        _, idle = await collect(backend, "idle", prompt(2048, 81), SamplingParams(max_tokens=2, ignore_eos=True))
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        assert isinstance(busy, FinishEvent) and isinstance(idle, FinishEvent)
        return {line["request_id"]: line for line in backend.trace.recent}

    lines = served.run(main(served.backend))
    busy, idle = lines["busy"], lines["idle"]
    assert busy["pd_decision"] == "disaggregate" and busy["pd_delayed_batch"] >= 32 and busy["pd_reason"] == "margin"
    assert busy["pd_interference_saved_s"] > 0 and busy["pd_tpot_slo_s"] > 0  # the profile's target, not 5 s
    assert busy["pd_tpot_slo_s"] < 1.0 and busy["prefill"] != busy["decode"]
    assert idle["pd_decision"] == "local" and idle["pd_delayed_batch"] == 0 and idle["prefill"] == idle["decode"]
    assert idle["pd_interference_saved_s"] == 0.0


async def _usage_calls(backend, port: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1"
    ids = list(prompt(300, 74))
    words = " ".join(f"word{i}" for i in range(120))
    bodies = {
        "completion": ("/completions", {"model": "tiny", "prompt": ids, "max_tokens": 4, "ignore_eos": True}),
        "chat": ("/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": words}],
                                       "max_tokens": 4, "ignore_eos": True}),
    }
    usage = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for kind, (path, body) in bodies.items():
            for stream in (False, True):
                for turn in (1, 2):  # the same prompt twice: the second reuses the first's blocks
                    payload = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
                    reply = await client.post(url + path, json=payload)
                    assert reply.status_code == 200, reply.text
                    if stream:
                        chunks = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
                        assert chunks[-1] == "[DONE]"
                        usage[(kind, stream, turn)] = json.loads(chunks[-2])["usage"]  # the usage chunk
                    else:
                        usage[(kind, stream, turn)] = reply.json()["usage"]
                    await wait_baseline(backend)
                    await _fresh_reports(backend)
    return usage


def test_usage_counts_the_reused_prompt_tokens_streamed_and_not(served):
    async def main(backend):
        port = served.launcher.config.port
        server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        before = len(backend.trace.recent)
        usage = await _usage_calls(backend, port)
        server.should_exit = True
        await task
        backend.router.assert_no_leaks()
        return usage, [line.get("cached_tokens", 0) for line in backend.trace.recent[before:]]

    usage, traced = served.run(main(served.backend))
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage.values()] == traced  # the workers' own counts
    for (kind, stream, turn), u in usage.items():
        n = u["prompt_tokens"]
        # the first of each prompt computes it whole; every repeat reuses every full block but the one
        # holding the prompt's last position (always computed, for its logits)
        want = 0 if (stream, turn) == (False, 1) else (n - 1) // BLOCK * BLOCK
        assert u["prompt_tokens_details"] == {"cached_tokens": want}, (kind, stream, turn, u)
        assert u["total_tokens"] == n + u["completion_tokens"]
    assert usage[("completion", False, 1)]["prompt_tokens"] == 300 and usage[("chat", True, 2)]["prompt_tokens"] > 100
