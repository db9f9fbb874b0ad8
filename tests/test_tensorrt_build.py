"""TensorRT engines and runtime, as far as a machine without a GPU can take them.

- the build configuration and the optimization profiles computed from a manifest (pure python);
- ``build_engines`` on a tiny exported engine folder: graphs checked and profiles computed, then it stops
  at GPU detection with a TensorRTUnavailable naming the need (on a GPU machine: real plans are built);
- the CLI without a GPU: exit 3 and one line naming the NVIDIA GPU and what to run instead;
- the TensorRT runtime's memory plan (one KV buffer with a sentinel row, bindings by address, 2D copies,
  CUDA graph replay) run end to end on the CPU: ``TrtSession.from_parts`` over emulated execution
  contexts that read and write a host byte array at the bound addresses and run the same ONNX graphs
  with onnxruntime. Its logits must equal OrtSession's (onnxruntime on the host KV buffer) at every step.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cli_lines import error_lines

from popcompile.engine.manifest import MANIFEST, EngineError, EngineManifest
from popcompile.engine.tensorrt import PLANS, Profile, ShapeRange, TensorRTUnavailable, TrtSection
from popcompile.errors import ConfigError
from popcompile.exporters.targets import OnnxTarget
from popcompile.exporters.tensorrt import TrtBuildConfig, build_engines, has_sliding_window, profiles
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import Sampler, SamplingConfig
from popcompile.runtime.trt import EngineIO, TrtSession, resolve_binding

HAS_GPU_STACK = shutil.which("nvidia-smi") is not None and importlib.util.find_spec("tensorrt") is not None
LOGITS_ATOL = 1e-5  # same ONNX graphs on the same CPU; only masked (zero-weight) rows differ in number


def _engine(engines, model_type: str, boundary: str = "folded", **model_kwargs) -> Path:
    return engines.tiny(model_type, model={"layers": 2, **model_kwargs}, max_seq=48, boundary=boundary,
                        target=OnnxTarget(attention="standard"))  # TensorRT takes standard ops only


@pytest.fixture(scope="module")
def llama_engine(engines) -> Path:
    """One KV head, so batch 1 binds in place (B * H == 1) and batch 2 does not."""
    return _engine(engines, "llama", kv_heads=1)


@pytest.fixture(scope="module")
def llama_separate_engine(engines) -> Path:
    """x_N as its own step after a prefill of x_1..x_{N-1}: the prefill engine has no logits output."""
    return _engine(engines, "llama", boundary="separate", kv_heads=1)


@pytest.fixture(scope="module")
def gemma_engine(engines) -> Path:
    """Sliding-window layers: the static binding is refused, decode steps gather their rows."""
    return _engine(engines, "gemma3_text")


# --------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "int8"}, "precision"), ({"workspace_gb": 0}, "workspace_gb"),
    ({"workspace_gb": float("nan")}, "workspace_gb"), ({"opt_seq": 0}, "opt_seq"),
    ({"max_batch": 2, "opt_batch": 3}, "opt_batch=3 exceeds max_batch=2"), ({"max_batch": True}, "max_batch"),
    ({"optimization_level": 6}, "optimization_level"), ({"timing_cache": ""}, "timing_cache"),
])
def test_build_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrtBuildConfig(**kwargs)


def test_shape_range_has_no_zero_length_dims():
    with pytest.raises(ValueError, match="1 <= min"):
        ShapeRange((1, 0), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="1 <= min"):
        ShapeRange((1, 4), (1, 2), (1, 8))


@pytest.mark.parametrize("static", [True, False])
def test_profiles_from_manifest(llama_engine, static):
    layout = EngineManifest.read(llama_engine).kv_layout
    config = TrtBuildConfig(opt_seq=16, opt_batch=2, max_batch=4)
    plan = profiles(layout, config, static_decode=static)
    names = {k: [p.name for p in v] for k, v in plan.items()}
    assert names == {"prefill": ["prefill"], "decode": ["step", "prompt"]}
    rows = layout.max_seq + 1
    step = plan["decode"][0].shapes
    assert step["input_ids"] == ShapeRange((1, 1), (2, 1), (4, 1))
    assert step[layout.past_names[0]].max == (4, layout.num_kv_heads, rows, layout.head_dim)
    assert step[layout.past_names[-1]].opt[2] == (rows if static else 17)
    for profile in (*plan["prefill"], plan["decode"][1]):
        assert profile.shapes["input_ids"] == ShapeRange((1, 1), (2, 16), (4, layout.max_seq - 1))
        assert {profile.shapes[n].min[2] for n in layout.past_names} == {1}  # the sentinel row, never 0
        assert {profile.shapes[n].max[2] for n in layout.past_names} == {1}
    for profile in (*plan["prefill"], *plan["decode"]):
        assert set(profile.shapes) == {"input_ids", "position_ids", "attention_mask", *layout.past_names}
        past, seq, mask = (profile.shapes[n] for n in (layout.past_names[0], "input_ids", "attention_mask"))
        for point in ("min", "opt", "max"):  # mask = past + seq at each point TensorRT checks shapes at
            assert getattr(mask, point)[1] == getattr(past, point)[2] + getattr(seq, point)[1]
        assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_sliding_window_from_config(llama_engine, gemma_engine, tmp_path):
    assert not has_sliding_window(llama_engine)
    assert has_sliding_window(gemma_engine)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": 4096}))
    assert has_sliding_window(tmp_path)


# --------------------------------------------------------------------------------------------- build

def test_build_runs_to_gpu_detection(llama_engine):
    """Without a GPU the graphs are checked and the profiles computed, then TensorRTUnavailable says why."""
    if HAS_GPU_STACK:
        pytest.skip("this machine has an NVIDIA GPU and tensorrt: test_build_on_gpu builds for real")
    before = (llama_engine / MANIFEST).read_text()
    steps = []
    with pytest.raises(TensorRTUnavailable, match="need an NVIDIA GPU") as err:
        build_engines(llama_engine, TrtBuildConfig(opt_seq=16), progress=steps.append)
    assert steps == ["check graphs", "detect GPU"]
    assert "popcompile check DIR --target tensorrt" in str(err.value)
    assert (llama_engine / MANIFEST).read_text() == before  # nothing written
    assert not any((llama_engine / plan).exists() for plan in PLANS.values())


def test_build_on_gpu(llama_engine, tmp_path):
    if not HAS_GPU_STACK:
        try:
            build_engines(llama_engine)
        except TensorRTUnavailable as err:
            pytest.skip(f"needs an NVIDIA GPU and tensorrt: {err}")
    folder = shutil.copytree(llama_engine, tmp_path / "engine")
    section = build_engines(folder, TrtBuildConfig(precision="fp32", opt_seq=16))
    assert all((folder / plan).stat().st_size > 0 for plan in PLANS.values())
    assert (folder / "timing.cache").is_file()
    assert TrtSection.from_manifest(EngineManifest.read(folder)) == section
    prompt = [5, 9, 11, 3, 7]
    expected = OrtSession(folder).generate([prompt], SamplingConfig(max_new_tokens=6))[0].token_ids
    assert TrtSession(folder).generate([prompt], SamplingConfig(max_new_tokens=6))[0].token_ids == expected


def test_build_needs_the_onnx_graphs(llama_engine, tmp_path):
    folder = shutil.copytree(llama_engine, tmp_path / "engine")
    (folder / "prefill.onnx").unlink()
    with pytest.raises(EngineError, match="prefill.onnx is missing"):
        build_engines(folder)


@pytest.mark.skipif(HAS_GPU_STACK, reason="this machine can build TensorRT engines")
@pytest.mark.parametrize("command", ["build-trt", "export"])
def test_cli_without_gpu_names_the_need(command, llama_engine, cli, tmp_path):
    args = ["build-trt", str(llama_engine)] if command == "build-trt" else [
        "export", "smollm2-135m", "--out", str(tmp_path / "new"), "--target", "tensorrt"]
    result = cli(*args, check=False)
    assert result.returncode == 3, result.stderr  # the machine lacks it: a skip, not a mistake
    lines = error_lines(result.stderr)  # after the steps that ran (progress lines, in a log)
    assert len(lines) == 1 and lines[0].startswith(f"popcompile {command}: error: ")
    assert "NVIDIA GPU" in lines[0] and "popcompile export MODEL --out DIR" in lines[0]


def test_trt_session_needs_built_engines(llama_engine):
    with pytest.raises(EngineError, match="build-trt"):
        TrtSession(llama_engine)


def test_runtime_import_is_light():
    code = ("import sys, popcompile.runtime.trt; "
            "print(sorted(m for m in ('tensorrt', 'torch', 'cuda', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------------------------- runtime

class HostDevice:
    """Device memory as one host byte array; a pointer is an offset plus BASE (so 0 is never valid)."""

    BASE = 1 << 16

    def __init__(self, capacity: int = 32 << 20):
        self.memory = np.zeros(capacity, np.uint8)
        self.top, self.allocs, self.stream, self.recording = self.BASE, 0, 7, None

    def alloc(self, nbytes: int) -> int:
        ptr, self.top = self.top, self.top + -(-max(nbytes, 1) // 256) * 256
        assert self.top - self.BASE <= self.memory.size, "emulated device memory exhausted"
        self.allocs += 1
        return ptr

    def bytes(self, ptr: int, nbytes: int) -> np.ndarray:
        assert self.BASE <= ptr and ptr + nbytes <= self.top, f"access outside allocations at {ptr}+{nbytes}"
        return self.memory[ptr - self.BASE: ptr - self.BASE + nbytes]

    def zero(self, ptr, nbytes):
        self.bytes(ptr, nbytes)[:] = 0

    def upload(self, ptr, array):
        self.bytes(ptr, array.nbytes)[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def download(self, array, ptr):
        array.reshape(-1).view(np.uint8)[:] = self.bytes(ptr, array.nbytes)

    def copy2d(self, dst, dpitch, src, spitch, width, height):
        assert width <= dpitch and width <= spitch
        for row in range(height):
            self.bytes(dst + row * dpitch, width)[:] = self.bytes(src + row * spitch, width).copy()

    def synchronize(self):
        pass

    def capture(self, launch):
        self.recording = []
        launch()
        graph, self.recording = self.recording, None
        assert graph, "nothing was captured"
        return graph

    def replay(self, graph):
        for context, state in graph:
            context.run(state)


class EmulatedContext:
    """An execution context of one profile: refuses shapes outside it (as TensorRT does), and runs the ONNX
    graph with onnxruntime on the tensors at the bound addresses, writing the outputs at theirs."""

    def __init__(self, session: ort.InferenceSession, profile: Profile, device: HostDevice, dtypes: dict):
        self.session, self.profile, self.device, self.dtypes = session, profile, device, dtypes
        self.shapes, self.addresses, self.runs = {}, {}, 0

    def set_input_shape(self, name, shape):
        if not self.profile.shapes[name].covers(tuple(shape)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream):
        assert stream == self.device.stream
        state = (dict(self.shapes), dict(self.addresses))
        if self.device.recording is not None:  # captured: replayed later with these shapes and addresses
            self.device.recording.append((self, state))
        else:
            self.run(state)
        return True

    def run(self, state):
        shapes, addresses = state
        feeds = {}
        for arg in self.session.get_inputs():
            dtype = np.dtype(self.dtypes[arg.name])
            raw = self.device.bytes(addresses[arg.name], int(np.prod(shapes[arg.name])) * dtype.itemsize)
            feeds[arg.name] = raw.view(dtype).reshape(shapes[arg.name]).copy()
        for arg, value in zip(self.session.get_outputs(), self.session.run(None, feeds)):
            self.device.upload(addresses[arg.name], value)
        self.runs += 1


def emulated_session(folder: Path, *, max_batch: int, kv_binding: str = "auto", cuda_graph: bool = False,
                     min_prompt_tokens: int | None = None):
    manifest = EngineManifest.read(folder)
    static = not has_sliding_window(folder)
    config = TrtBuildConfig(precision="fp32", opt_seq=16, max_batch=max_batch)
    plan = profiles(manifest.kv_layout, config, static_decode=static)
    section = TrtSection(
        tensorrt_version="emulated", gpu="none", compute_capability="none", precision="fp32",
        workspace_gb=1.0, max_batch=max_batch, sentinel_rows=1, decode_kv="static" if static else "gather",
        plans={name: {"file": file, "bytes": 0, "sha256": ""} for name, file in PLANS.items()},
        profiles={k: [p.to_dict() for p in v] for k, v in plan.items()}, onnx_sha256={}, timing_cache="",
        build_seconds={})
    sessions = {name: ort.InferenceSession(str(folder / f"{name}.onnx")) for name in PLANS}
    types = {"tensor(float)": "float32", "tensor(int64)": "int64"}
    dtypes = {a.name: types[a.type] for s in sessions.values() for a in [*s.get_inputs(), *s.get_outputs()]}
    device = HostDevice()
    contexts = {"prefill": EmulatedContext(sessions["prefill"], plan["prefill"][0], device, dtypes),
                **{p.name: EmulatedContext(sessions["decode"], p, device, dtypes) for p in plan["decode"]}}
    io = EngineIO(dtypes, sessions["decode"].get_outputs()[0].shape[-1])
    return TrtSession.from_parts(folder, section, contexts, io, device, kv_binding=kv_binding,
                                 cuda_graph=cuda_graph, min_prompt_tokens=min_prompt_tokens)


@pytest.fixture
def sampled_logits(monkeypatch) -> list[np.ndarray]:
    """The logits of every step any generation samples from (both runtimes share loop.Generation's
    Sampler)."""
    logits, call = [], Sampler.__call__

    def recording(self, step_logits):
        logits.append(np.array(step_logits))
        return call(self, step_logits)

    monkeypatch.setattr(Sampler, "__call__", recording)
    return logits


# left padding: the second row starts at column 5
PROMPTS = [[5, 9, 11, 3, 7, 40, 41, 60, 8], [12, 13, 70, 71]]


@pytest.mark.parametrize("engine, batch, binding, graph, mode", [
    ("llama_engine", 1, "auto", False, "pop"),      # B * H == 1: bound in place, no copies
    ("llama_engine", 2, "auto", False, "pop"),      # static: whole block bound, present rows copied in
    ("llama_engine", 2, "static", True, "pop"),     # static + CUDA graph replayed for every later step
    ("llama_engine", 2, "gather", False, "full"),   # rows gathered; --full runs the prompt profile
    ("gemma_engine", 2, "auto", False, "pop"),      # sliding windows: gather
    ("gemma_engine", 1, "auto", False, "full"),
    ("llama_separate_engine", 2, "static", True, "pop"),  # boundary step on the step profile
])
def test_emulated_trt_session_matches_onnxruntime(engine, batch, binding, graph, mode, request,
                                                   sampled_logits):
    folder = request.getfixturevalue(engine)
    trt_session = emulated_session(folder, max_batch=batch, kv_binding=binding, cuda_graph=graph)
    ort_session = OrtSession(folder)
    sampling = SamplingConfig(max_new_tokens=7)
    allocs = trt_session.device.allocs
    for _ in range(2):  # a second generation reuses every buffer: nothing is allocated again
        sampled_logits.clear()
        results = trt_session.generate(PROMPTS[:batch], sampling, mode=mode)
        got = list(sampled_logits)
        sampled_logits.clear()
        reference = ort_session.generate(PROMPTS[:batch], sampling, mode=mode)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        assert len(got) == len(sampled_logits) > 1
        for step, (a, b) in enumerate(zip(got, sampled_logits)):
            assert a.shape == b.shape == (batch, 97)
            assert np.abs(a - b).max() <= LOGITS_ATOL, f"step {step}"
    assert trt_session.device.allocs == allocs
    if graph:  # one capture per batch size; every decode step ran once, captured or replayed
        assert set(trt_session.graphs) == {batch}
        # with the boundary folded into the prefill engine, the first token's logits come from it
        first_from_prefill = mode == "pop" and trt_session.manifest.boundary == "folded"
        assert trt_session.contexts["step"].runs == 2 * (len(got) - first_from_prefill)


def test_emulated_session_refuses_more_prompts_than_max_batch(llama_engine):
    session = emulated_session(llama_engine, max_batch=1)
    with pytest.raises(ValueError, match="max batch 1.*--max-batch 2"):
        session.generate(PROMPTS, SamplingConfig(max_new_tokens=2))


def test_both_sessions_take_one_min_prompt_tokens_rule(llama_engine):
    """One session setup (runtime/session.py): the override, the manifest's default and the refusal are the
    same for onnxruntime and TensorRT, and a prompt under the threshold prefills with the full model in
    both."""
    one = [PROMPTS[0]]  # 9 tokens
    makers = (lambda **kw: OrtSession(llama_engine, **kw),
              lambda **kw: emulated_session(llama_engine, max_batch=1, **kw))
    for make in makers:
        assert make().min_prompt_tokens == EngineManifest.read(llama_engine).min_prompt_tokens == 0
        session = make(min_prompt_tokens=10)
        assert session.min_prompt_tokens == 10
        assert session.generate(one, SamplingConfig(max_new_tokens=1))[0].prefill == "full"  # 9 < 10
        assert make(min_prompt_tokens=9).generate(one, SamplingConfig(max_new_tokens=1))[0].prefill == "pop"
        with pytest.raises(ConfigError, match=r"min_prompt_tokens=-1 must be an integer >= 0"):
            make(min_prompt_tokens=-1)


def test_binding_choices(llama_engine, gemma_engine):
    gemma = emulated_session(gemma_engine, max_batch=1).section
    with pytest.raises(ValueError, match="sliding-window"):
        resolve_binding("static", gemma, cuda_graph=False)
    with pytest.raises(ValueError, match="CUDA graph"):
        resolve_binding("auto", gemma, cuda_graph=True)
    llama = emulated_session(llama_engine, max_batch=1).section
    assert resolve_binding("auto", llama, cuda_graph=True) == "static"
    with pytest.raises(ValueError, match="CUDA graph"):
        resolve_binding("gather", llama, cuda_graph=True)
    with pytest.raises(ValueError, match="kv_binding"):
        resolve_binding("paged", llama, cuda_graph=False)
