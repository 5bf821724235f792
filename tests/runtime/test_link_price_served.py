"""The handoff link's price in the served runtime (1P1D, every request handed off, a profile
file: a measured link prices only a fitted model): before any transfer the router prices the
link at the documented prior; after some, every cost model it routes and decides with carries
the least-squares fit of exactly the transfers the prefill worker reported
(router/pricing/link_rates.py), recomputed here from those reports."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.sequence import SamplingParams
from pdserve.router.pricing.cost import CostModel
from pdserve.workers import messages as m
from tests.runtime.conftest import collect, config, prompt, wait_baseline

LENGTHS = (20, 40, 70, 100, 150, 200)  # below the layer-wise threshold: serialized transfers, distinct sizes


def reference_fit(samples: list[tuple[int, float]], prior: CostModel) -> tuple[float, float]:
    """(same-host bytes/s, overhead s) of same-host samples, as link_rates.py's contract states it."""
    x = np.array([s[0] for s in samples], dtype=np.float64)
    t = np.array([s[1] for s in samples], dtype=np.float64)
    (a, u), _, rank, _ = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), t, rcond=None)
    if rank == 2 and a >= 0 and u > 0:
        return 1.0 / u, a
    a = min(max(a if rank == 2 else prior.transfer_overhead_s, 0.0), t.min())
    return 1.0 / max((t - a).sum() / x.sum(), 1e-12), a


def test_the_router_prices_the_link_at_the_fit_of_the_reported_transfers(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"prefill_coef": [0.005, 0.001, 0.0], "decode_coef": [0.01, 0.001, 0.0]}))

    async def main():
        async with cluster(config(pd_profile=str(profile))) as (backend, _):
            reports, original = [], backend._on_message

            async def recording(msg):  # test wrapper: every message as the router receives it
                if isinstance(msg, m.TransferDone) and msg.side == "source" and msg.published:
                    reports.append(msg)
                await original(msg)

            backend._on_message = recording
            snapshot = backend.router.snapshot()
            before = backend.router.pair_cost(snapshot, 0, 0)
            for i, n in enumerate(LENGTHS):
                _, event = await collect(backend, f"r{i}", prompt(n, i), SamplingParams(max_tokens=3, ignore_eos=True))
                assert isinstance(event, FinishEvent)
            await wait_baseline(backend)
            after = backend.router.pair_cost(backend.router.snapshot(), 0, 0)
            return before, after, reports, backend.router.config.cost, backend.router.link.price

    before, after, reports, prior, price = asyncio.run(main())
    assert before.fitted and (before.same_host_bytes_per_s, before.transfer_overhead_s) == (20e9, 1e-3)  # the prior
    assert len(reports) == len(LENGTHS) and all(r.serialized and r.dest_worker == "decode-0" for r in reports)
    assert len({r.logical_bytes for r in reports}) == len(LENGTHS)
    bandwidth, overhead = reference_fit([(r.logical_bytes, r.transfer_s) for r in reports], prior)
    assert price.num_samples == len(LENGTHS)
    assert after.same_host_bytes_per_s == pytest.approx(bandwidth, rel=1e-9)
    assert after.transfer_overhead_s == pytest.approx(overhead, rel=1e-9, abs=1e-15)
    assert after.cross_host_bytes_per_s == min(prior.cross_host_bytes_per_s, after.same_host_bytes_per_s)
