"""TrtSession: an engine folder run with TensorRT; one KV buffer in device memory serves both engines.

Same ``generate()`` as ``runtime.ort.OrtSession``, through the same loop (``runtime.loop.Generation``):
``DeviceKV`` is the KVStore (runtime/kvstore.py) in the host KVBuffer's place and ``TrtSession._run`` the
graph runner. Device memory::

    KV buffer   [layers, 2, max_batch, kv_heads, R, head_dim]   R = 1 + max_seq, allocated once
                 row 0 sentinel (zeros, masked), row 1 + t = cache position t (exporters/tensorrt.py)
    scratch     present [.., max_batch, kv_heads, max_seq, D]   what an engine emits before it is stored
                gather  [.., max_batch, kv_heads, R, D]         contiguous past rows (gather binding only)
                zeros   [.., max_batch, kv_heads, 1, D]         the past of a prompt step (sentinel only)
    inputs      ids, positions [max_batch, max_seq], mask [max_batch, R + 1] int64; logits [max_batch, V]

An engine input ``past_key_values.{i}`` is [B, H, P, D], contiguous. Rows 0..P-1 of the buffer's
[B, H, R, D] block are contiguous only when B * H == 1, so per step (``kv_binding``):

    direct   B * H == 1: past and present bound by address into the buffer, no copy at all
    static   decode steps bind the whole block (P = R) by address, rows not yet written masked out:
             shapes and addresses never change, so the step is captured once as a CUDA graph
             (``cuda_graph=True``). Needs a model without sliding-window layers: a window is
             measured in cache rows, and the graph sees the new token at row R, not at its own
    gather   past rows copied into contiguous scratch on the device (one 2D copy per tensor)

and the present rows [B, H, T, D] go to scratch and are copied into rows 1 + past..  by
``DeviceKV.write`` (one 2D copy per tensor) unless bound in place. Prompt steps read only the sentinel:
a zero block.

Device memory and the stream come from cuda-python (``cuda.bindings.runtime``), the pairing TensorRT's
own samples use: the runtime imports no torch (a deployed engine folder needs none, as with
runtime/ort.py). ``tensorrt`` and ``cuda`` are imported only when a session is made.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from ..engine.kv import ITEMSIZE
from ..engine.manifest import EngineManifest, is_file_name
from ..engine.tensorrt import PLANS, TensorRTUnavailable, TrtSection, check_section, is_count, require_gpu
from ..engine.verify import HashCache, verify_file
from ..errors import ConfigError, EngineError, InputError
from .kvstore import KVBookkeeping
from .session import Session

KV_BINDINGS = ("auto", "static", "gather")
INPUTS = ("input_ids", "position_ids", "attention_mask")


class Device(Protocol):
    """Device memory and one stream (CudaDevice; tests use a host emulation). Pointers are ints."""

    stream: int

    def alloc(self, nbytes: int) -> int: ...
    def zero(self, ptr: int, nbytes: int) -> None: ...
    def upload(self, ptr: int, array: np.ndarray) -> None: ...
    def download(self, array: np.ndarray, ptr: int) -> None: ...
    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None: ...
    def synchronize(self) -> None: ...
    def capture(self, launch: Callable[[], object]) -> object: ...
    def replay(self, graph: object) -> None: ...


class Context(Protocol):
    """The part of tensorrt.IExecutionContext used here (its profile already selected)."""

    def set_input_shape(self, name: str, shape: tuple) -> bool: ...
    def set_tensor_address(self, name: str, ptr: int) -> bool: ...
    def execute_async_v3(self, stream_handle: int) -> bool: ...


@dataclass(frozen=True)
class EngineIO:
    dtypes: dict          # tensor name -> "float32" | "float16" | "bfloat16" | "int64" | "int32"
    vocab: int


@dataclass(frozen=True)
class Rows:
    """Where one (layer, kind) tensor of a step lives: ``index`` = 2 * layer + kind, ``ptr`` its address,
    ``in_place`` when it already is the buffer's rows (nothing to copy)."""

    index: int
    ptr: int
    in_place: bool


