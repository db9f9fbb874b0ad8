"""The generation loop shared by every runtime backend (numpy only).

A backend runs one graph ("prefill" or "decode") on one step (``Backend.run``); the loop owns padding,
positions, the KV buffer's bookkeeping, sampling, stopping and timing. A backend that takes plain
arrays, ``run(graph, feeds) -> outputs`` with the past rows among the feeds, is wrapped in
``HostBackend``; one that binds memory itself (onnxruntime's IO binding, TensorRT's in-place KV
update) implements ``Backend.run`` and decides how the past reaches its graph::

    pop, folded:    prefill graph on x_1..x_N (x_N's logits out)              ->  decode graph per token
    pop, separate:  prefill graph on x_1..x_{N-1}  ->  decode graph on x_N    ->  decode graph per token
    full:           decode graph on x_1..x_N                                  ->  decode graph per token

Prompts of different lengths are left-padded, so x_N of every row sits in the last column. What the graphs
take beside input_ids and attention_mask comes from a ``Feeds``: ``TextFeeds`` (position_ids [B, T]) or, for
a vision-language engine, multimodal.VisionFeeds (M-RoPE positions and image features).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, InputError
from ..threshold import ALWAYS_POP, is_token_count, uses_pop
from .kvstore import KVStore
from .sampling import Sampler, SamplingConfig, StopChecker, StopStrings
from .tokenizer import EngineTokenizer, StreamDecoder

RunGraph = Callable[[str, dict[str, np.ndarray]], list[np.ndarray]]
StepOutputs = tuple[np.ndarray | None, list[np.ndarray]]
MODES = ("pop", "full")


@runtime_checkable
class Backend(Protocol):
    def run(self, graph: str, feeds: dict[str, np.ndarray], buffer: KVStore) -> StepOutputs:
        """Run ``graph`` on ``feeds`` (input_ids and position_ids [B, T], attention_mask [B, past+T]) with
        rows 0..buffer.length-1 of the first B sequences as the past.

        Returns (logits [B, V] of the last position for a graph that has them, else None; the new rows,
        2L arrays [B, H_kv, T, D] in the order k0, v0, k1, ...). The loop passes the rows to
        ``buffer.write`` before the next call, so they may be views into ``buffer.present(B, T)``; the
        backend never writes the cache itself."""


class Feeds(Protocol):
    def prompt(self, columns: slice, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The inputs beside input_ids and attention_mask for the prompt's ``columns`` (of the left-padded
        prompt the generation prefills); ``positions`` [B, T]: their text positions (cache rows)."""

    def step(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The same for tokens after the prompt at text positions ``positions`` [B, T]."""


class TextFeeds:
    """A text engine's: position_ids [B, T], the tokens' cache rows."""

    def prompt(self, columns: slice, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"position_ids": positions}

    def step(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"position_ids": positions}


@dataclass(frozen=True)
class HostBackend:
    """A backend that takes plain arrays: the past rows come from ``buffer.past()`` as feeds."""

    run_graph: RunGraph
    logits_graphs: frozenset[str] = frozenset({"decode"})  # graphs whose first output is logits
    # graphs whose presents are past + new rows (manifest attention.shared_kv)
    shared_kv: frozenset[str] = frozenset()

    def run(self, graph: str, feeds: dict[str, np.ndarray], buffer: KVStore) -> StepOutputs:
        past = buffer.past(feeds["input_ids"].shape[0])
        outputs = self.run_graph(graph, {**feeds, **dict(zip(buffer.layout.past_names, past))})
        logits, present = (outputs[0], outputs[1:]) if graph in self.logits_graphs else (None, outputs)
        if graph in self.shared_kv:  # given exactly the past rows, it returns past + new: keep the new
            present = [rows[:, :, buffer.length:] for rows in present]
        return logits, list(present)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str          # "eos" | "stop" | "length"
    mode: str                   # what was asked: "pop" | "full"
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill: str = "pop"        # what ran: "pop", or "full" (mode="full", prompts below min_prompt_tokens)
    cached_tokens: int = 0      # prompt tokens whose rows an earlier chat turn left cached (not prefilled)
    image_s: float = 0.0        # of ttft_s: the images' preprocessing and vision graph (a VLM engine)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def encode_prompt(tokenizer: EngineTokenizer, prompt: str, chat: bool | None = None) -> list[int]:
    """Prompt text -> token ids; ``chat=None`` applies the chat template when the tokenizer has one.

    Chat: the prompt as the user's message, rendered and encoded without added special tokens
    (``EngineTokenizer.encode_chat``, as transformers' ``apply_chat_template(tokenize=True)``).
    Plain text: encoded with the tokenizer's special tokens (Gemma's <bos>), as ``tokenizer(text)``."""
    if not isinstance(prompt, str) or not prompt:
        raise InputError(f"the prompt must be non-empty text, got {prompt!r}: give some text")
    use_chat = tokenizer.has_chat_template if chat is None else chat
    if use_chat and not tokenizer.has_chat_template:
        raise ConfigError("this model's tokenizer has no chat template: run without --chat")
    if use_chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def prompt_ids(tokenizer: EngineTokenizer, prompts: str | list[str] | list[list[int]], chat: bool | None,
               max_seq: int, vocab: int) -> list[list[int]]:
    """One prompt or a batch (text, or token id lists used as they are) -> checked token id lists.

    InputError for anything else: a batch that is not a non-empty list, ids that are not integers in
    0..vocab-1 (a negative id would wrap, a float truncate, a large one fail inside the runtime)."""
    if chat is not None and not isinstance(chat, bool):
        raise ConfigError(f"chat={chat!r} must be True, False or None "
                          "(None: the chat template when there is one)")
    batch = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(batch, (list, tuple)) or not batch:
        raise InputError(f"prompts must be a string, or a non-empty list of strings or of token id lists; "
                         f"got {_describe(prompts)}")
    if all(_is_token(p) for p in batch):
        raise InputError("prompts is a list of token ids: a batch holds prompts, so pass one prompt's ids as "
                         "[[id, id, ...]]")
    ids = [encode_prompt(tokenizer, p, chat) if isinstance(p, str) else token_ids(p, row, vocab)
           for row, p in enumerate(batch)]
    for prompt in ids:
        if not prompt:
            raise InputError("a prompt has no tokens: give some text")
        if len(prompt) >= max_seq:
            raise InputError(f"prompt of {len(prompt)} tokens does not fit the engine's max length "
                             f"{max_seq}: shorten it or re-export with a larger --max-seq")
    return ids


def token_ids(prompt: object, row: int, vocab: int) -> list[int]:
    """Prompt ``row`` given as token ids (a list, tuple or 1-D integer array) -> ints in 0..vocab-1."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InputError(f"prompt {row} is {_describe(prompt)}: give text or a list of token ids")
    for index, token in enumerate(prompt):
        if not _is_token(token) or not 0 <= token < vocab:
            raise InputError(f"prompt {row}, token {index} is {_describe(token)}: token ids are integers in "
                             f"0..{vocab - 1} (this engine's vocabulary)")
    return [int(token) for token in prompt]


def _is_token(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def threshold(value: int | None, default: int) -> int:
    """The ``min_prompt_tokens`` to use: ``value`` when given (checked), else the engine's ``default``."""
    if value is None:
        return default
    if not is_token_count(value):
        raise ConfigError(f"min_prompt_tokens={value!r} must be an integer >= 0 (0: always POP)")
    return int(value)


def prefill_path(mode: str, prompts: list[list[int]], min_prompt_tokens: int) -> str:
    """"pop" or "full": a batch prefills with POP only when its shortest prompt has ``min_prompt_tokens``
    or more (one graph call serves the whole batch, so one short prompt makes the batch full)."""
    return "pop" if mode == "pop" and uses_pop(min(map(len, prompts)), min_prompt_tokens) else "full"


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> ids [B, N] and mask [B, N] (int64), padded on the left."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


class Generation:
    """One batch of prompts through the two graphs; ``run()`` returns one result per prompt."""

    def __init__(self, backend: Backend | RunGraph, buffer: KVStore, tokenizer: EngineTokenizer,
                 sampling: SamplingConfig, mode: str, on_text: Callable[[str], None] | None = None,
                 folded: bool = False, min_prompt_tokens: int = ALWAYS_POP, feeds: Feeds | None = None,
                 image_s: float = 0.0):
        if not isinstance(mode, str) or mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if on_text is not None and not callable(on_text):
            raise ConfigError("on_text must be a function of one string (or None), "
                              f"got {type(on_text).__name__}")
        self.folded = folded  # the prefill graph takes x_1..x_N and returns x_N's logits (manifest boundary)
        self.backend = backend if isinstance(backend, Backend) else HostBackend(
            backend, frozenset({"decode", "prefill"}) if folded else frozenset({"decode"}))
        self.buffer, self.tokenizer = buffer, tokenizer
        self.sampling, self.mode, self.on_text = sampling, mode, on_text
        self.sampler = Sampler(sampling)
        self.min_prompt_tokens = min_prompt_tokens  # shorter prompts prefill in full: POP would gain ~nothing
        self.path = mode
        self.feeds = feeds or TextFeeds()  # position_ids (and a VLM's image inputs) of each call
        self.image_s = image_s  # the images' encoding before this generation: part of its TTFT
        self.results: list[GenerationResult] = []

    def step(self, graph: str, ids: np.ndarray, inputs: dict[str, np.ndarray],
             mask: np.ndarray) -> np.ndarray | None:
        """Run one graph on ids [B, T] with ``inputs`` (``Feeds``'); store the new K/V rows; return logits
        [B, V] (decode only)."""
        feeds = {"input_ids": ids, **inputs, "attention_mask": self.buffer.attention_mask(ids.shape[0], mask)}
        logits, present = self.backend.run(graph, feeds, self.buffer)
        self.buffer.write(present, mask)
        return logits

    def prefill(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids [B, N] (left-padded, mask [B, N]) after the cached rows, on the schedule the module docstring
        gives for this generation's mode; the logits [B, V] predicting token N+1. Public: eval scores them."""
        # after the cached rows
        positions = self.buffer.length + np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        if self.path == "pop" and self.folded and ids.shape[1] > 1:
            # x_N's logits come out of the same call
            return self.step("prefill", ids, self.feeds.prompt(slice(None), positions), mask)
        split = ids.shape[1] - 1 if self.path == "pop" else 0
        if split > 0:
            head = slice(0, split)
            self.step("prefill", ids[:, head], self.feeds.prompt(head, positions[:, head]), mask[:, head])
        tail = slice(split, None)
        return self.step("decode", ids[:, tail], self.feeds.prompt(tail, positions[:, tail]), mask[:, tail])

    def run(self, prompts: list[list[int]], resume: bool = False) -> list[GenerationResult]:
        """Generate for every prompt; ``on_text`` gets each new piece of text as it decodes (``resume``:
        as in ``stream``)."""
        for piece in self.stream(prompts, resume):
            if self.on_text is not None:
                self.on_text(piece)
        return self.results

    def stream(self, prompts: list[list[int]], resume: bool = False) -> Iterator[TextPiece]:
        """``run``'s work as a generator of the new text of each row (``TextPiece``) while it decodes;
        ``results`` holds the GenerationResults once it is exhausted. The pieces of a row concatenate to
        its result's text. Time the caller spends between pieces counts as decode time. ``resume``: the
        prompts continue the rows the buffer holds (one sequence: a chat's next turn) instead of an empty
        cache."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = left_pad(prompts, pad)
        assert not resume or len(prompts) == 1, "a resumed sequence is one row"
        self.path = prefill_path(self.mode, prompts, self.min_prompt_tokens)
        if not resume:
            self.buffer.reset()
        past = self.buffer.length
        start = time.perf_counter()
        first = self.sampler(self.prefill(ids, mask))
        prefill_s = time.perf_counter() - start
        ttft = prefill_s + self.image_s
        generated = [[] for _ in prompts]
        streams = [_RowText(self.tokenizer, self.sampling.stop) for _ in prompts]
        steps = yield from self._decode(first, past + mask.sum(axis=1), generated, streams)
        decode_s = time.perf_counter() - start - prefill_s
        texts = [self.stop.trim(self.tokenizer.decode(tokens)) for tokens in generated]
        for row, (text, stream) in enumerate(zip(texts, streams)):
            if len(text) > stream.shown:  # held back to the end: a tail that might have begun a stop string
                yield TextPiece(text[stream.shown:], row)
        reasons = [r or "length" for r in self.stop.finish_reasons]
        self.results = [GenerationResult(
            text=text, prompt_token_ids=list(prompt), token_ids=tokens, finish_reason=reason, mode=self.mode,
            ttft_s=ttft, prefill_tokens_per_s=sum(map(len, prompts)) / prefill_s,
            decode_tokens_per_s=steps * len(prompts) / decode_s if steps else 0.0, prefill=self.path,
            image_s=self.image_s,
        ) for prompt, tokens, text, reason in zip(prompts, generated, texts, reasons)]

    def _decode(self, tokens: np.ndarray, lengths: np.ndarray, generated: list[list[int]],
                streams: list[_RowText]) -> Iterator[TextPiece]:
        """From the first sampled tokens [B], run decode steps until every row stopped, appending each row's
        ids (up to and including its eos) to ``generated`` and yielding its new text; returns the number of
        decode steps run."""
        batch = tokens.shape[0]
        self.stop = StopChecker(self.tokenizer.eos_token_ids, self.sampling.stop, batch)
        positions, steps = lengths.astype(np.int64), 0
        while True:
            for row in range(batch):
                if not self.stop.finished[row]:
                    token = int(tokens[row])
                    generated[row].append(token)
                    piece = streams[row].push(token)
                    self.stop.update(row, token, streams[row].stopped)
                    if piece:
                        yield TextPiece(piece, row)
            full = self.buffer.length >= self.buffer.layout.max_seq
            if self.stop.all_finished or steps + 1 >= self.sampling.max_new_tokens or full:
                return steps
            logits = self.step("decode", tokens[:, None].astype(np.int64),
                               self.feeds.step(positions[:, None]), np.ones((batch, 1), np.int64))
            positions, steps = positions + 1, steps + 1
            tokens = self.sampler(logits)


class TextPiece(str):
    """New text of one prompt of a batch, as it decodes: a ``str``, with ``row``, the prompt's index in the
    batch (``on_text=lambda piece: print(piece, end="")`` works as for plain text)."""

    row: int

    def __new__(cls, text: str, row: int) -> TextPiece:
        piece = super().__new__(cls, text)
        piece.row = row
        return piece


class _RowText:
    """One row's streamed text: token ids -> text pieces (linear: DecodeStream) -> what may be shown
    (StopStrings). ``shown``: characters handed out so far."""

    def __init__(self, tokenizer: EngineTokenizer, stop: tuple[str, ...]):
        self.decoder, self.stops, self.shown = StreamDecoder(tokenizer), StopStrings(stop), 0

    @property
    def stopped(self) -> bool:
        return self.stops.hit

    def push(self, token: int) -> str:
        piece = self.stops.feed(self.decoder.push(token))
        self.shown += len(piece)
        return piece
