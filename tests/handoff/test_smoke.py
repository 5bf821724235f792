"""End-to-end happy path over the in-process transport, driven by the shared loops."""

from __future__ import annotations

import threading

from pdserve.handoff.driver import DriveConfig, drive_source, serve_destination
from pdserve.handoff.states import TxnState
from pdserve.handoff.transports.copy import inproc_links

from tests.handoff.world import make_world, open_transfer, published_bytes_equal, reserve_request


def test_inproc_end_to_end_publishes_exact_bytes():
    world = make_world()
    req = reserve_request(world)
    manifest, src = open_transfer(world, req)
    src.gate.mark_all_ready()
    s_link, r_link = inproc_links(world.dst_pool)
    t = threading.Thread(target=serve_destination, args=(world.endpoint, r_link, req.transfer_id),
                         kwargs={"until": lambda: src.state in (TxnState.PUBLISHED, TxnState.ABORTED)})
    t.start()
    drive_source(src, s_link, DriveConfig(ack_timeout_s=0.5, give_up_s=10))
    t.join(10)
    assert src.state is TxnState.PUBLISHED
    assert world.endpoint.transfers[req.transfer_id].state is TxnState.PUBLISHED
    assert published_bytes_equal(world, "req-1")
    world.endpoint.admit("req-1")
    assert src.release_source() == world.src_blocks
    world.assert_no_leaks()
    world.close()
