"""Where the ONNX writer keeps the weights while it rewrites the graphs: on disk, not in memory.

Each text graph is saved by torch.onnx without its initializers, which ``Scratch.save`` then writes tensor by
tensor (never the whole model as one protobuf; a model built without its weights has each read from its
checkpoint there, frontend.models.LazyWeights) into one file for both graphs, each distinct tensor once (a
vision graph is saved by torch.onnx with external data and read back, ``load``); from then on every large
initializer (``INLINE_BYTES`` or more) names its bytes by absolute path, offset and length, and the rewrites
read one tensor at a time (``ort_passes.graph.tensor_array``). What a rewrite creates in memory (a packed
projection, a transposed head, quantised blocks) is moved out again by ``Scratch.spill`` after that rewrite,
each distinct tensor once. ``write_shared`` then copies every tensor into weights.bin; the scratch folder,
inside the staged engine folder, is removed when the folder is written (and with it on any failure)::

    staged/.scratch/decode.onnx, prefill.onnx    the graphs as torch.onnx saved them, no initializers
    staged/.scratch/spill.bin                     every large tensor: the graphs' and what the rewrites made,
    staged/.scratch/spill.bf16bits                 but large float32 tensors of bf16 values (a bf16
                                                  checkpoint's): their upper halves only, half the disk

Only the exporter's own code reads spill.bf16bits (``tensor_array``): the one rewrite that hands the graphs
to another library, onnxscript's fusions (ort_passes/attention.py), sees tensors that large by shape only.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import onnx

from ..ort_passes.attention import LARGE_BYTES
from ..ort_passes.graph import BFLOAT16_BITS, tensor_array

#: tensors below this stay inside the graph: shapes and axes that shape inference and the rewrites read
INLINE_BYTES = 1024
_ALIGN = 64


class Scratch:
    """A folder of graphs and weights being written (module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._spill = self.folder / "spill.bin"
        self._halves = self.folder / f"spill{BFLOAT16_BITS}"
        self._offsets: dict[bytes, tuple[Path, int, int]] = {}  # file, offset, length

    def load(self, path: Path) -> onnx.ModelProto:
        """The graph saved at ``path`` with its external data, its large tensors left in their file (named by
        absolute path), the small ones read into the graph."""
        proto = onnx.load(str(path), load_external_data=False)
        base = Path(path).resolve().parent
        for tensor in _initializers(proto):
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {entry.key: entry for entry in tensor.external_data}
            location = info["location"]
            location.value = str(base / location.value)
            if nbytes(tensor) < INLINE_BYTES:
                _inline(tensor)
        return proto

    def save(self, program, name: str) -> onnx.ModelProto:
        """torch.onnx's ``program`` as a graph with its large initializers in spill.bin, each distinct
        tensor once for all the graphs saved here (decode and prefill share most weights: one copy on disk),
        read one at a time (a lazy one from its checkpoint)."""
        path = self.folder / name
        values = list(program.model.graph.initializers.values())
        program.save(path, include_initializers=False)
        proto = onnx.load(str(path))
        for value in values:
            tensor = value.const_value
            made = onnx.TensorProto(name=value.name, data_type=tensor.dtype.value, dims=list(tensor.shape))
            made.raw_data = tensor.tobytes()  # a lazy tensor is read now, from its checkpoint
            self.store(made)
            proto.graph.initializer.append(made)
        return proto

    def spill(self, proto: onnx.ModelProto) -> None:
        """Move each large initializer held in memory into spill.bin (each distinct tensor once)."""
        for tensor in _initializers(proto):
            self.store(tensor)

    def store(self, tensor: onnx.TensorProto) -> None:
        """Move ``tensor``'s values into spill.bin if it is large and held in memory (once per content)."""
        if tensor.data_location == onnx.TensorProto.EXTERNAL or nbytes(tensor) < INLINE_BYTES:
            return
        raw = tensor.raw_data if tensor.HasField("raw_data") else tensor_array(tensor).tobytes()
        key = hashlib.sha256(raw + str((tensor.data_type, tuple(tensor.dims))).encode()).digest()
        if key not in self._offsets:
            halves = (_bfloat16_halves(raw) if tensor.data_type == onnx.TensorProto.FLOAT
                      and len(raw) >= LARGE_BYTES else None)
            path, data = (self._spill, raw) if halves is None else (self._halves, halves)
            with open(path, "ab") as blob:
                blob.write(b"\0" * (-blob.tell() % _ALIGN))
                self._offsets[key] = (path, blob.tell(), len(data))
                blob.write(data)
        path, offset, length = self._offsets[key]
        external(tensor, str(path), offset, length)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """``tensor`` with its values dropped from the proto and named in ``location`` instead."""
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(name)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _bfloat16_halves(raw: bytes) -> bytes | None:
    """The upper 16 bits of each float32 in ``raw`` where every lower half is zero (the values are exactly
    bfloat16: a bf16 checkpoint's weights, transposed or packed), else None. Half the scratch on disk."""
    words = np.frombuffer(raw, np.uint32)
    if (words & 0xFFFF).any():
        return None
    return (words >> 16).astype(np.uint16).tobytes()


def nbytes(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def _inline(tensor: onnx.TensorProto) -> None:
    array = tensor_array(tensor)
    tensor.ClearField("external_data")
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = array.tobytes()


def _initializers(proto: onnx.ModelProto):
    """Every initializer of the graph and its subgraphs (none in ours but the exporter's If branches)."""
    yield from proto.graph.initializer
    for node in proto.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from attribute.g.initializer
