"""`pdserve serve`'s checks before any process starts: a deployment that cannot run is refused with
one `error:` line and exit 2, instead of a traceback from a worker, a worker restarted into the
same error, or a server that starts and then hangs or exits.

Contract: every function raises ValueError (or OSError, for a file or a socket) naming the flag;
none imports torch (the serving process has none). `finite_float` is the argparse type of every
float flag of `serve`: nan and inf are refused at the parse (a worker's JSON configuration cannot
carry them, and no deadline or target is infinite).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import socket


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def check_local(config) -> None:
    """Every check of a cluster started on this machine except its HTTP address: `pdserve demo`,
    `drill` and `chaos` serve on a free port they pick themselves."""
    check_model(config)
    check_predictor(config)
    check_machine(config)
    check_files(config)
    check_kv_events(config)


def check_model(config) -> None:
    """The checkpoint exists and reads: its config, its weights' headers against the config (names,
    dtypes, shapes, byte spans against the file sizes; no tensor is read) and its tokenizer; each
    role's tensor-parallel size divides it; a block fits the model's positions and the pool holds at
    least one (a CheckpointError or TpShapeError, both ValueErrors): a worker that found out would
    exit and be restarted into the same error, or, with no block to allocate, start and never run a
    request; the server itself would stop on it with a traceback."""
    from pdserve.engine.kv.kv_abi import KvAbi
    from pdserve.model.config import check_tp, load_config
    from pdserve.model.default import resolve_model
    from pdserve.model.loader import check_checkpoint
    from pdserve.model.tokenizer import load_tokenizer

    engine = config.engine
    model_dir = resolve_model(engine.model)
    model = load_config(model_dir)
    check_checkpoint(model_dir, model)
    load_tokenizer(model_dir)
    for role in config.shape().roles():
        check_tp(model, config.tp.for_role(role.value))
    if engine.block_size > model.max_position_embeddings:
        raise ValueError(f"--block-size {engine.block_size} is longer than the model's {model.max_position_embeddings} "
                         f"positions")
    abi = KvAbi(model.num_layers, model.num_kv_heads, model.head_dim, engine.block_size, engine.dtype)
    if engine.num_blocks is None and engine.kv_cache_bytes < abi.bytes_per_block:
        raise ValueError(f"--kv-cache-mb {engine.kv_cache_bytes / 2**20:g} holds no block of {engine.block_size} tokens "
                         f"({abi.bytes_per_block / 2**20:.2f} MiB each)")


def check_machine(config) -> None:
    """What this machine can give the workers started on it (not checked under Ray: they run
    elsewhere): the device, the cores a worker's threads would run on, the memory of every pool."""
    engine = config.engine
    if config.ray:
        return
    if engine.device != "cpu" and not glob.glob("/dev/nvidia[0-9]*"):
        raise ValueError(f"--device {engine.device}: this machine has no CUDA device")
    cpus = len(os.sched_getaffinity(0))
    if config.threads_per_worker > cpus:
        raise ValueError(f"--threads-per-worker {config.threads_per_worker} is more than the {cpus} CPUs this server "
                         f"may run on")
    workers = len(config.shape().roles())
    device_pool = engine.kv_cache_bytes if engine.num_blocks is None else 0  # else sized in blocks
    pools = workers * (device_pool + engine.host_kv_bytes)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pools > memory:
        raise ValueError(f"{workers} workers' K/V pools (--kv-cache-mb {engine.kv_cache_bytes >> 20} + --host-kv-mb "
                         f"{engine.host_kv_bytes >> 20} each) need {pools >> 20} MiB; this machine has {memory >> 20} MiB")


def check_files(config) -> None:
    """The files the server reads after its workers start are read once now."""
    if config.api_keys:
        from pdserve.api.tenants import load_api_keys

        load_api_keys(config.api_keys)
    if config.pd_profile not in ("auto", "refit", "none"):
        import json
        from pathlib import Path

        try:
            profile = json.loads(Path(config.pd_profile).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pd-profile {config.pd_profile}: not JSON ({exc})") from None
        from pdserve.router.pricing.calibration import is_fit

        if not is_fit(profile):
            raise ValueError(f"--pd-profile {config.pd_profile}: not a `pdserve profile` fit (prefill_coef and "
                             f"decode_coef of three numbers each)")
    if config.trace_dir:
        os.makedirs(config.trace_dir, exist_ok=True)


def check_listen(host: str, port: int) -> None:
    """The HTTP address can be listened on (bound and released at once: uvicorn binds it once the
    workers are up); an address in use or not of this machine fails here, before any worker."""
    try:
        _bind_once(host, port)
    except OSError as exc:
        raise OSError(f"cannot listen on --host {host} --port {port}: {exc.strerror or exc}") from None


def _bind_once(host: str, port: int) -> None:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn (and zmq) bind it
        sock.bind(address)


def check_kv_events(config) -> None:
    """Each worker's KV-events sockets (base port + its index) can be bound on this machine."""
    if config.ray or config.kv_events_endpoint is None:
        return
    from pdserve.workers.kv_publisher import endpoint_for

    for flag, base in (("--kv-events-endpoint", config.kv_events_endpoint),
                       ("--kv-events-replay-endpoint", config.kv_events_replay_endpoint)):
        for i in range(len(config.shape().roles()) if base else 0):
            host, _, port = endpoint_for(base, i).removeprefix("tcp://").rpartition(":")
            try:
                _bind_once("0.0.0.0" if host == "*" else host.strip("[]"), int(port))
            except OSError as exc:
                raise OSError(f"{flag} {base}: worker {i} cannot bind port {port}: {exc.strerror or exc}") from None


def check_predictor(config) -> None:
    """Refuse at start, before any worker, a predictor that is missing, malformed or trained for
    another model (router/tetri/reserve_mode.py; raises ValueError)."""
    if config.predictor is None:
        return
    from pdserve.model.default import resolve_model
    from pdserve.router.tetri.reserve_mode import load_policy

    load_policy(config.reserve, config.predictor, resolve_model(config.engine.model))
