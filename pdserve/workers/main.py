"""Worker process entry point: `python -m pdserve.workers.main CONFIG_JSON`.

The launcher passes a `WorkerConfig` as JSON (msgspec) on the command line, so a worker
inherits nothing from its parent but the environment: no pickled state, no re-import of the
parent's main module.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from pdserve.workers.config import decode_config
from pdserve.workers.worker import serve_worker


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # Ctrl-C in a terminal reaches the whole process group: the router shuts workers down
    # with a typed Shutdown message instead, and a worker whose router is gone exits by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve_worker(decode_config(args[0]))
    exit_closed()


def exit_closed() -> None:
    """Exit at once once the worker has closed (its sockets, whose LINGER is 0, its shared
    segments, trace files and tensor-parallel followers): interpreter finalization would only
    collect torch's modules again, which adds 0.5-1.5 s to every stop and every restart. A worker
    that raised does not come here; it exits the ordinary way, with its traceback."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
