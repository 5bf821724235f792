"""The step budgets' products alone (engine/speed/step_parts.py): every product of a step once, and
their multiply-adds counted from the model's shapes."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.speed import step_parts
from pdserve.model import numerics


def test_products_call_each_weight_once_and_count_its_multiply_adds(monkeypatch):
    model = Engine(EngineConfig(model="tiny", num_blocks=64)).model
    c = model.config  # tiny: d 512, 8 layers, 8 query / 2 K/V heads of 64, d_ff 1408, vocab 259
    calls = []
    real = numerics.linear
    monkeypatch.setattr(step_parts, "linear", lambda x, w, *a, **k: calls.append((x.shape[0], id(w))) or real(x, w, *a, **k))
    run, flops = step_parts.products(model, rows=6, head_rows=1)
    run()
    per_layer = c.hidden_size * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim
                                 + 3 * c.intermediate_size)
    assert flops == 2 * 6 * c.num_layers * per_layer + 2 * c.vocab_size * c.hidden_size
    assert flops == 2 * 6 * 8 * 512 * (12 * 64 + 8 * 64 + 3 * 1408) + 2 * 259 * 512
    weights = [w for layer in model.layers for w in (layer.wqkv, layer.wo, layer.w13, layer.w2)] + [model.lm_head]
    assert calls == [(6, id(w)) for w in weights[:-1]] + [(1, id(model.lm_head))]
