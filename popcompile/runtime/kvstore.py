"""What a KV store is to the session core, and the bookkeeping every store shares.

    KVStore        the interface loop.Generation, the backends and chat.History use (a Protocol)
    KVBookkeeping  rows written (``length``) and their mask, ``reset``/``truncate``, the "KV buffer full"
                   error: one copy, subclassed by both stores

    kvbuffer.KVBuffer  host numpy slabs (onnxruntime)      past(): arrays to feed or bind
    trt.DeviceKV       device memory (TensorRT)            past(): handles the runner binds or gathers

A store holds ``length`` rows of every sequence (positions 0..length-1 of the prompt and its tokens so
far); ``mask`` [batch, max_seq] int64 says which of them are real (1) or padding (0, also every row not
yet written). Rows past ``length`` are never read: ``truncate`` only moves ``length`` back.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..engine.kv import KVLayout
from ..errors import InputError


class KVStore(Protocol):
    """The session's KV cache as the generation loop uses it."""

    layout: KVLayout
    length: int  # rows written (the same for every sequence: prompts are left-padded)

    @property
    def batch(self) -> int:
        """Sequences the store was allocated for (a step may use fewer: the first ``B``)."""
        ...

    def reset(self) -> None:
        """Forget every row: the next step starts from an empty cache."""

    def truncate(self, length: int) -> None:
        """Forget rows ``length``.. (a chat's next turn keeps the rows its tokens share with the cache)."""

    def past(self, batch: int) -> list:
        """Rows 0..length-1 of the first ``batch`` sequences, one entry per KV input (k0, v0, k1, ...)."""
        ...

    def write(self, present: list, new_mask: np.ndarray) -> None:
        """Store a step's new rows (one entry per KV output, [B, H_kv, T, D]) at ``length..``;
        ``new_mask`` [B, T]. More than ``max_seq`` rows is an InputError."""

    def attention_mask(self, batch: int, new_mask: np.ndarray) -> np.ndarray:
        """[B, past + T] int64, the mask a graph takes: the cached rows' mask followed by the new tokens'."""
        ...


class KVBookkeeping:
    """The part of a KVStore that is the same on the host and the device: ``length``, ``mask``, ``reset``,
    ``truncate``, the room check and ``attention_mask``. A subclass holds the rows themselves and calls
    ``_check_room`` before a graph may write, ``_advance`` once the rows are stored."""

    #: always-masked rows in front of the cache (the TensorRT plans' sentinel; none on the host)
    sentinel = 0

    def __init__(self, layout: KVLayout, batch: int):
        self.layout = layout
        self.mask = np.zeros((batch, layout.max_seq), dtype=np.int64)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, length: int) -> None:
        """Forget rows ``length``.. (the rows' memory stays: masked, and overwritten by the next write)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length
        self.mask[:, length:] = 0

    def _check_room(self, steps: int) -> None:
        """InputError unless ``steps`` more rows fit in ``max_seq``."""
        if self.length + steps > self.layout.max_seq:
            raise InputError(f"KV buffer full: {self.length + steps} tokens exceed "
                             f"max_seq={self.layout.max_seq}: give a shorter prompt or fewer new tokens, "
                             "or re-export with a larger --max-seq")

    def _advance(self, new_mask: np.ndarray) -> None:
        """Record ``new_mask`` [B, T] as rows length..length+T-1 of the first B sequences."""
        batch, steps = new_mask.shape
        self.mask[:batch, self.length:self.length + steps] = new_mask
        self.length += steps

    def attention_mask(self, batch: int, new_mask: np.ndarray) -> np.ndarray:
        """[B, sentinel + length + T]: 0 for the sentinel rows, the cached rows' mask, the new tokens'."""
        parts = [self.mask[:batch, : self.length], new_mask.astype(np.int64, copy=False)]
        if self.sentinel:
            parts.insert(0, np.zeros((batch, self.sentinel), np.int64))
        return np.concatenate(parts, axis=1)
