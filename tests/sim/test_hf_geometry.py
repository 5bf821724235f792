"""Any Hugging Face geometry: the planner reads configs the engine cannot run (issue 24, part 3)."""

from __future__ import annotations

import json

import pytest

from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import PROFILE_DIR
from pdserve.latency.hf_geometry import geometry_of
from pdserve.model.config import ModelConfig

QWEN3_32B = {  # Qwen3-32B's published geometry
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
    "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": False, "vocab_size": 151936, "max_position_embeddings": 40960,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def _write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_qwen3_32b_geometry_and_parameter_count(tmp_path):
    spec = load_model_spec(str(_write(tmp_path, QWEN3_32B)))
    g = spec.geometry
    assert (g.layers, g.d_model, g.d_ff, g.q_heads, g.kv_heads, g.head_dim) == (64, 5120, 25600, 64, 8, 128)
    # 2 * 151936 * 5120 (embeddings + head) + 64 * (attention 2*5120*8192 + 2*5120*1024 + q/k norms 256
    #   + MLP 3*5120*25600 + norms 2*5120) + final norm 5120
    per_layer = 2 * 5120 * 8192 + 2 * 5120 * 1024 + 256 + 3 * 5120 * 25600 + 2 * 5120
    assert spec.total_weight_bytes == 2 * (2 * 151936 * 5120 + 64 * per_layer + 5120) == 65_524_246_528
    assert spec.kv_bytes_per_token == 64 * 2 * 8 * 128 * 2
    assert spec.source == str(tmp_path / "config.json")


@pytest.mark.parametrize("name", ["llama-13b-class", "llama-70b-class"])
def test_parameter_count_matches_the_engine_parser_where_both_apply(name):
    config = json.loads((PROFILE_DIR / f"{name}.config.json").read_text())
    assert geometry_of(config, name).num_params() == ModelConfig.from_dict(config, name).num_params()
    qwen3 = {**QWEN3_32B, "tie_word_embeddings": True}
    assert geometry_of(qwen3, "q").num_params() == ModelConfig.from_dict(qwen3, "q").num_params()


def test_an_architecture_the_engine_cannot_run_is_planned(tmp_path):
    config = {**QWEN3_32B, "architectures": ["SomeFutureDenseForCausalLM"], "model_type": "future",
              "hidden_act": "gelu", "mlp_bias": True}
    spec = load_model_spec(str(_write(tmp_path, config)))
    assert spec.geometry.layers == 64 and spec.name == "config"


def test_head_dim_and_kv_heads_default_like_llama(tmp_path):
    config = {k: v for k, v in QWEN3_32B.items() if k not in ("head_dim", "num_key_value_heads")}
    g = load_model_spec(str(_write(tmp_path, config))).geometry
    assert (g.head_dim, g.kv_heads) == (5120 // 64, 64)


@pytest.mark.parametrize("key,value", [("num_experts", 128), ("num_local_experts", 8), ("n_routed_experts", 256),
                                        ("moe_intermediate_size", 1536)])
def test_moe_geometry_is_refused_with_the_key_named(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"mixture-of-experts geometry \\({key} = {value}\\)"):
        load_model_spec(str(_write(tmp_path, {**QWEN3_32B, key: value})))


def test_missing_or_bad_keys_are_named(tmp_path):
    config = {k: v for k, v in QWEN3_32B.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="missing geometry key 'intermediate_size'"):
        load_model_spec(str(_write(tmp_path, config)))
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer"):
        load_model_spec(str(_write(tmp_path, {**QWEN3_32B, "num_hidden_layers": "64"})))
    with pytest.raises(ValueError, match="must be a multiple of num_key_value_heads"):
        load_model_spec(str(_write(tmp_path, {**QWEN3_32B, "num_key_value_heads": 6})))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a JSON config"):
        load_model_spec(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="unknown model"):
        load_model_spec(str(tmp_path / "absent.json"))


def test_fp8_checkpoints_store_one_byte_per_weight_and_keep_16_bit_kv(tmp_path):
    fp8 = {**QWEN3_32B, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    spec = load_model_spec(str(_write(tmp_path, fp8)))
    assert spec.total_weight_bytes == 65_524_246_528 // 2
    assert spec.kv_bytes_per_token == 64 * 2 * 8 * 128 * 2


def test_opt_non_gated_mlp_keeps_its_weights(tmp_path):
    opt_13b = {"architectures": ["OPTForCausalLM"], "hidden_size": 5120, "num_attention_heads": 40,
               "num_hidden_layers": 40, "ffn_dim": 20480, "vocab_size": 50272, "tie_word_embeddings": True}
    g = load_model_spec(str(_write(tmp_path, opt_13b))).geometry
    assert (g.kv_heads, g.head_dim, g.d_ff) == (40, 128, 13653)  # 2 x 20480 / 3, rounded
    assert 3 * g.d_model * g.d_ff == pytest.approx(2 * 5120 * 20480, rel=1e-4)
