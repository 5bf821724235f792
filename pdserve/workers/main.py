"""Worker process entry point: `python -m pdserve.workers.main CONFIG_JSON`, or `main([CONFIG_JSON])`
in a fork of the warm template (workers/process/warm_start.py: the local launcher's way).

The launcher passes a `WorkerConfig` as JSON (msgspec), so a worker inherits nothing from its
launcher but the environment and its standard output and error: no pickled state, no import of
the launcher's main module (the template imported only the worker's modules).
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
    # The worker's own resource tracker unlinks its shared memory when it dies (kill -9, a SIGTERM
    # to the whole process group): by design, so the tracker's "leaked shared_memory objects"
    # warning is not printed (it starts with these interpreter flags at the first segment).
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")
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


if __name__ == "__main__":  # a bare interpreter (`PDSERVE_WORKER_START=exec`), named as a fork is
    from pdserve.workers.process.warm_start import name_process
    name_process(sys.argv[1])
    main()
