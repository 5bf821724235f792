"""Keeping start-up objects out of the garbage collector's way in latency-sensitive loops.

A long-running process (the serving process, the benchmark client, the stand-in server) builds
its long-lived objects once: modules, the app, the tokenizer, registered workers, the workload.
Left in the collector's generations, every older-generation collection walks them again and
pauses whatever request is being handled. `frozen_heap()` collects once and then moves every
object that exists into the permanent generation (`gc.freeze`), for as long as the block runs;
objects made later are collected as usual. This is the tuning vLLM applies after start-up.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, freeze what exists now, and unfreeze on exit (so that a process that runs
    several of these blocks, such as the test suite, does not keep garbage alive for good)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
