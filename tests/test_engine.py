"""ONNX engine folders on the real models: numerics, the CLI end to end, the KV contract, bad input."""
from __future__ import annotations

import inspect
import json
import json.decoder
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from cli_lines import error_lines
from tiny import empty_past

from popcompile import reference
from popcompile.engine.kv import KVLayout
from popcompile.engine.manifest import MANIFEST, EngineManifest
from popcompile.errors import InputError
from popcompile.exporters.targets import OnnxTarget
from popcompile.runtime.kvbuffer import KVBuffer
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

ONNX_ATOL = 1e-4  # fp32 ORT vs eager torch logits: different kernels, same math
# K/V are compared relative to their size: Gemma 3's values reach ~100, where 1e-4 absolute is below
# fp32's resolution after a different summation order.
KV_RTOL = KV_ATOL = 1e-4
MAX_SEQ = 512
PROMPT = inspect.getsource(json.decoder)[:1200]  # real text, a few hundred tokens


@pytest.fixture(scope="module")
def smol_engine(engines) -> Path:
    """Exported through the CLI (itself the end-to-end test of `popcompile export` on a real model), once per
    run."""
    from popcompile.cli import main

    args = ["--max-seq", str(MAX_SEQ), "--kv-calibration", "none", "--min-prompt-tokens", "0",
            "--prune-ratio", "1/3"]  # the paper's cut, 20 (the floor's own CLI test: test_floor.py)
    build = lambda out: main(["export", "smollm2-135m", "--out", str(out), *args])
    return engines.get("smollm2-cli", build, args)


@pytest.fixture(scope="module")
def gemma_engine(real_engines) -> Path:
    """Standard ONNX ops (smol_engine has the default, onnxruntime's fused attention): both lowerings meet
    every real-model test, and this one is what TensorRT takes."""
    return real_engines.real("gemma3-270m", max_seq=MAX_SEQ, target=OnnxTarget(attention="standard"))


@pytest.fixture(scope="module")
def smol(real_model):
    return real_model("smollm2-135m")


def _ids(folder: Path, text: str = PROMPT) -> list[int]:
    return OrtSession(folder).tokenizer.encode(text)[:300]


@pytest.mark.parametrize("which", ["smol_engine", "gemma_engine"])
def test_decode_logits_and_prefill_kv_match_torch(which, request, real_model):
    folder = request.getfixturevalue(which)
    manifest = EngineManifest.read(folder)
    loaded = real_model(manifest.model["name"])
    session = OrtSession(folder)
    ids = np.array([_ids(folder)], dtype=np.int64)
    n = ids.shape[1]
    past = [t.numpy() for t in empty_past(manifest.kv_layout)]
    feeds = {"input_ids": ids, "position_ids": np.arange(n)[None],
             "attention_mask": np.ones((1, n), np.int64), **dict(zip(manifest.kv_layout.past_names, past))}
    logits = session.sessions["decode"].run(None, feeds)[0]
    prompt = torch.from_numpy(ids)
    with torch.no_grad():
        expected = loaded.model(prompt).logits[:, -1].numpy()
        # x_1..x_{N-1}, pruned
        pop_cache = reference.prefill_cache(loaded.model, prompt[:, :-1], manifest.cut)
        run = reference.PopRun(loaded.model, reference.Variant(cut=manifest.cut), n)
        first = run.prefill(prompt).numpy()  # x_N's logits after the boundary step
    assert np.abs(logits - expected).max() <= ONNX_ATOL
    assert manifest.boundary == "folded"  # one prefill call: x_N's logits, then every row's K/V
    pop_logits, *kv = session.sessions["prefill"].run(None, feeds)
    assert np.abs(pop_logits - first).max() <= ONNX_ATOL
    for i, (layer, true) in enumerate(zip(pop_cache.layers, run.cache.layers)):
        for name, got, want, last in (("K", kv[2 * i], layer.keys, true.keys),
                                      ("V", kv[2 * i + 1], layer.values, true.values)):
            np.testing.assert_allclose(got[:, :, :-1], want.numpy(), rtol=KV_RTOL, atol=KV_ATOL,
                                       err_msg=f"{name} {i}")
            np.testing.assert_allclose(got[:, :, -1:], last[:, :, -1:].numpy(), rtol=KV_RTOL, atol=KV_ATOL,
                                       err_msg=f"{name} {i}, x_N's row")


