"""Transfer schedules: serialized (whole request after prefill) or layer-wise streaming, and their times.

Contract (pure functions over seconds):
  * `choose_schedule(num_tokens, threshold)`: prompts shorter than the threshold go serialized
    (fine-grained synchronization would cost more than it hides), longer ones stream by layer.
  * `layerwise_visible_times(ready, durations)`: one serialized transfer engine, v_l =
    max(r_l, v_{l-1}) + x_l.
  * `serialized_completion(ready, durations)`: r_{L-1} + sum(x_l).
  * `exposed_transfer_s(publish_end, prefill_end)` = max(0, publish_end - prefill_end).
The producer gate (send a chunk only once `LayerGate` covers its layer and tokens; with chunked
prefill a layer's early blocks stream while its later chunks are still computing) and the consumer gate
(publish only after every chunk is visible) are enforced in `source` and `validate`; this
module only plans and measures.
"""

from __future__ import annotations

from dataclasses import dataclass

SERIALIZED = "serialized"
LAYERWISE = "layerwise"


@dataclass(frozen=True)
class ScheduleConfig:
    layerwise_min_tokens: int = 512  # a tunable crossover, not a universal constant


def choose_schedule(num_tokens: int, config: ScheduleConfig = ScheduleConfig()) -> str:
    return LAYERWISE if num_tokens >= config.layerwise_min_tokens else SERIALIZED


def layerwise_visible_times(ready_s: list[float], durations_s: list[float]) -> list[float]:
    visible, last = [], 0.0
    for ready, duration in zip(ready_s, durations_s, strict=True):
        last = max(ready, last) + duration
        visible.append(last)
    return visible


def serialized_completion(ready_s: list[float], durations_s: list[float]) -> float:
    return ready_s[-1] + sum(durations_s)


def exposed_transfer_s(publish_end_s: float, prefill_end_s: float) -> float:
    return max(0.0, publish_end_s - prefill_end_s)
