"""Worker process entry point: `python -m pdserve.workers.main CONFIG_JSON`.

The launcher passes a `WorkerConfig` as JSON (msgspec) on the command line, so a worker
inherits nothing from its parent but the environment: no pickled state, no re-import of the
parent's main module.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    main()
