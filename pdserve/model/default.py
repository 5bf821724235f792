"""Built-in default models, generated locally so pdserve runs fully offline.

Contract: `ensure_default_model(name)` returns a directory holding a real Hugging Face-format
Llama checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json). The weights are random, drawn from a fixed per-tensor seed, so the
same spec always yields byte-identical files; the text the model generates is meaningless.
These models exist to exercise the serving system (shapes, memory, K/V traffic, timing), not
to produce language.

The directory is `<root>/<name>-<spec hash>`, where root is `cache_dir` if given, else
`$PDSERVE_CACHE/models`, else `~/.cache/pdserve/models`. It is written into a temporary sibling
and renamed into place, so concurrent callers never see a half-written model; when two
processes race, the loser discards its copy and uses the winner's.

Tokenizer: byte-level, exactly round-tripping any UTF-8 text. Ids 0..255 are the raw bytes
(id == byte value), 256 = `<pad>`, 257 = `<s>` (BOS), 258 = `</s>` (EOS), and 259..vocab-1 are
reserved special tokens that decode to nothing, so every id the model can sample is valid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from pdserve.model.config import ModelConfig
from pdserve.model.errors import CheckpointError
from pdserve.model.loader import expected_shapes

if TYPE_CHECKING:
    import torch

GENERATOR_VERSION = 1  # bump when the files written for a given spec change
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
INIT_STD = 0.02


@dataclass(frozen=True)
class DefaultModelSpec:
    """Shape of a built-in Llama-style model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool
    max_pos: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0

    def spec_hash(self) -> str:
        payload = json.dumps([GENERATOR_VERSION, dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


DEFAULT_SPECS = {
    # ~22.7M parameters
    "tiny": DefaultModelSpec(
        hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, intermediate=1408, vocab=259, tie=True
    ),
    # ~126.5M parameters
    "small": DefaultModelSpec(
        hidden=1024, layers=12, heads=16, kv_heads=4, head_dim=64, intermediate=2560, vocab=259, tie=False
    ),
}


def resolve_model(spec: str) -> Path:
    """A built-in model name ("tiny", "small") or an existing checkpoint directory -> its path."""
    if spec in DEFAULT_SPECS:
        return ensure_default_model(spec)
    path = Path(spec).expanduser()
    if not path.is_dir():
        names = ", ".join(DEFAULT_SPECS)
        raise CheckpointError(path, f"model directory does not exist (built-in models: {names})")
    return path


def ensure_default_model(name: str = "tiny", cache_dir: Path | None = None) -> Path:
    """Generate the named built-in checkpoint once and return its directory."""
    if name not in DEFAULT_SPECS:
        raise ValueError(f"unknown default model {name!r}; choose one of {sorted(DEFAULT_SPECS)}")
    spec = DEFAULT_SPECS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / f"{name}-{spec.spec_hash()}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        write_checkpoint(spec, tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a real failure, not a lost race
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def default_cache_root() -> Path:
    env = os.environ.get("PDSERVE_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"
    return base / "models"


def write_checkpoint(spec: DefaultModelSpec, out_dir: Path) -> None:
    """Write all files of the checkpoint for `spec` into the existing directory `out_dir`."""
    from safetensors.torch import save_file  # torch only where weights are made (resolve_model runs in the router)

    hf_config = hf_config_dict(spec)
    config = ModelConfig.from_dict(hf_config, source=f"<default model spec {spec}>")
    _write_json(out_dir / "config.json", hf_config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    })
    save_file(_random_weights(config, spec.seed), str(out_dir / "model.safetensors"), {"format": "pt"})
    build_byte_tokenizer(spec.vocab).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "add_bos_token": True, "model_max_length": spec.max_pos,
    })


def hf_config_dict(spec: DefaultModelSpec) -> dict:
    """The config.json contents for `spec`, in the transformers Llama format."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_pos,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "initializer_range": INIT_STD,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def _random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """normal(0, 0.02) for matrices, ones for norms; each tensor seeded by its own name."""
    import torch

    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        weights[name] = (torch.randn(shape, generator=gen) * INIT_STD).to(torch.bfloat16)
    return weights


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def build_byte_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level tokenizer: one token per byte, then <pad>, <s>, </s>, reserved tokens."""
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"] + [f"<|reserved_{i}|>" for i in range(vocab_size - 259)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """Map each byte to a printable character (the GPT-2 byte-level scheme).

    Printable Latin-1 bytes map to themselves; the rest (control chars, space, ...) are shifted
    to code points from 256 up, in byte order, so no byte maps to whitespace or a control char.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    for offset, b in enumerate(shifted):
        mapping[b] = chr(256 + offset)
    return mapping


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
