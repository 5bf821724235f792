"""`pdserve serve --mode splitwise` (tiny model, 1 prompt + 2 token workers at start): a lasting
prompt backlog makes the pool controller move a token worker to the prompt pool through the one
role-change mechanism (drain, new epoch, register again); every request, before, during and after
the move, gets the tokens a single engine produces, and nothing leaks."""

from __future__ import annotations

import asyncio
import time

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.router.splitwise import Thresholds
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
PROMPTS = [prompt(300 + 11 * i, 900 + i) for i in range(10)]
# any queued prompt work counts as pressed; one observation is "lasting"; one move per run
MARKS = Thresholds(prompt_high_s=1e-6, prompt_low_s=0.0, kv_high=0.99, kv_low=0.9, hold=1, cooldown_s=3600.0)


async def _scenario():
    cfg = config(mode="splitwise", num_prefill=1, num_decode=2, splitwise=MARKS)
    async with cluster(cfg) as (backend, _):
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(backend, f"s{i}", p, PARAMS) for i, p in enumerate(PROMPTS))), 180)
        deadline = time.monotonic() + 60
        while sorted(w.role for w in backend.workers() if w.state == "live") != ["decode", "prefill", "prefill"]:
            assert time.monotonic() < deadline, [(w.id, w.role, w.state) for w in backend.workers()]
            await asyncio.sleep(0.1)
        after = await collect(backend, "after", PROMPTS[0], PARAMS)
        await wait_baseline(backend)
        backend.router.assert_no_leaks()
        return results, after, {w.id: (w.role, w.epoch) for w in backend.workers()}, backend.metrics_text().decode()


def test_a_prompt_backlog_moves_a_token_worker_to_the_prompt_pool():
    engine = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    expected = [list(engine.generate([list(p)], PARAMS)[0].output_ids) for p in PROMPTS]
    results, after, roles, metrics = asyncio.run(_scenario())
    assert all(isinstance(event, FinishEvent) for _, event in results)
    assert [ids for ids, _ in results] == expected and after[0] == expected[0]
    moved = [wid for wid, (role, epoch) in roles.items() if wid.startswith("decode") and role == "prefill"]
    assert len(moved) == 1 and roles[moved[0]][1] == 2 and roles["prefill-0"] == ("prefill", 1)
    assert 'pdserve_role_changes_total{from_role="decode",to_role="prefill"} 1.0' in metrics
