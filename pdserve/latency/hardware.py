"""Hardware profiles: the per-GPU numbers the roofline latency model needs.

Contract: a profile is a JSON object (see `profiles/*.json`, shipped as package data) whose
datasheet fields are peak dense BF16 TFLOP/s, HBM TB/s, memory GB, NVLink GB/s per GPU and a
typical inter-node NIC GB/s per GPU; every built-in profile names its sources. NVLink is quoted
as datasheets quote it, both directions together (A100: 12 links x 50 GB/s = 600 GB/s); what one
GPU can send while it receives, as every ring all-reduce step and every K/V push does, is half
of that (`nvlink_send_bytes_per_s`). A NIC's Gb/s is already per direction. The efficiency,
latency and overhead fields are modeling assumptions, stated as such in the file.
`load_hardware` accepts a built-in name (``a100-80g``, ``h100``, ``h200``) or a path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
BUILTIN_HARDWARE = ("a100-80g", "h100", "h200")


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU type inside one node type. Rates are per GPU, in SI units."""

    name: str
    peak_flops_per_s: float
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float
    gpus_per_node: int = 8
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    memory_utilization: float = 0.9
    collective_latency_s: float = 10e-6
    step_overhead_s: float = 1e-3
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("peak_flops_per_s", "hbm_bytes_per_s", "memory_bytes", "nvlink_bytes_per_s", "internode_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware profile {self.name}: {name} must be positive")

    @property
    def nvlink_send_bytes_per_s(self) -> float:
        """NVLink bandwidth in one direction (the datasheet figure counts both)."""
        return self.nvlink_bytes_per_s / 2

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.compute_efficiency

    @property
    def effective_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.memory_efficiency

    @property
    def usable_memory_bytes(self) -> float:
        """Memory the runtime may fill with weights and K/V."""
        return self.memory_bytes * self.memory_utilization


def hardware_from_dict(d: dict) -> HardwareProfile:
    """Parse the JSON profile format (datasheet units: TFLOP/s, TB/s, GB, GB/s, us, ms)."""
    try:
        return HardwareProfile(
            name=str(d["name"]),
            peak_flops_per_s=float(d["peak_bf16_tflops"]) * 1e12,
            hbm_bytes_per_s=float(d["hbm_tb_per_s"]) * 1e12,
            memory_bytes=float(d["memory_gb"]) * 1e9,
            nvlink_bytes_per_s=float(d["nvlink_gb_per_s"]) * 1e9,
            internode_bytes_per_s=float(d["internode_gb_per_s"]) * 1e9,
            gpus_per_node=int(d.get("gpus_per_node", 8)),
            compute_efficiency=float(d.get("compute_efficiency", 0.6)),
            memory_efficiency=float(d.get("memory_efficiency", 0.8)),
            memory_utilization=float(d.get("memory_utilization", 0.9)),
            collective_latency_s=float(d.get("collective_latency_us", 10.0)) * 1e-6,
            step_overhead_s=float(d.get("step_overhead_ms", 1.0)) * 1e-3,
            sources=dict(d.get("sources", {})),
        )
    except KeyError as exc:
        raise ValueError(f"hardware profile is missing {exc}") from exc


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name, or a hardware profile JSON file."""
    key = name_or_path.lower()
    path = PROFILE_DIR / f"{key}.json" if key in BUILTIN_HARDWARE else Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: use one of {BUILTIN_HARDWARE} or a profile JSON file")
    return hardware_from_dict(json.loads(path.read_text()))
