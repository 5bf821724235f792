"""The checkpoint's chat template: where it is read from, rendering equal to transformers'
apply_chat_template (text and ids), the sandbox, and which failures are the request's fault."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pdserve.model.checkpoint_template import ChatTemplateError, load_chat_template
from pdserve.model.errors import CheckpointError
from pdserve.model.tokenizer import load_tokenizer
from tests.helpers.checkpoints import CHATML_TEMPLATE, write_chat_tokenizer

VOCAB = 272
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "héllo wörld ✓"}],
    [{"role": "user", "content": "spelled <|im_end|> and <s> in content"}],
]
# Llama-2's shape: bos/eos from the special tokens, raise_exception on a bad role order
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def write_template(dir, template) -> None:
    write_chat_tokenizer(dir, VOCAB, template)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA2_TEMPLATE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_encodes_as_transformers(tmp_path, template, add_generation_prompt):
    write_template(tmp_path, template)
    ours, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS[:1] + (CONVERSATIONS[1:] if template == CHATML_TEMPLATE else []):
        text = ours.chat_template.render(messages, add_generation_prompt)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                     return_dict=False)
        assert ours.encode_chat(text) == list(ids)


def test_template_writes_control_ids_and_bos(tmp_path):
    write_template(tmp_path, LLAMA2_TEMPLATE)
    tok = load_tokenizer(tmp_path)
    ids = tok.encode_chat(tok.chat_template.render([{"role": "user", "content": "x"}]))
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode("<s>", add_bos=False) != [tok.bos_token_id]  # plain encode keeps spellings as text


def test_no_template_means_none(tmp_path):
    write_template(tmp_path, None)
    assert load_chat_template(tmp_path) is None and load_tokenizer(tmp_path).chat_template is None


def test_named_templates_and_jinja_file(tmp_path):
    write_template(tmp_path, None)
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "J1"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render([]) == "D"  # tokenizer_config.json wins over the file


@pytest.mark.parametrize("value, fragment", [
    ("{% for m in messages %}", "does not compile"),
    ([{"name": "tool_use", "template": "T"}], "no template named 'default'"),
    (7, "must be a string"),
])
def test_bad_template_is_a_checkpoint_error(tmp_path, value, fragment):
    write_template(tmp_path, value)
    with pytest.raises(CheckpointError, match=fragment) as exc_info:
        load_chat_template(tmp_path)
    assert "tokenizer_config.json" in str(exc_info.value)


@pytest.mark.parametrize("template, fragment", [
    ("{{ nobody_passed_this }}", "'nobody_passed_this' is undefined"),
    ("{% if nobody_passed_this %}x{% endif %}", "'nobody_passed_this' is undefined"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ messages.__class__ }}", "unsafe"),  # the sandbox refuses dunder attributes, loudly
    ("{{ ''.__class__.__mro__ }}", "chat template error"),
    ("{% set _ = messages.append(1) %}", "chat template error"),  # immutable: no mutation of inputs
])
def test_render_failures_are_chat_template_errors(tmp_path, template, fragment):
    write_template(tmp_path, template)
    template = load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match=fragment.replace("(", r"\(")):
        template.render([{"role": "user", "content": "x"}])


def test_missing_keys_stay_lenient_and_variables_pass(tmp_path):
    source = ("{% for m in messages %}{% if m.tool_calls %}T{% endif %}{{ m.content }}{% endfor %}"
              "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
              "{{ tools is none }}{{ eos_token }}{% generation %}G{% endgeneration %}{{ {'a': 'é'} | tojson }}")
    write_template(tmp_path, source)
    template = load_chat_template(tmp_path)
    messages = [{"role": "user", "content": "c"}]
    assert template.render(messages) == 'cTrue<|im_end|>G{"a": "é"}'
    assert template.render(messages, variables={"enable_thinking": False}).startswith("c/no_think")
    assert template.render(messages, variables={"messages": []}).startswith("c")  # messages are not overridable
