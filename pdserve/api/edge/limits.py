"""The HTTP edge's connection limits as configuration: the cap on open connections, the deadlines
for a request's head and body, and the open-file budget they need. Light to import (the CLI reads
its defaults here); connections.py enforces them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_CONNECTIONS = 512  # under a 1024 fd limit with room for the router's zmq sockets and pipes
DEFAULT_HEADER_TIMEOUT_S = 10.0  # Go's ReadHeaderTimeout in common use; a real client sends its head at once
DEFAULT_BODY_TIMEOUT_S = 30.0  # a 4 MiB body at ~140 KB/s still arrives
DEFAULT_WRITE_TIMEOUT_S = 60.0  # nginx send_timeout: a client that reads nothing this long is cut


@dataclass(frozen=True)
class EdgeLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.write_timeout_s > 0):
            raise ValueError(f"--request-header-timeout-s, --request-body-timeout-s and --response-write-timeout-s "
                             f"must be > 0, got {self.header_timeout_s}, {self.body_timeout_s}, {self.write_timeout_s}")


FD_RESERVE = 256  # the serving process's own: ~30, and ~7 per worker (zmq sockets, pipes; 57 with 4 workers)


def fit_fd_limit(limits: EdgeLimits) -> int:
    """Raise this process's soft open-file limit to cover `max_connections` and the reserve, up to
    the hard limit (vLLM raises it likewise); the soft limit now. Raises ValueError when the hard
    limit is too low, so the cap, not fd exhaustion, is what a client meets first."""
    import resource

    need = limits.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(f"--max-connections {limits.max_connections} needs {need} open files ({FD_RESERVE} kept for "
                         f"the server's own); the hard limit is {hard} (ulimit -Hn): lower --max-connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need