def test_cli_run_equals_eager_pop_reference(smol_engine, smol, cli):
    out = json.loads(cli("run", str(smol_engine), "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "24",
                         "--json").stdout)
    assert out["mode"] == "pop" and out["ttft_s"] > 0 and out["decode_tokens_per_s"] > 0
    prompt = torch.tensor([out["prompt_token_ids"]])
    manifest = EngineManifest.read(smol_engine)
    expected = reference.generate(smol.model, prompt, 24, reference.Variant(cut=manifest.cut), eos_token_id=2)
    assert out["token_ids"] == expected


def test_cli_full_mode_equals_hf_generate(smol_engine, smol, cli):
    out = json.loads(cli("run", str(smol_engine), "--prompt", "Name three colors.", "--max-new-tokens", "16",
                         "--full", "--json").stdout)
    prompt = torch.tensor([out["prompt_token_ids"]])
    expected = smol.model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert out["mode"] == "full" and out["token_ids"] == expected


def test_batch_of_different_lengths_equals_single_prompts(smol_engine):
    session = OrtSession(smol_engine)
    prompts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog because"]
    sampling = SamplingConfig(max_new_tokens=10)
    batched = session.generate(prompts, sampling, chat=False)
    single = [session.generate(p, sampling, chat=False)[0] for p in prompts]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]


def test_stream_yields_each_rows_text_as_it_decodes(smol_engine):
    """session.stream: pieces tagged with their prompt's row concatenate to generate's texts; nothing runs
    before the first piece is asked for; on_text gets every row's pieces, not only the first's."""
    session = OrtSession(smol_engine)
    prompts = ["Write a haiku about rivers in Japanese (日本語):", "The quick brown fox"]
    sampling = SamplingConfig(max_new_tokens=24)
    expected = [r.text for r in session.generate(prompts, sampling, chat=False)]
    stream = session.stream(prompts, sampling, chat=False)
    assert session.cache_length == 0  # a generator: not started yet
    pieces = list(stream)
    assert len(pieces) > 2 and {p.row for p in pieces} == {0, 1}
    assert ["".join(p for p in pieces if p.row == row) for row in (0, 1)] == expected
    seen = []
    session.generate(prompts, sampling, chat=False, on_text=seen.append)
    assert [(p.row, str(p)) for p in seen] == [(p.row, str(p)) for p in pieces]


def test_streamed_text_stops_before_a_stop_string_and_decodes_incrementally(smol_engine, monkeypatch):
    """Stop strings never reach the stream; each token is detokenised once (DecodeStream), not the whole
    output again per token: the full decode runs only once per row, at the end."""
    session = OrtSession(smol_engine)
    free = session.generate("def add(a, b):", SamplingConfig(max_new_tokens=24), chat=False)[0].text
    stop = free.strip().split()[2]  # a word the free run reaches
    calls = []
    decode = type(session.tokenizer).decode
    monkeypatch.setattr(type(session.tokenizer), "decode", lambda self, ids, **kw: calls.append(1) or decode(
        self, ids, **kw))
    sampling = SamplingConfig(max_new_tokens=24, stop=(stop,))
    pieces = list(session.stream("def add(a, b):", sampling, chat=False))
    text = "".join(pieces)
    assert stop not in text and text == free[:free.find(stop)]
    assert len(calls) == 1


CHAT = [{"role": "user", "content": "Name three prime numbers."}]


