"""The shared cluster's `run` when its event loop dies under it.

A SystemExit raised in any task on the loop (uvicorn exits so when the port it was given is
already taken, a race under load) ends `run_forever`; a coroutine submitted to the dead loop
never finishes, and waiting on it took the test's whole timeout (600 s) before. `run` raises as
soon as the loop's thread is gone.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.runtime.shared_cluster import SharedCluster


async def _exit_soon():
    await asyncio.sleep(0.1)
    raise SystemExit(1)


async def _a_task_exits_while_this_waits():
    asyncio.get_running_loop().create_task(_exit_soon())
    await asyncio.sleep(3600)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit is the point
def test_run_raises_once_the_loop_died_instead_of_waiting_out_its_timeout():
    cluster = SharedCluster.__new__(SharedCluster)  # the loop and thread alone, as __init__ makes them
    cluster.loop = asyncio.new_event_loop()
    cluster.thread = threading.Thread(target=cluster.loop.run_forever, daemon=True)
    cluster.thread.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="event loop stopped"):
        cluster.run(_a_task_exits_while_this_waits(), timeout_s=60.0)
    assert time.monotonic() - t0 < 30.0
    cluster.thread.join(5)
    cluster.loop.close()
