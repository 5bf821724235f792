"""`pdserve serve`: the OpenAI-compatible server over disaggregated or colocated worker pools."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from pdserve.api.preflight import (check_files, check_kv_events, check_listen, check_machine, check_model, check_predictor,
                                   finite_float)
from pdserve.engine.config import EngineConfig
from pdserve.engine.prompt_priority import PromptPriority
from pdserve.workers.process.tp_rank import add_tp_flags, shape_from_args

ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"
DEFAULTS = None  # filled lazily from ServeConfig so that argument parsing stays light


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Deployment flags shared by `serve` and `demo`; defaults mirror `ServeConfig`."""
    p.add_argument("--mode", choices=["disaggregated", "colocated", "splitwise"], default="disaggregated",
                   help="splitwise: disaggregated, and a pool controller moves workers between the prompt and "
                        "the token pool as load shifts (router/splitwise/splitwise.py)")
    p.add_argument("--workers", type=int, default=None,
                   help="splitwise: workers in all, half prompt (prefill) and half token (decode) at start")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    p.add_argument("--mixed", type=int, default=0, metavar="M",
                   help="splitwise: M mixed workers that serve both phases, taking prompt work while the prompt "
                        "pool is pressed and token work while the token pool is (router/splitwise/mixed_pool.py)")
    p.add_argument("--replicas", type=int, default=2, help="colocated workers (colocated)")
    add_tp_flags(p)
    p.add_argument("--model", default="tiny", help="tiny | small | path to a HF checkpoint dir")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=EngineConfig.dtype)
    p.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default=None,
                   help="activation/matmul dtype (default: --dtype); float32 over bf16 storage runs prefill "
                        "~5x faster on CPUs without native bf16, at some small-batch decode speed")
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="let fp32 products pick MKL's fastest kernel per batch size (faster small-batch decode; "
                        "a request's tokens may then depend on its batch mates)")
    p.add_argument("--device", default=EngineConfig.device, metavar="cpu|cuda[:N]",
                   help="where every worker's weights, K/V pool and activations live; cuda runs the Triton kernels "
                        "(model/gpu/) and, for now, --mode colocated only (the GPU handoff is not built yet)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="on a GPU: the batch-invariant products (Triton GEMM; slower than cuBLAS at small batches, "
                        "docs/gpu.md); on the CPU invariance is the default (--no-batch-invariant turns it off)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU: run decode steps eagerly instead of replaying CUDA graphs (engine/cuda_graphs.py)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish each worker's prefix-cache block events in vLLM's KV-events format (ZMQ PUB, msgpack "
                        "KVEventBatch; worker i at PORT + i, in launch order) for an indexer built for vLLM")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="their replay sockets (ZMQ ROUTER; worker i at PORT + i)")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="K/V pool per worker (MiB)")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="per-step token budget (chunked prefill)")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--prefill-runahead", type=int, default=0, metavar="K",
                   help="KV-Runahead: prompts of at least --runahead-min-tokens are prefilled by a causal chain of K "
                        "prefill workers (partitions on the chunk grid; K <= --prefill); 0 or 1: off")
    p.add_argument("--runahead-min-tokens", type=int, default=1024, metavar="N",
                   help="the shortest prompt a KV-Runahead chain prefills")
    p.add_argument("--prompt-priority", choices=["auto", "on", "off"], default="auto",
                   help="Splitwise mixed-machine rule: a fresh prompt that finds the batch full displaces one "
                        "young decode per step (engine/prompt_priority.py); auto = on in splitwise mode")
    p.add_argument("--prompt-age-override-ms", type=finite_float, default=PromptPriority.age_override_ms, metavar="MS",
                   help="prompt priority: decodes this old at their worker are never displaced")
    p.add_argument("--prompt-max-preemptions", type=int, default=PromptPriority.max_preemptions, metavar="N",
                   help="prompt priority: a request preempted N times is never displaced again")
    p.add_argument("--policy", choices=["round_robin", "jsq", "slo", "prefix"], default="jsq")
    p.add_argument("--decode-choice", choices=["policy", "p2c"], default="policy",
                   help="p2c: the decode worker by power-of-two choices on predicted heavy/light decodes "
                        "(TetriInfer); --policy keeps choosing the prefill side")
    p.add_argument("--reserve", choices=["static", "dynamic"], default="static",
                   help="decode reservations: static holds max_tokens of growth; dynamic holds the predicted "
                        "bucket's upper bound (needs --predictor), grows past it, and preempts by recompute "
                        "when it cannot")
    p.add_argument("--predictor", default=None, metavar="P.json",
                   help="output-length predictor (`pdserve predictor train`), trained for the served model")
    p.add_argument("--admission-wait-s", type=finite_float, default=30.0, metavar="S",
                   help="how long a request may wait in admission for K/V capacity before a 503")
    p.add_argument("--prefill-length-buckets", default="", metavar="0,128,512,...",
                   help="bucketed prefill admission (TetriInfer): after the queue head, a step admits prompts "
                        "of the head's length bucket first (engine/prefill_buckets.py); default off")
    p.add_argument("--pd-decision", choices=["always", "never", "margin"], default="margin",
                   help="disaggregated mode, per request: always hand off, never (prefill on the decode worker), or "
                        "only when the spec's net margin says the remote prefill pays (default)")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=0, metavar="N",
                   help="prompts with fewer than N uncached tokens at their decode worker (its prefix cache "
                        "subtracted) always prefill there (applies first, with always or margin)")
    p.add_argument("--pd-safety-margin-ms", type=finite_float, default=0.0, metavar="MS",
                   help="margin mode: hand off only when the net margin exceeds this (default 0)")
    p.add_argument("--pd-profile", default="auto", metavar="auto|refit|FILE.json|none",
                   help="the router's cost model (what the margin and colocated fetch decisions weigh): auto (default) "
                        "times the served engine on this machine at start and fits it (margin or colocated; pinned "
                        "P/D decisions skip it), then keeps the fit under ~/.cache/pdserve/fits for later starts "
                        "with the same checkpoint, engine, threads, CPU and code; refit: measure again; FILE a "
                        "`pdserve profile` fit; none: placeholders")
    p.add_argument("--slo-ttft-ms", type=finite_float, default=None, metavar="MS",
                   help="TTFT target: drives the P/D margin decision and the slo/prefix policies' admission; "
                        "default: derived per request from the measured profile (5x the idle prefill of the prompt or of "
                        "the recent median prompt, the longer; "
                        "admission then refuses past 30 s)")
    p.add_argument("--slo-tpot-ms", type=finite_float, default=None, metavar="MS",
                   help="TPOT (and per-token gap) target: drives the P/D margin decision (how much stall a running "
                        "decode absorbs) and the slo/prefix policies' admission; default: derived from the measured "
                        "profile (5x an idle decode step; admission then refuses past 5 s)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--no-pin-cpus", action="store_true", help="do not pin each worker to its own CPUs")
    p.add_argument("--transport", choices=["auto", "shm", "tcp"], default="auto", help="K/V handoff transport")
    p.add_argument("--layerwise-threshold", type=int, default=256,
                   help="prompts with at least this many tokens stream K/V layer by layer")
    p.add_argument("--trace-dir", default=None, help="write per-request and per-worker JSONL traces here (and each worker's engine step log)")
    p.add_argument("--ray", action="store_true", help="place workers as Ray actors")
    p.add_argument("--address", default=None, help="Ray cluster address (with --ray)")
    p.add_argument("--ray-pack-pairs", action="store_true", help="keep prefill/decode pairs on one node (placement group)")
    p.add_argument("--lease-s", type=finite_float, default=30.0,
                   help="K/V reserved or pinned for a request is reclaimed when the router stops renewing it this long")
    p.add_argument("--kv-index-max-entries", type=int, default=524_288, metavar="N",
                   help="bound of the router's cluster K/V index (block, worker) entries; least recently used "
                        "entries go past it (~280 bytes each)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="each worker keeps the K/V of full prompt blocks for later requests with the same prefix "
                        "(vLLM's flag; --no-enable-prefix-caching computes every prompt whole, with no reuse, "
                        "fetch or host tier)")
    p.add_argument("--no-kv-sharing", action="store_true",
                   help="no cross-worker prefix fetch and no routing credit for a prefix another worker holds "
                        "(each worker reuses only its own prefix cache; no host tier)")
    p.add_argument("--host-kv-mb", type=int, default=0, metavar="MB",
                   help="per worker, a host-memory tier for evicted prefix blocks (promoted back on a hit; "
                        "engine/kv/host_tier.py); 0: none")
    p.add_argument("--max-tenant-roots", type=int, default=EngineConfig.max_tenant_roots, metavar="N",
                   help="per worker, tenants (an API key's or a cache_salt's) whose prefix-cache chain root is "
                        "kept, least recently used first out (an evicted one is computed again)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="KEY -> TENANT file (JSON object or 'KEY TENANT' lines): generation needs "
                        "'Authorization: Bearer KEY', and K/V is reused only within the key's tenant")
    p.add_argument("--admin-token-file", default=None, metavar="FILE",
                   help="mount /admin/* (live disable of disaggregation, rollback, release state) behind "
                        f"'Authorization: Bearer T', T read from FILE (or from ${ADMIN_TOKEN_ENV}); off without either")
    p.add_argument("--admin-token", default=None, metavar="T",
                   help=f"deprecated: the token is visible in `ps`; use --admin-token-file or ${ADMIN_TOKEN_ENV}")
    p.add_argument("--max-request-body-bytes", type=int, default=None, metavar="N",
                   help="HTTP request bodies above N bytes answer 413, checked while the body streams in "
                        "(default 4 MiB: api/edge/http_guard.py)")
    p.add_argument("--max-logprobs", type=int, default=20, metavar="K",
                   help="the most top logprobs a request may ask for (completions logprobs, chat top_logprobs); more is a 400")
    p.add_argument("--no-restart", action="store_true",
                   help="do not start a dead worker again (default: restart under a new epoch, backoff 0.5 s doubling to 8 s)")
    p.add_argument("--max-crashes", type=int, default=5, metavar="N",
                   help="a worker that dies N times within --crash-window-s is marked FAILED (/workers, metrics) "
                        "and not started again")
    p.add_argument("--crash-window-s", type=finite_float, default=120.0)
    p.add_argument("--heartbeat-timeout-s", type=finite_float, default=10.0,
                   help="a worker silent this long (hung, e.g. SIGSTOP) is retired, ended (SIGKILL after a grace) "
                        "and restarted under its next epoch")
    p.add_argument("--step-timeout-s", type=finite_float, default=60.0, metavar="S",
                   help="a worker whose engine loop has not come round for this long (one step stuck: a "
                        "tensor-parallel rank stopped or hung, a deadlock) stops heartbeating, so it is retired, "
                        "ended and restarted after --heartbeat-timeout-s more (vLLM's "
                        "VLLM_ENGINE_ITERATION_TIMEOUT_S); longer than any step the model takes")
    p.add_argument("--startup-timeout-s", type=finite_float, default=180.0, metavar="S",
                   help="every worker registers within this long of the start, or the start fails naming those "
                        "that did not (a large checkpoint may need more)")
    p.add_argument("--max-reroutes", type=int, default=2, metavar="K",
                   help="a request whose route broke is moved to another worker at most K times, then ends with "
                        "the explicit error max_reroutes")


