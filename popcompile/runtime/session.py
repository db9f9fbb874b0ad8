"""The session core every runtime shares: encode, prefill, step, generate.

    session.generate(prompts, sampling)     text or token ids in, GenerationResults out (loop.Generation);
                                            a vision-language engine also takes ``images`` (multimodal.py)
    session.stream(prompts, sampling)       the same, as an iterator of text pieces while it decodes
    session.chat(messages, sampling)        one turn of a conversation; earlier turns' rows stay cached
    session.prefill(ids [B, N], mode)       from an empty cache: logits [B, V] predicting token N+1
    session.step(ids [B, T])                decode graph after the cached rows: logits [B, V] of the last

(gpt-fast's prefill / decode_one_token / decode_n_tokens.) ``prefill`` follows generate's schedule
for ``mode`` (pop: the prefill graph, folded or separate boundary; full: the decode graph) but always
prunes in pop: it is the primitive under ``min_prompt_tokens``, which only ``generate`` applies.

A runtime subclasses ``Session``. Its ``__init__`` runs the one setup, in two steps around loading its
own graphs (so a bad option or manifest fails before any graph is read, and the tokenizer is read last):

    self._read_manifest(folder, min_prompt_tokens)   folder, manifest, layout, min_prompt_tokens
    ... the runtime's graphs ...
    self._read_tokenizer(vocab)                      tokenizer, vocab (the graphs' rows, else the tokenizer's)

and it implements ``_graphs(batch) -> (backend, store)``: what ``loop.Generation`` runs graphs with (a
``loop.Backend`` or a graph runner) and the ``KVStore`` (kvstore.py) for ``batch`` rows (InputError when
the runtime cannot take them).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..engine.kv import KVLayout
from ..engine.manifest import EngineManifest
from ..errors import InputError
from ..threshold import ALWAYS_POP
from .chat import History, chat_prompt_ids
from .defaults import engine_sampling
from .kvstore import KVStore
from .loop import Feeds, Generation, GenerationResult, TextPiece, encode_prompt, prompt_ids, threshold
from .multimodal import Images, chat_text, encoded_rows, per_prompt_images, with_placeholders
from .sampling import SamplingConfig
from .tokenizer import EngineTokenizer


class Session:
    """Shared by OrtSession (onnxruntime) and TrtSession (TensorRT); see the module docstring."""

    folder: Path
    manifest: EngineManifest
    layout: KVLayout                  # the manifest's kv_layout
    min_prompt_tokens: int            # prompts shorter than this prefill in full (0: always POP)
    tokenizer: EngineTokenizer
    vocab: int                        # token ids a prompt may hold: 0..vocab-1
    _live: Generation | None = None   # the prefill/step sequence in progress
    _history: History | None = None   # what the buffer holds of a chat (chat.py)
    images: Images | None = None      # a vision-language engine's image path (multimodal.py); None: text

    def _read_manifest(self, folder: str | Path, min_prompt_tokens: int | None = None,
                       manifest: EngineManifest | None = None) -> None:
        """Setup, step 1: read and check the folder's manifest, or take ``manifest``, the record of a folder
        being written (the export driver measures its threshold before writing it once);
        ``min_prompt_tokens`` is the caller's override (checked: an integer >= 0) or, None, the
        manifest's."""
        self.manifest = EngineManifest.read(folder) if manifest is None else manifest
        self.folder = Path(folder)
        self.layout = self.manifest.kv_layout
        self.min_prompt_tokens = threshold(min_prompt_tokens, self.manifest.min_prompt_tokens)

    def _read_tokenizer(self, vocab: int | None) -> None:
        """Setup, step 2: the folder's tokenizer files; ``vocab``, the graphs' embedding rows when they
        declare them, else the tokenizer's size."""
        self.tokenizer = EngineTokenizer.from_folder(self.folder)
        self.vocab = vocab or self.tokenizer.vocab_size

    def _graphs(self, batch: int) -> tuple[Any, KVStore]:
        raise NotImplementedError

    def _generation(self, batch: int, sampling: SamplingConfig, mode: str,
                    on_text: Callable[[str], None] | None = None,
                    min_prompt_tokens: int = ALWAYS_POP, feeds: Feeds | None = None) -> Generation:
        backend, buffer = self._graphs(batch)
        if feeds is None and self.images is not None:  # token ids alone (prefill, step): text on a VLM
            feeds = self.images.text_feeds()
        return Generation(backend, buffer, self.tokenizer, sampling, mode, on_text,
                          folded=self.manifest.boundary == "folded", min_prompt_tokens=min_prompt_tokens,
                          feeds=feeds)

    def encode(self, prompt: str, chat: bool | None = None, images: int = 0) -> list[int]:
        """Prompt text -> token ids; ``chat=None`` applies the chat template when the tokenizer has one.
        ``images`` (a vision-language engine): the prompt's image count, one image token each where the text
        has none (``generate(ids, images=...)`` expands them)."""
        if images and self.images is None:
            raise InputError(f"{self.folder} is a text engine (no vision graph): it takes no images; export "
                             "a vision-language model (Qwen3-VL) to prompt with images")
        marked = with_placeholders(self.images, prompt, images) if images else prompt
        return encode_prompt(self.tokenizer, marked, chat)

    def generate(
        self, prompts: str | list[str] | list[list[int]], sampling: SamplingConfig | None = None, *,
        mode: str = "pop", chat: bool | None = None, on_text: Callable[[str], None] | None = None,
        min_prompt_tokens: int | None = None, images: list | None = None,
    ) -> list[GenerationResult]:
        """Generate for one prompt or a batch (text, or token id lists used as they are).

        ``mode="pop"`` prefills with POP when the batch's shortest prompt has at least
        ``min_prompt_tokens`` tokens (default: the session's, from the manifest), else in full; each
        result's ``prefill`` says which. ``sampling``: a SamplingConfig is used as given; None or a dict of
        its fields decodes as the engine's generation_config.json says, under the dict's values
        (runtime/defaults.py). ``on_text(piece)`` gets each prompt's new text as it decodes (``piece.row``:
        which prompt; see ``stream``). ``images`` (a vision-language engine): the prompt's images, file paths
        or PIL images (a batch: one list per prompt), each where the prompt writes the image token, or all
        before the text (multimodal.py)."""
        generation, ids = self._prepared(prompts, sampling, mode, chat, on_text, min_prompt_tokens, images)
        return generation.run(ids)

    def stream(
        self, prompts: str | list[str] | list[list[int]], sampling: SamplingConfig | None = None, *,
        mode: str = "pop", chat: bool | None = None, min_prompt_tokens: int | None = None,
        images: list | None = None,
    ) -> Iterator[TextPiece]:
        """``generate`` as an iterator of text pieces while it decodes::

            for piece in session.stream("Tell me about compilers"):
                print(piece, end="", flush=True)

        Each piece is a ``str`` with ``.row``, the index of its prompt in the batch; a row's pieces
        concatenate to the text ``generate`` returns. Nothing runs until the first piece is asked for."""
        generation, ids = self._prepared(prompts, sampling, mode, chat, None, min_prompt_tokens, images)
        return generation.stream(ids)

    def chat(self, messages: list[dict], sampling: SamplingConfig | None = None, *, mode: str = "pop",
             on_text: Callable[[str], None] | None = None,
             min_prompt_tokens: int | None = None) -> GenerationResult:
        """One turn of a conversation: ``messages`` (the whole conversation so far, ending with the user's
        turn) through the chat template; returns the reply. The cache keeps the rows of earlier turns
        that the new prompt starts with, and only the rest is prefilled (POP, its last token through the
        full model; below ``min_prompt_tokens`` new tokens, in full)::

            messages = [{"role": "user", "content": "Name a prime."}]
            reply = session.chat(messages)
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": "Another?"}]
            reply = session.chat(messages)      # prefills the new tokens only

        A vision-language engine takes images in a message's content as parts: ``[{"type": "image",
        "image": path or PIL image}, {"type": "text", "text": ...}]``; an image's rows stay cached while
        the conversation holds the same image there.

        ``generate``, ``stream`` and ``prefill`` start from an empty cache and end the conversation's
        reuse."""
        messages, images = chat_text(self.images, messages)
        ids = chat_prompt_ids(self.tokenizer, messages, self.layout.max_seq)
        self._live = None
        generation = self._generation(1, self._sampling(sampling), mode, on_text,
                                      threshold(min_prompt_tokens, self.min_prompt_tokens))
        prepared, limit, started = [], None, time.perf_counter()
        if self.images is not None:
            prepared = [self.images.prepare(image) for image in images]
            ids = self._fits(self.images.expand(ids, [p.grid for p in prepared]))
            limit = self._image_limit(ids, prepared)
        kept = self._history.keep_for(ids, generation.buffer, limit) if self._history is not None else 0
        if self.images is not None:
            generation.feeds = self.images.feeds([self.images.row(ids, kept, prepared)], len(ids) - kept)
            generation.image_s = time.perf_counter() - started
        result = generation.run([ids[kept:]], resume=kept > 0)[0]
        cached = ids[:kept] + result.prompt_token_ids + result.token_ids[:-1]
        self._history = History(generation.buffer, cached, [p.key for p in prepared])
        assert len(self._history.ids) == generation.buffer.length  # the last reply token never ran
        return dataclasses.replace(result, prompt_token_ids=ids, cached_tokens=kept)

    def _prepared(self, prompts, sampling, mode, chat, on_text, min_prompt_tokens,
                  images=None) -> tuple[Generation, list]:
        """The checked prompt ids and the Generation that runs them (generate, stream)."""
        sampling = self._sampling(sampling)
        started = time.perf_counter()
        ids, feeds = self._prompt_inputs(prompts, chat, images)
        self._live = self._history = None
        generation = self._generation(len(ids), sampling, mode, on_text,
                                      threshold(min_prompt_tokens, self.min_prompt_tokens), feeds)
        if self.images is not None:
            generation.image_s = time.perf_counter() - started
        return generation, ids

    def _prompt_inputs(self, prompts, chat, images) -> tuple[list[list[int]], Feeds | None]:
        """Prompt ids and their feeds: a text engine's (None: text positions); a vision-language engine's
        with each image's tokens expanded and its features run (multimodal.py)."""
        if self.images is None:
            if images and any(row if isinstance(row, (list, tuple)) else True for row in images):
                raise InputError(f"{self.folder} is a text engine (no vision graph): it takes no images; "
                                 "export a vision-language model (Qwen3-VL) to prompt with images")
            return prompt_ids(self.tokenizer, prompts, chat, self.layout.max_seq, self.vocab), None
        per_prompt = per_prompt_images(prompts, images)
        batch = [prompts] if isinstance(prompts, str) else prompts
        marked = [with_placeholders(self.images, prompt, len(row)) for prompt, row in zip(batch, per_prompt)]
        ids = prompt_ids(self.tokenizer, marked[0] if isinstance(prompts, str) else marked, chat,
                         self.layout.max_seq, self.vocab)
        rows = encoded_rows(self.images, ids, per_prompt)
        expanded = [self._fits(row.ids) for row in rows]
        return expanded, self.images.feeds(rows, max(map(len, expanded)))

    def _fits(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.layout.max_seq:
            raise InputError(f"the prompt with its images' tokens is {len(ids)} tokens, more than the "
                             f"engine's max length {self.layout.max_seq}: use fewer or smaller images, or "
                             "re-export with a larger --max-seq")
        return ids

    def _image_limit(self, ids: list[int], prepared: list) -> int | None:
        """A chat's rows may be reused up to the first image that is not the one the cache holds there."""
        if self._history is None:
            return None
        starts = self.images.image_starts(ids, [p.grid for p in prepared])
        for start, image, cached in zip(starts, prepared, [*self._history.images, *[None] * len(prepared)]):
            if image.key != cached:
                return start
        return None

    def _sampling(self, sampling) -> SamplingConfig:
        """The SamplingConfig a call decodes with (runtime/defaults.py: over the engine's
        generation_config.json)."""
        origin = str(self.folder / "generation_config.json")
        return engine_sampling(self.tokenizer.generation_config, sampling, origin)

    def prefill(self, ids: np.ndarray, mode: str = "pop") -> np.ndarray:
        """``ids`` [B, N] (no padding) from an empty cache on ``mode``'s schedule, pop always pruned; the
        logits [B, V] predicting token N+1. Starts a sequence that ``step`` continues."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[1] > self.layout.max_seq:
            raise InputError("prefill takes token ids [batch, N] with 1 <= N <= "
                             f"max_seq={self.layout.max_seq}, got shape {ids.shape}")
        self._history = None
        self._live = self._generation(ids.shape[0], SamplingConfig(), mode)
        self._live.buffer.reset()
        return self._live.prefill(ids, np.ones_like(ids))

    def step(self, ids: np.ndarray) -> np.ndarray:
        """The decode graph on ``ids`` [B, T] after the cached rows; logits [B, V] of the last of them."""
        if self._live is None:
            raise InputError("step continues a sequence: call prefill first")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batch, steps = ids.shape
        past = self.cache_length
        positions = np.tile(np.arange(past, past + steps, dtype=np.int64), (batch, 1))
        return self._live.step("decode", ids, self._live.feeds.step(positions),
                               np.ones((batch, steps), np.int64))

    @property
    def cache_length(self) -> int:
        """Cache rows the current prefill/step sequence holds (0 before any)."""
        return 0 if self._live is None else self._live.buffer.length
