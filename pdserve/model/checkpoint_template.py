"""The checkpoint's own chat template: Jinja text from the tokenizer files, rendered in a sandbox.

Contract: `load_chat_template(model_dir)` returns the template a checkpoint ships
(`tokenizer_config.json`'s `chat_template`: a string, or the entry named "default" of a list of
named templates; else a `chat_template.jinja` file, where newer transformers save it), or None
when it ships none; a template that does not compile raises `CheckpointError` at load, naming the
file. `ChatTemplate.render` fills it the way transformers' `apply_chat_template` does (messages,
`add_generation_prompt`, `tools`/`documents` as None, the special-token strings such as
`bos_token`, the caller's extra variables) and raises `ChatTemplateError` for anything the
template cannot render: `raise_exception(...)`, an access the sandbox refuses, a type error, or a
name the template reads that nobody passed (a missing key of a passed value, `message.tool_calls`,
stays the lenient empty value templates rely on).

Templates come with a downloaded checkpoint, so they run in Jinja's immutable sandbox (no
attribute starting with an underscore, no mutation of passed values, bounded `range`), with
transformers' environment: trim_blocks, lstrip_blocks, loop controls, a `tojson` that does not
HTML-escape, `raise_exception`, `strftime_now` and a `{% generation %}` block that renders its body.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing

from pdserve.model.errors import CheckpointError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template could not render these messages (bad input for this template)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled-on-demand template plus the special-token strings it may read."""

    source: str
    origin: str  # the file it came from, for messages
    special_tokens: tuple[tuple[str, str], ...]  # (name, text), e.g. ("bos_token", "<s>")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               variables: dict[str, Any] | None = None) -> str:
        """messages ([{"role", "content", ...}]) -> the prompt text; `variables` are extra template
        variables (vLLM's chat_template_kwargs), overriding the special tokens but not the messages."""
        context = {**dict(self.special_tokens), "tools": None, "documents": None, **(variables or {}),
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return _compile(self.source).render(context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc.message or type(exc).__name__}") from exc
        except Exception as exc:  # the template's own operations on this input (TypeError, IndexError, ...)
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it ships none."""
    model_dir = Path(model_dir)
    config_file = model_dir / TOKENIZER_CONFIG_FILE
    config = read_json_object(config_file)
    source, origin = _template_source(config.get("chat_template"), config_file), config_file
    if source is None and (model_dir / TEMPLATE_FILE).is_file():
        source, origin = (model_dir / TEMPLATE_FILE).read_text(), model_dir / TEMPLATE_FILE
    if source is None:
        return None
    try:
        _compile(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(origin, f"chat template does not compile (line {exc.lineno}: {exc.message})") from exc
    specials = _special_tokens({**read_json_object(model_dir / "special_tokens_map.json"), **config})
    return ChatTemplate(source=source, origin=str(origin), special_tokens=specials)


def _template_source(value: Any, file: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or [{"name", "template"}, ...] -> "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise CheckpointError(file, f"chat_template lists no template named 'default' (names: {sorted(map(str, named))})")
    raise CheckpointError(file, f"chat_template must be a string or a list of named templates, got {type(value).__name__}")


def _special_tokens(config: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # older files store AddedToken objects
            value = value.get("content")
        if isinstance(value, str):
            out.append((key, value))
    return tuple(out)


def read_json_object(file: Path) -> dict[str, Any]:
    """A tokenizer file's JSON object; {} when the file is absent or holds no object."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(file, f"not valid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


# ---- the environment ----------------------------------------------------------------------
def _fail_for_unknown_name(lenient_method):
    """A lenient Undefined method that fails instead when the name itself was never passed or the
    sandbox refused the access (which would otherwise render as an empty string)."""

    def method(self, *args):
        unknown_name = self._undefined_obj is missing  # a top-level lookup failed, not a missing key
        if unknown_name or self._undefined_exception is not jinja2.UndefinedError:
            self._fail_with_undefined_error()
        return lenient_method(self, *args)

    return method


class _UnknownNamesFail(jinja2.Undefined):
    """Undefined that is strict for unknown top-level names and refused attributes, lenient for missing keys."""

    __slots__ = ()
    __str__ = _fail_for_unknown_name(jinja2.Undefined.__str__)
    __iter__ = _fail_for_unknown_name(jinja2.Undefined.__iter__)
    __bool__ = _fail_for_unknown_name(jinja2.Undefined.__bool__)
    __len__ = _fail_for_unknown_name(jinja2.Undefined.__len__)
    __eq__ = _fail_for_unknown_name(jinja2.Undefined.__eq__)
    __ne__ = _fail_for_unknown_name(jinja2.Undefined.__ne__)
    __hash__ = jinja2.Undefined.__hash__


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text); renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=_UnknownNamesFail,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
