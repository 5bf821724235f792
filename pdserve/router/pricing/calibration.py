"""Where the router's cost model comes from: a `pdserve profile` file, or a fit made at start.

Contract: `cost_profile(source, engine, threads, model_dir)` returns the profile dict that
`CostModel.from_profile` reads, or None for the cost model's placeholder numbers:

    source "auto"   time the served engine on this machine now (a child process of the router's,
                    before the workers start, with the workers' thread count and numerics flags, at the
                    prefill role's TP size `tp`) at points sized by the serving chunk, and fit
                    (latency/engine_profile.py) — seconds on the embedded models; what the
                    per-request P/D margin decides with by default, and colocated serving's
                    fetch and host-tier decisions (router/pricing/kv_rates.py applies measured
                    placement rates only to a fitted model). When the deployment runs
                    any worker at TP > 1 (`collective_sizes`, and `tp`), gloo's all_reduce and
                    the step broadcast are timed at each such size too (latency/tp_collectives.py,
                    as `pdserve profile --tp N` does) and recorded as the profile's
                    `collectives`; other TP sizes are priced from it by router/pricing/tp_pricing.py
                    A fit is kept on disk (`$PDSERVE_CACHE/fits`, ~/.cache/pdserve/fits) under a key
                    naming everything it depends on (`fit_key`: the checkpoint, the engine's dtype,
                    chunk, pool and invariance flag, threads, context, TP sizes, the CPU's model
                    and kind, the ISA caps, the torch build and the engine's own source), and a
                    later start with the same key reads it instead of measuring again, as vLLM
                    keeps its compile cache: a warm start costs no fit.
    source "refit"  measure now whatever the disk holds, and keep the new fit for later starts
    source FILE     a `pdserve profile` JSON measured earlier (the same fit)
    source "none"   the placeholders (only for tests that pin the decision's inputs)

The fit is the planner's own (`profiled.fit_profile`): one copy of the latency formula. It runs in
a spawned child, not in the router's process: an engine loaded there (weights, K/V pool, torch)
would leave its freed heap resident in the process that serves HTTP for its whole life (measured:
~640 MiB of the 107M checkpoint's 1 GiB-pool fit), and the router itself needs no torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.engine.config import EngineConfig

AUTO, REFIT, NONE = "auto", "refit", "none"
FIT_FORMAT = 1  # bump when a fit's fields or meaning change: older files are then ignored


def profile_points(chunk_tokens: int, max_model_len: int) -> dict:
    """Prefill points up to the serving chunk, decode points at small and medium batches."""
    top = max(16, min(chunk_tokens, max_model_len - 16))
    prompts = sorted({max(16, top // 8), max(16, top // 2), top})
    contexts = sorted({min(64, top), min(256, top)})
    return {"prompt_lens": tuple(prompts), "batches": (1, 8), "contexts": tuple(contexts), "repeats": 2}


def cost_profile(source: str | None, engine: EngineConfig, threads: int, model_dir: Path, max_model_len: int,
                 tp: int = 1, collective_sizes: tuple[int, ...] = ()) -> dict | None:
    if source is None or source == NONE:
        return None
    if source not in (AUTO, REFIT):
        return json.loads(Path(source).read_text())
    key = fit_key(engine, threads, model_dir, max_model_len, tp, collective_sizes)
    path = fit_cache_root() / f"{key}.json"
    kept = _read_fit(path) if source == AUTO else None
    if kept is not None:
        print(f"pdserve: the router's cost model is the fit kept at {path} (same checkpoint, engine, threads, "
              "CPU and code; `--pd-profile refit` measures again)", file=sys.stderr, flush=True)
        return kept
    fitted = fit_in_child(engine, threads, model_dir, max_model_len, tp, collective_sizes)
    _keep_fit(path, fitted)
    return fitted


def fit_cache_root() -> Path:
    from pdserve.model.default import default_cache_root

    return default_cache_root().parent / "fits"


def fit_key(engine: EngineConfig, threads: int, model_dir: Path, max_model_len: int, tp: int = 1,
            collective_sizes: tuple[int, ...] = ()) -> str:
    """Everything a fit's numbers depend on, hashed: another value of any of them measures again."""
    from pdserve.model.cpu import ISA_CAPS, cpu_identity
    from pdserve.model.loader import checkpoint_hash

    cpu_model, kind, _ = cpu_identity()
    parts = {
        "format": FIT_FORMAT, "checkpoint": checkpoint_hash(model_dir),
        "engine": [engine.dtype, engine.compute_dtype, engine.batch_invariant, engine.max_num_batched_tokens,
                   engine.kv_cache_bytes, engine.block_size, engine.device],
        "threads": threads, "max_model_len": max_model_len, "tp": tp,
        "collectives": sorted({n for n in (tp, *collective_sizes) if n > 1}),
        "cpu": [cpu_model, kind, os.cpu_count()],
        "isa_caps": {name: os.environ.get(name) for name in (*ISA_CAPS, "PDSERVE_MARCH")},
        "torch": _version("torch"), "code": _engine_source_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _engine_source_digest() -> str:
    """The engine's, model's and profiler's source files: other code may step at another speed."""
    root = Path(__file__).resolve().parents[2]  # the pdserve package
    digest = hashlib.sha256()
    for sub in ("engine", "model", "latency"):
        for file in sorted((root / sub).rglob("*")):
            if file.suffix in (".py", ".c", ".h", ".cpp") and file.is_file():
                digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _read_fit(path: Path) -> dict | None:
    """A kept fit, or None when there is none or it cannot be read (it is measured again)."""
    try:
        fitted = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return fitted if is_fit(fitted) else None


def is_fit(profile) -> bool:
    """A `pdserve profile` fit as CostModel.from_profile reads one: three numbers each of prefill_coef and decode_coef."""
    return isinstance(profile, dict) and all(
        isinstance(coef, list) and len(coef) == 3 and all(isinstance(x, (int, float)) for x in coef)
        for coef in (profile.get("prefill_coef"), profile.get("decode_coef")))


def _keep_fit(path: Path, fitted: dict) -> None:
    """Write atomically (a concurrent start reads the old file or the new, never half of one); a
    read-only cache only costs the next start a fit."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", dir=path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(fitted, out)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"pdserve: could not keep the cost-model fit at {path} ({exc}); the next start fits again",
              file=sys.stderr, flush=True)


def fit_in_child(engine: EngineConfig, threads: int, model_dir: Path, max_model_len: int, tp: int = 1,
                 collective_sizes: tuple[int, ...] = ()) -> dict:
    """`fit_now` in a child interpreter (this process's CPU affinity and stderr, its own torch),
    which exits when the fit is made: its memory goes with it. A plain subprocess, not a
    multiprocessing pool, whose resource tracker would stay behind for this process's life."""
    with tempfile.TemporaryDirectory(prefix="pdserve-fit-") as tmp:
        args, out = Path(tmp) / "args.pickle", Path(tmp) / "fit.json"
        args.write_bytes(pickle.dumps((engine, threads, model_dir, max_model_len, tp, collective_sizes)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "import sys; from pdserve.router.pricing.calibration import fit_child_main; fit_child_main(*sys.argv[1:])"
        done = subprocess.run([sys.executable, "-c", code, str(args), str(out)], env=env, stdout=2,  # to our stderr
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the router's cost-model fit failed in its child process (exit {done.returncode}; "
                               "its error is printed above)")
        fitted = json.loads(out.read_text())
        if "error" in fitted:  # the deployment cannot be fitted (e.g. a step budget below its prompt points)
            raise ValueError(fitted["error"])
        return fitted


def fit_child_main(args_path: str, out_path: str) -> None:
    """The child's side of `fit_in_child`: read the arguments, fit, write the profile (or the
    ValueError that says why this deployment cannot be fitted: no traceback for a bad input)."""
    try:
        fitted = fit_now(*pickle.loads(Path(args_path).read_bytes()))
    except ValueError as exc:
        fitted = {"error": str(exc)}
    Path(out_path).write_text(json.dumps(fitted))


def fit_now(engine: EngineConfig, threads: int, model_dir: Path, max_model_len: int, tp: int = 1,
            collective_sizes: tuple[int, ...] = ()) -> dict:
    """The engine's steps timed at TP `tp`, and the collectives at every size > 1 of `tp` and
    `collective_sizes` (the deployment's workers' sizes)."""
    import torch

    from pdserve.latency.engine_profile import ProfilePlan, run_profile
    from pdserve.latency.tp_collectives import profile_section

    before = torch.get_num_threads()
    t0 = time.monotonic()
    plan = ProfilePlan(model=str(model_dir), threads=threads, dtype=engine.dtype, compute_dtype=engine.compute_dtype,
                       batch_invariant=engine.batch_invariant, chunk_tokens=engine.max_num_batched_tokens,
                       kv_cache_mb=max(1, engine.kv_cache_bytes >> 20) if engine.kv_cache_bytes else 256, tp=tp,
                       block_size=engine.block_size,
                       **profile_points(engine.max_num_batched_tokens, max_model_len))
    try:
        fitted = run_profile(plan).to_dict()
    finally:
        torch.set_num_threads(before)
    sizes = tuple(sorted({n for n in (tp, *collective_sizes) if n > 1}))
    if sizes:  # spawned ranks: this process's threads and affinity stay as they are
        fitted["collectives"] = profile_section(str(model_dir), engine.dtype, engine.compute_dtype, sizes)
    print(f"pdserve: fitted the router's cost model on this machine in {time.monotonic() - t0:.1f}s "
          f"(prefill {fitted['prefill_coef']}, decode {fitted['decode_coef']}"
          + "".join(f"; TP {c['tp']} all_reduce {c['allreduce_s'] * 1e3:.2f} ms, step broadcast "
                    f"{c['step_sync_s'] * 1e3:.2f} ms" for c in fitted.get("collectives", ())) + ")",
          file=sys.stderr, flush=True)
    return fitted
