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
  environment that ``transformers`` builds (chat_template.py).
* ``encode_chat`` renders, then tokenizes without adding special tokens: the
  template writes them itself (``{{ bos_token }}`` in Llama 3, Mistral, Gemma 3),
  and ``apply_chat_template(tokenize=True)`` in transformers 5 always encodes the
  rendered text with ``add_special_tokens=False``.

A file of the folder that cannot be read or parsed is an ``EngineError`` naming
the file. Only the standard library, ``tokenizers`` and ``jinja2`` are imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors
from tokenizers.decoders import DecodeStream

from ..engine.manifest import engine_file
from ..errors import ConfigError, EngineError
from .chat_template import ChatTemplate

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
GENERATION_CONFIG = "generation_config.json"
_REPAIR = "re-export the engine (or restore the file from the model's tokenizer files)"


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
        template_origin: str = "tokenizer_config.json",
    ) -> None:
        self._tok = tokenizer
        # transformers pads/truncates only when a call asks to; tokenizer.json may say otherwise.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.folder = folder
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template, template_origin) if chat_template else None
        self.special_tokens: dict[str, str] = _special_tokens(tokenizer_config)
        self._clean_up_spaces = bool(tokenizer_config.get("clean_up_tokenization_spaces"))
        _sync_post_processor(tokenizer, tokenizer_config, self.special_tokens)
        #: generation_config.json as written by export (sampling defaults: runtime/defaults.py)
        self.generation_config: dict[str, Any] = dict(generation_config)
        self._generation_origin = str(folder / GENERATION_CONFIG) if folder else GENERATION_CONFIG
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(generation_config)
        self.pad_token_id: int | None = self._pad_id(generation_config)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, path: str | Path) -> EngineTokenizer:
        """Load the tokenizer files of the engine folder ``path``.

        Raises ``EngineError`` naming the file when ``tokenizer.json`` is missing or any of
        the files cannot be read or parsed.
        """
        folder = Path(path).expanduser()
        tokenizer_file = _inside(folder, "tokenizer.json")
        if not tokenizer_file.is_file():
            raise EngineError(
                f"engine folder {str(folder)!r} has no tokenizer.json: the engine folder is "
                "incomplete; re-export the engine"
            )
        config = _read_json(_inside(folder, "tokenizer_config.json"))
        special_map = _read_json(_inside(folder, "special_tokens_map.json"))
        for key, value in special_map.items():  # tokenizer_config wins, as in transformers
            config.setdefault(key, value)
        template, origin = _find_chat_template(folder, config)
        return cls(
            _load_tokenizer(tokenizer_file),
            config,
            _read_json(_inside(folder, GENERATION_CONFIG)),
            template,
            folder=folder,
            template_origin=origin,
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
        ids = self._token_ids("eos_token_id", value)
        return tuple(dict.fromkeys(ids))  # ordered, without duplicates

    def _pad_id(self, generation_config: Mapping[str, Any]) -> int | None:
        """The tokenizer's pad token id, else generation_config ``pad_token_id``."""
        pad = self.special_tokens.get("pad_token")
        pad_id = self.token_to_id(pad) if pad else None
        if pad_id is None:
            value = generation_config.get("pad_token_id")
            ids = [] if value is None else self._token_ids("pad_token_id", value)
            pad_id = ids[0] if ids else None
        return pad_id

    def _token_ids(self, key: str, value: Any) -> list[int]:
        """A generation_config token id field (an id or a list of ids) as ids of this vocabulary."""
        ids = value if isinstance(value, list) else [value]
        if not all(type(i) is int and 0 <= i < self.vocab_size for i in ids):
            raise EngineError(f"{self._generation_origin}: {key} must be a token id or a list of token ids "
                              f"in [0, {self.vocab_size}), got {value!r}: fix the file or re-export the "
                              "engine")
        return list(ids)

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
        return self._template is not None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ({"role", "content"} dicts) as the prompt string.

        Equals ``tokenizer.apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)``; ``kwargs`` reach the template like in transformers.
        """
        if self._template is None:
            raise ConfigError(
                f"the tokenizer of engine folder {str(self.folder)!r} has no chat template: "
                "encode the prompt as plain text (--no-chat)"
            )
        return self._template.render(messages, add_generation_prompt, {**self.special_tokens, **kwargs})

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of ``messages`` under the chat template.

        Equals ``tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
        add_generation_prompt=...)``: the rendered text is encoded without adding special
        tokens, because the template places them (a second BOS would be out of distribution).
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class StreamDecoder:
    """Turn generated token ids, pushed one at a time, into printable text pieces, in time linear in the
    output: ``tokenizers.decoders.DecodeStream`` decodes only the few ids since its last complete piece,
    and holds back an incomplete multi-byte character until later tokens complete it.  ``flush`` returns
    whatever is still held back.  The pieces concatenate to ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: EngineTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def push(self, token_id: int) -> str:
        """Add one token id; return the new printable text (possibly empty)."""
        self.ids.append(int(token_id))
        piece = self._stream.step(self._tokenizer._tok, int(token_id)) or ""
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        """Return the text still held back (e.g. a genuinely invalid byte sequence): one full decode."""
        text = self._tokenizer.decode(self.ids, skip_special_tokens=self._skip_special)
        piece = text[self._emitted:]
        self._emitted = len(text)
        return piece


