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
import threading
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
        """Run `coro` on the cluster's loop; its result, or its exception re-raised here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        try:
            self.run(self._served.__aexit__(None, None, None))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
