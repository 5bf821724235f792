"""ModelConfig parsing: both rope spellings, Llama/Mistral/Qwen2 rules, and refused features."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pdserve.model.config import ModelConfig, load_config
from pdserve.model.errors import CheckpointError
from tests.helpers.checkpoints import load_hf_model, make_random_checkpoint

SRC = "/models/x/config.json"


def llama_dict(**overrides) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    }
    d.update(overrides)
    return d


def qwen2_dict(**overrides) -> dict:
    d = llama_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_key_value_heads=2,
                   max_position_embeddings=32768, sliding_window=4096, use_sliding_window=False,
                   rope_theta=1000000.0, eos_token_id=[7, 8], tie_word_embeddings=True)
    d.update(overrides)
    return d


def mistral_dict(**overrides) -> dict:
    d = llama_dict(architectures=["MistralForCausalLM"], model_type="mistral", num_key_value_heads=1,
                   max_position_embeddings=32768, sliding_window=None, head_dim=32)
    d.update(overrides)
    return d


def check_error(exc_info: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(exc_info.value)
    assert SRC in message
    for fragment in fragments:
        assert fragment in message, message


def test_transformers_written_config_uses_rope_parameters(tmp_path):
    make_random_checkpoint(tmp_path, rope_theta=5000.0)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw.get("rope_parameters", {}).get("rope_theta") == 5000.0 or raw.get("rope_theta") == 5000.0
    assert load_config(tmp_path).rope_theta == 5000.0


def test_rope_theta_both_spellings_and_default():
    top = ModelConfig.from_dict(llama_dict(rope_theta=500000.0), SRC)
    nested = ModelConfig.from_dict(
        llama_dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), SRC
    )
    assert top.rope_theta == nested.rope_theta == 500000.0
    assert ModelConfig.from_dict(llama_dict(), SRC).rope_theta == 10000.0
    ok = ModelConfig.from_dict(llama_dict(rope_scaling={"rope_type": "default"}), SRC)
    assert ok.rope_theta == 10000.0


def test_llama_defaults_and_derived_fields():
    c = ModelConfig.from_dict(llama_dict(eos_token_id=2, bos_token_id=1, head_dim=None), SRC)
    assert (c.num_kv_heads, c.head_dim, c.eos_token_ids, c.bos_token_id) == (4, 16, (2,), 1)
    assert not c.qkv_bias and not c.o_bias and not c.tie_word_embeddings
    biased = ModelConfig.from_dict(llama_dict(attention_bias=True), SRC)
    assert biased.qkv_bias and biased.o_bias


def test_qwen2_has_qkv_bias_only_and_list_eos():
    c = ModelConfig.from_dict(qwen2_dict(), SRC)
    assert c.architecture == "Qwen2ForCausalLM" and c.model_type == "qwen2"
    assert c.qkv_bias and not c.o_bias
    assert c.eos_token_ids == (7, 8) and c.rope_theta == 1e6 and c.tie_word_embeddings


def test_mistral_explicit_head_dim_and_no_bias():
    c = ModelConfig.from_dict(mistral_dict(attention_bias=True), SRC)
    assert c.head_dim == 32 and c.num_kv_heads == 1
    assert c.qkv_bias and not c.o_bias


@pytest.mark.parametrize("d", [
    mistral_dict(sliding_window=4096),
    qwen2_dict(use_sliding_window=True),
])
def test_sliding_window_refused(d):
    with pytest.raises(CheckpointError) as exc_info:
        ModelConfig.from_dict(d, SRC)
    check_error(exc_info, "sliding window attention is not supported")


def test_sliding_window_as_large_as_context_is_fine():
    c = ModelConfig.from_dict(mistral_dict(sliding_window=32768), SRC)
    assert c.max_position_embeddings == 32768


@pytest.mark.parametrize("d,fragments", [
    (llama_dict(architectures=["GPT2LMHeadModel"]), ["unsupported architecture", "GPT2LMHeadModel"]),
    (llama_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["unsupported rope scaling", "llama3"]),
    (llama_dict(rope_scaling={"type": "linear", "factor": 2.0}), ["unsupported rope scaling", "linear"]),
    (llama_dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), ["unsupported rope scaling", "yarn"]),
    (llama_dict(mlp_bias=True), ["mlp_bias"]),
    (llama_dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (llama_dict(num_key_value_heads=3), ["num_kv_heads"]),
    ({k: v for k, v in llama_dict().items() if k != "hidden_size"}, ["hidden_size"]),
    (llama_dict(model_type="qwen2"), ["model_type", "qwen2"]),
    # numbers the forward pass takes on trust: NaN logits, terabyte rotary tables, a spinning layer list
    (llama_dict(rms_norm_eps=float("nan")), ["rms_norm_eps must be a positive finite number", "nan"]),
    (llama_dict(rms_norm_eps=0), ["rms_norm_eps must be a positive finite number"]),
    (llama_dict(rms_norm_eps="1e-5"), ["rms_norm_eps must be a positive finite number"]),
    (llama_dict(rope_theta=0), ["rope_theta must be a positive finite number"]),
    (llama_dict(rope_theta=float("inf")), ["rope_theta must be a positive finite number"]),
    (llama_dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), ["rope_parameters.rope_theta", "-1.0"]),
    (llama_dict(max_position_embeddings=10**12), ["max_position_embeddings must be at most 16777216"]),
    (llama_dict(num_hidden_layers=10**9), ["num_hidden_layers must be at most 4096"]),
    (llama_dict(torch_dtype="int8"), ["torch_dtype 'int8' is not supported"]),
    (llama_dict(dtype="float8_e4m3fn", torch_dtype="bfloat16"), ["dtype 'float8_e4m3fn' is not supported"]),
])
def test_refused_configs_name_file_and_problem(d, fragments):
    with pytest.raises(CheckpointError) as exc_info:
        ModelConfig.from_dict(d, SRC)
    check_error(exc_info, *fragments)


def test_load_config_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found") as exc_info:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(exc_info.value)


def test_load_config_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("tie,bias", [(False, False), (True, True)])
def test_num_params_matches_transformers(tmp_path, tie, bias):
    make_random_checkpoint(tmp_path, tie=tie, attention_bias=bias, head_dim=24)
    model = load_hf_model(tmp_path)
    assert load_config(tmp_path).num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cls,model_cls,extra", [
    (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
])
def test_num_params_matches_transformers_qwen2_mistral(tmp_path, cls, model_cls, extra):
    hf_config = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=50, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    model_cls(hf_config).save_pretrained(tmp_path)
    model = model_cls.from_pretrained(tmp_path)
    assert load_config(tmp_path).num_params() == sum(p.numel() for p in model.parameters())


def test_to_dict_round_trips_and_error_pickles():
    c = ModelConfig.from_dict(qwen2_dict(), SRC)
    d = json.loads(json.dumps(c.to_dict()))
    assert ModelConfig(**{**d, "eos_token_ids": tuple(d["eos_token_ids"])}) == c
    err = pickle.loads(pickle.dumps(CheckpointError("/a/b.safetensors", "broken")))
    assert (err.path, err.problem, str(err)) == ("/a/b.safetensors", "broken", "/a/b.safetensors: broken")
