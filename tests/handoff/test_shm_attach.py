"""`pdserve.shm.attach`: an attacher sees the creator's bytes, never unlinks the segment, and
leaves the creator's resource-tracker registration alone (no `KeyError` from the tracker at exit)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from multiprocessing import shared_memory

import pytest

from pdserve.shm import attach


def test_attach_reads_and_writes_the_creators_bytes():
    owner = shared_memory.SharedMemory(name=f"pdt-{uuid.uuid4().hex[:12]}", create=True, size=4096)
    try:
        owner.buf[:4] = b"abcd"
        seg = attach(owner.name)
        assert seg.size >= 4096 and bytes(seg.buf[:4]) == b"abcd"
        seg.buf[4:8] = b"wxyz"
        assert bytes(owner.buf[:8]) == b"abcdwxyz"
        seg.close()
        seg.close()  # idempotent
        assert bytes(owner.buf[4:8]) == b"wxyz"  # closing the attach leaves the segment
    finally:
        owner.close()
        owner.unlink()


def test_missing_segment_raises_file_not_found():
    with pytest.raises(FileNotFoundError):
        attach(f"pdt-missing-{uuid.uuid4().hex[:12]}")


_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, uuid
    from multiprocessing import shared_memory
    from pdserve.shm import attach

    def child(name):
        seg = attach(name)
        seg.buf[0] = 7
        seg.close()

    if __name__ == "__main__":
        mp.set_start_method("spawn")
        owner = shared_memory.SharedMemory(name=f"pdt-{uuid.uuid4().hex[:12]}", create=True, size=4096)
        attach(owner.name).close()          # same process, same tracker
        p = mp.Process(target=child, args=(owner.name,))
        p.start(); p.join()                 # a spawned child shares the tracker too
        assert p.exitcode == 0 and owner.buf[0] == 7
        assert os.path.exists("/dev/shm/" + owner.name)  # nobody but the owner unlinks
        owner.close(); owner.unlink()
        print("gone" if not os.path.exists("/dev/shm/" + owner.name) else "left")
""")


def test_attachers_leave_the_creators_tracker_entry_alone(tmp_path):
    script = tmp_path / "attach_twice.py"  # a file, so the spawned child can import its target
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gone"
    assert "KeyError" not in done.stderr and "leaked" not in done.stderr, done.stderr


_ATTACH_AND_EXIT = "import sys; from pdserve.shm import attach; seg = attach(sys.argv[1]); seg.buf[1] = 9; seg.close()"


def test_an_independent_attacher_leaves_the_segment_when_it_exits():
    """A process with its own resource tracker (a separately started worker) attaches, writes and
    exits: the creator's segment and bytes are still there (a tracked attach unlinks it at exit)."""
    owner = shared_memory.SharedMemory(name=f"pdt-{uuid.uuid4().hex[:12]}", create=True, size=4096)
    try:
        done = subprocess.run([sys.executable, "-c", _ATTACH_AND_EXIT, owner.name], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "leaked" not in done.stderr, done.stderr
        assert os.path.exists("/dev/shm/" + owner.name) and owner.buf[1] == 9
        again = attach(owner.name)  # still attachable by name
        assert again.buf[1] == 9
        again.close()
    finally:
        owner.close()
        owner.unlink()
