"""Derive a hardware profile's measured kernel terms from aiconfigurator's installed database.

Prints the `gemm`, `attention` and `allreduce_us` blocks of `pdserve/latency/profiles/*.json`
for one aiconfigurator system (`a100_sxm` -> a100-80g.json, `h100_sxm` -> h100.json,
`h200_sxm` -> h200.json):

- gemm: one curve per GEMM kernel, fitted (least squares on log time) to NVIDIA's measured
  bf16 GEMM latencies through vLLM (m from 1, n and k 512-16384):
  t = max(F / (C_peak * e(F)), W / (R_peak * r) + t_floor), with the compute efficiency ramping
  with the kernel's size, e(F) = e_max / (1 + (F_half / F) ** gamma) (`kernel_costs.GemmCurve`);
- attention: the same curve form fitted to vLLM's measured flash-attention kernels of one layer
  (bf16 K/V, no window), one curve for context (causal prefill: F = 4 * pairs * heads * d_head,
  W = the K/V written and read) and one for generation (decode: F the same per visible token,
  W = the K/V read, with a bandwidth that ramps with W as the compute side does with F);
- allreduce_us: NCCL's measured all-reduce latency of fp16 messages per TP degree, as
  (bytes, microseconds) points.

Usage: python scripts/aic_kernel_fit.py a100_sxm|h100_sxm|h200_sxm
(needs `pip install 'pdserve[aic]'`, numpy, scipy, pandas)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

import aiconfigurator_core

DATA = Path(aiconfigurator_core.__file__).parent / "systems" / "data"
# system -> (dense BF16 peak, HBM peak (datasheets), vLLM database version, NCCL version, attention kernel)
SYSTEMS = {
    "a100_sxm": (312e12, 2.039e12, "0.14.0", "2.27.3", "vllm_flash_attn"),
    "h100_sxm": (989e12, 3.35e12, "0.24.0", "2.27.3", "vllm_flash_attn_fa3"),
    "h200_sxm": (989e12, 4.8e12, "0.24.0", "2.29.2", "vllm_flash_attn_fa3"),
}


def fit_curve(flops, moved, t, peaks, memory_ramp: bool = False) -> dict:
    """Least squares on log time of max(compute ramp, memory + floor) (see the module doc); with
    `memory_ramp` the bandwidth ramps with the bytes too, e(W) = r / (1 + (W_half / W) ** g)."""
    peak_flops, peak_bytes = peaks

    def model(p):
        e_max, log_half, gamma, r, floor_us, log_mhalf, mgamma = p if memory_ramp else (*p, 0, 1)
        compute = flops / (peak_flops * e_max) * (1 + (10 ** log_half / flops) ** gamma)
        memory = moved / (peak_bytes * r) * (1 + (10 ** log_mhalf / moved) ** mgamma if memory_ramp else 1)
        return np.maximum(compute, memory + floor_us * 1e-6)

    start, lo, hi = [0.9, 10, 0.5, 0.7, 5], [0.1, 5, 0.05, 0.1, 0], [1, 13, 2, 1, 50]
    if memory_ramp:
        start, lo, hi = start + [7, 0.5], lo + [3, 0.05], hi + [11, 2]
    fit = least_squares(lambda p: np.log(model(p)) - np.log(t), start, bounds=(lo, hi))
    e_max, log_half, gamma, r, floor_us, *ramp = fit.x
    ratio = np.exp(fit.fun)
    out = {"compute_efficiency_max": round(e_max, 3), "compute_half_gflop": round(10 ** log_half / 1e9, 2),
           "compute_ramp_exponent": round(gamma, 3), "memory_efficiency": round(r, 3),
           "kernel_floor_us": round(floor_us, 2)}
    if memory_ramp:
        out.update(memory_half_mb=round(10 ** ramp[0] / 1e6, 2), memory_ramp_exponent=round(ramp[1], 3))
    out["fit"] = (f"{len(t)} measured kernels, model/measured p10 {np.percentile(ratio, 10):.2f}, "
                  f"median {np.median(ratio):.2f}, p90 {np.percentile(ratio, 90):.2f}")
    return out


def fit_gemm(system: str) -> dict:
    peak_flops, peak_bytes, vllm, _, _ = SYSTEMS[system]
    g = pd.read_parquet(DATA / system / "gemm" / "vllm" / vllm / "gemm_perf.parquet")
    g = g[(g.gemm_dtype == "bfloat16") & (g.n >= 512) & (g.k >= 512) & (g.n <= 16384) & (g.k <= 16384)]
    m, n, k, t = (g[c].to_numpy(float) for c in ("m", "n", "k", "latency"))
    return fit_curve(2 * m * n * k, 2 * (n * k + m * k + m * n), t * 1e-3, (peak_flops, peak_bytes))  # table in ms


def fit_attention(system: str) -> dict:
    """One layer's flash-attention kernels, context and generation each on its own curve."""
    peak_flops, peak_bytes, vllm, _, kernel = SYSTEMS[system]
    base = DATA / system / "attention" / "vllm" / vllm
    out = {}
    for phase in ("context", "generation"):
        a = pd.read_parquet(base / f"{phase}_attention_perf.parquet")
        keep = (a.kernel_source == kernel) & (a.kv_cache_dtype == "bfloat16")
        if "window_size" in a:
            keep &= a.window_size == 0
        a = a[keep]
        b, s, h, kvh, d = (a[c].to_numpy(float) for c in ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim"))
        if phase == "context":  # a causal prompt of s rows: s(s+1)/2 pairs; its K/V written and read (2s tokens)
            pairs, kv_tokens = b * s * (s + 1) / 2, b * 2 * s
        else:  # one row over step + 1 visible tokens: their K/V read, one row written
            visible = a["step"].to_numpy(float) + 1
            pairs, kv_tokens = b * visible, b * (visible + 1)
        out[phase] = fit_curve(4 * pairs * h * d, kv_tokens * 2 * kvh * d * 2, a.latency.to_numpy(float) * 1e-3,
                               (peak_flops, peak_bytes), memory_ramp=phase == "generation")
    return out


def allreduce_points(system: str) -> dict:
    d = pd.read_parquet(DATA / system / "comm" / "nccl" / SYSTEMS[system][3] / "nccl_perf.parquet")
    d = d[(d.op_name == "all_reduce") & (d.nccl_dtype == "half")]
    out = {}
    for tp, rows in d.groupby("num_gpus"):  # elements of 2 bytes; latency in ms; repeated sizes: their median
        by_size = rows.groupby("message_size").latency.median().sort_index()
        out[str(int(tp))] = [[int(s) * 2, round(float(v) * 1e3, 2)] for s, v in by_size.items()]
    return out


if __name__ == "__main__":
    system = sys.argv[1] if len(sys.argv) > 1 else "a100_sxm"
    print(json.dumps({"gemm": fit_gemm(system), "attention": fit_attention(system),
                      "allreduce_us": allreduce_points(system)}, indent=1))