def test_chat_turns_keep_the_cache_and_equal_the_reference(smol_engine, smol):
    """Turn 2 prefills only what turn 1 did not leave in the cache (POP on the new tokens, after the
    cached rows), and its greedy reply equals reference.PopRun doing the same in PyTorch."""
    session, sampling = OrtSession(smol_engine), SamplingConfig(max_new_tokens=12)
    first = session.chat(CHAT, sampling)
    second_turn = CHAT + [{"role": "assistant", "content": first.text},
                          {"role": "user", "content": "Two more?"}]
    second = session.chat(second_turn, sampling)
    assert first.cached_tokens == 0 and second.cached_tokens > len(first.prompt_token_ids)
    assert second.prompt_token_ids == session.tokenizer.encode_chat(second_turn)

    run = reference.PopRun(smol.model, reference.Variant(cut=EngineManifest.read(smol_engine).cut), 0)
    prompt1, prompt2 = first.prompt_token_ids, second.prompt_token_ids
    reply1 = reference.greedy(run, run.extend(torch.tensor([prompt1]), 0), len(prompt1), 12, 2)
    assert reply1 == first.token_ids
    cached = prompt1 + reply1[:-1]
    kept = next(i for i, (a, b) in enumerate(zip(cached + [-1], prompt2)) if a != b)
    assert kept == second.cached_tokens
    reply2 = reference.greedy(run, run.extend(torch.tensor([prompt2[kept:]]), kept), len(prompt2), 12, 2)
    assert reply2 == second.token_ids


def test_chat_in_full_mode_equals_generating_from_the_whole_history(smol_engine):
    session, sampling = OrtSession(smol_engine), SamplingConfig(max_new_tokens=12)
    first = session.chat(CHAT, sampling, mode="full")
    turn = CHAT + [{"role": "assistant", "content": first.text},
                   {"role": "user", "content": "And their sum?"}]
    cached = session.chat(turn, sampling, mode="full")
    whole = session.generate([cached.prompt_token_ids], sampling, mode="full")[0]  # also ends the reuse
    assert cached.cached_tokens > 0 and cached.token_ids == whole.token_ids
    assert session.chat(turn, sampling, mode="full").cached_tokens == 0


def test_cli_chat_holds_a_conversation_on_stdin(smol_engine, cli):
    """`run --chat` without a prompt: one JSON object per stdin line; the second turn reuses the first's
    rows."""
    done = cli("run", smol_engine, "--chat", "--json", "--max-new-tokens", "8", "--greedy",
               input="Name a colour.\nAnother one?\n\nignored\n")
    turns = [json.loads(line) for line in done.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    assert turns[0]["cached_tokens"] == 0 and turns[1]["cached_tokens"] > len(turns[0]["prompt_token_ids"])


def test_chat_refuses_what_is_not_a_conversation(smol_engine):
    session = OrtSession(smol_engine)
    for bad in ("hello", [], [{"role": "user"}], [{"role": "user", "content": 3}]):
        with pytest.raises(InputError, match="messages must be"):
            session.chat(bad)
    with pytest.raises(InputError, match="more than the engine's max length"):
        session.chat([{"role": "user", "content": "word " * MAX_SEQ}])


def test_kv_buffer_allocated_once_and_signatures_equal(smol_engine):
    session = OrtSession(smol_engine)
    for prompt in ("one", "a longer second prompt", "third"):
        session.generate(prompt, SamplingConfig(max_new_tokens=3))
    assert session.allocations == 1
    graphs = {name: onnx.load(str(smol_engine / f"{name}.onnx"), load_external_data=False)
              for name in ("prefill", "decode")}
    kv = {name: [(v.name, str(v.type)) for v in g.graph.input if v.name.startswith("past_")]
          for name, g in graphs.items()}
    layers = EngineManifest.read(smol_engine).num_layers
    assert kv["prefill"] == kv["decode"] and len(kv["decode"]) == 2 * layers
    assert "dim_param: \"past\"" in kv["decode"][0][1]


def _rows(rng, batch: int, layout: KVLayout, steps: int) -> list[np.ndarray]:
    shape = (batch, layout.num_kv_heads, steps, layout.head_dim)
    return [rng.standard_normal(shape).astype(np.float32) for _ in layout.past_names]


def test_kv_buffer_hands_prefill_rows_to_the_next_step_without_a_copy():
    layout, rng = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, max_seq=16), np.random.default_rng(0)
    buffer = KVBuffer(layout, batch=2)
    prefill = buffer.present(2, 5)  # from an empty cache: where the prefill graph writes its rows
    for view, rows in zip(prefill, _rows(rng, 2, layout, 5)):
        view[...] = rows
    buffer.write(prefill, np.ones((2, 5), np.int64))
    past = buffer.past(2)
    assert all(np.shares_memory(a, b) and a.shape == (2, 2, 5, 4) for a, b in zip(past, prefill))
    np.testing.assert_array_equal(past[3], buffer.data[1, 1, :, :, :5])
    step = buffer.present(2, 1)  # after the past, never over it
    assert not any(np.shares_memory(a, b) for a in step for b in past)
    new = _rows(rng, 2, layout, 1)
    for view, rows in zip(step, new):
        view[...] = rows
    buffer.write(step, np.ones((2, 1), np.int64))
    expected = [np.concatenate([a.copy(), b], axis=2) for a, b in zip(prefill, new)]
    for got, want in zip(buffer.past(2), expected):  # gathered from the cache, 6 rows
        np.testing.assert_array_equal(got, want)
    buffer.reset()  # rows from outside the staging area (a plain backend's outputs) are copied, never aliased
    outside = _rows(rng, 1, layout, 3)
    buffer.write(outside, np.ones((1, 3), np.int64))
    for got, want in zip(buffer.past(1), outside):
        np.testing.assert_array_equal(got, want)
        assert not np.shares_memory(got, want)


