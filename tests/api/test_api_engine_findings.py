"""Engine behaviour noticed while building the API (fixed in stops.py; kept as regression tests).

Finding: a finished request's text never includes what the streaming detokenizer still holds
back. `IncrementalDetokenizer` promises "deltas + flush() == decode(all ids)", but StopChecker
never calls flush() at the finish, so an output that ends in bytes decoding to U+FFFD (an
incomplete or invalid UTF-8 sequence) loses them: text "" while decode(output_ids) is
"\\ufffd" * n. The API relays the engine's text as is (streamed and whole responses agree).
"""

from __future__ import annotations

import pytest

from pdserve.engine.sequence import SamplingParams


def test_final_text_equals_decode_of_output_ids(reference_engine):
    tokenizer = reference_engine.tokenizer
    prompt = tokenizer.encode("Hello")  # the tiny model greedily repeats byte 0x82 after this prompt
    out = reference_engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.text == tokenizer.decode(list(out.output_ids))
