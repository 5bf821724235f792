"""Model geometry for planning: block shapes, total weight bytes and K/V bytes per token.

Contract: `load_model_spec` accepts a built-in name (``tiny``, ``small``), a checkpoint
directory, a bare Hugging Face ``config.json`` (so users can plan for models they have not
downloaded), an example config shipped in `profiles/` by name (``llama-13b-class``,
``llama-70b-class``, and OPT's ``opt-13b``, ``opt-66b``, ``opt-175b`` for the DistServe
comparison), or a Hugging Face id (``Qwen/Qwen3-32B``) whose config aiconfigurator
ships (when it is installed). Files are read by `hf_geometry` (geometry keys only, any dense
architecture, MoE refused), not by the engine's config parser: the planner plans for models the
engine cannot run. Only the built-in names import `pdserve.model.default`, which loads torch.
`ModelSpec.source` keeps where the geometry came from (the config.json file, or the
Hugging Face id), for latency models that read the config themselves (`aic.py`).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.ledger.phase import BlockGeometry
from pdserve.model.config import ModelConfig
from pdserve.latency.hardware import PROFILE_DIR
from pdserve.latency.hf_geometry import HfGeometry, geometry_of

EXAMPLE_CONFIGS = ("llama-13b-class", "llama-70b-class", "opt-13b", "opt-66b", "opt-175b")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about a model; bytes assume `geometry.dtype_bytes` per scalar."""

    name: str
    geometry: BlockGeometry
    total_weight_bytes: int  # embeddings and LM head included (residency ledger)
    source: str | None = None  # the config.json file, or a Hugging Face id; None: built-in
    max_context: int | None = None  # longest prompt + output it serves (max_position_embeddings); None: unknown

    @property
    def kv_bytes_per_token(self) -> int:
        return self.geometry.kv_bytes_per_token


def spec_from_config(config: ModelConfig, name: str, dtype_bytes: int = 2) -> ModelSpec:
    """Planner view of a parsed model config."""
    geometry = BlockGeometry(
        layers=config.num_layers,
        d_model=config.hidden_size,
        d_ff=config.intermediate_size,
        q_heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype_bytes=dtype_bytes,
    )
    return ModelSpec(name=name, geometry=geometry, total_weight_bytes=config.num_params() * dtype_bytes)


def spec_from_geometry(geo: HfGeometry, name: str, source: str | None, dtype_bytes: int = 2) -> ModelSpec:
    """Planner view of a config.json's dense geometry."""
    geometry = BlockGeometry(layers=geo.layers, d_model=geo.d_model, d_ff=geo.d_ff, q_heads=geo.q_heads,
                             kv_heads=geo.kv_heads, head_dim=geo.head_dim, dtype_bytes=dtype_bytes)
    weight_bytes = geo.num_params() * geo.weight_bytes_per_param(dtype_bytes)
    return ModelSpec(name=name, geometry=geometry, total_weight_bytes=weight_bytes, source=source,
                     max_context=geo.max_context)


def load_model_spec(model: str, dtype_bytes: int = 2) -> ModelSpec:
    """Resolve `model` (built-in name, example name, directory, config.json or Hugging Face id)."""
    if model in ("tiny", "small"):
        return spec_from_config(_builtin_config(model), model, dtype_bytes)
    path = PROFILE_DIR / f"{model}.config.json" if model in EXAMPLE_CONFIGS else Path(model)
    hf_id = None
    if not path.exists() and bundled_config(model) is not None:
        path, hf_id = bundled_config(model), model
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: use tiny, small, {', '.join(EXAMPLE_CONFIGS)}, a directory, a "
                         "config.json, or a Hugging Face id whose config aiconfigurator ships")
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: cannot read a JSON config ({exc})") from exc
    name = hf_id or (path.name.removesuffix(".json").removesuffix(".config") if path.is_file() else path.name)
    return spec_from_geometry(geometry_of(config, str(file)), name, hf_id or str(file), dtype_bytes)


def bundled_config(hf_id: str) -> Path | None:
    """aiconfigurator's shipped config.json for `hf_id` (``ORG/NAME``), if it is installed and has one."""
    if hf_id.count("/") != 1 or Path(hf_id).exists():
        return None
    found = importlib.util.find_spec("aiconfigurator_core")
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / "model_configs" / f"{hf_id.replace('/', '--')}_config.json"
    return path if path.is_file() else None


def _builtin_config(name: str) -> ModelConfig:
    from pdserve.model.default import DEFAULT_SPECS, hf_config_dict

    return ModelConfig.from_dict(hf_config_dict(DEFAULT_SPECS[name]), f"<built-in {name}>")