def test_kv_buffer_with_one_kv_head_lets_graphs_read_and_write_the_cache_in_place():
    layout, rng = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, max_seq=16), np.random.default_rng(1)
    buffer = KVBuffer(layout, batch=2)
    assert buffer.in_place(1) and not buffer.in_place(2)
    for steps in (5, 1):
        views, rows = buffer.present(1, steps), _rows(rng, 1, layout, steps)
        assert all(np.shares_memory(v, buffer.data) and v.flags.c_contiguous for v in views)
        for view, new in zip(views, rows):
            view[...] = new
        start = buffer.length
        buffer.write(views, np.ones((1, steps), np.int64))
        np.testing.assert_array_equal(buffer.data[1, 0, 0, 0, start:start + steps], rows[2][0, 0])
    past = buffer.past(1)
    assert all(np.shares_memory(p, buffer.data) and p.shape == (1, 1, 6, 4) for p in past)


def test_kv_buffer_shared_binds_the_cache_itself_and_write_copies_nothing():
    """A buffer-sharing graph (manifest attention.shared_kv) gets each layer's whole cache rows; the rows it
    writes are the cache's, so ``write`` only moves the length and the mask, and staging is never claimed."""
    layout, rng = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, max_seq=16), np.random.default_rng(2)
    buffer = KVBuffer(layout, batch=3)
    for steps in (1, 4, 1):  # a one-token prompt, a chat turn after it, a decode step
        whole, new = buffer.shared(2, steps)
        assert all(w.shape == (2, 2, 16, 4) and w.flags.c_contiguous and np.shares_memory(w, buffer.data)
                   for w in whole)
        start, rows = buffer.length, _rows(rng, 2, layout, steps)
        for view, value in zip(new, rows):  # what the graph does: its new rows at length..length+steps-1
            view[...] = value
        data = buffer.data.copy()
        buffer.write(new, np.ones((2, steps), np.int64))
        np.testing.assert_array_equal(buffer.data, data)
        np.testing.assert_array_equal(buffer.data[1, 0, :2, :, start:start + steps], rows[2])
    for got, want in zip(buffer.past(2), buffer.data.reshape(4, 3, 2, 16, 4)):  # gathered, not stale staging
        np.testing.assert_array_equal(got, want[:2, :, :6])
    buffer.shared(1, 10)
    with pytest.raises(InputError, match="KV buffer full"):
        buffer.shared(1, 11)


