"""The session's KV buffer on the host: allocated once, read as past rows, written row by row.

    k/v rows: [layers, 2, batch, kv_heads, max_seq, head_dim]   (kv.KVLayout)
    mask:     [batch, max_seq] int64   1 = real token, 0 = padding or not yet written

A step reads rows ``0..past-1`` of every layer (``past``) and writes the ``T`` rows the graph emitted
at ``past..past+T-1`` (``write``). Nothing is concatenated; the buffer never moves.
"""
from __future__ import annotations

import numpy as np

from ..kv import KVLayout


class KVBuffer:
    def __init__(self, layout: KVLayout, batch: int):
        self.layout = layout
        self.data = layout.allocate(batch)
        self.mask = np.zeros((batch, layout.max_seq), dtype=np.int64)
        self.length = 0

    @property
    def batch(self) -> int:
        return self.data.shape[2]

    def reset(self) -> None:
        self.length = 0
        self.mask[:] = 0

    def past(self, batch: int) -> list[np.ndarray]:
        """Rows 0..length-1 for the first ``batch`` sequences, as the graph inputs' order: k0, v0, k1, ...

        ONNX Runtime needs contiguous inputs, so the [B, H_kv, past, D] views become copies here; see
        docs/kv.md for what that costs and what TensorRT does instead.
        """
        rows = self.data[:, :, :batch, :, : self.length, :]
        return [np.ascontiguousarray(rows[layer, kind]) for layer in range(self.layout.num_layers) for kind in (0, 1)]

    def write(self, present: list[np.ndarray], new_mask: np.ndarray) -> None:
        """Store the rows a step produced: present[2l + kind] is [B, H_kv, T, D]; new_mask is [B, T]."""
        batch, steps = new_mask.shape
        end = self.length + steps
        if end > self.layout.max_seq:
            raise ValueError(f"KV buffer full: {end} tokens exceed max_seq={self.layout.max_seq}")
        for index, rows in enumerate(present):
            self.data[index // 2, index % 2, :batch, :, self.length:end, :] = rows
        self.mask[:batch, self.length:end] = new_mask
        self.length = end

    def attention_mask(self, batch: int, new_mask: np.ndarray) -> np.ndarray:
        """[B, past+T]: the cached rows' mask followed by the new tokens'."""
        return np.concatenate([self.mask[:batch, : self.length], new_mask], axis=1)
