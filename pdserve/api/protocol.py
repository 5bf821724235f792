"""OpenAI-compatible request bodies for /v1/completions and /v1/chat/completions, and their validation.

Contract: FastAPI validates a body against `CompletionRequest` / `ChatCompletionRequest` (strict
types: "16" is not an int, 1 is not a bool; NaN/inf rejected); `parse_completion` / `parse_chat`
then check what types cannot (served model name, unsupported features, prompt length) and build a
`ParsedRequest`: prompt token ids plus engine `SamplingParams`. Every failure is an `ApiError`
(400, or 404 for an unknown model) naming the offending parameter.

Supported beyond OpenAI: `top_k` (0 or -1 disables), `ignore_eos`, `return_token_ids` (each
choice then carries `token_ids`, the output ids), vLLM's `min_tokens`, `stop_token_ids` and
`repetition_penalty` (api/extensions.py states their semantics); chat also takes vLLM's
`add_generation_prompt` (default true) and `chat_template_kwargs` (extra variables for the
checkpoint's template). Accepted but ignored: `user`, and any field this server does not know
(as vLLM, which only logs them). Rejected with 400 `unsupported_parameter` naming the field when
set to a non-default value: best_of > 1 (as vLLM's current engine), suffix, presence and frequency
penalties, logit_bias, tools/functions, non-text response formats and content parts, and every
other vLLM extension (`extensions.REFUSED`: min_p, length_penalty, use_beam_search,
allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, truncate_prompt_tokens, priority, guided_* and structured
outputs, logits_processors, ...; `add_special_tokens` other than the endpoint's default).
Defaults follow OpenAI: max_tokens 16, temperature 1.0, top_p 1.0; an omitted max_tokens never
asks for more than the context has left (max_model_len - prompt tokens). A given max_tokens (chat:
max_completion_tokens, else max_tokens) that does not fit beside the prompt is a 400
`context_length_exceeded` naming that field, as vLLM answers; each of `n` choices needs the same room.
Benchmark hook, outside the OpenAI body: the header `x-pdserve-scripted-eos-tokens: N`
(`with_scripted_eos`) ends the output with reason "stop" after N tokens, as if the model had
emitted EOS there; `max_tokens` stays the bound every reservation uses.

Logprobs (values: log_softmax of the raw logits, engine/logprobs.py): completions `logprobs: k`,
chat `logprobs: true` with `top_logprobs: k`; k above the server's `max_logprobs` (serve
`--max-logprobs`, default 20) is a 400, and so is `top_logprobs` without `logprobs: true` (as
vLLM). Completions `echo: true` returns the prompt before the output, with the prompt tokens'
logprobs when `logprobs` is set (the first prompt token's is null); `max_tokens: 0` is allowed
only with echo (the prompt alone comes back). Chat `echo` is vLLM's: when the last message has the
response's role (assistant, or the last message's own role when `add_generation_prompt` is
false), its content is put before the generated content. vLLM's `prompt_logprobs` extension is
not served: with `stream: true` it is the 400 vLLM answers, otherwise a 400 naming completions'
`echo` + `logprobs` instead. `n` independent choices share the prompt (engine/fork.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.api import extensions
from pdserve.api.backend import GenerationRequest
from pdserve.api.chat_template import chat_prompt_ids
from pdserve.api.errors import ApiError, bad_request
from pdserve.api.extensions import VllmExtensions
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sequence import SamplingParams

DEFAULT_MAX_TOKENS = 16
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 128  # choices per request
Finite = Annotated[float, Field(allow_inf_nan=False)]


class StrictBody(BaseModel):
    """A request body: unknown fields ignored, types strict, every string valid Unicode."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """JSON's `\\ud800` escapes decode to lone UTF-16 surrogates, which no tokenizer, wire
        message or response can encode: refused here as the field's 400, before anything reads them."""
        for text in _strings(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"holds a lone UTF-16 surrogate at character {exc.start} "
                                 "(an unpaired \\ud800-\\udfff escape); send valid Unicode") from None
        return value


def _strings(value: Any) -> list[str]:
    """The strings a field's value holds directly (nested bodies validate their own fields). A list
    that does not start with a string is one of token ids, or a shape the field's own check refuses:
    a prompt of 100,000 ids is not walked again."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)] if value and isinstance(value[0], str) else []
    if isinstance(value, dict):
        return [v for item in value.items() for v in item if isinstance(v, str)]
    return []


class StreamOptions(StrictBody):
    include_usage: bool = False


class _CommonRequest(StrictBody, VllmExtensions):
    """Fields shared by both endpoints (vLLM's extensions: api/extensions.py); None means "use
    the default" as in OpenAI's API."""

    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 only with completions' echo
    temperature: Annotated[Finite, Field(ge=0)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=1 << 31)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)] | None = None  # the workers' wire carries 64 bits
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    prompt_logprobs: int | None = None  # vLLM's extension; not served (see the module contract)
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's: salts prefix caching


