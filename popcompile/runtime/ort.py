"""OrtSession: an engine folder run with ONNX Runtime (CPU by default, CUDA or TensorRT providers).

Both graphs run with IO binding (``BoundBackend``): the graph reads its past K/V from, and writes its
new rows into, the session's KV buffer's staging area (runtime/kvbuffer.py), so onnxruntime neither
allocates the K/V outputs nor copies them out, and the boundary step reads the prefill graph's rows
where the prefill graph wrote them. No torch import: a deployment needs onnxruntime, numpy,
tokenizers and jinja2.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..engine.kv import KVLayout
from ..engine.manifest import EngineManifest
from ..engine.verify import HashCache, verify_folder
from ..errors import ConfigError, EngineError, EnvironmentUnavailable
from .kvbuffer import KVBuffer
from .loop import HostBackend, StepOutputs
from .multimodal import Images
from .ort_load import check_external_data, check_signature, load_graph, vocab_size
from .session import Session

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def provider_list(provider: str) -> list[str]:
    """ORT providers for a short name, with CPU as the fallback for unsupported nodes."""
    if not isinstance(provider, str) or provider not in PROVIDERS:
        raise ConfigError(f"unknown provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    name = PROVIDERS[provider]
    if name not in ort.get_available_providers():
        raise EnvironmentUnavailable(
            f"provider {provider!r} ({name}) is not available in this onnxruntime build "
            f"(available: {', '.join(ort.get_available_providers())}); "
            "install onnxruntime-gpu for cuda/tensorrt")
    return [name] if name == PROVIDERS["cpu"] else [name, PROVIDERS["cpu"]]


#: onnxruntime providers that run float16 engines with float16 kernels. The CPU provider has none for
#: MatMul on x86 and runs a float16 graph through inserted Casts (float32 compute, no faster, float32
#: copies of the weights): measured in docs/benchmarks.md, so a float16 engine on CPU is refused.
FLOAT16_PROVIDERS = ("cuda", "tensorrt")
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def check_precision(manifest: EngineManifest, provider: str) -> None:
    """EngineError unless ``provider`` runs the engine's dtype well."""
    if manifest.dtype == "float16" and provider not in FLOAT16_PROVIDERS:
        raise EngineError(
            f"this is a float16 engine and onnxruntime's {PROVIDERS.get(provider, provider)} has no float16 "
            f"kernels for most of its nodes (it casts to float32 around them and keeps float32 copies of the "
            "weights: no faster than float32): run it with --provider cuda, or export it with "
            "--dtype float32")


def session_options(threads: int | None) -> ort.SessionOptions:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
        raise ConfigError(f"threads={threads!r} must be None or an integer >= 0 (0: onnxruntime's default)")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return options


def signature(session: ort.InferenceSession, names) -> list[tuple]:
    by_name = {arg.name: arg for arg in session.get_inputs()}
    return [(n, by_name[n].type, tuple(by_name[n].shape)) for n in names if n in by_name]


class BoundBackend:
    """loop.Backend with onnxruntime IO binding: every input and output is bound to host memory the
    session owns, so ``run_with_iobinding`` reads the past K/V from the buffer's staging area and writes
    the new rows (and logits) in place: no output allocation, no copy out of onnxruntime."""

    def __init__(self, sessions: dict[str, ort.InferenceSession], layout: KVLayout,
                 shared_kv: frozenset[str] = frozenset()):
        self.sessions, self.layout = sessions, layout
        # graphs that read and write the buffer in place (manifest attention.shared_kv)
        self.shared_kv = shared_kv
        self.logits_graphs = {name for name, s in sessions.items() if s.get_outputs()[0].name == "logits"}
        logits = sessions["decode"].get_outputs()[0]
        self.logits_dtype = _NUMPY_TYPES[logits.type]
        self.vocab = logits.shape[1] if isinstance(logits.shape[1], int) else None
        self.after_prefill = _shrink_arena_options(sessions["decode"])
        # graph -> (the cache rows it is bound to, its binding): a shared graph's K/V bindings are the same
        # slabs every step, so only the token inputs and the logits are bound again (60 binds fewer a step)
        self._kept: dict[str, tuple[tuple, ort.IOBinding]] = {}

    def run(self, graph: str, feeds: dict[str, np.ndarray], buffer: KVBuffer) -> StepOutputs:
        session = self.sessions[graph]
        batch, steps = feeds["input_ids"].shape
        binding, present = self._binding(session, graph, buffer, batch, steps)
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))  # CPU: no copy
        logits, with_logits = None, graph in self.logits_graphs
        if with_logits and self.vocab is not None:
            logits = np.empty((batch, self.vocab), dtype=self.logits_dtype)
            binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        elif with_logits:
            binding.bind_output("logits", "cpu")
        session.run_with_iobinding(binding, self.after_prefill if steps > 1 else None)
        if with_logits and logits is None:
            logits = binding.get_outputs()[0].numpy()
        return logits, present

    def _binding(self, session: ort.InferenceSession, graph: str, buffer: KVBuffer, batch: int,
                 steps: int) -> tuple[ort.IOBinding, list]:
        """A binding with the past and present K/V bound; the new rows [B, H_kv, T, D] (views for
        ``buffer.write``).

        A shared graph gets the cache itself as both, except for a first prompt (empty past, T > 1): its
        GroupQueryAttention would size its scores T x max_seq, so the past is bound empty and the T rows it
        returns (past + new = new) land in staging, as for any other graph. Its binding is kept while the
        slabs are the same (same batch, same buffer memory)."""
        if graph not in self.shared_kv or (buffer.length == 0 and steps > 1):
            binding = session.io_binding()
            return binding, self._bind_kv(binding, buffer, batch, steps)
        whole, present = buffer.shared(batch, steps)
        key = (batch, whole[0].ctypes.data, whole[-1].ctypes.data)
        kept = self._kept.get(graph)
        if kept is None or kept[0] != key:
            binding = session.io_binding()
            names = zip(self.layout.past_names, self.layout.present_names)
            for (past_name, present_name), rows in zip(names, whole):
                value = ort.OrtValue.ortvalue_from_numpy(rows)
                binding.bind_ortvalue_input(past_name, value)
                binding.bind_ortvalue_output(present_name, value)
            kept = self._kept[graph] = (key, binding)
        return kept[1], present

    def _bind_kv(self, binding: ort.IOBinding, buffer: KVBuffer, batch: int, steps: int) -> list:
        """Bind the past (the staging area's rows) and the present (new rows into staging); the new rows."""
        for name, array in zip(self.layout.past_names, buffer.past(batch)):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        present = buffer.present(batch, steps)
        for name, array in zip(self.layout.present_names, present):
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
        return present


