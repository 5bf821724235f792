"""A worker process's configuration, as the router's process builds it and sends it on argv.

Contract: `WorkerConfig` is frozen and crosses the process boundary as JSON (`encode_config` /
`decode_config`, msgspec). This module imports no torch and no engine, so the router's process
(workers/process/launch.py) builds worker command lines without loading either (workers/worker.py runs them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pdserve.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated" | "mixed" (roles.py)
    router_address: str  # zmq endpoint, e.g. tcp://127.0.0.1:5555
    epoch: int = 1
    host_id: str = "localhost"
    handoff_host: str = "127.0.0.1"
    engine: EngineConfig = field(default_factory=EngineConfig)
    cpu_affinity: tuple[int, ...] = ()
    heartbeat_s: float = 0.25
    # the engine loop must come round within this long, or heartbeats stop and the router replaces the
    # worker as hung (a step blocked in a TP collective on a stopped rank, a deadlock); vLLM's
    # VLLM_ENGINE_ITERATION_TIMEOUT_S is 60 s too (workers/heartbeat.py)
    step_timeout_s: float = 60.0
    trace_path: str | None = None
    step_log_path: str | None = None  # engine step log (engine/step_log.py), one line per step
    layerwise_threshold_tokens: int = 256
    exit_with_parent: bool = False  # local processes: stop when the router process is gone
    lease_s: float = 30.0  # unrenewed K/V leases expire after this long (handoff/leases.py)
    capability_key: str | None = None  # the router's public key (hex): transfers need its capability (handoff/trust/capability.py)
    capability_key_epoch: int = 1  # its key epoch (a rollback's revocation moves to the next one)
    kv_events_endpoint: str | None = None  # publish vLLM-format KV events here (workers/kv_publisher.py)
    kv_events_replay_endpoint: str | None = None  # their replay socket
    lendable: bool = False  # Splitwise: both sides whatever the role, so it can be lent without a role change (roles.py)


def encode_config(config: WorkerConfig) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str) -> WorkerConfig:
    return msgspec.json.decode(text.encode(), type=WorkerConfig)
