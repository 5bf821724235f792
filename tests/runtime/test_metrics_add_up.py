"""Metrics that add up under churn (issue 36, part 6), on a live 1P1D cluster with supervision:
repeated prompts hit the prefix cache, each worker is killed with kill -9 and started again under
its next epoch, and at every scrape the prefix-hit counters (pdserve's four disjoint `where`s and
vLLM's `prefix_cache_*`) have not gone backwards and sum to the cached tokens of the finished
requests; tier gauges are never negative and add up to each pool; the latency histograms count
every request and every inter-token gap, under pdserve's and vLLM's names."""

from __future__ import annotations

import asyncio
import re

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from tests.runtime.conftest import collect, config, prompt, wait_baseline
from tests.runtime.test_kv_index_runtime import until
from tests.runtime.test_supervision import FAST, wait_epoch

WHERE = ("local_device", "local_host", "remote_device", "remote_host")
MAX_TOKENS = 4
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
VLLM = '{engine="0",model_name="tiny"}'


def samples(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s][^ ]*) ([0-9.e+-]+)$", text, re.M)}


async def scrape(backend, runs: list) -> dict[str, float]:
    await wait_baseline(backend)
    await until(lambda: backend.hits.num_pending == 0)  # the hit counters settle at the workers' next reports
    return samples(backend.metrics_text().decode())


async def _scenario() -> tuple[list[dict[str, float]], list[tuple[int, int]]]:
    async with cluster(config(restart=FAST)) as (backend, launcher):
        runs: list[tuple[int, int]] = []  # (prompt tokens, cached tokens) of each finished request
        scrapes = []

        async def ask(rid: str, ids: tuple[int, ...]) -> None:
            tokens, event = await collect(backend, rid, ids, PARAMS)
            assert isinstance(event, FinishEvent) and len(tokens) == MAX_TOKENS
            runs.append((len(ids), event.cached_tokens))

        doc = prompt(64, 3)
        for i in range(3):
            await ask(f"a{i}", doc)
        scrapes.append(await scrape(backend, runs))
        for n, victim in enumerate(("prefill-0", "decode-0")):
            launcher.kill(victim)
            await wait_epoch(backend, victim, 2)
            for i in range(2):
                await ask(f"k{n}-{i}", doc)
            scrapes.append(await scrape(backend, runs))
        backend.router.assert_no_leaks()
        return scrapes, runs


def test_counters_survive_restarts_and_every_family_adds_up():
    scrapes, runs = asyncio.run(_scenario())
    assert sum(cached for _, cached in runs) > 0  # the repeats hit
    hit_names = [f'pdserve_prefix_hit_tokens_total{{where="{w}"}}' for w in WHERE]
    monotone = hit_names + [f"vllm:prefix_cache_queries_total{VLLM}", f"vllm:prefix_cache_hits_total{VLLM}",
                            f"vllm:time_to_first_token_seconds_count{VLLM}", "pdserve_inter_token_latency_seconds_count"]
    for before, after in zip(scrapes, scrapes[1:]):
        for name in monotone:
            assert after[name] >= before[name], name
    final = scrapes[-1]
    cached = sum(c for _, c in runs)
    assert sum(final[name] for name in hit_names) == final[f"vllm:prefix_cache_hits_total{VLLM}"] == cached
    assert final[f"vllm:prefix_cache_queries_total{VLLM}"] == sum(p for p, _ in runs)
    for name in (f"vllm:time_to_first_token_seconds_count{VLLM}", f"vllm:e2e_request_latency_seconds_count{VLLM}"):
        assert final[name] == len(runs)
    gaps = len(runs) * (MAX_TOKENS - 1)
    assert final["pdserve_inter_token_latency_seconds_count"] == final[f"vllm:inter_token_latency_seconds_count{VLLM}"] == gaps
    for scrape_ in scrapes:
        tiers = {k: v for k, v in scrape_.items() if k.startswith("pdserve_kv_tier_blocks{")}
        assert tiers and all(v >= 0 for v in tiers.values())
        for worker in ("prefill-0", "decode-0"):
            state = {k.split('state="')[1].split('"')[0]: v for k, v in tiers.items()
                     if f'worker="{worker}"' in k and 'tier="device"' in k}
            assert set(state) == {"used", "cached", "free"}  # the pool: used + cached + free, none negative
            assert state["cached"] + state["free"] == max(0, scrape_[f'pdserve_free_blocks{{worker="{worker}"}}'])
        assert 0.0 <= scrape_[f"vllm:kv_cache_usage_perc{VLLM}"] <= 1.0
        assert scrape_[f"vllm:num_requests_running{VLLM}"] == scrape_[f"vllm:num_requests_waiting{VLLM}"] == 0
