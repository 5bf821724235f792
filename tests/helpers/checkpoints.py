"""Build small random Hugging Face checkpoints and load reference transformers models.

Weights are re-initialised away from transformers' defaults so tests are sensitive: linear
weights ~ N(0, 0.05), biases random when enabled, RMSNorm weights ~ 1 + 0.1 * N(0, 1) (so a
forgotten norm weight changes the output; Qwen3's per-head q/k norms included), embeddings ~ N(0, 0.5).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from pdserve.model.default import BOS_ID, EOS_ID, PAD_ID, build_byte_tokenizer

# family -> (config class, model class); Qwen3 adds per-head q/k RMSNorm and biases o_proj with q/k/v
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def make_random_checkpoint(
    dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 128,
    vocab: int = 128,
    tie: bool = False,
    attention_bias: bool = False,
    rope_theta: float = 10000.0,
    max_pos: int = 512,
    seed: int = 0,
    shard_size: int | str | None = None,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = False,
    family: str = "llama",
) -> Path:
    """Save a random checkpoint of `family` (see FAMILIES; safetensors) into `dir` and return it."""
    if with_tokenizer and vocab < EOS_ID + 1:
        raise ValueError(f"with_tokenizer needs vocab >= {EOS_ID + 1}, got {vocab}")
    dir = Path(dir)
    special = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID) if with_tokenizer else {}
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim if head_dim is not None else hidden // heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
        rope_theta=rope_theta,
        max_position_embeddings=max_pos,
        **special,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    _reinit(model, seed)
    model.to(dtype)
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(dir, safe_serialization=True, **save_kwargs)
    if with_tokenizer:
        build_byte_tokenizer(vocab).save(str(dir / "tokenizer.json"))
    return dir


CHATML_TEMPLATE = (  # the ChatML shape Qwen checkpoints ship, with a default system message
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def write_chat_tokenizer(dir: str | Path, vocab: int, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """tokenizer.json (the byte tokenizer whose last ids are CHAT_TOKENS, `vocab` ids in all) and a
    tokenizer_config.json carrying `chat_template` (none when None), loadable by transformers'
    AutoTokenizer. Returns `dir`."""
    dir = Path(dir)
    tok = build_byte_tokenizer(vocab - len(CHAT_TOKENS))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    tok.save(str(dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
              "pad_token": "<pad>", "model_max_length": 1024}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (dir / "tokenizer_config.json").write_text(json.dumps(config))
    return dir


def load_hf_model(dir: str | Path) -> PreTrainedModel:
    """The reference transformers model for a checkpoint (any family), fp32, eval mode, eager attention."""
    model = AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def _reinit(model: PreTrainedModel, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen)
        if "norm" in name:
            param.copy_(1.0 + 0.1 * noise)
        elif "embed_tokens" in name:
            param.copy_(0.5 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.1 * noise)
        else:
            param.copy_(0.05 * noise)
