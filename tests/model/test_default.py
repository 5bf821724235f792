"""Built-in default models: deterministic, cached atomically, loadable by us and by transformers."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaForCausalLM

from pdserve.model import default
from pdserve.model.config import ModelConfig, load_config
from pdserve.model.default import DEFAULT_SPECS, ensure_default_model, hf_config_dict, resolve_model
from pdserve.model.errors import CheckpointError
from pdserve.model.loader import load_state_dict
from pdserve.model.tokenizer import load_tokenizer

EXPECTED_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"]


def file_bytes(model_dir):
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_tiny_is_deterministic(tiny_model_dir, tmp_path):
    again = ensure_default_model("tiny", cache_dir=tmp_path)
    assert again != tiny_model_dir
    assert sorted(file_bytes(again)) == EXPECTED_FILES
    assert file_bytes(again) == file_bytes(tiny_model_dir)


def test_second_call_reuses_directory(tiny_model_dir):
    weights = tiny_model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_default_model("tiny", cache_dir=tiny_model_dir.parent) == tiny_model_dir
    assert weights.stat().st_mtime_ns == mtime


def test_lost_race_uses_winner_and_cleans_up(tmp_path, monkeypatch):
    real_rename = os.rename

    def rename_after_rival(src, dst):
        os.makedirs(dst)  # another process finished first
        real_rename(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
        real_rename(src, dst)  # fails: dst exists and is not empty

    monkeypatch.setattr(default.os, "rename", rename_after_rival)
    final = ensure_default_model("tiny", cache_dir=tmp_path)
    assert final.is_dir() and (final / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_param_counts_near_targets(tiny_model_dir):
    tiny = load_config(tiny_model_dir)
    small = ModelConfig.from_dict(hf_config_dict(DEFAULT_SPECS["small"]), "small")
    assert abs(tiny.num_params() - 20e6) / 20e6 < 0.15
    assert abs(small.num_params() - 120e6) / 120e6 < 0.15
    assert tiny.tie_word_embeddings and not small.tie_word_embeddings


def test_tiny_loads_with_our_loader(tiny_model_dir):
    config = load_config(tiny_model_dir)
    assert config.checkpoint_dtype == "bfloat16" and config.head_dim == 64
    state = load_state_dict(tiny_model_dir, config, dtype=torch.bfloat16)
    assert torch.equal(state["model.norm.weight"], torch.ones(512, dtype=torch.bfloat16))
    std = state["model.layers.3.mlp.up_proj.weight"].float().std().item()
    assert 0.019 < std < 0.021
    tok = load_tokenizer(tiny_model_dir)
    assert tok.vocab_size == config.vocab_size and tok.eos_token_ids == config.eos_token_ids


def test_transformers_loads_tiny(tiny_model_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == load_config(tiny_model_dir).num_params()
    ids = load_tokenizer(tiny_model_dir).encode("hello", add_bos=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # [1, S, V]
    assert logits.shape == (1, len(ids), 259) and torch.isfinite(logits).all()


def test_resolve_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    tiny = resolve_model("tiny")
    assert tiny.parent == tmp_path / "cache" / "models" and tiny.name.startswith("tiny-")
    assert resolve_model(str(tiny)) == tiny
    with pytest.raises(CheckpointError, match="does not exist") as exc_info:
        resolve_model(str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in str(exc_info.value)
    with pytest.raises(ValueError, match="unknown default model"):
        ensure_default_model("huge", cache_dir=tmp_path)
