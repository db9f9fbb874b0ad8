"""Phi-3 / Phi-4-mini (``phi3``): what its layers have that the other families do not.

    fused qkv_proj     the pruned layers keep its K/V rows only: kv_projections (eager: POP+, POP++, the
                       reference) and passes/fused.py (graphs); the engine's prefill stores those rows, not
                       the whole projection (exporters/onnx.fold_weight_slices), lazily loaded or not
    LongRoPE           capture.settle_longrope: the frequencies the first forward computes are made eagerly,
                       and every graph picks the short or long ones per call as the model does
    partial rotary     RoPE on the first 3/4 of each head (ort_passes/rotary.py: one RotaryEmbedding with
                       rotary_embedding_dim; tests/test_ort_attention.py runs it)

The per-family suites (test_pass, test_fold_export, test_dynamo, test_calibrate, test_distill, ...) run phi3
like every family of tests/tiny.py.
"""
from __future__ import annotations

import onnx
import pytest
import torch
from tiny import empty_past, run_graph, tiny_model
from tiny_engine import tiny_hf_folder

from popcompile import reference
from popcompile.config import PopConfig
from popcompile.driver import compile
from popcompile.engine.manifest import EngineManifest
from popcompile.exporters.targets import OnnxTarget
from popcompile.frontend.arch import arch_spec, kv_projections, pruned_kv, split_fused_kv
from popcompile.frontend.capture import capture
from popcompile.frontend.models import load_model
from popcompile.kvfit.calibrate import ridge_fits
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

# one worker runs this file: its module fixture exports two engines (conftest.py)
pytestmark = pytest.mark.xdist_group("test_phi3")

LAYERS, CUT = 4, 2
Q, KV, D = 64, 32, 64  # tiny_model's rows: 4 heads x 16, 2 KV heads x 16; hidden 64


def test_kv_projections_are_the_fused_rows_and_write_through():
    model = tiny_model("phi3", layers=LAYERS)
    spec, layer = arch_spec(model.config), model.get_decoder().layers[3]
    fused = layer.self_attn.qkv_proj.weight
    assert split_fused_kv(Q + 2 * KV, KV) == (slice(Q, Q + KV), slice(Q + KV, Q + 2 * KV))
    own = kv_projections(spec, layer)
    assert own["k_proj"].rows == slice(Q, Q + KV) and own["v_proj"].module is layer.self_attn.qkv_proj
    x = torch.randn(3, D)
    torch.testing.assert_close(torch.cat([own["k_proj"](x), own["v_proj"](x)], -1),
                               layer.self_attn.qkv_proj(x)[:, Q:], rtol=0, atol=1e-6)
    queries = fused[:Q].clone()
    with torch.no_grad():
        own["v_proj"].weight.zero_()  # a write through the view reaches the model, and only V's rows
    assert not fused[Q + KV:].any() and torch.equal(fused[:Q], queries) and fused[Q:Q + KV].any()


