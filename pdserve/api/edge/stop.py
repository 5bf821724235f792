"""The HTTP server's stop signal, told to the supervisor before uvicorn acts on it.

Contract: `StoppingServer(config, on_stop)` is uvicorn's server; when SIGINT or SIGTERM arrives it
calls `on_stop()` first, then stops as uvicorn does (stops accepting, lets open requests end,
then re-raises the signal, so the process's exit status is the signal's).
Why: a service manager's SIGTERM (systemd's control-group stop, `timeout`, `kill -- -PGID`)
reaches the workers at the same time as the server. Told first, the supervisor takes their deaths
as the stop's instead of restarting them (`Launcher.begin_stop`, workers/process/launcher.py).
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn


class StoppingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]):
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame) -> None:
        self.on_stop()
        super().handle_exit(sig, frame)
