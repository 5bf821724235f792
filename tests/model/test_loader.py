"""Checkpoint loading: layouts, validation errors (each naming file and problem), identity hash."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from pdserve.model.config import load_config
from pdserve.model.errors import CheckpointError
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import check_checkpoint, checkpoint_hash, expected_shapes, load_state_dict
from tests.helpers.checkpoints import load_hf_model, make_random_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return make_random_checkpoint(tmp_path / "single", seed=1)


@pytest.fixture
def sharded(tmp_path):
    return make_random_checkpoint(tmp_path / "sharded", seed=1, shard_size="40KB")


def load(model_dir, dtype=torch.float32):
    return load_state_dict(model_dir, load_config(model_dir), dtype=dtype)


def rewrite(file, edit) -> None:
    """Apply `edit` to the tensors of one safetensors file and save it back."""
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), {"format": "pt"})


def test_loads_all_expected_tensors_matching_transformers(ckpt):
    state = load(ckpt)
    config = load_config(ckpt)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(config)
    reference = load_hf_model(ckpt).state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, reference[name]), name


def test_sharded_equals_unsharded(ckpt, sharded):
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    single, shards = load(ckpt), load(sharded)
    assert single.keys() == shards.keys()
    assert all(torch.equal(single[k], shards[k]) for k in single)


def test_dtype_conversion(ckpt):
    state = load(ckpt, dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_tied_checkpoint_loads_without_lm_head(tmp_path):
    model_dir = make_random_checkpoint(tmp_path, tie=True)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in load(model_dir)


def test_tied_checkpoint_that_stores_lm_head_drops_it(tmp_path):
    model_dir = make_random_checkpoint(tmp_path, tie=True)
    rewrite(model_dir / "model.safetensors",
            lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert "lm_head.weight" not in load(model_dir)


def test_qwen2_checkpoint_with_qkv_bias(tmp_path):
    hf_config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=50, max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen2ForCausalLM(hf_config).save_pretrained(tmp_path)
    state = load(tmp_path)
    assert state["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in state


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found") as exc_info:
        load_state_dict(ckpt, None)
    assert str(ckpt / "config.json") in str(exc_info.value)


def test_no_safetensors(ckpt):
    config = load_config(ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors") as exc_info:
        load_state_dict(ckpt, config)
    assert str(ckpt) in str(exc_info.value)


def test_missing_shard_is_named(sharded):
    shard = sorted(sharded.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing") as exc_info:
        load(sharded)
    assert shard.name in str(exc_info.value)


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999, 0.0001])
def test_truncated_safetensors_is_named(ckpt, keep_fraction):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: max(1, int(len(data) * keep_fraction))])
    with pytest.raises(CheckpointError, match="unreadable safetensors") as exc_info:
        load(ckpt)
    assert str(file) in str(exc_info.value)


def test_garbage_header_is_named(ckpt):
    file = ckpt / "model.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="unreadable safetensors") as exc_info:
        load(ckpt)
    assert str(file) in str(exc_info.value)


def test_a_header_length_past_safetensors_cap_is_refused_before_it_is_read(ckpt):
    """Before: f.read(2**62) raised a bare MemoryError in the serving process."""
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes((2**62).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError, match="unreadable safetensors header .its length field says 4611686018427387904"):
        check_checkpoint(ckpt, load_config(ckpt))
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        checkpoint_hash(ckpt)


@pytest.mark.parametrize("edit, said", [
    (lambda data: data + b"\0" * 4, "4 bytes after the last tensor"),
    (lambda data: data[:-1], "past the file's"),
])
def test_header_checks_see_what_safetensors_refuses_at_load(ckpt, edit, said):
    """The header-only check (the serving process's pre-flight) refuses what safe_open would."""
    file = ckpt / "model.safetensors"
    file.write_bytes(edit(file.read_bytes()))
    with pytest.raises(CheckpointError, match="unreadable safetensors") as exc_info:
        check_checkpoint(ckpt, load_config(ckpt))
    assert said in str(exc_info.value) and str(file) in str(exc_info.value)


def test_a_quantized_tensor_is_refused_by_its_dtype(ckpt):
    file = ckpt / "model.safetensors"
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite(file, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is I8; loadable: F16, BF16, F32, F64"):
        check_checkpoint(ckpt, load_config(ckpt))


def test_shape_mismatch_names_tensor_file_and_shapes(ckpt):
    file = ckpt / "model.safetensors"
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite(file, lambda t: t.update({name: t[name][:16].contiguous()}))
    with pytest.raises(CheckpointError) as exc_info:
        load(ckpt)
    message = str(exc_info.value)
    for fragment in (name, str(file), "(16, 64)", "expected (32, 64)"):
        assert fragment in message, message


def test_extra_tensor_is_refused_but_inv_freq_ignored(ckpt):
    file = ckpt / "model.safetensors"
    rewrite(file, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load(ckpt)
    rewrite(file, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(4)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'") as exc_info:
        load(ckpt)
    assert str(file) in str(exc_info.value)


def test_missing_tensor_is_named(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        load(ckpt)


def test_index_out_of_sync_with_shards(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = index["weight_map"]["model.norm.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.9.mlp.up_proj.weight"):
        load(sharded)


def test_checkpoint_hash_is_stable_and_layout_independent(ckpt, sharded, tmp_path):
    assert checkpoint_hash(ckpt) == checkpoint_hash(ckpt)
    assert checkpoint_hash(ckpt) == checkpoint_hash(sharded)  # same weights, different sharding
    other_seed = make_random_checkpoint(tmp_path / "other", seed=2)
    assert checkpoint_hash(other_seed) != checkpoint_hash(ckpt)


def test_checkpoint_hash_sees_config_and_weight_edits(ckpt):
    before = checkpoint_hash(ckpt)
    rewrite(ckpt / "model.safetensors",
            lambda t: t["model.layers.0.input_layernorm.weight"].mul_(2.0))
    after_weights = checkpoint_hash(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (ckpt / "config.json").write_text(json.dumps(config))
    assert len({before, after_weights, checkpoint_hash(ckpt)}) == 3


def test_a_loaded_model_keeps_no_view_of_the_checkpoint_files_mapping(tmp_path):
    """bf16 on disk and in the model: the loader's tensors are views of the file's mmap, and one kept
    view (an embedding, a norm) would keep the whole file mapped and resident."""
    model_dir = make_random_checkpoint(tmp_path / "bf16", hidden=128, intermediate=256, vocab=256, dtype=torch.bfloat16)
    file = str(model_dir / "model.safetensors")
    state = load(model_dir, torch.bfloat16)
    assert file in Path("/proc/self/maps").read_text()  # read in place
    model = LlamaModel(load_config(model_dir), state, torch.bfloat16)
    del state
    gc.collect()
    # a product plan that multiplies by the loaded tensors as they are (no packing) keeps o_proj's, by design
    plain = any(isinstance(layer.wo, torch.Tensor) for layer in model.layers)
    assert (file in Path("/proc/self/maps").read_text()) == plain
    assert torch.equal(model.embed, load(model_dir, torch.bfloat16)["model.embed_tokens.weight"])