class DeviceKV(KVBookkeeping):
    """The session's KVStore in device memory: [layers, 2, batch, kv_heads, sentinel + max_seq, head_dim]
    (``past`` hands out Rows handles: the runner binds or gathers the rows itself)."""

    def __init__(self, layout, batch: int, itemsize: int, device: Device, sentinel: int = 1):
        super().__init__(layout, batch)
        self.device, self.sentinel = device, sentinel
        self.rows = layout.max_seq + sentinel
        self.row_bytes = layout.head_dim * itemsize
        self.block = batch * layout.num_kv_heads * self.rows * self.row_bytes   # one (layer, kind)
        self.base = device.alloc(2 * layout.num_layers * self.block)
        # unwritten rows stay finite (masked, times 0)
        device.zero(self.base, 2 * layout.num_layers * self.block)

    def address(self, index: int, row: int = 0) -> int:
        return self.base + index * self.block + row * self.row_bytes

    def past(self, batch: int) -> list[Rows]:
        """Handles, not data: the runner binds or gathers the rows (0..sentinel+length-1) itself."""
        return [Rows(i, self.address(i), True) for i in range(2 * self.layout.num_layers)]

    def write(self, present: list[Rows], new_mask: np.ndarray) -> None:
        """Store a step's rows [B, H, T, D] at rows sentinel + length..; new_mask is [B, T]."""
        batch, steps = new_mask.shape
        self._check_room(steps)
        width, pitch = steps * self.row_bytes, self.rows * self.row_bytes
        for rows in present:
            if not rows.in_place:
                self.device.copy2d(self.address(rows.index, self.sentinel + self.length), pitch,
                                   rows.ptr, width, width, batch * self.layout.num_kv_heads)
        self._advance(new_mask)


