"""The GPU figures of issue 37 in one run, written as one JSON (stdout and --out).

On a CUDA machine: the chip's two ceilings measured first (a device-to-device copy, a bf16
matrix product), then per geometry (the built-in `small`, ~126M, and a 1B-class Llama built by
the project's own generator) and per product mode (invariant: Triton; fast: cuBLAS): pdserve's
decode step at batch 1/32/128 over 1k-token contexts against the HBM roofline, a 2k-token prefill
against the bf16 rate, transformers on the same GPU and checkpoint, and a host-staged K/V move
between two GPU pools against a device-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.engine.kv.kv_pool import KvPool
from pdserve.engine.sequence import SamplingParams
from pdserve.model.default import DEFAULT_SPECS, DefaultModelSpec, ensure_default_model, write_checkpoint

HBM_BYTES_S = 4.8e12  # H200 datasheet; the measured copy rate is reported beside it
DENSE_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 datasheet
ONE_B = DefaultModelSpec(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256,
                         tie=True, max_pos=8192)  # Llama-3.2-1B's geometry


DEVICE = "cuda"  # --device cpu: a smoke run of this script on a machine without a GPU (figures meaningless)


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def sync_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings() -> dict:
    n = 1 << (29 if DEVICE != "cpu" else 22)
    a = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)  # 1 GiB on the GPU
    b = torch.empty_like(a)
    copy_s = sync_time(lambda: b.copy_(a), 10)
    m = 8192 if DEVICE != "cpu" else 256
    x = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    mm_s = sync_time(lambda: x @ y, 10)
    del a, b, x, y
    return {"copy_bytes_s": 2 * 2 * n / copy_s, "bf16_matmul_flops": 2 * m**3 / mm_s}


def params(spec: DefaultModelSpec) -> dict:
    h, L, ff, v = spec.hidden, spec.layers, spec.intermediate, spec.vocab
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * ff
    return {"layer_params": L * layer, "head_params": v * h, "kv_bytes_per_token": L * 2 * kv * 2}


def engine_for(ckpt: Path, invariant: bool, kv_gib: int, budget: int, eager: bool = False) -> Engine:
    return Engine(EngineConfig(model=str(ckpt), dtype="bfloat16", device=DEVICE, batch_invariant=invariant,
                               enforce_eager=eager,
                               kv_cache_bytes=kv_gib << 30, max_num_seqs=256, max_num_batched_tokens=budget))


def decode_step_s(engine: Engine, batch: int, context: int, vocab: int, steps: int = 12) -> float:
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=4000, ignore_eos=True)  # none finishes while others still prefill
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(3, vocab, (context,), generator=gen).tolist(), params)
    while any(not engine.seqs[r].output_ids for r in ids if r in engine.seqs):  # every prompt prefilled
        engine.step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times[2:])


def prefill_s(engine: Engine, length: int, vocab: int) -> float:
    gen = torch.Generator().manual_seed(length)
    prompts = [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(4)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([prompts[0]], one)  # warm-up (Triton compiles)
    times = []
    for p in prompts[1:]:
        sync()
        t0 = time.perf_counter()
        engine.generate([p], one)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transformers_figures(ckpt: Path, length: int, context: int, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(DEVICE).eval()
    cfg = model.config
    out = {}
    with torch.inference_mode():
        ids = torch.randint(3, vocab, (1, length), device=DEVICE)
        out["prefill_s"] = sync_time(lambda: model(ids, use_cache=True).logits[:, -1].argmax(-1), 3)
        for batch in (1, 32):
            cache = DynamicCache()
            for layer in range(cfg.num_hidden_layers):
                k = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, device=DEVICE, dtype=torch.bfloat16)
                cache.update(k, torch.randn_like(k), layer)
            nxt = torch.randint(3, vocab, (batch, 1), device=DEVICE)
            state = {"past": cache, "next": nxt}

            def step():
                o = model(state["next"], past_key_values=state["past"], use_cache=True)
                state["past"], state["next"] = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                state["next"].tolist()  # the host sees each token, as a server does
            out[f"decode_{batch}_s"] = sync_time(step, 10)
    del model
    if DEVICE != "cpu":
        torch.cuda.empty_cache()
    return out


def handoff_figure(spec: DefaultModelSpec, mib: int = 128) -> dict:
    abi = KvAbi(spec.layers, spec.kv_heads, spec.head_dim, 16, "bfloat16")
    blocks = (mib << 20) // abi.bytes_per_block
    src, dst = KvPool(abi, blocks + 1, device=DEVICE), KvPool(abi, blocks + 1, device=DEVICE)
    src.tensor.normal_()
    ids = list(range(1, blocks + 1))

    def staged():
        for layer in range(spec.layers):
            dst.write_chunk(layer, ids, src.read_chunk(layer, ids))
    staged_s = sync_time(staged, 3, warmup=1)
    assert torch.equal(src.tensor[:, :, 1:blocks + 1], dst.tensor[:, :, 1:blocks + 1])  # past them: the scratch block
    d2d_s = sync_time(lambda: dst.tensor.copy_(src.tensor), 5)
    nbytes = blocks * abi.bytes_per_block
    return {"bytes": nbytes, "host_staged_bytes_s": nbytes / staged_s, "d2d_bytes_s": src.nbytes / d2d_s,
            "ratio_to_d2d": (nbytes / staged_s) / (src.nbytes / d2d_s), "transport": "host-staged (no CUDA IPC yet)"}


def _ipc_source(conn, shape) -> None:
    from pdserve.handoff.transports.cuda_ipc import export_pool
    pool = torch.randn(shape, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    conn.send(export_pool(pool))
    conn.recv()


def ipc_figure(spec: DefaultModelSpec, mib: int = 128) -> dict:
    """Two processes on the GPU: the destination maps the source pool through CUDA IPC and copies
    `mib` MiB of granted blocks; against a device-to-device copy of the same bytes in one process."""
    import multiprocessing as mp
    from pdserve.handoff.transports.cuda_ipc import attach_pool, copy_granted
    abi = KvAbi(spec.layers, spec.kv_heads, spec.head_dim, 16, "bfloat16")
    blocks = (mib << 20) // abi.bytes_per_block
    shape = (spec.layers, 2, blocks + 8, 16, spec.kv_heads, spec.head_dim)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_ipc_source, args=(theirs, shape))
    child.start()
    try:
        src = attach_pool(mine.recv())
        dst = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        ids = list(range(blocks))
        perm = torch.randperm(blocks).tolist()  # landing blocks in another order, as a real reservation
        granted = frozenset(ids)
        ipc_s = sync_time(lambda: copy_granted(src, ids, dst, perm, granted), 10)
        assert torch.equal(dst[:, :, perm], src[:, :, ids])
        local = torch.empty_like(dst)
        d2d_s = sync_time(lambda: local.copy_(dst), 10)
        nbytes = blocks * abi.bytes_per_block
        del src
        torch.cuda.synchronize()
        return {"bytes": nbytes, "ipc_copy_s": ipc_s, "ipc_bytes_s": nbytes / ipc_s,
                "d2d_bytes_s": dst.numel() * 2 / d2d_s, "ratio_to_d2d": (nbytes / ipc_s) / (dst.numel() * 2 / d2d_s)}
    except Exception as exc:  # report, keep the rest of the run's figures
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        mine.send("done")
        child.join(30)


def geometry_figures(name: str, ckpt: Path, spec: DefaultModelSpec, ceil: dict, batches: tuple[int, ...]) -> dict:
    p = params(spec)
    weight_bytes = 2 * (p["layer_params"] + p["head_params"])
    context, length = (1024, 2048) if DEVICE != "cpu" else (40, 64)
    res: dict = {"geometry": name, "params": p["layer_params"] + p["head_params"], "modes": {}}
    for invariant in (False, True):
        mode = "invariant" if invariant else "fast"
        kv_gib = max(2, -(-max(batches) * (context + 32) * p["kv_bytes_per_token"] // (1 << 30)) + 1)
        engine = engine_for(ckpt, invariant, kv_gib, budget=length)
        fig: dict = {"products": engine.model.products.describe(), "decode": {}}
        pre = prefill_s(engine, length, spec.vocab)
        flops = 2 * p["layer_params"] * length + 2 * p["head_params"] + 2 * spec.layers * spec.heads * spec.head_dim * length * length
        fig["prefill_2k_s"] = pre
        fig["prefill_2k_tflops"] = flops / pre / 1e12
        fig["prefill_2k_of_dense_bf16"] = flops / pre / DENSE_BF16_FLOPS
        if spec.max_pos > 4096 and not invariant:
            fig["prefill_4k_s"] = prefill_s(engine, 4096, spec.vocab)  # TTFT of a 4k prompt (two 2k chunks)
            fig["kv_4k_bytes"] = 4096 * p["kv_bytes_per_token"]
        for b in batches:
            step = decode_step_s(engine, b, context, spec.vocab)
            roof_bytes = weight_bytes + b * context * p["kv_bytes_per_token"]
            fig["decode"][str(b)] = {"step_s": step, "roofline_s": roof_bytes / HBM_BYTES_S,
                                     "over_roofline": step / (roof_bytes / HBM_BYTES_S),
                                     "over_measured_copy": step / (roof_bytes / ceil["copy_bytes_s"])}
        engine.assert_no_leaks()
        res["modes"][mode] = fig
        del engine
        if not invariant:  # the same decode steps without CUDA graphs, for what the graphs save
            eager = engine_for(ckpt, invariant, kv_gib, budget=length, eager=True)
            fig["decode_eager"] = {str(b): decode_step_s(eager, b, context, spec.vocab) for b in batches[:2]}
            del eager
        if DEVICE != "cpu":
            torch.cuda.empty_cache()
    hf = transformers_figures(ckpt, length, context, spec.vocab)
    res["transformers"] = hf
    for mode, fig in res["modes"].items():
        fig["vs_transformers"] = {"prefill": hf["prefill_s"] / fig["prefill_2k_s"],
                                  "decode_1": hf["decode_1_s"] / fig["decode"]["1"]["step_s"],
                                  "decode_32": hf["decode_32_s"] / fig["decode"]["32"]["step_s"]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--geometries", default="small,1b")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny sizes)")
    ap.add_argument("--batches", default="1,32,128")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    report = {"device": torch.cuda.get_device_name() if DEVICE != "cpu" else "cpu", "torch": torch.__version__}
    if DEVICE != "cpu":
        import triton
        report["triton"] = triton.__version__
    report["ceilings"] = ceil = ceilings()
    work = Path(tempfile.mkdtemp(prefix="pdserve-gpu-"))
    report["geometries"] = []
    for name in args.geometries.split(","):
        spec = DEFAULT_SPECS.get(name) or ONE_B
        if name in DEFAULT_SPECS:
            ckpt = ensure_default_model(name, cache_dir=work)
        else:
            ckpt = work / name
            ckpt.mkdir()
            write_checkpoint(spec, ckpt)
        batches = tuple(int(b) for b in args.batches.split(","))
        report["geometries"].append(geometry_figures(name, ckpt, spec, ceil, batches))
        print(json.dumps(report["geometries"][-1]), flush=True)
    report["handoff"] = handoff_figure(ONE_B, 128 if DEVICE != "cpu" else 4)
    if DEVICE != "cpu":
        report["handoff_ipc"] = ipc = ipc_figure(ONE_B)
        one_b = next((g for g in report["geometries"] if g["geometry"] == "1b"), None)
        if one_b and "ipc_bytes_s" in ipc and "prefill_4k_s" in one_b["modes"]["fast"]:
            fast = one_b["modes"]["fast"]
            ipc["exposed_of_ttft_4k"] = fast["kv_4k_bytes"] / ipc["ipc_bytes_s"] / fast["prefill_4k_s"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