class CompletionRequest(_CommonRequest):
    prompt: Any  # str | list[int], or a list holding exactly one of those; checked in parse_completion
    echo: bool | None = None
    best_of: int | None = None
    logprobs: Annotated[int, Field(ge=0)] | None = None
    suffix: str | None = None


class TextPart(StrictBody):
    type: str
    text: str | None = None


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False  # vLLM's: the last message's content leads the answer when its role is the answer's
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class ServedModel:
    """What parsing needs to know about the model behind the backend."""

    name: str
    max_model_len: int
    tokenizer: Any  # pdserve.model.tokenizer.Tokenizer | None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


@dataclass(frozen=True)
class Echo:
    """What a choice's text starts with before the generated output."""

    text: str
    prompt_ids: tuple[int, ...] = ()  # completions: the prompt, whose logprobs lead the choice's when asked for


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request, ready to submit."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    echo: Echo | None = None
    drop_output: bool = False  # max_tokens 0: the engine samples one token nobody sees

    @property
    def n(self) -> int:
        return self.params.n

    def to_generation(self, request_id: str) -> GenerationRequest:
        return GenerationRequest(request_id=request_id, prompt_ids=self.prompt_ids, params=self.params,
                                 tenant=self.params.tenant)


SCRIPTED_EOS_HEADER = "x-pdserve-scripted-eos-tokens"  # the benchmark's stand-in EOS (engine/sequence.py)
MAX_SCRIPTED_EOS = 2**31 - 1  # past any context; the worker messages carry it as a 64-bit integer


def with_scripted_eos(parsed: ParsedRequest, headers) -> ParsedRequest:
    """`parsed` ending after the header's N tokens, when the request carries SCRIPTED_EOS_HEADER."""
    value = headers.get(SCRIPTED_EOS_HEADER)
    if value is None:
        return parsed
    text = value.strip()  # ASCII digits only: '²' is a digit to str.isdigit, not to int()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_SCRIPTED_EOS:
        raise bad_request(f"{SCRIPTED_EOS_HEADER} must be an integer from 1 to {MAX_SCRIPTED_EOS}, got {value!r}",
                          param=SCRIPTED_EOS_HEADER)
    return replace(parsed, params=replace(parsed.params, scripted_eos_tokens=int(text)))


# ---- entry points -------------------------------------------------------------------------
def parse_completion(body: CompletionRequest, served: ServedModel) -> ParsedRequest:
    check_model(body.model, served)
    _reject_unsupported(_common_unsupported(body) + _completion_unsupported(body) + extensions.problems(body, "completions"))
    _check_logprobs_k(body.logprobs, served, "logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
    prompt_ids = _completion_prompt_ids(body.prompt, served)
    echo = Echo(_prompt_text(body.prompt, prompt_ids, served), tuple(prompt_ids)) if body.echo else None
    parsed = _finish(body, served, prompt_ids, (body.max_tokens, "max_tokens"), "prompt", body.logprobs)
    if echo is not None and body.logprobs is not None:
        parsed = replace(parsed, params=replace(parsed.params, prompt_logprobs=body.logprobs))
    return replace(parsed, echo=echo)


def parse_chat(body: ChatCompletionRequest, served: ServedModel) -> ParsedRequest:
    check_model(body.model, served)
    _reject_unsupported(_common_unsupported(body) + _chat_unsupported(body) + extensions.problems(body, "chat"))
    if body.top_logprobs and not body.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
    k = (body.top_logprobs or 0) if body.logprobs else None
    _check_logprobs_k(k, served, "top_logprobs")
    messages = template_messages(body.messages)
    prompt_ids = chat_prompt_ids(messages, served.tokenizer, body.add_generation_prompt, body.chat_template_kwargs)
    asked = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
             else (body.max_tokens, "max_tokens"))
    if asked[0] == 0:
        raise bad_request("max_tokens must be at least 1", param=asked[1])
    parsed = _finish(body, served, prompt_ids, asked, "messages", k)
    return replace(parsed, echo=_chat_echo(body, messages))


def _chat_echo(body: ChatCompletionRequest, messages: list[dict[str, str]]) -> Echo | None:
    """vLLM's chat echo: the last message leads the answer when it has the answer's role."""
    role = "assistant" if body.add_generation_prompt else messages[-1]["role"]
    if not body.echo or messages[-1]["role"] != role or not messages[-1]["content"]:
        return None
    return Echo(messages[-1]["content"])


