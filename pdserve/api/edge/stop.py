"""The HTTP server's stop signal, told to the supervisor before uvicorn acts on it.

Contract: `StoppingServer(config, on_stop)` is uvicorn's server; when SIGINT or SIGTERM arrives it
calls `on_stop()` first (the caller ends every open request there), then stops as uvicorn does
(stops accepting, waits for open responses to end), cutting the connections of those still open
STOP_GRACE_S on.
uvicorn then re-raises the signal as its `serve()` returns, so the process's exit status is the
signal's; here that is left to the caller, `raise_stop_signals()` once the cluster is stopped.
A second SIGINT or SIGTERM, while uvicorn stops or while the cluster stops after it, calls
`on_force()` (every worker killed, its pool unlinked) and ends the process as signalled at once, as
a second Ctrl-C does elsewhere (uvicorn alone forces on a second SIGINT only, cancelling its open
responses and ending with status 0, and ignores a second SIGTERM).
Raised by uvicorn, SIGTERM ended the process before `cluster()` stopped the workers: a stopped
(SIGSTOP) or hung worker then outlived the server with its shared-memory pool, since only its
own check of its parent would have ended it.
Why: a service manager's SIGTERM (systemd's control-group stop, `timeout`, `kill -- -PGID`)
reaches the workers at the same time as the server. Told first, the supervisor takes their deaths
as the stop's instead of restarting them (`Launcher.begin_stop`, workers/process/launcher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Generator

import uvicorn

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0  # a response still open this long into the stop has its connection cut


class StoppingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None], on_force: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_stop, self.on_force = on_stop, on_force
        self._restore: dict[int, object] = {}
        self._forcing = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and self.on_force is not None:  # a second signal while the server stops
            self._forced(sig, frame)
            return
        self.on_stop()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's, but a response still open STOP_GRACE_S on (a client that reads nothing) has
        its connection cut, so that its handler ends as on a client's disconnect; uvicorn's own
        `timeout_graceful_shutdown`, if set, cancels the task instead, logged as an exception."""
        cut = asyncio.get_running_loop().call_later(STOP_GRACE_S, self._cut_connections)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _cut_connections(self) -> None:
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, but the signals it caught are kept for `raise_stop_signals` instead of
        re-raised when `serve()` returns."""
        self.stop_signals: list[int] = []
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", [])  # uvicorn's list (0.29+), re-raised after this
                self.stop_signals, captured[:] = list(captured), []
        if self.stop_signals and self.on_force is not None:  # stopping: a second signal forces it
            self._restore = {sig: signal.signal(sig, self._forced) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _forced(self, sig: int, frame) -> None:
        if self._forcing:  # a storm of signals: the first one's kill is under way and ends the process
            return
        self._forcing = True
        log.warning("a second %s during the stop: the workers are killed now", signal.Signals(sig).name)
        try:
            self.on_force()
        finally:  # the process ends as signalled whatever the kill met
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    def raise_stop_signals(self) -> None:
        """The caught signals, last first as uvicorn raises them, each with its default action: the
        process ends as signalled (under Python's own handler a SIGINT is a KeyboardInterrupt, and
        the command ended with status 0)."""
        caught = list(reversed(getattr(self, "stop_signals", [])))
        for sig in caught:  # first: one arriving now must not meet Python's SIGINT handler
            signal.signal(sig, signal.SIG_DFL)
        for sig, handler in self._restore.items():
            if sig not in caught:
                signal.signal(sig, handler)
        for sig in caught:
            signal.raise_signal(sig)
