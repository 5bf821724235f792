"""The rollback's acknowledged control messages (router/process/control_acks.py), driven with typed
worker messages, no processes: the key rotation waits for every live worker's `ControlAck`, a
worker that stays silent is retired (deregistered and handed to the launcher to be ended), and an
ack for another subject or from nobody waited on changes nothing."""

from __future__ import annotations

import asyncio

from pdserve.workers import messages as m
from tests.router.process.test_router_frontend import Harness


def test_a_key_rotation_waits_for_every_worker_and_retires_the_silent_one():
    async def scenario():
        h = Harness(["prefill-0"], ["decode-0"])
        hung: list[tuple[str, int]] = []
        h.backend.on_worker_hung = lambda wid, epoch, reason: hung.append((wid, epoch))
        rotation = asyncio.create_task(h.backend.revoke_capabilities(ack_timeout_s=0.5))
        sent = [await h.next_sent(m.CapabilityKey) for _ in range(2)]
        await h.deliver(m.ControlAck("decode-0", 1, "capability_key", "1", 5.0))  # the old epoch: not this rotation
        await h.deliver(m.ControlAck("decode-0", 1, "capability_key", "2", 7.0))
        result = await rotation
        return h, hung, sent, result

    h, hung, sent, result = asyncio.run(scenario())
    assert sorted(wid for wid, _ in sent) == ["decode-0", "prefill-0"] and {k.key_epoch for _, k in sent} == {2}
    assert result == {"key_epoch": 2, "installed_at_s": {"decode-0": 7.0}}
    assert hung == [("prefill-0", 1)] and sorted(h.backend.registered) == ["decode-0"]
    assert "prefill-0" in h.backend.away and h.backend.router.worker_state("prefill-0") is None
