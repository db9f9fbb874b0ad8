"""KVLayout: the one KV buffer layout that every graph and runtime shares.

One allocation per session holds K and V of every layer up to ``max_seq`` tokens::

    buffer: [layers, 2, batch, kv_heads, max_seq, head_dim]     (2 = K, V)
              |       |                      |
              |       |                      +-- rows 0..past-1 are filled; a step writes rows past..past+T-1
              |       +-- index 0 = K (after k_norm and RoPE), 1 = V
              +-- decoder layer index

Both graphs (prefill and decode) read the filled rows of every layer as ``past_key_values.{i}.key`` /
``.value`` with shape ``[batch, kv_heads, past, head_dim]`` and emit only the rows of the tokens they
processed as ``present.{i}.key`` / ``.value`` with shape ``[batch, kv_heads, T, head_dim]``; the runtime
writes those rows into the buffer at their positions. The layout is plain data (no torch import) so a
deployed runtime can check it against the engine manifest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ConfigError

KV_DTYPES = ("float32", "float16", "bfloat16")
#: bytes per element of the dtypes an engine's tensors take (the KV buffer's, the graphs' inputs)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}
#: the KV buffer length (max_seq) of an export that names none: this, or the model's position limit where
#: lower (frontend.capture.kv_layout); the help texts that state it read it from here
DEFAULT_MAX_SEQ = 4096
#: upper bounds of a sane layout: a manifest asking for more is damaged, not a model (4M tokens of context,
#: 64k layers/heads/head_dim); the KV buffer itself is checked against memory when it is allocated
LIMITS = {"num_layers": 1 << 16, "num_kv_heads": 1 << 16, "head_dim": 1 << 16, "max_seq": 1 << 22}


@dataclass(frozen=True)
class KVLayout:
    """Shape and naming contract of the KV buffer (see module docstring for the picture)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= limit:
                raise ConfigError(f"KVLayout.{name} must be an integer in 1..{limit}, got {_short(value)}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.dtype, str) or self.dtype not in KV_DTYPES:
            raise ConfigError(f"KVLayout.dtype must be one of {', '.join(KV_DTYPES)}, "
                              f"got {_short(self.dtype)}")

    # Names are part of the contract: both graphs declare exactly these inputs and outputs.
    @staticmethod
    def past_name(layer: int, kind: str) -> str:
        return f"past_key_values.{layer}.{kind}"

    @staticmethod
    def present_name(layer: int, kind: str) -> str:
        return f"present.{layer}.{kind}"

    @property
    def past_names(self) -> list[str]:
        """Graph inputs in order: layer 0 key, layer 0 value, layer 1 key, ..."""
        return [self.past_name(i, kind) for i in range(self.num_layers) for kind in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [self.present_name(i, kind) for i in range(self.num_layers) for kind in ("key", "value")]

    def buffer_shape(self, batch: int) -> tuple[int, ...]:
        return (self.num_layers, 2, batch, self.num_kv_heads, self.max_seq, self.head_dim)

    def bytes_per_token(self) -> int:
        """K and V of all layers for one token of one sequence."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    def allocate(self, batch: int) -> np.ndarray:
        """The one buffer of a session, zero-filled. bfloat16 has no numpy dtype: use float32 host-side."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        np_dtype = np.float16 if self.dtype == "float16" else np.float32
        return np.zeros(self.buffer_shape(batch), dtype=np_dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        if not isinstance(data, dict):
            raise ConfigError(f"a KVLayout is an object of {', '.join(cls.__dataclass_fields__)}, "
                              f"got {_short(data)}")
        fields = set(cls.__dataclass_fields__)
        unknown, missing = set(data) - fields, fields - set(data) - {"dtype"}
        if unknown or missing:
            raise ConfigError(f"KVLayout fields unknown {sorted(map(str, unknown))}, "
                              f"missing {sorted(missing)}: "
                              "the engine was made by another version")
        return cls(**data)


def _short(value: object) -> str:
    """repr() cut to 60 characters: a damaged file's value can be megabytes."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
