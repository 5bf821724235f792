"""Derive the A100 profile's measured kernel terms from aiconfigurator's a100_sxm database.

Prints the `gemm` and `allreduce` blocks of `pdserve/latency/profiles/a100-80g.json`:

- gemm: one curve per GEMM kernel, fitted (least squares on log time) to NVIDIA's measured
  bf16 GEMM latencies (`gemm/vllm/0.14.0/gemm_perf.parquet`: cuBLAS through vLLM, m 1-8192,
  n and k 512-16384): t = max(F / (C_peak * e(F)), W / (R_peak * r) + t_floor), with the compute
  efficiency ramping with the kernel's size, e(F) = e_max / (1 + (F_half / F) ** gamma);
- allreduce: NCCL 2.27.3's measured all-reduce latency of fp16 messages per TP degree
  (`comm/nccl/2.27.3/nccl_perf.parquet`), as (bytes, microseconds) points.

Usage: python scripts/a100_kernel_fit.py   (needs `pip install 'pdserve[aic]'`, numpy, scipy, pandas)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

import aiconfigurator_core

DATA = Path(aiconfigurator_core.__file__).parent / "systems" / "data" / "a100_sxm"
PEAK_FLOPS, PEAK_BYTES = 312e12, 2.039e12  # the A100 datasheet's dense BF16 and HBM2e figures


def fit_gemm() -> dict:
    g = pd.read_parquet(DATA / "gemm" / "vllm" / "0.14.0" / "gemm_perf.parquet")
    g = g[(g.gemm_dtype == "bfloat16") & (g.n >= 512) & (g.k >= 512) & (g.n <= 16384) & (g.k <= 16384)]
    m, n, k, t = (g[c].to_numpy(float) for c in ("m", "n", "k", "latency"))
    t = t * 1e-3  # the table is in ms
    flops, moved = 2 * m * n * k, 2 * (n * k + m * k + m * n)

    def model(p):
        e_max, log_half, gamma, r, floor_us = p
        compute = flops / (PEAK_FLOPS * e_max) * (1 + (10 ** log_half / flops) ** gamma)
        return np.maximum(compute, moved / (PEAK_BYTES * r) + floor_us * 1e-6)

    fit = least_squares(lambda p: np.log(model(p)) - np.log(t), [0.9, 10, 0.5, 0.7, 5],
                        bounds=([0.3, 6, 0.05, 0.3, 0], [1, 13, 2, 1, 50]))
    e_max, log_half, gamma, r, floor_us = fit.x
    ratio = np.exp(fit.fun)
    return {"compute_efficiency_max": round(e_max, 3), "compute_half_gflop": round(10 ** log_half / 1e9, 2),
            "compute_ramp_exponent": round(gamma, 3), "memory_efficiency": round(r, 3),
            "kernel_floor_us": round(floor_us, 2),
            "fit": f"{len(t)} measured GEMMs, model/measured p10 {np.percentile(ratio, 10):.2f}, "
                   f"median {np.median(ratio):.2f}, p90 {np.percentile(ratio, 90):.2f}"}


def allreduce_points() -> dict:
    d = pd.read_parquet(DATA / "comm" / "nccl" / "2.27.3" / "nccl_perf.parquet")
    d = d[(d.op_name == "all_reduce") & (d.nccl_dtype == "half")]
    out = {}
    for tp, rows in d.groupby("num_gpus"):
        rows = rows.sort_values("message_size")  # elements of 2 bytes; latency in ms
        out[str(int(tp))] = [[int(s) * 2, round(float(v) * 1e3, 2)] for s, v in zip(rows.message_size, rows.latency)]
    return out


if __name__ == "__main__":
    print(json.dumps({"gemm": fit_gemm(), "allreduce_us": allreduce_points()}, indent=1))
