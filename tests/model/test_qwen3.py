"""Qwen3-family (dense) configs and checkpoints: per-head q/k RMSNorm, head_dim independent of
hidden size, o_proj bias with attention_bias, sliding windows refused; the planner reads them.
Logit and token parity with transformers is in tests/engine/test_model_parity.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pdserve.cli import main
from pdserve.model.config import ModelConfig, load_config
from pdserve.model.errors import CheckpointError
from pdserve.model.loader import load_state_dict
from pdserve.latency.geometry import load_model_spec
from tests.helpers.checkpoints import make_random_checkpoint

SRC = "/models/qwen3/config.json"


def qwen3_0_6b_dict(**overrides) -> dict:
    """Qwen3-0.6B's published config.json: 16 heads x head_dim 128 = 2048 != hidden 1024."""
    d = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    }
    d.update(overrides)
    return d


def test_qwen3_config_has_qk_norm_and_its_own_head_dim():
    c = ModelConfig.from_dict(qwen3_0_6b_dict(), SRC)
    assert (c.architecture, c.model_type, c.qk_norm) == ("Qwen3ForCausalLM", "qwen3", True)
    assert (c.head_dim, c.q_size, c.kv_size, c.hidden_size) == (128, 2048, 1024, 1024)
    assert not c.qkv_bias and not c.o_bias and c.tie_word_embeddings and c.rope_theta == 1e6
    biased = ModelConfig.from_dict(qwen3_0_6b_dict(attention_bias=True), SRC)
    assert biased.qkv_bias and biased.o_bias  # Qwen3's attention_bias covers o_proj too
    assert not ModelConfig.from_dict({**qwen3_0_6b_dict(), "architectures": ["Qwen2ForCausalLM"],
                                      "model_type": "qwen2"}, SRC).qk_norm


@pytest.mark.parametrize("attention_bias", [False, True])
def test_num_params_matches_transformers(attention_bias):
    d = qwen3_0_6b_dict(attention_bias=attention_bias)
    with torch.device("meta"):  # shapes only: no 0.6B parameters are allocated
        model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in d.items() if k != "architectures"}))
    assert ModelConfig.from_dict(d, SRC).num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", [
    {"use_sliding_window": True, "sliding_window": 4096},
    {"layer_types": ["full_attention"] * 27 + ["sliding_attention"], "sliding_window": 4096},
])
def test_sliding_window_refused(overrides):
    with pytest.raises(CheckpointError, match="sliding window attention is not supported") as exc_info:
        ModelConfig.from_dict(qwen3_0_6b_dict(**overrides), SRC)
    assert SRC in str(exc_info.value)


def test_loader_reads_and_requires_the_qk_norm_weights(tmp_path):
    ckpt = make_random_checkpoint(tmp_path, hidden=64, layers=1, heads=4, kv_heads=2, head_dim=24, family="qwen3")
    config = load_config(ckpt)
    state = load_state_dict(ckpt, config)
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (24,)
    assert state["model.layers.0.self_attn.k_norm.weight"].shape == (24,)
    llama_view = {**json.loads((ckpt / "config.json").read_text()), "architectures": ["LlamaForCausalLM"],
                  "model_type": "llama"}
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.[qk]_norm.weight'"):
        load_state_dict(ckpt, ModelConfig.from_dict(llama_view, "x"))


def test_planner_reads_a_qwen3_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(qwen3_0_6b_dict()))
    spec = load_model_spec(str(tmp_path / "config.json"))
    g = spec.geometry
    assert (g.layers, g.d_model, g.q_heads, g.kv_heads, g.head_dim) == (28, 1024, 16, 8, 128)
    assert spec.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2  # layers x (K, V) x H_kv x D x bf16
    assert spec.total_weight_bytes == ModelConfig.from_dict(qwen3_0_6b_dict(), SRC).num_params() * 2
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--hardware", "h100", "--gpus", "2", "--input-len", "256",
            "--output-len", "32", "--num-requests", "100", "--slo-ttft-ms", "300", "--slo-tpot-ms", "60",
            "--chunk-budgets", "512", "--max-seqs", "16", "--quiet", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["decision"] in ("colocate", "disaggregate") and summary["model"] == "config"
