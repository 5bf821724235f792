"""Hardware profiles: the per-GPU numbers the roofline latency model needs.

Contract: a profile is a JSON object (see `profiles/*.json`, shipped as package data) whose
datasheet fields are peak dense BF16 TFLOP/s, HBM TB/s, memory GB, NVLink GB/s per GPU and a
typical inter-node NIC GB/s per GPU; every built-in profile names its sources. NVLink is quoted
as datasheets quote it, both directions together (A100: 12 links x 50 GB/s = 600 GB/s); what one
GPU can send while it receives, as every ring all-reduce step and every K/V push does, is half
of that (`nvlink_send_bytes_per_s`). A NIC's Gb/s is already per direction. The efficiency,
latency and overhead fields are modeling assumptions, stated as such in the file. A profile may
also carry measured kernel terms (`kernel_costs.py`): a `gemm` block (a fit to measured GEMMs),
an `allreduce_us` table (measured all-reduce latencies per TP degree), an `elementwise` block
(a layer's norm, residual and activation kernels) and an `attention` block (fits to measured
context and generation attention kernels); the roofline then times each of those kernels by them
instead of by the flat efficiencies.
`load_hardware` accepts a built-in name (``a100-80g``, ``h100``, ``h200``) or a path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.latency.kernel_costs import (
    AllReduceTable,
    AttentionCurves,
    ElementwiseCost,
    GemmCurve,
    allreduce_from_dict,
    attention_from_dict,
    elementwise_from_dict,
    gemm_curve_from_dict,
)

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
    gemm: GemmCurve | None = None  # measured GEMM kernels (None: the flat efficiencies)
    allreduce: AllReduceTable | None = None  # measured all-reduces (None: bandwidth + latency)
    elementwise: ElementwiseCost | None = None  # a layer's norms, residuals, activation (None: free)
    attention: AttentionCurves | None = None  # measured attention kernels (None: the flat efficiencies)
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("peak_flops_per_s", "hbm_bytes_per_s", "memory_bytes", "nvlink_bytes_per_s", "internode_bytes_per_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"hardware profile {self.name}: {name} must be positive and finite")

    def without_measured_kernels(self) -> HardwareProfile:
        """The same GPU on the plain roofline (flat efficiencies, bandwidth + latency collectives)."""
        return replace(self, gemm=None, allreduce=None, elementwise=None, attention=None)

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
        peak_flops, hbm = float(d["peak_bf16_tflops"]) * 1e12, float(d["hbm_tb_per_s"]) * 1e12
        return HardwareProfile(
            name=str(d["name"]),
            peak_flops_per_s=peak_flops,
            hbm_bytes_per_s=hbm,
            memory_bytes=float(d["memory_gb"]) * 1e9,
            nvlink_bytes_per_s=float(d["nvlink_gb_per_s"]) * 1e9,
            internode_bytes_per_s=float(d["internode_gb_per_s"]) * 1e9,
            gpus_per_node=int(d.get("gpus_per_node", 8)),
            compute_efficiency=float(d.get("compute_efficiency", 0.6)),
            memory_efficiency=float(d.get("memory_efficiency", 0.8)),
            memory_utilization=float(d.get("memory_utilization", 0.9)),
            collective_latency_s=float(d.get("collective_latency_us", 10.0)) * 1e-6,
            step_overhead_s=float(d.get("step_overhead_ms", 1.0)) * 1e-3,
            gemm=gemm_curve_from_dict(d["gemm"], peak_flops, hbm) if "gemm" in d else None,
            allreduce=allreduce_from_dict(d["allreduce_us"]) if "allreduce_us" in d else None,
            elementwise=elementwise_from_dict(d["elementwise"], hbm) if "elementwise" in d else None,
            attention=attention_from_dict(d["attention"], peak_flops, hbm) if "attention" in d else None,
            sources=dict(d.get("sources", {})),
        )
    except KeyError as exc:
        raise ValueError(f"hardware profile is missing {exc}") from exc
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"malformed hardware profile ({exc})") from exc


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name, or a hardware profile JSON file."""
    key = name_or_path.lower()
    path = PROFILE_DIR / f"{key}.json" if key in BUILTIN_HARDWARE else Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: use one of {BUILTIN_HARDWARE} or a profile JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{name_or_path}: cannot read a hardware profile ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name_or_path}: a hardware profile is a JSON object, got {type(data).__name__}")
    return hardware_from_dict(data)