@pytest.fixture(scope="module")
def tiny_llama_engine(engines) -> Path:
    return engines.tiny("llama", cut=3, max_seq=64)


@pytest.fixture(scope="module")
def tiny_one_kv_head_engine(engines) -> Path:
    """One KV head: at batch 1 the graphs bind the cache rows themselves (KVBuffer.in_place)."""
    return engines.tiny("llama", model={"kv_heads": 1}, cut=3, max_seq=64)


@pytest.fixture(scope="module")
def tiny_separate_engine(engines) -> Path:
    """The boundary step as its own decode-graph call (boundary="separate")."""
    return engines.tiny("llama", cut=3, max_seq=64, boundary="separate")


def test_folded_and_separate_boundaries_generate_the_same(tiny_llama_engine, tiny_separate_engine):
    prompts = [[5, 9, 12, 40, 41, 7, 3, 88, 19], [61, 3, 70], [44]]
    sampling = SamplingConfig(max_new_tokens=6)
    folded, separate = OrtSession(tiny_llama_engine), OrtSession(tiny_separate_engine)
    assert (folded.manifest.boundary, separate.manifest.boundary) == ("folded", "separate")
    assert [s.name for s in folded.sessions["prefill"].get_outputs()][0] == "logits"
    assert "logits" not in [s.name for s in separate.sessions["prefill"].get_outputs()]
    for batch in (prompts[:2], prompts[:1], prompts[2:]):
        assert ([r.token_ids for r in folded.generate(batch, sampling)] ==
                [r.token_ids for r in separate.generate(batch, sampling)])


def test_format_version_1_engines_still_run_as_separate(tiny_separate_engine, tmp_path):
    engine = _copy(tiny_separate_engine, tmp_path)
    data = json.loads((engine / MANIFEST).read_text())
    del data["boundary"]
    (engine / MANIFEST).write_text(json.dumps({**data, "format_version": 1}))
    session = OrtSession(engine)
    assert session.manifest.boundary == "separate"
    assert len(session.generate([[5, 9, 12, 40]], SamplingConfig(max_new_tokens=3))[0].token_ids) == 3


@pytest.mark.parametrize("engine", ["tiny_llama_engine", "tiny_one_kv_head_engine", "tiny_separate_engine"])
@pytest.mark.parametrize("mode", ["pop", "full"])
def test_io_binding_generates_what_plain_run_generates(engine, mode, request):
    folder = request.getfixturevalue(engine)
    prompts = [[5, 9, 12, 40, 41, 7, 3, 88, 19], [61, 3, 70]]  # left-padded batch of two lengths
    sampling = SamplingConfig(max_new_tokens=6)
    bound, plain = OrtSession(folder), OrtSession(folder, io_binding=False)
    for batch in (prompts, prompts[:1]):
        got = [r.token_ids for r in bound.generate(batch, sampling, mode=mode)]
        assert got == [r.token_ids for r in plain.generate(batch, sampling, mode=mode)]
        assert all(len(tokens) == 6 for tokens in got)
    assert bound.allocations == 1


def test_weights_are_stored_once(smol_engine, smol):
    manifest = EngineManifest.read(smol_engine)
    params = sum(p.numel() for p in smol.model.parameters()) * 4
    assert manifest.weights["bytes"] <= params * 1.02  # one copy (tied embedding counted once)


def _copy(engine: Path, tmp_path: Path) -> Path:
    target = tmp_path / "engine"
    target.mkdir()
    for item in engine.iterdir():
        (target / item.name).hardlink_to(item)  # a symlink out of the folder is refused (docs/reliability.md)
    (target / MANIFEST).unlink()
    shutil.copy(engine / MANIFEST, target / MANIFEST)
    return target


