"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as one readable forward pass over paged K/V.

Contract: `LlamaModel.forward` takes the flat rows of one engine step (token ids, positions and
`AttnMetadata`), writes each layer's new K/V rows into the pool *before* attending, and returns
logits only for the rows named by `logits_rows`. Numerics follow Hugging Face `transformers`:
RMSNorm in fp32 then cast, RoPE tables in fp32 cast to the compute dtype, SwiGLU MLP; Qwen3's
per-head q/k RMSNorm runs before RoPE, as transformers' does. The residual adds, the norms and
RoPE and SiLU * up run as model/glue.py's C passes where it is built (RoPE and the adds bit for
bit the eager formulas; a norm's sum of squares in an order of its own, SiLU's e^-x its own).

Weights are rounded to the storage dtype and held in the compute dtype (see `numerics`); every
matmul goes through `numerics.linear` under the product plan chosen at load
(`numerics.choose_plan`), which keeps a row's result independent of its batch mates. Weights are fused at load time (q|k|v into one matrix, gate|up into one) so a layer costs two
large matmuls plus two small ones; the fused products equal the separate ones column by column.
An optional `layer_hook(layer)` runs after each layer's K/V rows are in the pool, which is the
producer-ready event that layer-wise K/V streaming waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.model.attention import AttnMetadata, paged_attention, write_kv
from pdserve.model.config import ModelConfig
from pdserve.model import glue, skinny
from pdserve.model.numerics import Weight, choose_plan, linear, prepare


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    wqkv: Weight  # [(H_q + 2 H_kv) * D, d]
    bqkv: torch.Tensor | None  # [(H_q + 2 H_kv) * D]
    q_norm: torch.Tensor | None  # [D], shared by every query head (Qwen3)
    k_norm: torch.Tensor | None  # [D], shared by every key head (Qwen3)
    wo: Weight  # [d, H_q * D]
    bo: torch.Tensor | None  # [d]
    post_norm: torch.Tensor  # [d]
    w13: Weight  # [2 * d_ff, d]  (gate rows then up rows)
    w2: Weight  # [d, d_ff]