def _shrink_arena_options(session: ort.InferenceSession) -> ort.RunOptions | None:
    """Run options that hand the CPU arena's free chunks back after a run: a prefill of thousands of
    tokens grows the arena by hundreds of MB, and decode steps that then run inside the fragmented arena
    were 1.3-1.6x slower (docs/benchmarks.md). None on other providers (not measured there)."""
    if session.get_providers()[0] != "CPUExecutionProvider":
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


class OrtSession(Session):
    """Load an engine folder once; ``generate`` many times. The KV buffer is allocated once per
    session (and again only for a larger batch than any before). ``PopSession``: its deprecated name.

    ``io_binding=False`` runs the graphs with plain ``InferenceSession.run`` (past rows copied into
    the feeds, outputs allocated by onnxruntime): kept for measurements (benchmarks/ttft.py).

    Loading checks every file it reads (engine/verify.py, docs/reliability.md): the manifest's types,
    every path inside the folder, graphs and weights by size and sha256 (a verified hash is remembered in
    ``hash_cache``, default ``HashCache.default()``: ~/.cache/popcompile/verified), the graphs' external
    data and their inputs/outputs against kv_layout. Any failure is an EngineError naming the file."""

    def __init__(self, folder: str | Path, *, provider: str = "cpu", threads: int | None = None,
                 io_binding: bool = True, min_prompt_tokens: int | None = None,
                 hash_cache: HashCache | None = None, manifest: EngineManifest | None = None):
        # min_prompt_tokens: shorter prompts prefill in full; None: the manifest's, 0: always POP
        # manifest: None reads the folder's (Session._read_manifest)
        self._read_manifest(folder, min_prompt_tokens, manifest)
        providers = provider_list(provider)
        check_precision(self.manifest, provider)
        options = session_options(threads)
        if not isinstance(io_binding, bool):
            raise ConfigError(f"io_binding={io_binding!r} must be True or False")
        paths = verify_folder(self.folder, self.manifest, hash_cache or HashCache.default())
        for name in self.manifest.graphs:
            check_external_data(self.folder, paths[name], self.manifest.weights)
        self.sessions = {name: load_graph(paths[name], options, providers) for name in self.manifest.graphs}
        self._check_signatures()
        if "vision" in paths:  # a vision-language engine: its image path (multimodal.py)
            check_external_data(self.folder, paths["vision"], self.manifest.weights)
            vision = load_graph(paths["vision"], options, providers)
            self.images = Images(self.manifest.vision_section(self.folder),
                                 lambda feeds: vision.run(None, feeds), np.dtype(self.manifest.dtype))
        shared = frozenset(g for g in self.sessions if self.manifest.shares_kv(g))
        self.backend = BoundBackend(self.sessions, self.layout, shared) if io_binding else HostBackend(
            self._run, frozenset(g for g in self.sessions if self.manifest.has_logits(g)), shared)
        self._read_tokenizer(vocab_size(self.sessions["decode"]))
        self.buffer: KVBuffer | None = None
        self.allocations = 0

    def _check_signatures(self) -> None:
        for name, session in self.sessions.items():
            check_signature(self.folder, name, session, self.manifest)
        kv = self.layout.past_names
        if signature(self.sessions["prefill"], kv) != signature(self.sessions["decode"], kv):
            raise EngineError(f"{self.folder}: prefill and decode graphs declare different KV inputs: "
                              "re-export")

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.sessions[graph].run(None, feeds)

    def _buffer(self, batch: int) -> KVBuffer:
        if self.buffer is None or self.buffer.batch < batch:
            self.buffer = KVBuffer(self.layout, batch)
            self.allocations += 1
        return self.buffer

    def _graphs(self, batch: int) -> tuple[BoundBackend | HostBackend, KVBuffer]:
        return self.backend, self._buffer(batch)


#: earlier names (deprecated) -> their current ones: the same objects, with a DeprecationWarning on use
_RENAMED = {"PopSession": "OrtSession"}


def __getattr__(name: str):
    if name in _RENAMED:
        warnings.warn(f"popcompile.runtime.ort.{name} is deprecated: use {_RENAMED[name]} (the same class)",
                      DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
