"""One served cluster shared by several tests of a module.

A cluster costs seconds to start and stop (worker processes import torch, load the model, probe
the CPU). Tests that only need the same deployment at baseline serve from one `SharedCluster`:
`cluster(cfg)` stays open on an event loop in a background thread and `run(coro)` runs a test's
coroutine there. Contract: every test that uses it leaves the cluster where it found it (its
requests finished, `wait_baseline` and `assert_no_leaks` passed), kills nothing and changes no
setting, except the module's last user, which may change roles (its fixture's docstring names
it); a test that faults a worker or needs counters from zero starts its own cluster."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine

from pdserve.api.server import ServeConfig, cluster


class SharedCluster:
    def __init__(self, config: ServeConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="shared-cluster")
        self.thread.start()
        self._served = cluster(config)
        try:
            self.backend, self.launcher = self.run(self._served.__aenter__())
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Coroutine, timeout_s: float = 600.0):
        """Run `coro` on the cluster's loop; its result, or its exception re-raised here. A loop
        that stopped meanwhile (a SystemExit in one of its tasks ends `run_forever`: uvicorn exits
        so when its port was taken) raises at once instead of waiting out `timeout_s`."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return future.result(min(0.5, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if not self.thread.is_alive():
                    future.cancel()
                    raise RuntimeError("the shared cluster's event loop stopped (a task raised SystemExit?)") from None
                if time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        try:
            self.run(self._served.__aexit__(None, None, None))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