def _product_shapes(state: dict[str, torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """The [N, K] shapes of one layer's fused products and the LM head, for the invariance probe."""
    shapes = {}
    for name, t in state.items():
        if t.dim() == 2 and name.endswith("proj.weight") and ".layers.0." in name:
            shapes[name.rsplit(".", 2)[-2]] = tuple(t.shape)
    q, k, v = shapes.get("q_proj"), shapes.get("k_proj"), shapes.get("v_proj")
    fused = {(q[0] + k[0] + v[0], q[1])} if q and k and v else set()
    if "gate_proj" in shapes and "up_proj" in shapes:
        fused.add((2 * shapes["gate_proj"][0], shapes["gate_proj"][1]))
    fused |= {shapes[n] for n in ("o_proj", "down_proj") if n in shapes}
    head = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
    return tuple(sorted(fused | ({tuple(head.shape)} if head is not None else set())))


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor the model keeps as loaded (embedding, norms, biases), in memory of its own: a
    checkpoint tensor of the storage dtype is a view of the safetensors file's mmap, and one such
    view keeps the whole file mapped and its pages resident after the products are packed (the
    107M checkpoint: 201 MiB for 3 MiB of embedding and norms)."""
    return t.clone()


rms_norm = glue.rms_norm_eager  # x: [..., d] -> [..., d]; the reduction in fp32, as transformers does


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [P, D] in fp32, laid out as cat(freqs, freqs) for rotate-half RoPE."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, D]; cos, sin_rot: [T, 1, D] in x's dtype, sin_rot = cat(-sin[:D/2],
    sin[D/2:]) (`rotary_sin`). x * cos + roll(x, D/2) * sin_rot is bit for bit x * cos +
    cat(-x[D/2:], x[:D/2]) * sin (negating a factor is exact) in two fewer operations."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_rot


def rotary_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin: [P, D] -> [P, D] with the first half negated, the form apply_rope takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


class LlamaModel:
    """Weights plus the forward pass. Holds no K/V: the caller passes the pool per step."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 compute_dtype: torch.dtype | None = None, batch_invariant: bool = True, device: str = "cpu"):
        """`dtype`: storage (weights are rounded to it, the K/V pool holds it); `compute_dtype`:
        what activations and matmuls use (defaults to `dtype`); `batch_invariant`: see numerics;
        `device`: where weights and activations live ("cpu" or "cuda[:N]")."""
        self.config = config
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads  # this rank's (model/tp.py)
        self.storage_dtype = dtype
        self.dtype = compute_dtype or dtype
        self.device = torch.device(device)
        state = {name: t.to(dtype).to(self.device) for name, t in state.items()}  # round once to the storage dtype
        self.products = choose_plan(self.dtype, batch_invariant, _product_shapes(state), self.device.type)
        # small-row fp32 products (numerics.py): a CPU kernel
        self.skinny = self.device.type == "cpu" and skinny.eligible(self.dtype, batch_invariant)
        if self.skinny:
            skinny.warm_up()
        self.embed = _own(state["model.embed_tokens.weight"].to(self.dtype))  # [V, d]
        head = state.get("lm_head.weight")
        head = self.embed if (config.tie_word_embeddings or head is None) else head.to(self.dtype)  # [V, d]
        self.lm_head = prepare(head, self.products.plan)
        self.final_norm = _own(state["model.norm.weight"].to(self.dtype))
        self.layers = [self._fuse_layer(state, i) for i in range(config.num_layers)]
        self.products = self.products.with_weights(
            [self.lm_head] + [w for layer in self.layers for w in (layer.wqkv, layer.wo, layer.w13, layer.w2)])
        cos, sin = rope_tables(config, config.max_position_embeddings)
        self.rope_cos = cos.to(self.dtype).to(self.device)  # [P, D]
        self.rope_sin = rotary_sin(sin.to(self.dtype)).to(self.device)

    def _fuse_layer(self, state: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        wqkv = torch.cat([state[attn + f"{n}_proj.weight"] for n in "qkv"])
        bqkv = None
        if self.config.qkv_bias:
            bqkv = torch.cat([state[attn + f"{n}_proj.bias"] for n in "qkv"]).to(self.dtype)
        bo = _own(state[attn + "o_proj.bias"].to(self.dtype)) if self.config.o_bias else None
        q_norm = k_norm = None
        if self.config.qk_norm:  # elementwise scales, not products: no prepare()
            q_norm, k_norm = (_own(state[attn + f"{n}_norm.weight"].to(self.dtype)) for n in "qk")
        w13 = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
        return LayerWeights(
            input_norm=_own(state[p + "input_layernorm.weight"].to(self.dtype)),
            wqkv=self._weight(wqkv),
            bqkv=bqkv,
            q_norm=q_norm,
            k_norm=k_norm,
            wo=self._weight(state[attn + "o_proj.weight"]),
            bo=bo,
            post_norm=_own(state[p + "post_attention_layernorm.weight"].to(self.dtype)),
            w13=self._weight(w13),
            w2=self._weight(state[mlp + "down_proj.weight"]),
        )

    def _weight(self, w: torch.Tensor) -> Weight:
        return prepare(w.to(self.dtype).contiguous(), self.products.plan)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttnMetadata,
        kv: torch.Tensor,  # pool [L, 2, N, B, H_kv, D]
        logits_rows: torch.Tensor,  # [R] int64 rows whose next-token logits are wanted
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """-> logits [R, V] in fp32."""
        cfg, eps, layers = self.config, self.config.rms_norm_eps, self.layers
        x = self.embed[token_ids]  # [T, d], a copy: the residual stream, updated in place
        rope = (positions, None, None)
        if cfg.qk_norm or not glue.available():  # the eager RoPE's per-row tables
            rope = (positions, self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
        h = glue.add_rms_norm(x, None, layers[0].input_norm, eps)  # [T, d]
        for i, layer in enumerate(layers):
            a = self._attention(layer, h, rope, meta, kv[i])
            if layer_hook is not None:
                layer_hook(i)
            h = glue.add_rms_norm(x, a, layer.post_norm, eps)  # x += a; h = norm(x)
            m = self._mlp(layer, h)
            if i + 1 < len(layers):
                h = glue.add_rms_norm(x, m, layers[i + 1].input_norm, eps)
            else:
                x = x + m
        x = glue.add_rms_norm(x[logits_rows], None, self.final_norm, eps)  # [R, d]
        return linear(x, self.lm_head, skinny_rows=self.skinny).float()  # [R, V]

    def _attention(self, layer: LayerWeights, h: torch.Tensor, rope, meta: AttnMetadata, kv_layer: torch.Tensor):
        """rope: (positions [T], cos [T, 1, D] | None, sin_rot [T, 1, D] | None); None tables: RoPE in glue.rope_."""
        cfg = self.config
        num_rows, hq, hkv, d = h.shape[0], self.num_heads, self.num_kv_heads, cfg.head_dim
        positions, cos, sin = rope
        qkv = linear(h, layer.wqkv, layer.bqkv, self.skinny)  # [T, (H_q + 2 H_kv) * D]
        if layer.q_norm is not None:  # Qwen3: RMSNorm over each head's D values, before RoPE
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k = q.view(num_rows, hq, d), k.view(num_rows, hkv, d)  # [T, H_q, D], [T, H_kv, D]
            q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif cos is None and glue.rope_(qkv, hq + hkv, d, positions, self.rope_cos, self.rope_sin):
            q = qkv[:, :hq * d].view(num_rows, hq, d)  # rotated in place: [T, H_q, D]
            k = qkv[:, hq * d:(hq + hkv) * d].view(num_rows, hkv, d)  # [T, H_kv, D]
        else:  # one RoPE pass over the query and key heads together (adjacent columns of qkv)
            if cos is None:
                cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
            qk = apply_rope(qkv[:, :(hq + hkv) * d].view(num_rows, hq + hkv, d), cos, sin)  # [T, H_q + H_kv, D]
            q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, (hq + hkv) * d:].reshape(num_rows, hkv, d)
        if kv_layer.dtype != k.dtype:  # attend over the rounded values the pool holds
            k, v = k.to(kv_layer.dtype), v.to(kv_layer.dtype)
            write_kv(kv_layer[0], kv_layer[1], k, v, meta.slot_mapping)
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            write_kv(kv_layer[0], kv_layer[1], k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, kv_layer[0], kv_layer[1], meta)  # [T, H_q, D]
        return self._row_linear(o.reshape(num_rows, hq * d), layer.wo, layer.bo)

    def _mlp(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        gate_up = linear(h, layer.w13, skinny_rows=self.skinny)  # [T, 2 d_ff]: gate columns, then up
        return self._row_linear(glue.silu_mul(gate_up), layer.w2, None)  # silu(gate) * up: [T, d_ff]

    def _row_linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """The products whose inner dimension tensor parallelism splits (o_proj, down_proj);
        model/tp.py sums the ranks' partial products here."""
        return linear(x, w, bias, self.skinny)
