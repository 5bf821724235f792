"""The serve configuration a plan deploys: `pdserve plan --emit-config FILE` writes it,
`pdserve serve --config FILE` runs it, and command-line flags given explicitly override it.

Contract: one JSON object, `{"pdserve_serve_config": 1, ...}` with these keys (all optional but
the version): model (a built-in name or a checkpoint directory: what the plan was made for),
dtype and compute_dtype (the engine's), mode ("disaggregated" | "colocated" | "splitwise"), prefill, decode, mixed (splitwise
only), replicas (worker counts), max_num_batched_tokens (the chunk budget), max_num_seqs (batch limit), policy,
pd_decision, reserve ("static" | "dynamic": then `predictor` names the
predictor file, or `--predictor` gives it), predictor, prefill_runahead (0 or 1: off; K >= 2: a
KV-Runahead chain of K prefill workers, which the file's prefill count must cover), and per-role parallelism prefill_tp,
prefill_pp, decode_tp, decode_pp, tp, pp (1): the TP sizes become `--prefill-tp`, `--decode-tp`
and `--tp` (workers of N ranks, workers/process/tp_rank.py; the model's heads must split N ways, checked
when a worker starts). `check_runnable` refuses what this runtime cannot
run, naming what is missing (pipeline parallelism, a runahead chain longer than the prefill pool); `apply(args, config, explicit)` sets every argparse destination the file names unless
the user typed that flag, whatever its value (`explicit_flags` re-reads the command line with
every default suppressed: `--prefill 1` typed wins over the file's 2 although 1 is the default).
`source.undecided` lists what the plan left to the server's defaults.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

VERSION_KEY = "pdserve_serve_config"
# file key -> argparse destination of `pdserve serve`
ARG_OF = {"model": "model", "dtype": "dtype", "compute_dtype": "compute_dtype", "mode": "mode", "prefill": "prefill", "decode": "decode", "mixed": "mixed", "replicas": "replicas",
          "max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs", "policy": "policy",
          "pd_decision": "pd_decision", "reserve": "reserve", "predictor": "predictor", "decode_choice": "decode_choice",
          "prefill_runahead": "prefill_runahead", "prefill_tp": "prefill_tp", "decode_tp": "decode_tp", "tp": "tp"}
PARALLEL_KEYS = ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp", "tp", "pp")
TP_KEYS = ("prefill_tp", "decode_tp", "tp")  # run by workers of N ranks (workers/process/tp_rank.py)


class ConfigError(ValueError):
    pass


def load(path: str | Path) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if not isinstance(config, dict) or config.get(VERSION_KEY) != 1:
        raise ConfigError(f"--config {path}: not a pdserve serve configuration (needs \"{VERSION_KEY}\": 1)")
    unknown = set(config) - {VERSION_KEY, "source", *ARG_OF, *PARALLEL_KEYS}
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {sorted(unknown)}")
    check_runnable(config)
    return config


def check_runnable(config: dict) -> None:
    """Raise ConfigError naming every feature the configuration needs and this runtime lacks."""
    missing = [f"{key} {config[key]} (pipeline parallelism: workers here run PP 1)"
               for key in PARALLEL_KEYS if key not in TP_KEYS and int(config.get(key, 1)) != 1]
    missing += [f"{key} {config[key]} (a tensor-parallel size is at least 1)"
                for key in TP_KEYS if int(config.get(key, 1)) < 1]
    if config.get("reserve", "static") not in ("static", "dynamic"):
        missing.append(f"reserve {config['reserve']} (static or dynamic reservations only)")
    k, prefill = int(config.get("prefill_runahead", 0)), config.get("prefill")
    if k >= 2 and prefill is not None and int(prefill) < k:
        missing.append(f"prefill_runahead {k} (a KV-Runahead chain needs {k} prefill workers, the plan has {prefill})")
    if missing:
        raise ConfigError("this runtime cannot run the configuration: " + "; ".join(missing))


def explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags typed in `argv` (the subcommand's own arguments), whatever
    their values: `argv` parsed again by a copy of `parser` whose every default is suppressed."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    probe._defaults = {}
    typed, _ = probe.parse_known_args(argv)
    return set(vars(typed))


def check_model(config: dict, explicit: set[str]) -> None:
    """Refuse a file whose model this machine cannot load, unless `--model` was typed."""
    from pdserve.model.default import DEFAULT_SPECS
    model = config.get("model")
    if model is None or "model" in explicit or model in DEFAULT_SPECS or Path(model).expanduser().is_dir():
        return
    raise ConfigError(f"the configuration is for model {model!r}, which has no checkpoint here (built-in: "
                      f"{', '.join(DEFAULT_SPECS)}, or a checkpoint directory): give --model to serve another")


def apply(args: argparse.Namespace, config: dict, explicit: set[str]) -> argparse.Namespace:
    """`args` with every value the file names, except flags the user gave."""
    merged = vars(args).copy()
    for key, dest in ARG_OF.items():
        if config.get(key) is not None and dest not in explicit:
            merged[dest] = config[key]
    return argparse.Namespace(**merged)


def write(path: str | Path, config: dict) -> None:
    """Write what the plan says, runnable here or not (`pdserve serve --config` refuses the latter)."""
    Path(path).write_text(json.dumps({VERSION_KEY: 1, **config}, indent=2) + "\n")
