"""Model configuration: the subset of a Hugging Face `config.json` that pdserve runs.

Contract: `ModelConfig.from_dict` either returns a config the forward pass implements exactly
(a Llama-style decoder: RMSNorm, rotary embeddings with plain theta, grouped-query attention,
SwiGLU MLP; Qwen3 adds an RMSNorm over each query and key head before RoPE, `qk_norm`) or raises `CheckpointError` naming the source file and the unsupported feature.
Anything that would silently change the math (rope scaling, sliding windows, MLP biases, a
different activation) is refused rather than ignored.

Both rope spellings are read: the top-level `rope_theta` that transformers 4.x writes and the
`rope_parameters` dict ({"rope_type": "default", "rope_theta": ...}) that transformers 5.x writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.model.errors import CheckpointError

CONFIG_FILE = "config.json"

# architecture -> model_type it must be paired with
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# architectures whose sliding window applies only when `use_sliding_window` is set
OPT_IN_SLIDING_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6
# Every worker builds its rotary tables ([P, D] fp32 cos and sin) for all positions up front, so a
# context of 10**12 asks for terabytes; 2**24 is past every released model's (Llama 4 Scout: 10M).
MAX_POSITION_EMBEDDINGS = 2**24
# The expected-tensor list is built per layer before any is checked; a layer count of 10**9 would
# spin there. No released decoder has more than a few hundred.
MAX_HIDDEN_LAYERS = 4096
# `dtype` (transformers 5) / `torch_dtype` (4.x): the float kinds the loader converts from; an
# integer or float8 dtype means quantized weights this engine does not dequantize.
CHECKPOINT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a supported decoder-only model."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None = None  # dtype the weights were saved in, e.g. "bfloat16"
    qk_norm: bool = False  # RMSNorm over each query and key head (weights [D]) before RoPE (Qwen3)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> ModelConfig:
        """Parse a Hugging Face config dict; `source` names the file in error messages."""
        return _parse(d, source)

    @property
    def q_size(self) -> int:
        """Width of the query projection output: H * D."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs: H_kv * D."""
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count: embedding + layers + final norm + lm_head when untied."""
        h, d_ff = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * d_ff + 2 * h  # q/k/v/o, gate/up/down, two RMSNorms
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_layers * per_layer + h + head

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of this config's fields (not Hugging Face key names)."""
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a model directory (or the file itself) into a `ModelConfig`."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(file, "config.json not found")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(file, f"config.json is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(file, "config.json must hold a JSON object")
    return ModelConfig.from_dict(raw, str(file))


def _parse(d: dict[str, Any], source: str) -> ModelConfig:
    arch, model_type = _architecture(d, source)
    _reject_unsupported(d, source, arch)
    num_heads = _int(d, "num_attention_heads", source)
    hidden = _int(d, "hidden_size", source)
    head_dim = d.get("head_dim")
    attention_bias = bool(d.get("attention_bias", False))
    try:
        return ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=_int(d, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size", source),
            num_layers=_int(d, "num_hidden_layers", source, most=MAX_HIDDEN_LAYERS),
            num_heads=num_heads,
            num_kv_heads=_int(d, "num_key_value_heads", source, default=num_heads),
            head_dim=_int(d, "head_dim", source) if head_dim is not None else hidden // num_heads,
            rope_theta=_rope_theta(d, source),
            rms_norm_eps=_positive_float(d.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS), "rms_norm_eps", source),
            max_position_embeddings=_int(d, "max_position_embeddings", source, most=MAX_POSITION_EMBEDDINGS),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=attention_bias if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else False,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_token_ids(d.get("eos_token_id"), source),
            checkpoint_dtype=_checkpoint_dtype(d, source),
            qk_norm=arch == "Qwen3ForCausalLM",
        )
    except ValueError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(source, str(exc)) from exc


def _architecture(d: dict[str, Any], source: str) -> tuple[str, str]:
    archs = d.get("architectures") or []
    if len(archs) != 1:
        raise CheckpointError(source, f"expected exactly one entry in 'architectures', got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise CheckpointError(source, f"unsupported architecture {arch!r} (supported: {supported})")
    model_type = d.get("model_type", SUPPORTED_ARCHITECTURES[arch])
    if model_type != SUPPORTED_ARCHITECTURES[arch]:
        raise CheckpointError(source, f"model_type {model_type!r} does not match architecture {arch!r}")
    return arch, model_type


def _reject_unsupported(d: dict[str, Any], source: str, arch: str) -> None:
    """Refuse features that would change the math if ignored."""
    if d.get("mlp_bias", False):
        raise CheckpointError(source, "mlp_bias: true is not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(source, f"hidden_act {act!r} is not supported (only 'silu')")
    if arch != "LlamaForCausalLM" and _uses_sliding_window(d, arch):
        raise CheckpointError(
            source,
            f"sliding window attention is not supported (sliding_window={d.get('sliding_window')}, "
            f"max_position_embeddings={d.get('max_position_embeddings')})",
        )


def _uses_sliding_window(d: dict[str, Any], arch: str) -> bool:
    if "sliding_attention" in (d.get("layer_types") or ()):
        return True
    window = d.get("sliding_window")
    if window is None or window >= d.get("max_position_embeddings", 0):
        return False
    # Qwen2 and Qwen3 apply the window only when use_sliding_window is set (transformers' default: off).
    if arch in OPT_IN_SLIDING_WINDOW:
        return bool(d.get("use_sliding_window", False))
    return True


def _rope_theta(d: dict[str, Any], source: str) -> float:
    scaling = d.get("rope_scaling")
    if scaling is not None:
        _check_rope_type(scaling, "rope_scaling", source)
    params = d.get("rope_parameters")
    if params is not None:
        _check_rope_type(params, "rope_parameters", source)
        if "rope_theta" in params:
            return _positive_float(params["rope_theta"], "rope_parameters.rope_theta", source)
    return _positive_float(d.get("rope_theta", DEFAULT_ROPE_THETA), "rope_theta", source)


def _check_rope_type(params: Any, key: str, source: str) -> None:
    if not isinstance(params, dict):
        raise CheckpointError(source, f"{key} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(source, f"unsupported rope scaling: {key}.rope_type = {rope_type!r}")


def _int(d: dict[str, Any], key: str, source: str, default: int | None = None, most: int | None = None) -> int:
    value = d.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(source, f"missing required key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(source, f"{key} must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise CheckpointError(source, f"{key} must be at most {most}, got {value!r}")
    return value


def _positive_float(value: Any, key: str, source: str) -> float:
    """A positive finite number: a NaN epsilon or a zero or negative rope theta gives NaN logits with
    no error anywhere (json reads NaN and Infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(source, f"{key} must be a positive finite number, got {value!r}")
    return float(value)


def _checkpoint_dtype(d: dict[str, Any], source: str) -> str | None:
    key = "dtype" if d.get("dtype") is not None else "torch_dtype"
    value = d.get(key)
    if value is not None and value not in CHECKPOINT_DTYPES:
        raise CheckpointError(source, f"{key} {value!r} is not supported (one of {', '.join(CHECKPOINT_DTYPES)})")
    return value


def _token_ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(source, f"eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(ids)


class TpShapeError(ValueError):
    """The tensor-parallel size does not divide the model's heads or intermediate size."""


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise `TpShapeError` unless `tp` splits query heads, K/V heads and the MLP evenly."""
    if tp < 1:
        raise TpShapeError(f"tensor-parallel size must be >= 1, got {tp}")
    for what, n in (("query heads", config.num_heads), ("K/V heads", config.num_kv_heads),
                    ("intermediate size", config.intermediate_size)):
        if n % tp:
            raise TpShapeError(f"tensor-parallel size {tp} does not divide the model's {n} {what}")
