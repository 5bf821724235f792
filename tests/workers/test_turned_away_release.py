"""A transfer aborted by its owner while an unauthenticated link is being turned away has its
record released at once.

The owner (decode_side.abort, fetch, KV-Runahead) aborts and calls `release`, which keeps the
record while a link claims the transfer: "now, or when its link's end is reported". A turned-away
link (a forged first manifest, workers/handoff_io.py) reports nothing, so it must never hold the
claim: the listener screens the signature before the link may claim the transfer. Before that, a
forger screened after its claim made the owner's release wait for a report that never came, and
the record stayed for the worker's life (handoff_records never back to 0).
"""

from __future__ import annotations

import msgspec

from pdserve.handoff.trust.capability import peek  # noqa: F401  (capabilities module loads)
from pdserve.handoff.errors import RejectReason
from pdserve.router.process.capabilities import CapabilityIssuer
from tests.workers.test_capability_enforcement import PROMPT, open_pair, signed
from tests.handoff.world import make_world


def test_an_abort_while_a_forger_is_turned_away_does_not_keep_the_record():
    world = make_world(num_tokens=len(PROMPT), shm=False)
    try:
        sender, listener, plan, request, done = open_pair(world, "tcp", source_checks=False)
        tid = request.transfer_id
        original = world.endpoint.turn_away

        def turn_away_then_owner_aborts(transfer_id, reason):
            ack = original(transfer_id, reason)
            # the router's Abort (client gone) reaches the owner now, with the forger's claim still held
            world.endpoint.abort(transfer_id, RejectReason.CANCELLED)
            assert world.endpoint.release(transfer_id)  # no link carries it: the record goes now
            return ack

        world.endpoint.turn_away = turn_away_then_owner_aborts
        forged = msgspec.structs.replace(plan, capability=signed(plan, world, issuer=CapabilityIssuer()))
        sender.start(request.request_id, PROMPT, world.src_blocks, forged, request.tenant, "serialized")
        gate = sender.gate(request.request_id)
        if gate is not None:
            gate.mark_all_ready()
        side, _, _ = done.get(timeout=30)
        assert side == "source"  # the forger read its refusal
        assert tid not in world.endpoint.transfers, "the aborted transfer's record was kept"
        assert not world.endpoint.claim(tid)  # and its link claim is gone
        listener.close()
    finally:
        world.close()
