"""A model's Jinja chat template, rendered in the sandbox transformers builds (jinja2 only).

``ChatTemplate(source, origin).render(messages, add_generation_prompt, context)`` equals
``tokenizer.apply_chat_template(messages, tokenize=False, ...)``: the same
``ImmutableSandboxedEnvironment`` (trim_blocks, lstrip_blocks, loop controls), the same globals
(``raise_exception``, ``strftime_now``, ``dict``, an underscore-refusing ``namespace``) and a
non-escaping ``tojson``. A template that cannot compile or that breaks the sandbox is the engine
folder's fault: ``EngineError`` naming ``origin`` (the file it came from). A template that
refuses the conversation (``raise_exception``) is the caller's: ``InputError`` with its message.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import EngineError, InputError

__all__ = ["ChatTemplate"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_FIX = "fix or remove the template, or encode the prompt without it (--no-chat)"


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """What the template's own ``raise_exception(message)`` raises."""


# render-time exception -> (error class, message); first isinstance match wins
_RENDER_ERRORS: tuple[tuple[type[BaseException], type[Exception], str], ...] = (
    (_TemplateRaised, InputError, "the chat template in {origin} refused the conversation: {error}"),
    (jinja2.exceptions.SecurityError, EngineError,
     "the chat template in {origin} tried an operation the sandbox forbids ({error}): " + _FIX),
    (Exception, EngineError,
     "the chat template in {origin} failed while rendering ({kind}: {error}): " + _FIX),
)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class ChatTemplate:
    """One compiled chat template; ``origin`` names where it came from in error messages."""

    def __init__(self, source: str, origin: str) -> None:
        if not isinstance(source, str) or not source:
            raise EngineError(f"the chat template in {origin} is not a non-empty string: " + _FIX)
        self.source, self.origin = source, origin
        self._compiled: jinja2.Template | None = None

    def _template(self) -> jinja2.Template:
        """Compiled on first use (a folder with a broken template still encodes plain prompts)."""
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except jinja2.exceptions.TemplateSyntaxError as error:
                raise EngineError(f"the chat template in {self.origin} is not valid Jinja "
                                  f"(line {error.lineno}: {_one_line(error.message)}): {_FIX}") from error
            except jinja2.exceptions.TemplateError as error:
                raise EngineError(f"the chat template in {self.origin} does not compile "
                                  f"({_one_line(error)}): {_FIX}") from error
        return self._compiled

    def render(self, messages: Iterable[Any], add_generation_prompt: bool, context: Mapping[str, Any]) -> str:
        """The prompt text of ``messages`` ({"role", "content"} mappings); ``context`` holds the special
        tokens and the caller's template variables (they win over the special tokens)."""
        template = self._template()
        chat = _alias_reasoning_fields(_normalize_messages(messages))
        variables = {"tools": None, "documents": None, **_plain(dict(context))}
        try:
            return template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except Exception as error:  # the template's code raised: map it to whose fault it is
            error_class, message = next((c, m) for kind, c, m in _RENDER_ERRORS if isinstance(error, kind))
            raise error_class(message.format(origin=self.origin, error=_one_line(error),
                                             kind=type(error).__name__)) from error


# ------------------------------------------------------------------ environment
class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict`` for templates: constructs dicts without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja ``namespace`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """JSON without jinja's HTML escaping, like transformers' ``tojson`` filter."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment transformers compiles chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# ------------------------------------------------------------------- messages
def _plain(value: Any) -> Any:
    """A copy of ``value`` made only of JSON types (what the template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__} object>"


def _normalize_messages(messages: Iterable[Any]) -> list[dict]:
    """Plain-data copies of the messages, without the keys whose value is None."""
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise InputError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
        chat.append({key: _plain(value) for key, value in message.items() if value is not None})
    if not chat:
        raise InputError("cannot apply the chat template to an empty conversation: give at least one message")
    return chat


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    """Copy a message's reasoning under every name templates read, as transformers does."""
    aliased = []
    for message in chat:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased
