"""Planner geometry from any Hugging Face config.json, whatever the architecture.

Contract: `geometry_of(config, source)` reads only the usual geometry keys of a dense
decoder-only transformer (Llama, Qwen2/Qwen3, Mistral, ... spellings) and returns the block
shapes and the parameter count, without asking whether pdserve's engine can run the model
(that check belongs to `pdserve.model.config`). A config whose text model sits under
``text_config`` is read from there. Mixture-of-experts geometry (any routed-expert key) is
refused with a ValueError naming the key, as is a config missing a required key; errors name
`source`.

Non-gated MLPs (OPT's ``ffn_dim``, GPT-2's ``n_inner``: two matrices of d x ffn) are stored as
the gated d_ff with the same weights and FLOPs, round(2 * ffn / 3), since the ledger's block
geometry counts three d x d_ff matrices.

FP8 checkpoints (``quantization_config.quant_method`` fp8 / fbgemm_fp8) store one byte per
weight (`weight_bytes_per_param`); their K/V stays in the model's 16-bit dtype.

Context window (`max_context`): ``max_position_embeddings`` (``n_positions``, ``max_seq_len``,
``seq_length``), the longest prompt + output the model serves (vLLM's default max model length);
None when the config has none. OPT's learned positions stop there: a request past it cannot run.

Parameter count: embeddings, plus the LM head unless tied, plus per layer q/k/v/o (and their
biases when ``attention_bias``), per-head q/k norms when the architecture has them (Qwen3),
gate/up/down and two norms, plus the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass

# keys whose presence (with a value above 1 for counts) marks a mixture-of-experts model
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
            "moe_intermediate_size")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)
FP8_METHODS = ("fp8", "fbgemm_fp8")


@dataclass(frozen=True)
class HfGeometry:
    """Dense decoder geometry read from a config.json (architecture kept for provenance only)."""

    architecture: str
    layers: int
    d_model: int
    d_ff: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    fp8_weights: bool = False
    max_context: int | None = None

    def weight_bytes_per_param(self, dtype_bytes: int) -> int:
        return 1 if self.fp8_weights else dtype_bytes

    def num_params(self) -> int:
        d, q, kv = self.d_model, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = 2 * d * q + 2 * d * kv + (q + 2 * kv if self.attention_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + 3 * d * self.d_ff + 2 * d
        embed = self.vocab_size * d
        return embed + self.layers * per_layer + d + (0 if self.tied_embeddings else embed)


def geometry_of(config: dict, source: str) -> HfGeometry:
    """Dense geometry of a Hugging Face config dict (see the module contract)."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: config.json must hold a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    _refuse_moe(text, source)
    archs = config.get("architectures") or ["unknown"]
    d_model = _int(text, ("hidden_size", "n_embd", "d_model"), source)
    q_heads = _int(text, ("num_attention_heads", "n_head"), source)
    kv_heads = _int(text, ("num_key_value_heads",), source, default=q_heads)
    if q_heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({q_heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = text.get("head_dim") or d_model // q_heads
    return HfGeometry(
        architecture=str(archs[0]),
        layers=_int(text, ("num_hidden_layers", "n_layer", "num_layers"), source),
        d_model=d_model,
        d_ff=_d_ff(text, source),
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=_positive(head_dim, "head_dim", source),
        vocab_size=_int(text, ("vocab_size",), source),
        tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        attention_bias=bool(text.get("attention_bias", False)),
        qk_norm=str(archs[0]) in QK_NORM_ARCHITECTURES,
        fp8_weights=str((config.get("quantization_config") or {}).get("quant_method", "")).lower() in FP8_METHODS,
        max_context=_optional_int(text, ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"), source),
    )


def _d_ff(d: dict, source: str) -> int:
    """The gated MLP width; a non-gated one (two matrices) as its weight-equivalent gated width."""
    if d.get("intermediate_size") is None and (d.get("ffn_dim") or d.get("n_inner")):
        return round(2 * _int(d, ("ffn_dim", "n_inner"), source) / 3)
    return _int(d, ("intermediate_size",), source)


def _refuse_moe(d: dict, source: str) -> None:
    for key in MOE_KEYS:
        value = d.get(key)
        if value not in (None, 0, 1, False):
            raise ValueError(f"{source}: mixture-of-experts geometry ({key} = {value!r}) is not supported by the "
                             "planner yet; dense decoder configs only")


def _int(d: dict, keys: tuple[str, ...], source: str, default: int | None = None) -> int:
    for key in keys:
        if d.get(key) is not None:
            return _positive(d[key], key, source)
    if default is not None:
        return default
    raise ValueError(f"{source}: missing geometry key {keys[0]!r}")


def _optional_int(d: dict, keys: tuple[str, ...], source: str) -> int | None:
    return next((_positive(d[key], key, source) for key in keys if d.get(key) is not None), None)


def _positive(value, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value
