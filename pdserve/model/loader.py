"""Checkpoint loading: safetensors files on disk -> validated state dict in Hugging Face names.

Contract: `load_state_dict` returns exactly the tensors `expected_shapes(config)` lists, each
with its expected shape, converted to the requested dtype, or raises `CheckpointError` naming
the file and the problem. It never returns a partial or silently reshaped model. Rotary
`inv_freq` buffers are ignored; for tied embeddings `lm_head.weight` is never returned (the
forward pass reuses `model.embed_tokens.weight`), whether or not the checkpoint stores it.

`check_checkpoint` runs every one of those checks from the safetensors headers alone (names,
dtypes, shapes, byte spans against the file sizes; model/safetensors_header.py), without torch:
the serving process's pre-flight calls it, so a checkpoint no worker could load is refused once
before any worker starts, and `load_state_dict` calls it before it reads a tensor.

Layouts: one `model.safetensors`, or shards listed by `model.safetensors.index.json`.

`checkpoint_hash` is the model identity used to fence K/V: it covers the config and every
tensor's name, dtype, shape and a fixed sample of its bytes, so it is fast on large checkpoints
and independent of how the tensors are sharded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from pdserve.model.config import CONFIG_FILE, ModelConfig
from pdserve.model.errors import CheckpointError
from pdserve.model.safetensors_header import TensorEntry, read_header

if TYPE_CHECKING:  # torch is loaded by the calls that make tensors: the router's process hashes and checks checkpoints without it
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
HASH_VERSION = b"pdserve-checkpoint-hash-v1"
HASH_SAMPLE_BYTES = 256  # bytes hashed at each of a tensor's start, middle and end
# The float kinds `.to(dtype)` turns into the same weight; integer or float8 tensors are quantized
# weights whose scales this loader would not apply.
LOADABLE_DTYPES = ("F16", "BF16", "F32", "F64")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must hold, in Hugging Face names."""
    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (q, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q)
        if config.qkv_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (q,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv,)
        if config.o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (ff, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (ff, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, ff)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def load_state_dict(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Load and validate all weights of the checkpoint in `model_dir` as `dtype` tensors (default float32)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    model_dir = Path(model_dir)
    located = check_checkpoint(model_dir, config)
    by_file: dict[Path, list[str]] = {}
    for name in expected_shapes(config):
        by_file.setdefault(located[name][0], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        state.update(_read_tensors(file, names, dtype))
    return state


def check_checkpoint(model_dir: str | Path, config: ModelConfig) -> dict[str, tuple[Path, TensorEntry]]:
    """Every tensor of the checkpoint in `model_dir` located (file, header entry) and checked against
    `config` from the headers alone: exactly the expected names, each of its expected shape and of a
    loadable dtype, each file's spans whole. Raises `CheckpointError` naming the file and the problem."""
    model_dir = Path(model_dir)
    if not (model_dir / CONFIG_FILE).is_file():
        raise CheckpointError(model_dir / CONFIG_FILE, "config.json not found")
    located = _locate_tensors(model_dir)
    _check_tensors(located, expected_shapes(config), model_dir)
    return located


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked to exist; sorted by name."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        shards = sorted(set(_read_index(index).values()))
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise CheckpointError(model_dir / shard, f"shard listed in {INDEX_FILE} is missing")
        return [model_dir / shard for shard in shards]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    if (model_dir / SINGLE_FILE).exists():
        raise CheckpointError(model_dir / SINGLE_FILE, "not a regular file")
    raise CheckpointError(model_dir, f"no {SINGLE_FILE} or {INDEX_FILE} found")


def checkpoint_hash(model_dir: str | Path) -> str:
    """Stable identity of a checkpoint: config + each tensor's name, dtype, shape, sampled bytes."""
    model_dir = Path(model_dir)
    config_file = model_dir / CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(config_file, "config.json not found")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(config_file, f"config.json is not valid JSON ({exc})") from exc
    digest = hashlib.sha256(HASH_VERSION)
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    entries = [(entry, file) for file in weight_files(model_dir) for entry in read_header(file)]
    for entry, file in sorted(entries, key=lambda e: e[0].name):
        digest.update(json.dumps([entry.name, entry.dtype, list(entry.shape)]).encode())
        digest.update(_sample_bytes(file, entry.start, entry.end))
    return digest.hexdigest()


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(index, f"not a valid safetensors index ({exc!r})") from exc
    if not isinstance(weight_map, dict):
        raise CheckpointError(index, "weight_map must be an object")
    return weight_map


def _locate_tensors(model_dir: Path) -> dict[str, tuple[Path, TensorEntry]]:
    """Map every tensor name in the checkpoint to (file holding it, its header entry)."""
    index_map = _read_index(model_dir / INDEX_FILE) if (model_dir / INDEX_FILE).is_file() else None
    located: dict[str, tuple[Path, TensorEntry]] = {}
    for file in weight_files(model_dir):
        for entry in read_header(file):
            name = entry.name
            if name in located:
                raise CheckpointError(file, f"tensor {name!r} also stored in {located[name][0].name}")
            if index_map is not None and index_map.get(name) != file.name:
                raise CheckpointError(file, f"tensor {name!r} is not listed for this shard in {INDEX_FILE}")
            located[name] = (file, entry)
    if index_map is not None:
        for name, shard in index_map.items():
            if name not in located:
                raise CheckpointError(model_dir / shard, f"tensor {name!r} listed in {INDEX_FILE} is missing")
    return located


def _check_tensors(
    located: dict[str, tuple[Path, TensorEntry]],
    expected: dict[str, tuple[int, ...]],
    model_dir: Path,
) -> None:
    for name, want in expected.items():
        if name not in located:
            raise CheckpointError(model_dir, f"missing tensor {name!r} (expected shape {want})")
        file, entry = located[name]
        if entry.shape != want:
            raise CheckpointError(file, f"tensor {name!r} has shape {entry.shape}, expected {want}")
        if entry.dtype not in LOADABLE_DTYPES:
            raise CheckpointError(file, f"tensor {name!r} is {entry.dtype}; loadable: {', '.join(LOADABLE_DTYPES)} "
                                        f"(a quantized checkpoint is not supported)")
    for name, (file, _) in located.items():
        if name in expected or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight":  # tied checkpoints may still store it; it is not used
            continue
        raise CheckpointError(file, f"unexpected tensor {name!r}")


def _read_tensors(file: Path, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name).to(dtype) for name in names}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(file, f"unreadable safetensors file ({exc})") from exc


def _sample_bytes(file: Path, start: int, end: int) -> bytes:
    """A tensor's bytes if small, else fixed windows at its start, middle and end."""
    n = HASH_SAMPLE_BYTES
    spans = [(start, end)] if end - start <= 3 * n else [
        (start, start + n), ((start + end) // 2, (start + end) // 2 + n), (end - n, end)
    ]
    with open(file, "rb") as f:
        chunks = []
        for a, b in spans:
            f.seek(a)
            chunks.append(f.read(b - a))
    return b"".join(chunks)
