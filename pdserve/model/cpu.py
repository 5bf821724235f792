"""What CPU this process computes on: instruction-set features and the math libraries' paths.

Contract: `cpu_report()` is a JSON-ready dict, the same in every process on one machine for one
environment: `kind` ("avx512-amx", "avx512-bf16", "avx512", "avx2" or "other"), the feature
flags the engine's numerics depend on (AVX2, AVX-512F, AVX512-BF16, AMX-BF16), PyTorch's chosen
CPU capability, the BLAS/oneDNN builds, and the ISA caps a user set (`MKL_ENABLE_INSTRUCTIONS`,
`ONEDNN_MAX_CPU_ISA`, `MKL_CBWR`), which make an AVX-512 machine take the AVX2 code paths.
`generate --json`, `bench-engine --json`, each worker's `/workers` entry and the start log carry it.
torch is imported by `cpu_report()`, not with this module: the router's process formats its
workers' reports (`summary(report)`) without loading torch.
"""

from __future__ import annotations

import os
import platform
import re
from functools import lru_cache
from pathlib import Path

FEATURES = {"avx2": "avx2", "avx512f": "avx512f", "avx512_bf16": "avx512_bf16", "amx_bf16": "amx_bf16"}
ISA_CAPS = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
_X86 = ("x86_64", "amd64", "i686", "x86")


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """/proc/cpuinfo text -> (model name, the first processor's flags)."""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (model.group(1).strip() if model else platform.processor() or "unknown",
            set(flags.group(1).split()) if flags else set())


def kind_of(features: dict[str, bool], x86: bool = True) -> str:
    """The CPU kind the project's figures are labelled with."""
    if not x86:
        return "other"
    if features["amx_bf16"]:
        return "avx512-amx"
    if features["avx512_bf16"]:
        return "avx512-bf16"
    if features["avx512f"]:
        return "avx512"
    return "avx2" if features["avx2"] else "other"


def cpu_identity() -> tuple[str, str, dict[str, bool]]:
    """(model name, kind, feature flags) from /proc/cpuinfo, without torch."""
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = platform.processor() or "unknown", set()
    features = {name: flag in flags for name, flag in FEATURES.items()}
    return model, kind_of(features, platform.machine().lower() in _X86), features


@lru_cache(maxsize=1)
def cpu_report() -> dict:
    import torch

    model, kind, features = cpu_identity()
    return {
        "kind": kind,
        "model": model,
        "features": features,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "onednn": torch.backends.mkldnn.is_available(),
        "isa_caps": {name: os.environ[name] for name in ISA_CAPS if name in os.environ},
        "logical_cpus": os.cpu_count(),
    }


def cpu_has_native_bf16() -> bool:
    """True when bf16 dot products are native (AVX512-BF16 / AMX-BF16) or the CPU is not x86."""
    features = cpu_report()["features"]
    return platform.machine().lower() not in _X86 or features["avx512_bf16"] or features["amx_bf16"]


def summary(report: dict | None = None) -> str:
    """One short line for logs: kind, model, torch capability, ISA caps (of `report`, else this process's)."""
    r = report if report is not None else cpu_report()
    caps = ",".join(f"{k}={v}" for k, v in r["isa_caps"].items())
    return f"cpu={r['kind']} ({r['model']}; torch {r['torch_capability']}{'; ' + caps if caps else ''})"
