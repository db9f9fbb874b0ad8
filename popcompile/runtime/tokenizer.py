"""Tokenizer and chat template of an exported engine, without torch or transformers.

An engine folder holds what ``tokenizer.save_pretrained(folder)`` and
``generation_config.save_pretrained(folder)`` write: ``tokenizer.json``,
``tokenizer_config.json``, optionally ``chat_template.jinja`` and
``special_tokens_map.json``, and ``generation_config.json``.  ``EngineTokenizer``
reproduces what ``transformers`` does with those files:

* ``encode`` runs the ``tokenizers`` pipeline with special tokens on, like
  ``AutoTokenizer(...)(text).input_ids`` (Gemma prepends ``<bos>``, SmolLM2 does not,
  because that is what each ``tokenizer.json`` post-processor says).
* ``apply_chat_template`` renders the Jinja template in the same sandboxed
  environment that ``transformers`` builds (trim_blocks, lstrip_blocks, loop
  controls, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``).

Only the standard library, ``tokenizers`` and ``jinja2`` are imported here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, processors

__all__ = ["EngineTokenizer", "StreamDecoder"]

#: The keys of ``special_tokens_map`` that transformers passes to chat templates.
SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"


class EngineTokenizer:
    """Encode, decode and chat-format text for one engine folder.

    Build it with ``EngineTokenizer.from_folder(path)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any],
        chat_template: str | None,
        *,
        folder: Path | None = None,
    ) -> None:
        self._tok = tokenizer
        # transformers pads/truncates only when a call asks to; tokenizer.json may say otherwise.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.folder = folder
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = _special_tokens(tokenizer_config)
        self._clean_up_spaces = bool(tokenizer_config.get("clean_up_tokenization_spaces"))
        self._compiled_template: jinja2.Template | None = None
        _sync_post_processor(tokenizer, tokenizer_config, self.special_tokens)
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(generation_config)
        self.pad_token_id: int | None = self._pad_id(generation_config)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, path: str | Path) -> EngineTokenizer:
        """Load the tokenizer files of the engine folder ``path``.

        Raises ``ValueError`` when ``tokenizer.json`` is missing (the folder is incomplete).
        """
        folder = Path(path).expanduser()
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"engine folder {str(folder)!r} has no tokenizer.json: the engine folder is "
                "incomplete; re-export the engine"
            )
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        for key, value in special_map.items():  # tokenizer_config wins, as in transformers
            config.setdefault(key, value)
        return cls(
            Tokenizer.from_file(str(tokenizer_file)),
            config,
            _read_json(folder / "generation_config.json"),
            _find_chat_template(folder, config),
            folder=folder,
        )

    # ------------------------------------------------------------ special tokens
    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token string, or None."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token string (tokenizer_config), or None."""
        return self.special_tokens.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of the token string ``token``, or None if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def _eos_ids(self, generation_config: Mapping[str, Any]) -> tuple[int, ...]:
        """generation_config ``eos_token_id`` (int or list), else the tokenizer's eos token."""
        value = generation_config.get("eos_token_id")
        if value is None:
            eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
            return () if eos_id is None else (eos_id,)
        ids = [value] if isinstance(value, int) else list(value)
        return tuple(dict.fromkeys(int(i) for i in ids))  # ordered, without duplicates

    def _pad_id(self, generation_config: Mapping[str, Any]) -> int | None:
        """The tokenizer's pad token id, else generation_config ``pad_token_id``."""
        pad = self.special_tokens.get("pad_token")
        pad_id = self.token_to_id(pad) if pad else None
        if pad_id is None:
            value = generation_config.get("pad_token_id")
            pad_id = value[0] if isinstance(value, list) and value else value
        return None if pad_id is None else int(pad_id)

    # ---------------------------------------------------------- encode / decode
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; equal to ``AutoTokenizer(...)(text).input_ids``."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of the token ids ``ids`` (a list or a 1-D array)."""
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        # transformers skips this clean-up for BPE models because it would corrupt them.
        if self._clean_up_spaces and type(self._tok.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh ``StreamDecoder`` over this tokenizer."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------- chat template
    @property
    def has_chat_template(self) -> bool:
        """Whether the engine folder carries a chat template."""
        return bool(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ({"role", "content"} dicts) as the prompt string.

        Equals ``tokenizer.apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)``; ``kwargs`` reach the template like in transformers.
        """
        if not self.has_chat_template:
            raise ValueError(
                f"the tokenizer of engine folder {str(self.folder)!r} has no chat template; "
                "encode a plain prompt instead"
            )
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        chat = _alias_reasoning_fields(_normalize_messages(messages))
        context = {**self.special_tokens, **_plain(kwargs)}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        return self._compiled_template.render(
            messages=chat, add_generation_prompt=add_generation_prompt, **context
        )


class StreamDecoder:
    """Turn generated token ids, pushed one at a time, into printable text pieces.

    Each ``push`` decodes the whole generated list and returns the text added since
    the last call, holding back a trailing U+FFFD (an incomplete multi-byte
    character) until later tokens complete it.  ``flush`` returns whatever is still
    held back.  The pieces concatenate to ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: EngineTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned

    @property
    def text(self) -> str:
        """The full text of every pushed token, held-back characters included."""
        return self._tokenizer.decode(self.ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token id; return the new printable text (possibly empty)."""
        self.ids.append(int(token_id))
        text = self.text
        end = len(text.rstrip(_REPLACEMENT_CHAR))
        if end <= self._emitted:
            return ""
        piece = text[self._emitted : end]
        self._emitted = end
        return piece

    def flush(self) -> str:
        """Return the text still held back (e.g. a genuinely invalid byte sequence)."""
        text = self.text
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece


# ---------------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special token strings of tokenizer_config, keyed like ``special_tokens_map``."""
    tokens = {key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: value for key, value in tokens.items() if value is not None}


def _sync_post_processor(
    tokenizer: Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]
) -> None:
    """Rebuild the post-processor like transformers does when the config asks for it.

    transformers replaces ``tokenizer.json``'s post-processor only when
    tokenizer_config sets ``add_bos_token``/``add_eos_token`` or there is none.
    """
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if not explicit and tokenizer.post_processor is not None:
        return
    parts: dict[str, tuple[str, int]] = {}
    for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = special.get(key)
        token_id = tokenizer.token_to_id(token) if token else None
        if config.get(flag, False) and token_id is not None:
            parts[key] = (token, token_id)
    bos = f"{parts['bos_token'][0]}:0 " if "bos_token" in parts else ""
    eos = f" {parts['eos_token'][0]}:0" if "eos_token" in parts else ""
    bos1 = f" {parts['bos_token'][0]}:1" if "bos_token" in parts else ""
    eos1 = f" {parts['eos_token'][0]}:1" if "eos_token" in parts else ""
    single = f"{bos}$A:0{eos}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single}{bos1} $B:1{eos1}", special_tokens=list(parts.values())
    )


def _find_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config's (or chat_template.json's) template."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation/contractions)."""
    for old, new in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(old, new)
    return text


# ------------------------------------------------------------ template rendering
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
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """JSON without jinja's HTML escaping, like transformers' ``tojson`` filter."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


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
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        chat.append({key: _plain(value) for key, value in message.items() if value is not None})
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