class TrtSession(Session):
    """Load an engine folder's TensorRT plans once; ``generate`` many times (same interface as OrtSession)."""

    def __init__(self, folder: str | Path, *, device: int = 0, kv_binding: str = "auto",
                 cuda_graph: bool = False, min_prompt_tokens: int | None = None,
                 hash_cache: HashCache | None = None, manifest: EngineManifest | None = None):
        self._read_manifest(folder, min_prompt_tokens, manifest)  # manifest: None reads the folder's
        section = TrtSection.from_manifest(self.manifest, self.folder)
        check_section(self.folder, section)
        plans = verify_plans(self.folder, section, hash_cache or HashCache.default())
        trt = import_tensorrt(section)
        cuda = CudaDevice(device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._trt_runtime = trt.Runtime(self._logger)
        engines = {name: _deserialize(self._trt_runtime, plans[name], section) for name in PLANS}
        contexts = make_contexts(trt, engines, section, cuda.stream)
        self._engines = engines  # contexts need their engines alive
        self._setup(section, contexts, engine_io(trt, engines["decode"]), cuda, kv_binding, cuda_graph)

    @classmethod
    def from_parts(cls, folder: str | Path, section: TrtSection, contexts: dict, io: EngineIO,
                   device: Device, *, kv_binding: str = "auto", cuda_graph: bool = False,
                   min_prompt_tokens: int | None = None) -> TrtSession:
        """A session over given contexts and device (tests run the ONNX graphs behind emulated contexts)."""
        self = cls.__new__(cls)
        self._read_manifest(folder, min_prompt_tokens)
        self._setup(section, contexts, io, device, kv_binding, cuda_graph)
        return self

    def _setup(self, section: TrtSection, contexts: dict, io: EngineIO, device: Device, kv_binding: str,
               cuda_graph: bool) -> None:
        """What __init__ and from_parts share once the manifest is read: the plans' contexts, the device
        buffers, the tokenizer."""
        self.section, self.contexts, self.io, self.device = section, contexts, io, device
        self.binding = resolve_binding(kv_binding, section, cuda_graph)
        wrong = {n: io.dtypes.get(n) for n in INPUTS if io.dtypes.get(n) != "int64"}
        if wrong:
            raise EngineError(f"{self.folder}: engine inputs {wrong} are not int64 as the KV contract says: "
                              "re-export")
        self.cuda_graph, self.graphs = cuda_graph, {}
        self.max_batch = section.max_batch
        self._read_tokenizer(io.vocab)  # token ids a prompt may hold: the engine's embedding rows
        self._allocate()

    def _allocate(self) -> None:
        """Every device buffer, once, at the engines' maximum batch and length."""
        layout, dev, batch = self.layout, self.device, self.max_batch
        itemsize = ITEMSIZE[self.io.dtypes[layout.past_names[0]]]
        self.kv = DeviceKV(layout, batch, itemsize, dev, self.section.sentinel_rows)
        count, per_row = 2 * layout.num_layers, batch * layout.num_kv_heads * self.kv.row_bytes
        self.present = dev.alloc(count * per_row * layout.max_seq)
        self.zeros = dev.alloc(count * per_row * self.kv.sentinel)
        dev.zero(self.zeros, count * per_row * self.kv.sentinel)
        needs_gather = self.binding == "gather" and layout.num_kv_heads * batch > 1  # else never copied
        self.gather = dev.alloc(count * per_row * self.kv.rows) if needs_gather else None
        self.inputs = {name: dev.alloc(batch * (self.kv.rows + 1) * 8) for name in INPUTS}
        self.logits = dev.alloc(batch * self.io.vocab * ITEMSIZE[self.io.dtypes["logits"]])
        self.allocations = 1

    # ----------------------------------------------------------------------------------------- one step

    def _run(self, graph: str, feeds: dict) -> list:
        """Generation's graph runner: feeds as runtime.loop builds them, past entries being DeviceKV
        handles."""
        ids = feeds["input_ids"]
        batch, steps = ids.shape
        kind = "prefill" if graph == "prefill" else "step" if steps == 1 else "prompt"
        if kind != "step" and self.kv.length:
            raise EngineError(f"the TensorRT {kind} profile covers an empty cache only "
                              "(past = the sentinel row)")
        static = kind == "step" and self.binding == "static"
        past = self.kv.rows if static else self.kv.sentinel + self.kv.length
        mask = self._static_mask(feeds["attention_mask"]) if static else feeds["attention_mask"]
        tokens = {"input_ids": ids, "position_ids": feeds["position_ids"], "attention_mask": mask}
        for name, array in tokens.items():
            self.device.upload(self.inputs[name], np.ascontiguousarray(array, dtype=np.int64))
        context = self.contexts[kind]
        graphed = static and self.cuda_graph
        in_place = batch * self.layout.num_kv_heads == 1 and not graphed
        present = self._bind(context, kind, tokens, past, in_place)
        if graphed:
            self._launch_graph(context, batch)
        elif not context.execute_async_v3(self.device.stream):
            raise EngineError(f"TensorRT failed to run the {kind} step (see its log above)")
        if not self.manifest.has_logits(graph):
            return present
        return [self._download_logits(batch), *present]

    def _bind(self, context: Context, kind: str, tokens: dict, past: int, in_place: bool) -> list[Rows]:
        """Set every input shape and every tensor address of this step; returns where the present rows go."""
        layout, kv = self.layout, self.kv
        batch, steps = tokens["input_ids"].shape
        for name, array in tokens.items():
            _check(context.set_input_shape(name, array.shape), name, array.shape)
            _check(context.set_tensor_address(name, self.inputs[name]), name, "address")
        kv_shape = (batch, layout.num_kv_heads, past, layout.head_dim)
        per_row = self.max_batch * layout.num_kv_heads * kv.row_bytes
        present = []
        for index, (past_name, present_name) in enumerate(zip(layout.past_names, layout.present_names)):
            _check(context.set_input_shape(past_name, kv_shape), past_name, kv_shape)
            _check(context.set_tensor_address(past_name, self._past_address(index, batch, past, in_place)),
                   past_name, "address")
            scratch = self.present + index * per_row * layout.max_seq
            ptr = kv.address(index, kv.sentinel + kv.length) if in_place else scratch
            _check(context.set_tensor_address(present_name, ptr), present_name, "address")
            present.append(Rows(index, ptr, in_place))
        if kind != "prefill" or self.manifest.boundary == "folded":
            _check(context.set_tensor_address("logits", self.logits), "logits", "address")
        return present

    def _past_address(self, index: int, batch: int, past: int, in_place: bool) -> int:
        """Address of [B, H, past, D] contiguous rows 0..past-1 of tensor ``index`` (copied there if
        needed)."""
        kv = self.kv
        heads = batch * self.layout.num_kv_heads
        per_row = self.max_batch * self.layout.num_kv_heads * kv.row_bytes
        if past == kv.rows or in_place:   # the whole block, or B * H == 1
            return kv.address(index)
        if past == kv.sentinel:           # a prompt step: only the sentinel, zeros
            return self.zeros + index * per_row * kv.sentinel
        dst = self.gather + index * per_row * kv.rows
        self.device.copy2d(dst, past * kv.row_bytes, kv.address(index), kv.rows * kv.row_bytes,
                           past * kv.row_bytes, heads)
        return dst

    def _static_mask(self, mask: np.ndarray) -> np.ndarray:
        """[B, sentinel + length + 1] -> [B, R + 1]: rows not yet written masked, the new token last."""
        out = np.zeros((mask.shape[0], self.kv.rows + 1), dtype=np.int64)
        out[:, : mask.shape[1] - 1] = mask[:, :-1]
        out[:, -1] = mask[:, -1]
        return out

    def _launch_graph(self, context: Context, batch: int) -> None:
        """Static decode step: replay its CUDA graph, or run it once and capture it (shapes fixed per
        batch)."""
        if batch in self.graphs:
            self.device.replay(self.graphs[batch])
            return
        if not context.execute_async_v3(self.device.stream):  # also settles TensorRT's shape-dependent state
            raise EngineError("TensorRT failed to run the decode step (see its log above)")
        self.device.synchronize()
        self.graphs[batch] = self.device.capture(lambda: context.execute_async_v3(self.device.stream))

    def _download_logits(self, batch: int) -> np.ndarray:
        dtype = self.io.dtypes["logits"]
        host = np.empty((batch, self.io.vocab), dtype=np.uint16 if dtype == "bfloat16" else dtype)
        self.device.download(host, self.logits)
        self.device.synchronize()
        if dtype == "bfloat16":  # no numpy bfloat16: widen the bits to float32
            return (host.astype(np.uint32) << 16).view(np.float32)
        return host

    # ----------------------------------------------------------------------------------------- generate

    def _graphs(self, batch: int) -> tuple[Callable[[str, dict], list], DeviceKV]:
        if batch > self.max_batch:
            raise InputError(f"{batch} prompts exceed the engines' max batch {self.max_batch}: "
                             f"rebuild with `popcompile build-trt {self.folder} --max-batch {batch} --force`")
        return self._run, self.kv


def resolve_binding(kv_binding: str, section: TrtSection, cuda_graph: bool) -> str:
    """"auto" -> what the build tuned the step profile for; static refused for sliding-window models."""
    if kv_binding not in KV_BINDINGS:
        raise ConfigError(f"kv_binding must be one of {KV_BINDINGS}, got {kv_binding!r}")
    binding = section.decode_kv if kv_binding == "auto" else kv_binding
    if binding == "static" and section.decode_kv != "static":
        raise ConfigError("static KV binding reads the whole buffer, which breaks sliding-window attention, "
                          "and this model has sliding-window layers: use kv_binding='gather' (the default "
                          "for it)")
    if cuda_graph and binding != "static":
        raise ConfigError("a CUDA graph needs fixed shapes, i.e. the static KV binding, which this model "
                          "cannot use (sliding-window layers): run without --cuda-graph")
    return binding


def _check(ok: bool, name: str, what) -> None:
    if not ok:
        raise EngineError(f"TensorRT refused {name} = {what}: outside the engine's optimization profile; "
                          "rebuild with `popcompile build-trt DIR --force` for this shape")


# --------------------------------------------------------------------------------------------- loading

def verify_plans(folder: Path, section: TrtSection, cache: HashCache) -> dict[str, Path]:
    """Both plans inside the folder with the sizes and hashes the manifest recorded; their resolved paths."""
    paths = {}
    for name, entry in section.plans.items():
        if not (isinstance(entry, dict) and is_file_name(entry.get("file")) and is_count(entry.get("bytes"))
                and isinstance(entry.get("sha256"), str)):
            raise EngineError(f"{folder}: the manifest's tensorrt.plans.{name} is malformed ({entry!r:.80}): "
                              f"run `popcompile build-trt {folder} --force`")
        fix = f"rebuild the plans with `popcompile build-trt {folder} --force`"
        paths[name] = verify_file(folder, entry["file"], f"tensorrt.plans.{name}", entry["bytes"],
                                  entry["sha256"], cache, fix=fix)
    return paths


def import_tensorrt(section: TrtSection):
    """The tensorrt module, checked against the version the plans were built with (plans are
    version-bound)."""
    require_gpu()
    try:
        import tensorrt
    except ImportError as err:
        raise TensorRTUnavailable(f"the tensorrt package does not load ({err}): reinstall it") from None
    if tensorrt.__version__ != section.tensorrt_version:
        raise EngineError(f"the plans were built with TensorRT {section.tensorrt_version} and this is "
                          f"{tensorrt.__version__}: rebuild them with `popcompile build-trt DIR --force`")
    return tensorrt


def _deserialize(runtime, path: Path, section: TrtSection):
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise EngineError(f"TensorRT could not load {path} (built for "
                          f"{section.gpu}, compute capability {section.compute_capability}): "
                          "rebuild on this GPU with `popcompile build-trt DIR --force`")
    return engine


def make_contexts(trt, engines: dict, section: TrtSection, stream: int) -> dict:
    """One execution context per profile: "prefill", "step" and "prompt" (decode engine, two profiles)."""
    strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
    contexts = {}
    for engine_name, profiles in (("prefill", section.profile_list("prefill")),
                                  ("decode", section.profile_list("decode"))):
        for index, profile in enumerate(profiles):
            engine = engines[engine_name]
            # ON_PROFILE_CHANGE: each context holds activation memory for its own profile only
            context = (engine.create_execution_context(strategy.ON_PROFILE_CHANGE) if strategy
                       else engine.create_execution_context())
            if context is None or not context.set_optimization_profile_async(index, stream):
                raise EngineError(f"could not make a TensorRT context for profile {profile.name} "
                                  "(GPU memory?)")
            contexts[profile.name] = context
    return contexts


def engine_io(trt, engine) -> EngineIO:
    names = {trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16", trt.DataType.INT64: "int64",
             trt.DataType.INT32: "int32"}
    if hasattr(trt.DataType, "BF16"):
        names[trt.DataType.BF16] = "bfloat16"
    tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    dtypes = {t: names[engine.get_tensor_dtype(t)] for t in tensors}
    return EngineIO(dtypes, int(engine.get_tensor_shape("logits")[-1]))


# --------------------------------------------------------------------------------------------- CUDA

def _cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError:
            raise TensorRTUnavailable("the TensorRT runtime needs cuda-python for device memory: "
                                      "pip install cuda-python") from None
    return cudart


class CudaDevice:
    """Device memory, copies and CUDA graphs on one stream of GPU ``index`` (cuda-python's runtime
    API)."""

    def __init__(self, index: int = 0):
        self.rt = _cudart()
        self._call(self.rt.cudaSetDevice(index))
        self._stream = self._call(self.rt.cudaStreamCreate())
        self.stream = int(self._stream)
        self._pointers: list[int] = []

    def _call(self, result):
        err, *values = result
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA error {err}: {self.rt.cudaGetErrorString(err)[1]}")
        return values[0] if len(values) == 1 else values

    def alloc(self, nbytes: int) -> int:
        ptr = int(self._call(self.rt.cudaMalloc(max(nbytes, 1))))
        self._pointers.append(ptr)
        return ptr

    def zero(self, ptr: int, nbytes: int) -> None:
        self._call(self.rt.cudaMemsetAsync(ptr, 0, nbytes, self._stream))

    def upload(self, ptr: int, array: np.ndarray) -> None:
        # pageable source: the call returns once the data is staged, so ``array`` may go away after it
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._call(self.rt.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, self._stream))

    def download(self, array: np.ndarray, ptr: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._call(self.rt.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes, kind, self._stream))

    def copy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._call(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, self._stream))

    def synchronize(self) -> None:
        self._call(self.rt.cudaStreamSynchronize(self._stream))

    def capture(self, launch: Callable[[], object]) -> object:
        mode = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        self._call(self.rt.cudaStreamBeginCapture(self._stream, mode))
        try:
            launch()
        finally:
            graph = self._call(self.rt.cudaStreamEndCapture(self._stream))
        executable = self._call(self.rt.cudaGraphInstantiate(graph, 0))
        self._call(self.rt.cudaGraphDestroy(graph))
        return executable

    def replay(self, graph: object) -> None:
        self._call(self.rt.cudaGraphLaunch(graph, self._stream))

    def __del__(self):
        try:
            self.synchronize()
            for ptr in self._pointers:
                self.rt.cudaFree(ptr)
            self.rt.cudaStreamDestroy(self._stream)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may already be gone
            pass
