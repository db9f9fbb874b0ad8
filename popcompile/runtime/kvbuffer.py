"""The session's KV buffer on the host (a KVStore, kvstore.py): allocated once, read as past rows, written
row by row.

    cache:    [layers, 2, batch, kv_heads, max_seq, head_dim]   (kv.KVLayout)   the KV cache itself
    staging:  [layers * 2, batch * kv_heads * max_seq * head_dim]                the graphs' KV tensors
    mask:     [batch, max_seq] int64   1 = real token, 0 = padding or not yet written

A graph reads rows ``0..past-1`` of every layer as contiguous ``[B, H_kv, past, D]`` tensors and emits
the ``T`` new rows as ``[B, H_kv, T, D]``. Rows ``0..past-1`` of ``[B, H_kv, max_seq, D]`` are not
contiguous (unless ``B * H_kv == 1``), and onnxruntime binds only contiguous memory, so each layer's
staging row holds the graph-side tensors back to back::

    staging[2l + kind]:  | past  [B, H_kv, past, D]  | present [B, H_kv, T, D] |  (unused)  |
                           past(): gathered from the cache, or already there (see below)
                                                       present(): the graph writes its new rows here

``write`` copies the new rows into the cache at ``past..past+T-1``. When a step started from an
empty cache (a prefill, or the full model on the whole prompt), its present rows sit at offset 0:
exactly the next step's past. ``past`` then hands them over without a copy: the boundary step reads
what the prefill graph wrote. Later steps gather (docs/kv.md has the numbers). Both arrays are
allocated once, with ``np.zeros``/``np.empty``: pages cost memory only once a step touches them.

Where the layout allows (``batch * kv_heads == 1``, e.g. Gemma 3 270M at batch 1), the cache rows are
contiguous themselves: ``past`` and ``present`` are views of the cache, a graph reads and writes the
cache in place, and ``write`` copies nothing.

A graph that shares the buffer (manifest ``attention.shared_kv``: onnxruntime's GroupQueryAttention) binds
``shared``: each layer's whole ``[B, H_kv, max_seq, D]`` cache rows (contiguous: batch is their outer axis) as
its past and as its present; it writes its new rows at ``length..`` itself, and ``write`` copies nothing.
"""
from __future__ import annotations

import numpy as np

from ..engine.kv import KVLayout
from ..errors import EngineError
from .kvstore import KVBookkeeping


class KVBuffer(KVBookkeeping):
    """The host KVStore: the cache, the graphs' staging area and the mask, allocated once per batch size."""

    def __init__(self, layout: KVLayout, batch: int):
        try:
            super().__init__(layout, batch)
            self.data = layout.allocate(batch)
            row = batch * layout.num_kv_heads * layout.max_seq * layout.head_dim
            self.staging = np.empty((2 * layout.num_layers, row), dtype=self.data.dtype)
        except MemoryError:  # cache and staging: twice the buffer's bytes of address space
            gib = 2 * batch * layout.max_seq * layout.bytes_per_token() / 2**30
            raise EngineError(f"the KV buffer for {batch} sequences of max_seq={layout.max_seq} tokens "
                              f"needs {gib:.1f} GiB, more than this machine can map: use a smaller batch "
                              "or re-export the engine with a smaller --max-seq") from None
        self._staged: tuple[int, int] | None = None    # (batch, rows) laid out as a past in staging
        self._handed: list[np.ndarray] | None = None   # the views present() gave out last
        self._handed_cache = False                     # ... and whether they are the cache's own rows

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self._staged = self._handed = None

    def _views(self, batch: int, offset_rows: int, rows: int) -> list[np.ndarray]:
        """[batch, H_kv, rows, D] views of every staging row, starting after ``offset_rows`` rows' worth."""
        heads, dim = batch * self.layout.num_kv_heads, self.layout.head_dim
        start, size = heads * offset_rows * dim, heads * rows * dim
        shape = (batch, self.layout.num_kv_heads, rows, dim)
        return [self.staging[i, start:start + size].reshape(shape) for i in range(len(self.staging))]

    def in_place(self, batch: int) -> bool:
        """Whether the first ``batch`` sequences' rows of a layer are contiguous in the cache itself."""
        return batch * self.layout.num_kv_heads == 1

    def _cache_views(self, start: int, end: int) -> list[np.ndarray]:
        """[1, 1, end-start, D] views of cache rows start..end-1 (contiguous when ``in_place(1)``)."""
        return [self.data[index // 2, index % 2, :1, :, start:end, :]
                for index in range(2 * self.layout.num_layers)]

    def past(self, batch: int) -> list[np.ndarray]:
        """Rows 0..length-1 of the first ``batch`` sequences as contiguous arrays, in the graph inputs'
        order (k0, v0, k1, ...). Views into staging (or the cache, ``in_place``): read-only for the
        caller, valid until the next ``past``/``present`` call."""
        if self.in_place(batch):
            return self._cache_views(0, self.length)
        views = self._views(batch, 0, self.length)
        if self._staged != (batch, self.length):
            for index, view in enumerate(views):
                np.copyto(view, self.data[index // 2, index % 2, :batch, :, : self.length, :])
            self._staged = (batch, self.length)
        return views

    def present(self, batch: int, steps: int) -> list[np.ndarray]:
        """Where a graph writes its ``steps`` new rows: [batch, H_kv, steps, D] views just after the past
        (in staging, or the cache rows themselves when ``in_place``).

        Bind them as the graph's outputs, then pass them to ``write``."""
        self._check_room(steps)
        self._handed_cache = self.in_place(batch)
        if self._handed_cache:
            self._handed = self._cache_views(self.length, self.length + steps)
        else:
            self._handed = self._views(batch, self.length, steps)
        return self._handed

    def shared(self, batch: int, steps: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """What a buffer-sharing graph binds: (as both its past and its present, the first ``batch``
        sequences' [batch, H_kv, max_seq, D] cache rows of every layer; the [batch, H_kv, steps, D] views
        of the rows it writes, to pass to ``write``, which then copies nothing)."""
        self._check_room(steps)
        end = self.length + steps
        whole = [self.data[index // 2, index % 2, :batch] for index in range(2 * self.layout.num_layers)]
        self._handed, self._handed_cache = [rows[:, :, self.length:end] for rows in whole], True
        return whole, self._handed

    def write(self, present: list[np.ndarray], new_mask: np.ndarray) -> None:
        """Store the rows a step produced: present[2l + kind] is [B, H_kv, T, D]; new_mask is [B, T]."""
        batch, steps = new_mask.shape
        self._check_room(steps)
        end = self.length + steps
        handed = self._handed is not None and all(a is b for a, b in zip(present, self._handed))
        if not (handed and self._handed_cache):  # in place: the graph wrote the cache rows itself
            for index, rows in enumerate(present):
                self.data[index // 2, index % 2, :batch, :, self.length:end, :] = rows
        # From an empty cache, rows a graph wrote into staging are laid out there exactly as the next past.
        self._staged = (batch, end) if handed and not self._handed_cache and self.length == 0 else None
        self._handed = None
        self._advance(new_mask)
