"""The external-data references of an ONNX file, read from its protobuf wire format (no onnx import).

An initializer stored outside the graph names its file in ``TensorProto.external_data`` ("location",
"offset", "length"); onnxruntime opens that file relative to the graph. An engine folder's graphs may
reference one file only: the manifest's weights file, already verified by its hash. Tensors can sit in
the graph's initializers, in node attributes (Constant), in subgraphs (If/Loop) and in functions, so
the reader walks every message that can hold one; everything else is skipped by its length, and so is
any message whose bytes do not contain ``location`` (an external tensor must name its file: onnxruntime
refuses one without), which keeps the walk to the few messages that matter (ms for SmolLM2's graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

#: message -> {field number: message it holds} for every path from ModelProto to a TensorProto (onnx.proto)
_SCHEMA = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node", 11: "attribute"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {},
}
_EXTERNAL_DATA, _ENTRY_KEY, _ENTRY_VALUE = 13, 1, 2   # TensorProto.external_data, StringStringEntryProto
_FIXED = {1: 8, 5: 4}                                  # wire type -> bytes (fixed64, fixed32)
_MAX_DEPTH = 64
_LOCATION = b"location"


class ProtoError(ValueError):
    """The bytes are not a protobuf message of the expected shape."""


@dataclass(frozen=True)
class ExternalRef:
    location: str | None
    offset: str | None
    length: str | None


def external_refs(data: bytes) -> list[ExternalRef]:
    """Every external-data reference of the serialized ModelProto ``data`` (ProtoError if it does not
    parse)."""
    refs: list[ExternalRef] = []
    _walk(bytes(data), 0, len(data), "model", refs, 0)
    return refs


def _walk(buf: bytes, start: int, end: int, kind: str, refs: list[ExternalRef], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ProtoError("messages nested deeper than any ONNX graph")
    if buf.find(_LOCATION, start, end) < 0:
        return
    children = _SCHEMA[kind]
    entries = {}
    for number, span in _fields(buf, start, end):
        if span is None:
            continue
        if kind == "tensor" and number == _EXTERNAL_DATA:
            key, value = _entry(buf, *span)
            entries[key] = value
        elif number in children:
            _walk(buf, *span, children[number], refs, depth + 1)
    if entries:
        refs.append(ExternalRef(entries.get("location"), entries.get("offset"), entries.get("length")))


def _entry(buf: bytes, start: int, end: int) -> tuple[str, str]:
    """A StringStringEntryProto -> (key, value)."""
    strings = {1: "", 2: ""}
    for number, span in _fields(buf, start, end):
        if number in strings and span is not None:
            try:
                strings[number] = buf[span[0]:span[1]].decode("utf-8")
            except UnicodeDecodeError:
                raise ProtoError("an external_data entry is not UTF-8") from None
    return strings[_ENTRY_KEY], strings[_ENTRY_VALUE]


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, tuple[int, int] | None]]:
    """(field number, (start, end) of a length-delimited value or None) of the message ``buf[pos:end]``."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        span = None
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            span, pos = (pos, pos + length), pos + length
        elif wire in _FIXED:
            pos += _FIXED[wire]
        else:
            raise ProtoError(f"wire type {wire} at byte {pos}")
        if pos > end or number == 0:
            raise ProtoError(f"a field runs past its message at byte {pos}")
        yield number, span


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < end and shift < 64:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos
    raise ProtoError(f"a varint runs past its message at byte {pos}")
