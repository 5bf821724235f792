"""Process checks the fault tests share."""

from __future__ import annotations


def exited(pid: int) -> bool:
    """Whether `pid` has exited: gone, or a zombie waiting for its parent's wait (a reparented
    zombie may stay in this container, whose init does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
