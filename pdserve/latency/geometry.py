"""Model geometry for planning: block shapes, total weight bytes and K/V bytes per token.

Contract: `load_model_spec` accepts a built-in name (``tiny``, ``small``), a checkpoint
directory, or a bare Hugging Face ``config.json`` (so users can plan for models they have not
downloaded); the example configs shipped in `profiles/` (``llama-13b-class``,
``llama-70b-class``) are also accepted by name. Parsing goes through `pdserve.model.config`
(no torch); only the built-in names import `pdserve.model.default`, which loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.ledger.phase import BlockGeometry
from pdserve.model.config import ModelConfig, load_config
from pdserve.latency.hardware import PROFILE_DIR

EXAMPLE_CONFIGS = ("llama-13b-class", "llama-70b-class")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about a model; bytes assume `geometry.dtype_bytes` per scalar."""

    name: str
    geometry: BlockGeometry
    total_weight_bytes: int  # embeddings and LM head included (residency ledger)

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


def load_model_spec(model: str, dtype_bytes: int = 2) -> ModelSpec:
    """Resolve `model` (built-in name, example name, directory or config.json) to a ModelSpec."""
    if model in ("tiny", "small"):
        return spec_from_config(_builtin_config(model), model, dtype_bytes)
    path = PROFILE_DIR / f"{model}.config.json" if model in EXAMPLE_CONFIGS else Path(model)
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: use tiny, small, {', '.join(EXAMPLE_CONFIGS)}, a directory or a config.json")
    name = path.name.removesuffix(".json").removesuffix(".config") if path.is_file() else path.name
    return spec_from_config(load_config(path), name, dtype_bytes)


def _builtin_config(name: str) -> ModelConfig:
    from pdserve.model.default import DEFAULT_SPECS, hf_config_dict

    return ModelConfig.from_dict(hf_config_dict(DEFAULT_SPECS[name]), f"<built-in {name}>")
