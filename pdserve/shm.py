"""Attach to a POSIX shared-memory segment that another component created, leaving ownership alone.

Contract: `attach(name)` maps an existing segment read/write and returns a `SharedMemory`-like
object (`name`, `size`, `buf`, `close()`; no `unlink`: the creator alone unlinks). The attach is
never registered with multiprocessing's resource tracker, so

* an attacher's exit never unlinks the creator's segment, and
* an attacher that shares the creator's tracker (a child process, or the same process: the
  benchmarks, the TP ranks) does not remove the creator's registration, which used to make the
  tracker print a `KeyError` traceback when the creator later unlinked its segment.

CPython 3.13 does this with `SharedMemory(track=False)`; earlier versions register every attach,
hence the small mapping below. A missing segment raises `FileNotFoundError`, an empty one
`ValueError`, as `SharedMemory` does.

`reap_dead_pools(worker_id)` unlinks the segments of a worker's dead incarnations (a restarted
worker at its start, the launcher once its workers have stopped).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
from multiprocessing import shared_memory

if sys.version_info < (3, 13):
    import _posixshmem  # the module SharedMemory itself opens segments with


class AttachedSegment:
    """A mapping of someone else's segment: read and write its bytes, close the mapping."""

    def __init__(self, name: str):
        path = name if name.startswith("/") else "/" + name
        fd = _posixshmem.shm_open(path, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"shared-memory segment {name!r} is empty")
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the segment's pages; the descriptor is not needed
        self.name = name.lstrip("/")
        self.size = size
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        """Drop the mapping (numpy views of `buf` must be gone first, as with `SharedMemory`)."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def attach(name: str) -> AttachedSegment | shared_memory.SharedMemory:
    """Map the existing segment `name` without telling the resource tracker about it."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    return AttachedSegment(name)


def reap_dead_pools(worker_id: str, shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink the K/V pool segments earlier incarnations of this worker left behind when they
    were killed (kill -9 skips the unlink): `pdserve-<worker>-<pid>[-<token>]` whose pid is gone."""
    prefix, reaped = f"pdserve-{worker_id}-", []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return reaped
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, name))
                reaped.append(name)
    return reaped
