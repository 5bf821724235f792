"""Tokenizer wrapper and streaming detokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers

from pdserve.model.default import BOS_ID, EOS_ID
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_no_tokenizer_file_means_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_default_tokenizer_special_ids(tok):
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (BOS_ID, (EOS_ID,), 259)
    assert tok.encode("hi", add_bos=True) == [BOS_ID, ord("h"), ord("i")]
    assert tok.encode("hi", add_bos=False) == [ord("h"), ord("i")]
    assert tok.token_id("</s>") == EOS_ID
    assert len(tok.identity_hash) == 64


def test_special_token_text_is_not_a_control_id(tok):
    ids = tok.encode("a</s><s>", add_bos=False)
    assert EOS_ID not in ids and BOS_ID not in ids
    assert tok.decode(ids) == "a</s><s>"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trips_any_text(tok, text):
    ids = tok.encode(text, add_bos=True)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_streaming_concatenates_to_text(tok, text):
    pieces = stream(tok, tok.encode(text, add_bos=True) + [EOS_ID])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=319), max_size=40))
def test_streaming_arbitrary_ids_matches_full_decode(tok, ids):
    # Random ids include invalid UTF-8 and special tokens, as a random model produces.
    assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_split_character_is_held_back(tok):
    euro = list("€".encode())  # three bytes, byte id == byte value
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in euro] == ["", "", "€"]
    assert detok.flush() == ""


def test_context_dependent_decoder_streams_correctly():
    # A sentencepiece-style decoder strips the leading space of the first word only, so
    # decoding each id alone would lose the spaces between words.
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3}
    inner = HfTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Metaspace()
    inner.decoder = decoders.Metaspace()
    tok = Tokenizer(inner=inner, bos_token_id=None, eos_token_ids=(), identity_hash="test")
    ids = [1, 2, 3, 2]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "hello world! world"
