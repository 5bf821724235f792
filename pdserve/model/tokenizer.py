"""Text <-> token ids, and streaming detokenization.

Contract: `Tokenizer.encode` never adds special tokens except the BOS id when asked, and text
that spells a special token (say "</s>") is encoded as ordinary text, so a prompt cannot inject
control ids and encode/decode round-trips exactly; the engine controls what the model sees.
`decode` drops special tokens. `load_tokenizer`
returns None when a checkpoint has no `tokenizer.json`: the engine then works on token ids only.

A checkpoint that ships a chat template (`checkpoint_template.py`) gets it as `chat_template`, and
`encode_chat` encodes that template's rendered text as transformers' `apply_chat_template` does:
special-token spellings become their ids (the template writes them, BOS included) and nothing is
added. Message content inside the rendered text is not told apart, as in transformers and vLLM.

`IncrementalDetokenizer` turns a stream of ids into text deltas whose concatenation (plus
`flush()`) equals `decode(all ids)`. It re-decodes a short window of recent ids so decoders that
depend on context (leading-space handling) stay right, and holds back text ending in U+FFFD,
which marks a UTF-8 character whose bytes have not all arrived yet.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from pdserve.model.checkpoint_template import ChatTemplate, load_chat_template, read_json_object
from pdserve.model.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and identity the engine needs."""

    inner: tokenizers.Tokenizer = field(repr=False, compare=False)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    identity_hash: str  # sha256 of tokenizer.json bytes and the special ids
    chat_template: ChatTemplate | None = field(default=None, compare=False)
    # a second copy that matches special-token spellings (`encode_special_tokens` is per instance)
    template_inner: tokenizers.Tokenizer | None = field(default=None, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added/special tokens included."""
        return self.inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.inner.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def encode_chat(self, text: str) -> list[int]:
        """Rendered chat-template text -> ids, special-token spellings as their ids, nothing added."""
        if self.template_inner is None:
            raise ValueError("this tokenizer has no chat template")
        return self.template_inner.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        """Id of a token string (e.g. a special token), or None if unknown."""
        return self.inner.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer for one request's output."""
        return IncrementalDetokenizer(self)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json."""
    model_dir = Path(model_dir)
    file = model_dir / TOKENIZER_FILE
    if not file.is_file():
        return None
    data = file.read_bytes()
    try:
        inner = tokenizers.Tokenizer.from_str(data.decode())
    except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
        raise CheckpointError(file, f"unreadable tokenizer ({exc})") from exc
    inner.encode_special_tokens = True  # special-token strings in text stay plain text
    bos, eos = _special_ids(model_dir, inner)
    digest = hashlib.sha256(data)
    digest.update(json.dumps([bos, list(eos)]).encode())
    template = load_chat_template(model_dir)
    template_inner = tokenizers.Tokenizer.from_str(data.decode()) if template is not None else None
    return Tokenizer(inner=inner, bos_token_id=bos, eos_token_ids=eos, identity_hash=digest.hexdigest(),
                     chat_template=template, template_inner=template_inner)


def _special_ids(model_dir: Path, inner: tokenizers.Tokenizer) -> tuple[int | None, tuple[int, ...]]:
    """BOS and EOS ids: generation_config.json, then config.json, then tokenizer_config.json."""
    sources = [read_json_object(model_dir / n) for n in ("generation_config.json", "config.json")]
    bos = next((s["bos_token_id"] for s in sources if s.get("bos_token_id") is not None), None)
    eos: list[int] = []
    for s in sources:
        value = s.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)
    tok_config = read_json_object(model_dir / "tokenizer_config.json")
    if bos is None:
        bos = _token_id(inner, tok_config.get("bos_token"))
    eos_from_name = _token_id(inner, tok_config.get("eos_token"))
    if not eos and eos_from_name is not None:
        eos.append(eos_from_name)
    return bos, tuple(eos)


def _token_id(inner: tokenizers.Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # older tokenizer_config.json stores AddedToken objects
        token = token.get("content")
    return inner.token_to_id(token) if isinstance(token, str) else None


class IncrementalDetokenizer:
    """Feeds ids one at a time and returns the text each one completes.

    Invariant: `ids[:prefix_offset]` and `ids[:read_offset]` end on complete characters, and
    all text up to `read_offset` has been returned. Text is produced by decoding the window
    `ids[prefix_offset:]` and subtracting the already-returned part `ids[prefix_offset:read_offset]`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one id; return newly completed text ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text, window_text = self._window_texts()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window_text[len(prefix_text):]

    def flush(self) -> str:
        """Return held-back text at end of stream (incomplete characters become U+FFFD)."""
        prefix_text, window_text = self._window_texts()
        self.prefix_offset = self.read_offset = len(self.ids)
        return window_text[len(prefix_text):]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self.ids[self.prefix_offset:]
        return decode(self.ids[self.prefix_offset:self.read_offset]), decode(window)