# ---------------------------------------------------------------------- helpers
def _inside(folder: Path, name: str) -> Path:
    """``folder/name``, refused (EngineError) when it resolves outside the folder (a symlink out of it): the
    tokenizer files are not in the manifest's hashed list, so this is their only guard."""
    return engine_file(folder, name, name)


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; EngineError naming the file when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise EngineError(f"{str(path)!r} is not UTF-8 text (byte {error.start}): {_REPAIR}") from error
    except OSError as error:
        raise EngineError(f"{str(path)!r} cannot be read ({error.strerror}): {_REPAIR}") from error


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise EngineError(f"{str(path)!r} is not valid JSON (line {error.lineno} column {error.colno}: "
                          f"{error.msg}): {_REPAIR}") from error
    if not isinstance(data, dict):
        raise EngineError(f"{str(path)!r} does not hold a JSON object: {_REPAIR}")
    return data


def _load_tokenizer(path: Path) -> Tokenizer:
    """``tokenizer.json`` as a ``tokenizers.Tokenizer``; EngineError naming the file when it is corrupt."""
    text = _read_text(path)
    try:
        return Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception for any file it cannot parse
        reason = " ".join(str(error).split())
        raise EngineError(f"{str(path)!r} is not a tokenizer file the tokenizers library can load "
                          f"({reason}): {_REPAIR}") from error


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


def _find_chat_template(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, str]:
    """(template, the file it came from): chat_template.jinja, else tokenizer_config's, else
    chat_template.json's."""
    jinja_file = _inside(folder, "chat_template.jinja")
    if jinja_file.is_file():
        return _read_text(jinja_file), str(jinja_file)
    origin = _inside(folder, "tokenizer_config.json")
    template = config.get("chat_template")
    if template is None:
        origin = _inside(folder, "chat_template.json")
        template = _read_json(origin).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        if not all(isinstance(item, dict) for item in template):
            raise EngineError(f"{str(origin)!r}: chat_template must be a string or a list of "
                              f'{{"name", "template"}} objects: {_REPAIR}')
        template = {item.get("name"): item.get("template") for item in template}.get("default")
    if template is not None and not isinstance(template, str):
        raise EngineError(f"{str(origin)!r}: chat_template must be a string, got {type(template).__name__}: "
                          f"{_REPAIR}")
    return template or None, str(origin)


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation/contractions)."""
    for old, new in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(old, new)
    return text