def _split(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prefill, decode, mixed) workers: --workers N in splitwise mode splits N in half, else
    --prefill/--decode/--mixed (ServeConfig checks the counts)."""
    workers, mixed = getattr(args, "workers", None), getattr(args, "mixed", 0)
    if workers is None:
        return args.prefill, args.decode, mixed
    if args.mode != "splitwise" or workers < 2:
        raise ValueError("--workers N (N >= 2) goes with --mode splitwise")
    if mixed:
        raise ValueError("--workers N splits N into prompt and token workers; a mixed pool takes an explicit "
                         "--prefill P --decode D --mixed M")
    return workers // 2, workers - workers // 2, 0


def prompt_priority(args: argparse.Namespace) -> PromptPriority | None:
    """The mixed-machine rule every worker's scheduler runs, or None (`--prompt-priority`)."""
    choice = getattr(args, "prompt_priority", "auto")
    if choice == "off" or (choice == "auto" and args.mode != "splitwise"):
        return None
    return PromptPriority(getattr(args, "prompt_age_override_ms", PromptPriority.age_override_ms),
                          getattr(args, "prompt_max_preemptions", PromptPriority.max_preemptions))


def serve_config(args: argparse.Namespace, port: int | None = None):
    from pdserve.api.server import ServeConfig
    from pdserve.workers.process.supervisor import RestartPolicy

    engine = EngineConfig(
        model=args.model, dtype=args.dtype, compute_dtype=args.compute_dtype,
        batch_invariant=invariance(args), block_size=args.block_size, kv_cache_bytes=args.kv_cache_mb << 20,
        device=getattr(args, "device", EngineConfig.device), enforce_eager=getattr(args, "enforce_eager", False),
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        prefill_length_buckets=length_buckets(getattr(args, "prefill_length_buckets", "")),
        prompt_priority=prompt_priority(args),
        host_kv_bytes=0 if getattr(args, "no_kv_sharing", False) or not getattr(args, "enable_prefix_caching", True)
        else getattr(args, "host_kv_mb", 0) << 20,  # the tier holds evicted prefix blocks: none without a cache
        max_tenant_roots=getattr(args, "max_tenant_roots", EngineConfig.max_tenant_roots),
        enable_prefix_cache=getattr(args, "enable_prefix_caching", True),
    )
    if engine.device != "cpu" and args.mode != "colocated":
        raise ValueError(f"--device {engine.device} serves --mode colocated only: the handoff between GPU pools "
                         "(CUDA IPC, or TCP through pinned host staging) is not built yet")
    return ServeConfig(
        mode=args.mode, **dict(zip(("num_prefill", "num_decode", "num_mixed"), _split(args))), replicas=args.replicas,
        engine=engine,
        host=getattr(args, "host", "127.0.0.1"), port=port if port is not None else getattr(args, "port", 8000),
        policy=args.policy, slo_ttft_s=_seconds(args.slo_ttft_ms), slo_tpot_s=_seconds(args.slo_tpot_ms),
        pd_safety_margin_s=getattr(args, "pd_safety_margin_ms", 0.0) / 1e3,
        kv_events_endpoint=getattr(args, "kv_events_endpoint", None),
        kv_events_replay_endpoint=getattr(args, "kv_events_replay_endpoint", None),
        decode_choice=getattr(args, "decode_choice", "policy"), reserve=getattr(args, "reserve", "static"),
        predictor=getattr(args, "predictor", None), admission_wait_s=getattr(args, "admission_wait_s", 30.0),
        threads_per_worker=args.threads_per_worker, pin_cpus=not args.no_pin_cpus, trace_dir=args.trace_dir,
        layerwise_threshold_tokens=args.layerwise_threshold, transport=args.transport, ray=args.ray,
        ray_address=args.address, ray_pack_pairs=args.ray_pack_pairs,
        restart=RestartPolicy(enabled=not args.no_restart, max_crashes=getattr(args, "max_crashes", 5),
                              crash_window_s=getattr(args, "crash_window_s", 120.0)),
        lease_s=args.lease_s, heartbeat_timeout_s=getattr(args, "heartbeat_timeout_s", 10.0),
        step_timeout_s=getattr(args, "step_timeout_s", 60.0),
        startup_timeout_s=getattr(args, "startup_timeout_s", 180.0),
        max_reroutes=getattr(args, "max_reroutes", 2),
        pd_decision=args.pd_decision, pd_min_prompt_tokens=args.pd_min_prompt_tokens,
        pd_profile=args.pd_profile, admin_token=admin_token(args),
        **({"max_request_body_bytes": args.max_request_body_bytes} if getattr(args, "max_request_body_bytes", None) else {}),
        http_limits=edge_limits(args),
        max_logprobs=getattr(args, "max_logprobs", 20), api_keys=getattr(args, "api_keys", None),
        kv_index_max_entries=getattr(args, "kv_index_max_entries", 524_288),
        prefill_runahead=getattr(args, "prefill_runahead", 0), runahead_min_tokens=getattr(args, "runahead_min_tokens", 1024),
        kv_sharing=not getattr(args, "no_kv_sharing", False),
        tp=shape_from_args(args),
    )


