"""A step's products alone, for the budgets that set a step against its parts
(scripts/decode_budget.py, scripts/prefill_budget.py).

Contract: `products(model, rows, head_rows)` returns (run, flops): `run()` calls every product of a
step of `rows` rows on the model's own prepared weights through `numerics.linear` (fused q|k|v, o,
fused gate|up and down per layer, then the LM head on `head_rows` rows: all of them in a decode
step, the last one in a prefill), on random inputs of the model's dtype; `flops` counts their
multiply-adds twice.
"""

from __future__ import annotations

import torch

from pdserve.model.numerics import dense, linear


def products(model, rows: int, head_rows: int):
    cfg = model.config
    x = torch.randn(rows, cfg.hidden_size).to(model.dtype)  # [T, d]
    xo = torch.randn(rows, cfg.num_heads * cfg.head_dim).to(model.dtype)  # [T, H_q * D]
    xf = torch.randn(rows, dense(model.layers[0].w2).shape[1]).to(model.dtype)  # [T, d_ff]
    head = x[rows - head_rows:]  # [head_rows, d]
    flops = 2 * rows * sum(dense(w).numel() for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w13, layer.w2))
    flops += 2 * head_rows * dense(model.lm_head).numel()

    def run():
        for layer in model.layers:
            linear(x, layer.wqkv, layer.bqkv, model.skinny)
            linear(xo, layer.wo, layer.bo, model.skinny)
            linear(x, layer.w13, skinny_rows=model.skinny)
            linear(xf, layer.w2, skinny_rows=model.skinny)
        linear(head, model.lm_head, skinny_rows=model.skinny)
    return run, flops
