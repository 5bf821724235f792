"""vLLM's request extensions to the OpenAI bodies: the fields this server honours, and those it
refuses with a 400 rather than drop.

Contract: `VllmExtensions` declares every vLLM sampling/request extension a client may send, so
none is silently ignored as an unknown field. Honoured (vLLM's semantics, on whichever worker
decodes, engine/logits_processors.py and engine/stops.py):
  - `min_tokens` (0 <= min_tokens <= max_tokens): no EOS, stop token id, stop string or scripted
    EOS ends a choice before it has min_tokens output tokens (EOS and stop_token_ids are never
    sampled before then);
  - `stop_token_ids`: a choice that samples one of them ends with finish_reason "stop"; the id is
    the last of the choice's token ids and, like EOS, not part of its text;
  - `repetition_penalty` (> 0, default 1): the logit of each token id seen in the prompt or the
    output so far is divided by it when positive, multiplied by it otherwise.
`problems(body, endpoint)` lists (field, message) for every refused extension set to anything but
its neutral value (REFUSED, and `add_special_tokens` against its endpoint's default: true for
completions, false for chat); `sampling_fields(body)` gives the honoured ones as SamplingParams
keywords; `check_min_tokens` is the 400 vLLM answers when min_tokens exceeds max_tokens.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from pdserve.api.errors import bad_request

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 63)]

# refused field -> its neutral value (None, and [] for a list, are neutral too): what vLLM does
# with it by default, which is what this server does
REFUSED: dict[str, Any] = {
    "min_p": 0.0, "length_penalty": 1.0, "use_beam_search": False, "allowed_token_ids": None, "bad_words": None,
    "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None, "priority": 0, "logits_processors": None, "return_tokens_as_token_ids": False,
    "prompt_embeds": None, "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structural_tag": None,
    "structured_outputs": None, "vllm_xargs": None, "kv_transfer_params": None, "continue_final_message": False,
    "chat_template": None, "documents": None, "mm_processor_kwargs": None,
}
ADD_SPECIAL_TOKENS = {"completions": True, "chat": False}  # the prompt's BOS: what each endpoint encodes with


class VllmExtensions(BaseModel):
    """vLLM's extension fields (types strict through the request body that inherits them)."""

    min_tokens: Annotated[int, Field(ge=0, lt=1 << 63)] = 0
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0)] | None = None
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    length_penalty: Finite | None = None
    use_beam_search: bool = False
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    add_special_tokens: bool | None = None  # None: the endpoint's default (ADD_SPECIAL_TOKENS)
    logits_processors: Any = None
    return_tokens_as_token_ids: bool | None = None
    prompt_embeds: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    continue_final_message: bool = False  # chat's
    chat_template: Any = None  # chat's
    documents: Any = None  # chat's
    mm_processor_kwargs: Any = None


def problems(body: VllmExtensions, endpoint: str) -> list[tuple[str, str]]:
    """(field, message) for each refused extension the body sets to a non-neutral value."""
    found = [(name, f"{name} is not supported by this server (send it unset or as {neutral!r})")
             for name, neutral in REFUSED.items() if not _neutral(getattr(body, name), neutral)]
    default = ADD_SPECIAL_TOKENS[endpoint]
    if body.add_special_tokens not in (None, default):
        found.append(("add_special_tokens", f"add_special_tokens is not supported on {endpoint} "
                                            f"(send it unset or as {default!r})"))
    return found


def _neutral(value: Any, neutral: Any) -> bool:
    return value is None or value == [] or value == neutral


def sampling_fields(body: VllmExtensions) -> dict[str, Any]:
    """The honoured extensions as SamplingParams keywords. stop_token_ids keeps each id once (in
    first-seen order): a body may repeat ids ~10^6 times within the 4 MiB limit, and every decode
    step reads the list (engine/stops.py, engine/logits_processors.py)."""
    return {"min_tokens": body.min_tokens, "stop_token_ids": tuple(dict.fromkeys(body.stop_token_ids or ())),  # each once
            "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty}


def check_min_tokens(min_tokens: int, max_tokens: int, max_tokens_param: str) -> None:
    """vLLM's 400 when a choice could never have min_tokens output tokens."""
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be less than or equal to {max_tokens_param}={max_tokens}, "
                          f"got {min_tokens}", param="min_tokens")