def invariance(args: argparse.Namespace) -> bool:
    """Batch invariance: the CPU's default (off with --no-batch-invariant); on a GPU only with
    --batch-invariant, since cuBLAS is the faster product there (docs/gpu.md)."""
    if getattr(args, "device", "cpu") == "cpu":
        return not args.no_batch_invariant
    return getattr(args, "batch_invariant", False) and not args.no_batch_invariant


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def with_config_file(args: argparse.Namespace) -> argparse.Namespace:
    """`--config FILE` merged under the flags the user set (commands/deploy_config.py)."""
    if getattr(args, "config", None) is None:
        return args
    from pdserve.commands import deploy_config

    file_config = deploy_config.load(args.config)
    argv = getattr(args, "cli_argv", None)
    argv = argv[1:] if argv is not None else sys.argv[2:]  # the subcommand's own arguments
    explicit = deploy_config.explicit_flags(args.serve_parser, argv)
    deploy_config.check_model(file_config, explicit)
    return deploy_config.apply(args, file_config, explicit)


def length_buckets(text: str) -> tuple[int, ...]:
    """`--prefill-length-buckets 0,128,512` -> (0, 128, 512); raises ValueError on a bad list."""
    from pdserve.engine.prefill_buckets import validate_bounds

    try:
        bounds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--prefill-length-buckets: expected comma-separated integers, got {text!r}") from None
    validate_bounds(bounds)
    return bounds


