"""Request parsing without a server: defaults, conversions, the chat template, rejections."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.backend import GenerationRequest
from pdserve.api.chat_template import render_chat
from pdserve.api.errors import ApiError
from pdserve.api.lifecycle import RequestStream
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, ServedModel, parse_chat, parse_completion
from pdserve.engine.sequence import SamplingParams
from tests.api.servers import ByteTokenizer, FakeBackend, finish, tokens

SERVED = ServedModel("m", 64, ByteTokenizer())


def completion(**fields):
    return parse_completion(CompletionRequest.model_validate({"model": "m", "prompt": "abc", **fields}), SERVED)


def chat(messages, **fields):
    return parse_chat(ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields}), SERVED)


def test_defaults_follow_openai():
    parsed = completion()
    assert parsed.prompt_ids == (97, 98, 99)
    assert parsed.params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
    assert (parsed.stream, parsed.include_usage, parsed.return_token_ids) == (False, False, False)


def test_fields_map_to_sampling_params():
    parsed = completion(prompt=[1, 2], max_tokens=5, temperature=0, top_p=0.5, top_k=-1, seed=3, stop="\n",
                        ignore_eos=True, stream=True, stream_options={"include_usage": True}, return_token_ids=True,
                        n=1, best_of=1, user="u", some_future_field=1)
    assert parsed.prompt_ids == (1, 2)
    assert parsed.params == SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, top_k=0, seed=3, stop=("\n",),
                                           ignore_eos=True)
    assert parsed.include_usage and parsed.return_token_ids
    assert parsed.to_generation("cmpl-1") == GenerationRequest("cmpl-1", (1, 2), parsed.params)


def test_stop_token_ids_are_kept_once_each():
    """A body may repeat an id ~10^6 times within the 4 MiB limit; each decode step reads the list
    (engine/stops.py, engine/logits_processors.py), so each id is kept once, in first-seen order."""
    parsed = completion(stop_token_ids=[7, 3, 7] * 100_000, min_tokens=2)
    assert parsed.params.stop_token_ids == (7, 3)


def test_single_prompt_in_a_list_is_unwrapped():
    assert completion(prompt=["ab"]).prompt_ids == (97, 98)
    assert completion(prompt=[[7, 8]]).prompt_ids == (7, 8)


def test_chat_template_and_max_completion_tokens():
    parsed = chat([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}],
                  max_tokens=3, max_completion_tokens=4)
    assert render_chat([("system", "s"), ("user", "u")]) == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"
    assert bytes(parsed.prompt_ids).decode() == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"
    assert parsed.params.max_tokens == 4


@pytest.mark.parametrize("fields, status, fragment", [
    ({"model": "other"}, 404, "does not exist"),
    ({"best_of": 2}, 400, "best_of > 1 is not supported"),
    ({"max_tokens": 0}, 400, "only with echo"),
    ({"logprobs": 21}, 400, "at most 20"),
    ({"suffix": "x"}, 400, "suffix"),
    ({"prompt": "x" * 64}, 400, "maximum context length is 64"),
    ({"prompt": [True]}, 400, "list of token ids"),
])
def test_rejections(fields, status, fragment):
    with pytest.raises(ApiError) as caught:
        completion(**fields)
    assert caught.value.info.status == status and fragment in caught.value.info.message


def test_an_omitted_max_tokens_is_bounded_by_the_room_the_prompt_leaves():
    """The default 16 where it fits, else max_model_len - prompt (vLLM's default), never past the context."""
    assert completion(prompt=[1] * 40).params.max_tokens == 16
    assert completion(prompt=[1] * 59).params.max_tokens == 5
    assert chat([{"role": "user", "content": "x" * 30}]).params.max_tokens == 64 - 30 - len("<|user|>\n\n<|assistant|>\n")
    assert completion(prompt="x" * 63, echo=True, max_tokens=0).drop_output  # the prompt alone still fits


def test_a_max_tokens_past_the_context_names_the_field_that_asked():
    for parse, param in ((lambda: completion(prompt=[1] * 60, max_tokens=5), "max_tokens"),
                         (lambda: chat([{"role": "user", "content": "x"}], max_completion_tokens=64), "max_completion_tokens"),
                         (lambda: chat([{"role": "user", "content": "x"}], max_tokens=10**9), "max_tokens")):
        with pytest.raises(ApiError) as caught:
            parse()
        info = caught.value.info
        assert (info.status, info.code, info.param) == (400, "context_length_exceeded", param)
        assert "maximum context length is 64 tokens" in info.message
    assert completion(prompt=[1] * 60, max_tokens=4).params.max_tokens == 4


def test_text_prompt_needs_a_tokenizer():
    served = ServedModel("m", 32, None)
    with pytest.raises(ApiError, match="no tokenizer"):
        parse_completion(CompletionRequest.model_validate({"model": "m", "prompt": "abc"}), served)
    assert parse_completion(CompletionRequest.model_validate({"model": "m", "prompt": [1]}), served).prompt_ids == (1,)


def test_request_stream_aborts_exactly_once_when_cancelled():
    async def scenario():
        fake = FakeBackend(endless=True)
        stream = RequestStream(fake, GenerationRequest("r1", (1,), SamplingParams()))
        await stream.open()
        reader = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0)
        reader.cancel()
        await asyncio.gather(stream.close(), stream.close(), return_exceptions=True)
        await asyncio.sleep(0.05)
        return fake

    fake = asyncio.run(scenario())
    assert fake.aborts == ["r1"] and fake.closed_iterators == ["r1"]


def test_request_stream_never_aborts_after_finish():
    async def scenario():
        fake = FakeBackend(events=[*tokens("a"), finish()])
        stream = RequestStream(fake, GenerationRequest("r2", (1,), SamplingParams()))
        await stream.open()
        await stream.next()
        await stream.close()
        return fake

    assert asyncio.run(scenario()).aborts == []
