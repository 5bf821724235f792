"""The producer gate: which of a prompt's K/V exist yet, per layer.

Contract: the prefill engine reports progress as it computes. With chunked prefill a layer's K/V
become final chunk by chunk: after a step that computed the prompt's tokens up to t, every layer
holds final K/V for tokens [0, t). `mark_progress(layer, t)` records that watermark (it never moves
back: a prefill worker never preempts a prompt whose K/V may be streaming), `mark_ready(layer)`
says the layer is complete (the whole prompt, including a partial last block). A transfer chunk
covering prompt tokens [start, end) of a layer may be sent once `covers(layer, end)`; nothing
else may be read from the source pool. Waiters block on a version counter that moves with every
report, so a sender wakes the moment any chunk may have become sendable.
"""

from __future__ import annotations

import math
import threading


class LayerGate:
    """Per-layer K/V watermarks for one prompt; thread-safe, waitable."""

    def __init__(self, num_layers: int, clock=None):
        self._num_layers = num_layers
        self._tokens = [0] * num_layers  # per layer: prompt tokens with final K/V
        self._ready: dict[int, float] = {}  # complete layers -> when they completed
        self._version = 0
        self._cond = threading.Condition()
        self._clock = clock

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self._num_layers:
            raise ValueError(f"layer {layer} out of range")

    def mark_progress(self, layer: int, tokens: int) -> None:
        """Layer `layer` holds final K/V for the prompt's first `tokens` tokens."""
        self._check(layer)
        with self._cond:
            if tokens < self._tokens[layer]:
                raise ValueError(f"layer {layer} watermark moved back: {self._tokens[layer]} -> {tokens}")
            self._tokens[layer] = tokens
            self._version += 1
            self._cond.notify_all()

    def mark_ready(self, layer: int, ts: float | None = None) -> None:
        """Layer `layer` is complete for the whole prompt."""
        self._check(layer)
        with self._cond:
            self._ready.setdefault(layer, ts if ts is not None else (self._clock() if self._clock else 0.0))
            self._tokens[layer] = math.inf
            self._version += 1
            self._cond.notify_all()

    def mark_all_ready(self) -> None:
        for layer in range(self._num_layers):
            self.mark_ready(layer)

    def is_ready(self, layer: int) -> bool:
        return layer in self._ready

    def all_ready(self) -> bool:
        return len(self._ready) == self._num_layers

    def covers(self, layer: int, token_end: int) -> bool:
        """May the K/V of prompt tokens [.., token_end) of `layer` be read?"""
        return self._tokens[layer] >= token_end

    def ready_times(self) -> dict[int, float]:
        return dict(self._ready)

    @property
    def version(self) -> int:
        return self._version

    def wait_for_more(self, known_version: int, timeout_s: float) -> bool:
        """Block until some report newer than `known_version` arrives (or timeout); True if one did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version > known_version, timeout_s)