def admin_token(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str | None:
    """The admin token from --admin-token-file or $PDSERVE_ADMIN_TOKEN, never from argv (`ps` shows
    argv to every user); the deprecated --admin-token still works, with a warning."""
    path, given, env = getattr(args, "admin_token_file", None), getattr(args, "admin_token", None), environ.get(ADMIN_TOKEN_ENV)
    if sum(x is not None for x in (path, given, env)) > 1:
        raise ValueError(f"give the admin token once: --admin-token-file, ${ADMIN_TOKEN_ENV} or --admin-token")
    if given is not None:
        print(f"warning: --admin-token is visible in `ps`; use --admin-token-file or ${ADMIN_TOKEN_ENV}", file=sys.stderr)
    token = Path(path).read_text().strip() if path is not None else (env if env is not None else given)
    if token is not None and not token.strip():
        raise ValueError("the admin token is empty")
    return token


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible API over prefill/decode worker pools")
    add_cluster_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", default=None, metavar="FILE.json",
                   help="a serve configuration (`pdserve plan --emit-config`); flags set here override it")
    add_edge_args(p)
    p.set_defaults(func=run, serve_parser=p)


def add_edge_args(p: argparse.ArgumentParser) -> None:
    """The HTTP edge's connection limits (api/edge/limits.py, enforced by api/edge/connections.py);
    defaults mirror `EdgeLimits`."""
    from pdserve.api.edge import limits as edge

    p.add_argument("--max-connections", type=int, default=edge.DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open HTTP connections (streams and idle keep-alives included); one more answers 503 "
                        "at once and is closed. The soft open-file limit is raised to N + "
                        f"{edge.FD_RESERVE} at start (default {edge.DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--request-header-timeout-s", type=finite_float, default=edge.DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="a request's head (request line and headers) must arrive within S seconds of the "
                        "connection's opening (or of its first byte on a kept-alive connection); else 408 and close "
                        f"(default {edge.DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--request-body-timeout-s", type=finite_float, default=edge.DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="a request's body must arrive within S seconds of its head; else 408 and close, "
                        f"before any route runs (default {edge.DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--response-write-timeout-s", type=finite_float, default=edge.DEFAULT_WRITE_TIMEOUT_S, metavar="S",
                   help="a connection whose client reads none of its answer for S seconds (the server's "
                        f"send buffers full) is dropped (default {edge.DEFAULT_WRITE_TIMEOUT_S:g})")