@pytest.fixture
def cli_error(cli):
    """``cli_error(*args)``: the CLI's one-line error (exit 2, no traceback)."""
    return lambda *args: _one_line(cli(*args, check=False))


def _one_line(result) -> str:
    """The error line (after the progress lines of the steps that ran, in a log)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(error_lines(result.stderr)) == 1, result.stderr
    return error_lines(result.stderr)[0]


def test_bad_engine_folders(smol_engine, tmp_path, cli_error):
    assert "does not exist" in cli_error("run", str(tmp_path / "nope"), "--prompt", "hi")
    assert "not a popcompile engine folder" in cli_error("run", str(tmp_path), "--prompt", "hi")
    engine = _copy(smol_engine, tmp_path)
    data = json.loads((engine / MANIFEST).read_text())
    (engine / MANIFEST).write_text(json.dumps({**data, "format_version": 99}))
    assert "format version 99" in cli_error("run", str(engine), "--prompt", "hi")
    (engine / MANIFEST).write_text("{ not json")
    assert "corrupt" in cli_error("info", str(engine))
    (engine / MANIFEST).write_text(json.dumps(data))
    (engine / "prefill.onnx").unlink()
    assert "prefill.onnx is missing" in cli_error("run", str(engine), "--prompt", "hi")


def test_bad_run_input(smol_engine, cli_error):
    assert "empty" in cli_error("run", smol_engine, "--prompt", "")
    assert "max length" in cli_error("run", smol_engine, "--prompt", "word " * (MAX_SEQ + 10), "--no-chat")
    assert "--greedy" in cli_error("run", smol_engine, "--prompt", "hi", "--greedy", "--temperature", "0.7")


def test_export_never_overwrites_or_leaves_half_folders(smol_engine, tmp_path, cli_error):
    before = sorted(p.name for p in smol_engine.iterdir())
    assert "already exists" in cli_error("export", "smollm2-135m", "--out", str(smol_engine))
    assert sorted(p.name for p in smol_engine.iterdir()) == before
    assert "out of range" in cli_error("export", "smollm2-135m", "--out", str(tmp_path / "x"), "--cut", "31")
    assert "not-a-model" in cli_error("export", "not-a-model", "--out", str(tmp_path / "y"))
    assert not list(tmp_path.iterdir())  # no partial folders


def test_info_json(smol_engine, cli):
    data = json.loads(cli("info", str(smol_engine), "--json").stdout)
    assert data["cut"] == 20 and data["kv_layout"]["max_seq"] == MAX_SEQ


def test_runtime_imports_no_torch():
    code = "import sys, popcompile.runtime.ort, popcompile.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_check_tensorrt_passes_on_a_real_standard_engine(gemma_engine, cli):
    out = json.loads(cli("check", str(gemma_engine), "--target", "tensorrt", "--json").stdout)
    assert out["ok"] and all(f["status"] != "unsupported" for f in out["findings"])


def test_cli_check_tensorrt_names_fused_attention(smol_engine, cli):
    run = cli("check", str(smol_engine), "--target", "tensorrt", "--json", check=False)
    unsupported = {f["op"] for f in json.loads(run.stdout)["findings"] if f["status"] == "unsupported"}
    assert run.returncode == 1 and "com.microsoft.GroupQueryAttention" in unsupported


def test_export_for_tensorrt_without_gpu_says_what_to_do(tmp_path, cli):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA GPU: the no-GPU message does not apply")
    result = cli("export", "smollm2-135m", "--out", tmp_path / "trt", "--target", "tensorrt", check=False)
    assert result.returncode == 3, result.stderr  # the machine lacks it: a skip, not a mistake (2)
    message = result.stderr
    assert "Traceback" not in message and len(error_lines(message)) == 1
    assert "NVIDIA GPU" in message and "popcompile check" in message
    assert not list(tmp_path.iterdir())
