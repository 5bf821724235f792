"""`scripted_eos_tokens` (a benchmark's stand-in EOS): the output stops there with reason "stop",
its tokens are the first tokens of an unlimited run, and the API passes it through."""

from __future__ import annotations

import pytest

from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sequence import SamplingParams


def test_output_stops_at_the_scripted_eos_with_the_same_tokens(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt)
    prompt = list(range(3, 40))
    full = eng.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    cut = eng.generate([prompt], SamplingParams(max_tokens=1024, ignore_eos=True, scripted_eos_tokens=7))[0]
    assert cut.finish_reason == "stop" and list(cut.output_ids) == list(full.output_ids)[:7]
    longer = eng.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, scripted_eos_tokens=7))[0]
    assert longer.finish_reason == "length" and len(longer.output_ids) == 5


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_scripted_eos_must_be_a_positive_integer(bad):
    with pytest.raises(InvalidRequest, match="scripted_eos_tokens"):
        SamplingParams(scripted_eos_tokens=bad).validate()


def test_the_completions_api_passes_it_through_and_refuses_zero():
    """The benchmark's scripted end reaches the engine through its header (api/protocol.py), not the body."""
    from pdserve.api.errors import ApiError
    from pdserve.api.protocol import SCRIPTED_EOS_HEADER, CompletionRequest, ServedModel, parse_completion, with_scripted_eos
    from tests.api.servers import ByteTokenizer

    served = ServedModel("m", 64, ByteTokenizer())
    body = CompletionRequest.model_validate({"model": "m", "prompt": "abc", "max_tokens": 50})
    assert with_scripted_eos(parse_completion(body, served), {SCRIPTED_EOS_HEADER: "9"}).params.scripted_eos_tokens == 9
    assert with_scripted_eos(parse_completion(body, served), {}).params.scripted_eos_tokens is None
    with pytest.raises(ApiError):
        with_scripted_eos(parse_completion(body, served), {SCRIPTED_EOS_HEADER: "0"})