def edge_limits(args: argparse.Namespace):
    """`EdgeLimits` from the flags (their defaults for commands that serve no HTTP edge of their own)."""
    from pdserve.api.edge.limits import EdgeLimits

    base = EdgeLimits()
    return EdgeLimits(getattr(args, "max_connections", base.max_connections),
                      getattr(args, "request_header_timeout_s", base.header_timeout_s),
                      getattr(args, "request_body_timeout_s", base.body_timeout_s),
                      getattr(args, "response_write_timeout_s", base.write_timeout_s))


def run(args: argparse.Namespace) -> int:
    from pdserve.api.edge.limits import fit_fd_limit
    from pdserve.api.server import StartFailed, serve
    from pdserve.loop import run as run_loop

    try:
        args = with_config_file(args)
        config = serve_config(args)
        config.shape()
        check_model(config)
        check_predictor(config)
        check_machine(config)
        check_files(config)
        check_listen(config.host, config.port)
        check_kv_events(config)
        fit_fd_limit(config.http_limits)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run_loop(serve(config))  # uvloop where installed (pdserve/loop.py)
    except KeyboardInterrupt:  # a SIGINT before the HTTP server took the signals (during the start)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the process ends as signalled, as a later one does
        signal.raise_signal(signal.SIGINT)
    except (TimeoutError, StartFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