def _prompt_text(prompt: Any, prompt_ids: list[int], served: ServedModel) -> str:
    """The prompt as echo returns it: the text sent, or the ids decoded."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return served.tokenizer.decode(prompt_ids, skip_special_tokens=False) if served.tokenizer is not None else ""


def _check_logprobs_k(k: int | None, served: ServedModel, param: str) -> None:
    if k is not None and k > served.max_logprobs:
        raise bad_request(f"{param} must be at most {served.max_logprobs} (this server's --max-logprobs); got {k}",
                          param=param)


# ---- checks -------------------------------------------------------------------------------
def check_model(model: str, served: ServedModel) -> None:
    if model != served.name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served.name}`.",
                       param="model", code="model_not_found")


def _reject_unsupported(problems: list[tuple[str, str]]) -> None:
    if problems:
        param, message = problems[0]
        raise bad_request(message, param=param, code="unsupported_parameter")


def _common_unsupported(body: _CommonRequest) -> list[tuple[str, str]]:
    problems = []
    if body.prompt_logprobs is not None:
        problems.append(("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`" if body.stream
                         else "prompt_logprobs is not supported; use completions with echo and logprobs"))
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            problems.append((name, f"{name} is not supported (only 0)"))
    if body.logit_bias:
        problems.append(("logit_bias", "logit_bias is not supported"))
    if body.stream_options is not None and not body.stream:
        problems.append(("stream_options", "stream_options is only allowed when stream is true"))
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        problems.append(("response_format", "only the text response format is supported"))
    return problems


def _completion_unsupported(body: CompletionRequest) -> list[tuple[str, str]]:
    problems = []
    if body.best_of is not None and body.best_of != 1:
        problems.append(("best_of", "best_of > 1 is not supported"))
    if body.suffix:
        problems.append(("suffix", "suffix is not supported"))
    return problems


def _chat_unsupported(body: ChatCompletionRequest) -> list[tuple[str, str]]:
    problems = []
    if body.tools or body.functions or body.tool_choice not in (None, "none"):
        problems.append(("tools", "tools and function calling are not supported"))
    if body.function_call not in (None, "none"):
        problems.append(("function_call", "function calling is not supported"))
    return problems


# ---- prompts ------------------------------------------------------------------------------
def _completion_prompt_ids(prompt: Any, served: ServedModel) -> list[int]:
    """str | [int] -> ids; a list holding exactly one prompt is unwrapped; several are refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"one prompt per request is supported; got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _encode(prompt, served, "prompt")
    if isinstance(prompt, list) and all(_is_token_id(t) for t in prompt):
        return list(prompt)
    raise bad_request("prompt must be a string or a list of token ids (non-negative integers)", param="prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _encode(text: str, served: ServedModel, param: str) -> list[int]:
    if served.tokenizer is None:
        raise bad_request("this model has no tokenizer; send the prompt as a list of token ids", param=param)
    return served.tokenizer.encode(text)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as a chat template reads them: {"role", "content"} plus "name" when sent."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": _message_text(m, i)}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" or part.text is None for part in content):
        raise bad_request("only text content parts are supported", param=f"messages.{index}.content")
    return "".join(part.text for part in content)


# ---- sampling -----------------------------------------------------------------------------
def _finish(body: _CommonRequest, served: ServedModel, prompt_ids: list[int], asked: tuple[int | None, str],
            prompt_param: str, logprobs: int | None) -> ParsedRequest:
    """`asked`: the request's max_tokens (None when omitted) and the field that carried it."""
    _check_length(prompt_ids, served, prompt_param)
    max_tokens = _output_budget(len(prompt_ids), served.max_model_len, *asked)
    extensions.check_min_tokens(body.min_tokens, max_tokens, asked[1])
    drop_output = max_tokens == 0  # the prompt alone: one token is sampled and dropped
    params = _sampling_params(body, 1 if drop_output else max_tokens, logprobs)
    stream = bool(body.stream)
    include_usage = stream and body.stream_options is not None and body.stream_options.include_usage
    return ParsedRequest(tuple(prompt_ids), params, stream, include_usage, body.return_token_ids, drop_output=drop_output)


def _check_length(prompt_ids: list[int], served: ServedModel, param: str) -> None:
    if not prompt_ids:
        raise bad_request("the prompt is empty", param=param)
    if len(prompt_ids) >= served.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {served.max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens and at least one token must remain for the output.",
            param=param, code="context_length_exceeded",
        )


def _output_budget(num_prompt: int, max_model_len: int, max_tokens: int | None, param: str) -> int:
    """The output tokens a request may have: the default bounded by the room the prompt leaves, or
    the request's own number, which must fit in that room (a 400 as vLLM's, never a later 503)."""
    room = max_model_len - num_prompt  # >= 1: _check_length ran first
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the request asked for "
            f"{num_prompt} prompt tokens + {max_tokens} completion tokens = {num_prompt + max_tokens}; "
            f"lower {param} to at most {room} or shorten the prompt.",
            param=param, code="context_length_exceeded",
        )
    return max_tokens


def _sampling_params(body: _CommonRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        n=body.n or 1,
        **extensions.sampling_fields(body),
    )
    try:
        params.validate()
    except InvalidRequest as exc:
        raise bad_request(str(exc)) from exc
    return params
