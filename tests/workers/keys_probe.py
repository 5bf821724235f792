"""A stand-in worker for tests/workers/process/test_control_keys_handover.py: takes its keys as
Worker.__init__ does, writes what it found to $PROBE_OUT, then waits to be ended."""

from __future__ import annotations

import json
import os
import time

from pdserve.workers.control_keys import from_env


def main(argv: list[str] | None = None) -> None:
    fd = os.environ.get("PDSERVE_CONTROL_KEYS_FD")
    keys = from_env()
    text = None if keys is None else b",".join((keys.server_public, keys.client_public, keys.client_secret)).decode()
    fds = set(os.listdir("/proc/self/fd"))
    out = os.environ["PROBE_OUT"]
    with open(out + ".tmp", "w") as f:
        f.write(json.dumps({"keys": text, "fd_still_open": fd in fds}))
    os.rename(out + ".tmp", out)
    time.sleep(60)


if __name__ == "__main__":
    main()
