"""Engine configuration: one frozen dataclass; the CLI reads its defaults from here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.engine.prompt_priority import PromptPriority


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # "tiny" | "small" | path to a Hugging Face checkpoint directory
    dtype: str = "bfloat16"  # storage: weights and K/V pool; "bfloat16" | "float32"
    compute_dtype: str | None = None  # activations/matmuls; None = dtype (see model/numerics.py)
    batch_invariant: bool = True  # a request's tokens never depend on its batch mates (numerics.py)
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024
    num_blocks: int | None = None  # overrides kv_cache_bytes when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_cache: bool = True
    max_tenant_roots: int = 1024  # tenants (cache_salt or API key) whose chain root is kept, an LRU (block_manager.py)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    kv_shm_name: str | None = None  # put the K/V pool in this POSIX shared-memory segment
    host_kv_bytes: int = 0  # host-memory tier for evicted prefix blocks (host_tier.py); 0 = none
    prompt_priority: PromptPriority | None = None  # Splitwise mixed-machine rule (prompt_priority.py); None = off
    prefill_length_buckets: tuple[int, ...] = ()  # bucketed prefill admission (prefill_buckets.py); () = off
    tp: int = 1  # tensor-parallel ranks: this process and tp - 1 followers (engine/tp_group.py)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N": weights, K/V pool and activations (model/gpu/ on CUDA)
    enforce_eager: bool = False  # on a GPU: no CUDA graphs for decode steps (engine/cuda_graphs.py)
    tp_cores: tuple[int, ...] = ()  # rank r is pinned to tp_cores[r % len]; () = no pinning (1 thread each)

    def __post_init__(self) -> None:
        """Refuse sizes no engine can run with, naming the field and its flag (a ValueError: the
        CLI prints it and exits 2 before any process starts)."""
        at_least_one = {"block_size (--block-size)": self.block_size, "max_num_seqs (--max-num-seqs)": self.max_num_seqs,
                        "max_num_batched_tokens (--max-num-batched-tokens)": self.max_num_batched_tokens,
                        "max_tenant_roots (--max-tenant-roots)": self.max_tenant_roots, "tp (--tp)": self.tp}
        if self.num_threads is not None:
            at_least_one["num_threads (--threads-per-worker)"] = self.num_threads
        if self.max_model_len is not None:
            at_least_one["max_model_len"] = self.max_model_len
        if self.num_blocks is not None:
            at_least_one["num_blocks"] = self.num_blocks
        elif self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes (--kv-cache-mb) must be > 0, got {self.kv_cache_bytes}")
        for name, value in at_least_one.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device (--device) must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes (--host-kv-mb) must be >= 0, got {self.host_kv_bytes}")
