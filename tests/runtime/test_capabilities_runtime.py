"""`pdserve serve` enforces transfer capabilities: the router signs every transfer, the workers
hold only its public key. A 1P1D cluster serves exactly with them on; once the router signs with
a key the workers were never given (a rotation they were not told of), the memory owner denies
the transfer, the denial is counted by reason, the request still finishes with the same tokens
(the decode-start fallback recomputes it) and every pool returns to baseline."""

from __future__ import annotations

import asyncio

from pdserve.api.backend import FinishEvent
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.handoff.errors import CAPABILITY_DENIALS
from tests.router.process.test_router_metrics import sample
from tests.runtime.conftest import WORKER_THREADS, collect, config, prompt, wait_baseline


def denials(backend) -> dict[str, float]:
    text = backend.metrics_text().decode()
    return {r.value: sample(text, "pdserve_capability_denials_total", f'reason="{r.value}"') for r in CAPABILITY_DENIALS}


def test_serve_signs_every_transfer_and_denies_an_untrusted_key():
    reference = Engine(EngineConfig(model="tiny", num_blocks=256, num_threads=WORKER_THREADS))
    cases = [(prompt(n, 60 + i), SamplingParams(max_tokens=8, ignore_eos=True, temperature=t, seed=3 + i))
             for i, (n, t) in enumerate([(40, 0.0), (150, 0.8), (70, 0.0)])]
    expected = [list(reference.generate([list(p)], s)[0].output_ids) for p, s in cases]

    async def main():
        async with cluster(config(transport="auto")) as (backend, _):
            good = await asyncio.gather(*(collect(backend, f"ok{i}", p, s) for i, (p, s) in enumerate(cases[:2])))
            assert [ids for ids, _ in good] == expected[:2] and all(isinstance(e, FinishEvent) for _, e in good)
            assert backend.capabilities.num_issued == 2 and set(denials(backend).values()) == {0}
            await wait_baseline(backend)

            backend.capabilities.rotate()  # the workers still trust only the first key
            ids, event = await collect(backend, "denied", *cases[2])
            assert isinstance(event, FinishEvent) and ids == expected[2]  # recomputed, same seed
            counts = denials(backend)
            assert counts.pop("capability_forged") == 1 and set(counts.values()) == {0}
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())


def test_a_worker_restarted_across_a_key_rotation_gets_the_new_key_when_it_registers():
    """A worker the supervisor started again before a rotation (its launch config holds the old
    key) that registers only after the rotation's broadcast (it was loading, so not asked) must
    still verify with the new key: otherwise every transfer to it is denied from then on."""
    import os
    import signal

    from pdserve.workers.process.supervisor import RestartPolicy
    from tests.runtime.test_hung_workers import until
    from tests.runtime.test_supervision import wait_epoch

    async def main():
        async with cluster(config(restart=RestartPolicy(first_delay_s=0.2, max_delay_s=1.0))) as (backend, launcher):
            old = launcher.pid("decode-0")
            launcher.kill("decode-0")
            await until(lambda: launcher.pid("decode-0") != old, 30, "decode-0 started again")
            os.kill(launcher.pid("decode-0"), signal.SIGSTOP)  # held before it registers
            try:
                assert "decode-0" not in backend.registered
                rotated = await backend.revoke_capabilities(2.0)
                assert rotated["key_epoch"] == 2 and list(rotated["installed_at_s"]) == ["prefill-0"]
            finally:
                os.kill(launcher.pid("decode-0"), signal.SIGCONT)
            await wait_epoch(backend, "decode-0", 2)
            ids, event = await collect(backend, "after", prompt(40, 7), SamplingParams(max_tokens=8, ignore_eos=True))
            assert isinstance(event, FinishEvent) and len(ids) == 8
            assert set(denials(backend).values()) == {0}  # the handoff was allowed, not recomputed
            await wait_baseline(backend)
            backend.router.assert_no_leaks()

    asyncio.run(main())
