"""This host's TCP connections to a port, read from /proc/net/tcp (IPv4): what a served test
watches to know a handoff link is open, or how many of its bytes are still on their way."""

from __future__ import annotations

ESTABLISHED = "01"


def tcp_links(port: int) -> dict[tuple[int, int], tuple[str, int, int]]:
    """Connections with `port` at one end: (local port, remote port) -> (state, unacknowledged
    send queue, unread receive queue) in bytes."""
    links = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            _, local, remote, state, queues, *_ = line.split()
            ends = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
            if port in ends:
                tx, rx = (int(q, 16) for q in queues.split(":"))
                links[ends] = (state, tx, rx)
    return links


def accepted(port: int) -> list[tuple[int, int]]:
    """The open connections a listener at `port` accepted (its own ends)."""
    return [ends for ends, (state, _, _) in tcp_links(port).items() if ends[0] == port and state == ESTABLISHED and ends[1]]