def test_pruned_kv_of_the_layers_own_projections_is_the_reference_cache():
    """arch.pruned_kv without a projection reads the layer's own K/V rows: RoPE'd, the cache a pruned layer
    leaves in reference.prefill_cache."""
    model = tiny_model("phi3", layers=LAYERS)
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        h_cut = model(ids, output_hidden_states=True).hidden_states[CUT]
        cache = reference.prefill_cache(model, ids, CUT)
        layer = model.get_decoder().layers[3]
        k, v = pruned_kv(arch_spec(model.config), layer, h_cut)
        cos, sin = model.get_decoder().rotary_emb(h_cut, torch.arange(9)[None])
        k = k.view(1, 9, 2, 16).transpose(1, 2)
        rope = __import__("transformers").models.phi3.modeling_phi3.apply_rotary_pos_emb
        torch.testing.assert_close(rope(k, k, cos, sin)[1], cache.layers[3].keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(v.view(1, 9, 2, 16).transpose(1, 2), cache.layers[3].values,
                                   rtol=0, atol=1e-6)


def test_longrope_is_settled_eagerly_and_the_graph_picks_long_factors_past_the_original_length():
    """The first forward of a LongRoPE model keeps its long frequencies on the module: capture makes them
    eagerly, so the model can be captured twice and run eagerly after; the graph picks the long factors for a
    call past original_max_position_embeddings (64 here) as the model does."""
    model = tiny_model("phi3", layers=LAYERS)
    rope = model.get_decoder().rotary_emb
    assert getattr(rope, "long_inv_freq", None) is None
    first = capture(model)
    assert isinstance(rope.long_inv_freq, torch.Tensor) and not isinstance(
        rope.long_inv_freq, torch._subclasses.FakeTensor)
    second = capture(model)  # reads the real tensor the first capture left
    for length in (11, 70):
        ids = torch.randint(3, 97, (2, length))
        with torch.no_grad():
            want = model(ids).logits[:, -1]
        for captured in (first, second):
            logits, *_ = run_graph(captured.program.module(), ids, empty_past(captured.layout, 2))
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        short, long = (rope(torch.zeros(1), torch.tensor([[n - 1]]))[0] for n in (11, 70))
    assert not torch.allclose(short, long)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """A tiny Phi-3 folder exported with the separate boundary twice: built without its weights (the driver's
    lazy load: a placeholder's rows are a placeholder of their own) and loaded."""
    base = tmp_path_factory.mktemp("phi3")
    folder = tiny_hf_folder(base / "hf", "phi3", layers=LAYERS)
    config = PopConfig(cut=CUT, boundary="separate", kv_calibration="none", min_prompt_tokens=0, max_seq=96)
    compile(str(folder), config, out=base / "lazy", target=OnnxTarget())
    loaded = load_model(str(folder))
    compile(loaded, config, out=base / "loaded", target=OnnxTarget())
    return {"folder": folder, "lazy": base / "lazy", "loaded": base / "loaded", "model": loaded.model}


def _weights(path) -> dict[tuple, int]:
    """2-D initializer shapes of one graph -> how many."""
    found = {}
    for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
        if len(tensor.dims) == 2:
            found[tuple(tensor.dims)] = found.get(tuple(tensor.dims), 0) + 1
    return found


def test_the_prefill_stores_the_pruned_layers_kv_rows_not_their_whole_qkv(exported):
    """The decode graph reads every layer's qkv_proj whole ([d, q+2kv] after the transpose); the separate
    prefill reads it whole in the shallow layers only and, for each pruned layer, its K/V rows (packed into
    one [d, 2kv] MatMul). A placeholder's slice reads those rows from the checkpoint: the lazily loaded
    model's engine is the loaded model's, byte for byte."""
    folder = exported["loaded"]
    decode, prefill = (_weights(folder / f"{name}.onnx") for name in ("decode", "prefill"))
    assert decode[(D, Q + 2 * KV)] == LAYERS and prefill[(D, Q + 2 * KV)] == CUT
    weights = {t.name: t for t in onnx.load(str(folder / "prefill.onnx")).graph.initializer}
    packed = [onnx.numpy_helper.to_array(t) for name, t in weights.items()
              if name.startswith("pop_pack/") and name.endswith("/weight")]  # [d, 2kv]: its columns
    rows = [exported["model"].get_decoder().layers[i].self_attn.qkv_proj.weight[Q:].detach().numpy()
            for i in range(CUT, LAYERS)]  # [2kv, d]: K's rows, then V's
    assert len(packed) == LAYERS - CUT
    assert sorted(c.tobytes() for p in packed for c in p.T) == sorted(r.tobytes() for w in rows for r in w)
    assert (exported["lazy"] / "weights.bin").read_bytes() == (folder / "weights.bin").read_bytes()


def test_the_engine_equals_the_pop_reference(exported):
    """The prefill graph's K/V rows are reference.prefill_cache's, for a prompt within the original 64
    positions (short factors) and one past them (long); greedy tokens are the reference's."""
    model, session = exported["model"], OrtSession(exported["lazy"])
    layout = EngineManifest.read(exported["lazy"]).kv_layout
    generator = torch.Generator().manual_seed(5)
    for length in (13, 70):
        prompt = torch.randint(3, 97, (1, length), generator=generator)
        feeds = {"input_ids": prompt.numpy(), "position_ids": torch.arange(length)[None].numpy(),
                 "attention_mask": torch.ones(1, length, dtype=torch.long).numpy(),
                 **{name: t.numpy() for name, t in zip(layout.past_names, empty_past(layout))}}
        kv = session.sessions["prefill"].run(None, feeds)
        cache = reference.prefill_cache(model, prompt, CUT)
        for i, layer in enumerate(cache.layers):
            torch.testing.assert_close(torch.from_numpy(kv[2 * i]), layer.keys, rtol=0, atol=1e-4)
            torch.testing.assert_close(torch.from_numpy(kv[2 * i + 1]), layer.values, rtol=0, atol=1e-4)
    got = session.generate([prompt[0].tolist()], SamplingConfig(max_new_tokens=4), chat=False)[0]
    assert got.token_ids == reference.generate(model, prompt, 4, reference.Variant(CUT),
                                               eos_token_id=model.config.eos_token_id)


def test_a_streamed_ridge_fit_reads_the_fused_rows_of_the_layer_it_runs(exported):
    """A model built without its weights holds each module's real weights during that module's forward only
    (LazyWeights.streamed): the fit's targets run the fused qkv_proj and keep its K/V rows, so they are the
    loaded model's."""
    lazy = load_model(str(exported["folder"]), lazy=True)
    batches = [torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with torch.no_grad():
        want = ridge_fits(exported["model"], batches, [CUT])[CUT]
        with lazy.lazy.streamed(lazy.model):
            got = ridge_fits(lazy.model, batches, [CUT])[CUT]
    assert set(got.weights) == {3}
    for part, projection in want.weights[3].items():
        torch.testing.assert_close(got.weights[3][part].weight, projection.weight, rtol=0, atol=0)
