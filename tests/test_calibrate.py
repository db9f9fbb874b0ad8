"""POP+: the closed-form K/V refit, its file format, and its place in the pass and the engine."""
from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch
from engine_cache import export_key
from tiny import tiny_model
from tiny_engine import tiny_engine

from popcompile import reference
from popcompile.frontend.arch import DECODER_TYPES, arch_spec, kv_projections
from popcompile.kvfit.calibrate import check_fit, default_batches, load_fit, ridge_fit, save_fit
from popcompile.kvfit.corpus import CALIBRATION_MODULES, STDLIB_MODULES, encode, stdlib_texts

EXACT_ATOL = 1e-5  # the bound for an exactly linear case (float64 solve, float32 apply)
ONNX_ATOL = KV_TOL = 1e-4  # fp32 ORT vs eager torch: different kernels, same math (test_engine.py's bounds)


def _linear_deep_layers(model, cut):
    """Zero the deep layers' o_proj and down_proj: then h_l == h_cut for every l >= cut (linear, exactly)."""
    with torch.no_grad():
        for layer in model.get_decoder().layers[cut:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_fit_recovers_kv_when_deep_inputs_are_linear_in_h_cut(arch):
    """phi3: the targets are its fused qkv_proj's K/V rows (arch.kv_projections)."""
    model, cut = tiny_model(arch, layers=4), 2
    _linear_deep_layers(model, cut)
    torch.manual_seed(3)
    with torch.no_grad():
        fit = ridge_fit(model, [torch.randint(0, 97, (4, 64)) for _ in range(4)], cut, ridge=1e-10)
    held_out = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        h = model.get_decoder()(held_out, output_hidden_states=True).hidden_states
        for index in (3,):  # layer 2 = cut reads h_cut already and is not refitted
            layer = model.get_decoder().layers[index]
            x = layer.input_layernorm(h[cut])
            for part, own in kv_projections(arch_spec(model.config), layer).items():
                target = own(layer.input_layernorm(h[index]))
                p = fit.weights[index][part]
                got = torch.nn.functional.linear(x, p.weight, p.bias)
                assert (got - target).abs().max() <= EXACT_ATOL, (index, part)


def test_cut_equal_to_layers_changes_nothing(tmp_path):
    model = tiny_model("llama", layers=4)
    with pytest.raises(ValueError, match="prunes nothing"):
        ridge_fit(model, [torch.randint(0, 97, (1, 8))], 4)
    from popcompile.kvfit.fit import resolve_fit

    assert resolve_fit(model, None, 4, "auto") is None


def test_save_load_roundtrip_and_mismatch(tmp_path):
    model = tiny_model("qwen2", layers=4)
    with torch.no_grad():
        fit = ridge_fit(model, [torch.randint(0, 97, (2, 16))], 2)
    save_fit(fit, tmp_path / "kv.safetensors")
    loaded = load_fit(tmp_path / "kv.safetensors")
    # no side file
    assert loaded.info == fit.info and [p.name for p in tmp_path.iterdir()] == ["kv.safetensors"]
    for i, parts in fit.weights.items():
        for part, p in parts.items():
            assert torch.equal(loaded.weights[i][part].weight, p.weight)
            # qwen2 has biases
            assert p.bias is not None and torch.equal(loaded.weights[i][part].bias, p.bias)
    with pytest.raises(ValueError, match="re-run `popcompile calibrate --cut 3`"):
        check_fit(loaded, 3, 4)
    with pytest.raises(ValueError, match="does not exist"):
        load_fit(tmp_path / "missing.safetensors")


#: ONNX ops that move or select data (no arithmetic on the sequence's rows)
MOVEMENT = {"Slice", "Transpose", "Unsqueeze", "Squeeze", "Reshape", "Concat", "ScatterND", "ScatterElements",
            "Expand", "Shape", "Gather", "Identity", "Cast", "Range", "Constant", "ConstantOfShape", "Sub",
            "Add"}


def _prefill_ops(folder) -> Counter:
    return Counter(n.op_type
                   for n in onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph.node)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("boundary", ["separate", "folded"])
def test_calibrated_engine_has_the_same_nodes(engines, boundary, bias):
    """separate: the prefill graph's nodes are exactly the plain one's (only weights change). folded: x_N
    is in the same graph and keeps the model's own K/V weights, so each refitted projection adds one
    MatMul for that one row (and the ops that pick the row); nothing else computes more. With a fitted
    bias (llama has none) each refitted layer adds one Add: its [bk|bv] after the packed [Wk|Wv] MatMul
    (ort_passes/pack.py); x_N's row (model's own weights) gets none."""
    refit = _fitted_engine(engines, "llama", bias, boundary=boundary)
    added = {"Add": 1} if bias else {}  # layer 3 only: layer 2 = cut reads h_cut already
    plain = engines.tiny("llama", cut=2, boundary=boundary)
    before, after = _prefill_ops(plain), _prefill_ops(refit)
    if boundary == "separate":
        assert after == before + Counter(added)
    else:
        # k_proj and v_proj of layer 3 on x_N's row (layer 2 = cut already reads h_cut): one MatMul and its
        # Split, as the fused graphs pack the projections of one activation (ort_passes/pack.py)
        assert after["MatMul"] + after["Gemm"] == before["MatMul"] + before["Gemm"] + 1
        assert after["Split"] == before["Split"] + 1
        assert after["Add"] >= before["Add"] + added.get("Add", 0)
        changed = {op for op in before | after if before[op] != after[op]}
        assert changed <= MOVEMENT | {"MatMul", "Gemm", "Split"}, changed
    import json
    assert json.loads((refit / "popcompile.json").read_text())["extra"]["kv_calibration"]["cut"] == 2


def test_calibration_corpus_is_held_out_from_evaluation():
    assert not set(CALIBRATION_MODULES) & set(STDLIB_MODULES)


def test_smollm2_refit_reduces_kv_error_on_held_out_text(real_model):
    loaded = real_model("smollm2-135m")
    model, cut = loaded.model, 20
    with torch.no_grad():
        fit = ridge_fit(model, default_batches(loaded.tokenizer, seq_len=256, max_tokens=8192), cut)
        held_out = torch.tensor([encode(loaded.tokenizer, stdlib_texts(("textwrap",))[0][1])[:256]])
        full = model(held_out, use_cache=True).past_key_values
        plain = reference.prefill_cache(model, held_out, cut)
        refit = reference.prefill_cache(model, held_out, cut, kv_weights=fit.weights)
    assert set(fit.weights) == set(range(cut + 1, 30))
    for index in range(cut + 1, 30):
        for kind in ("keys", "values"):
            truth = getattr(full.layers[index], kind)
            err_plain = (getattr(plain.layers[index], kind) - truth).norm()
            err_refit = (getattr(refit.layers[index], kind) - truth).norm()
            assert err_refit < err_plain, f"layer {index} {kind}: {err_refit:.3f} >= {err_plain:.3f}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
def test_one_pass_fit_of_every_cut_equals_fit_kv(arch, bias):
    """ridge_fits solves the same ridge problems as ridge_fit from shared moments (RMS norm = scale * unit
    norm; Gemma 3's scale is 1 + w; Qwen2 has biases). Float64 moments of float32 activations: the
    weights agree to 1e-5 of their scale (measured 1e-7) (float32 rounding of x = norm(h) in ridge_fit is the
    difference)."""
    from popcompile.kvfit.calibrate import ridge_fits

    model = tiny_model(arch, layers=5)
    torch.manual_seed(1)
    batches = [torch.randint(0, 97, (2, 48)) for _ in range(3)]
    with torch.no_grad():
        fits = ridge_fits(model, batches, [2, 3, 4], bias=bias)
        single = {cut: ridge_fit(model, batches, cut, bias=bias) for cut in (2, 3)}
    assert set(fits) == {2, 3, 4} and fits[4].weights == {}  # cut L-1: layer L-1 reads h_{L-1} anyway
    for cut, fit in single.items():
        assert (fits[cut].info == fit.info
                and set(fits[cut].weights) == set(fit.weights) == set(range(cut + 1, 5)))
        for layer, parts in fit.weights.items():
            for part, p in parts.items():
                q = fits[cut].weights[layer][part]
                scale = p.weight.abs().max()
                assert (q.weight - p.weight).abs().max() <= 1e-5 * scale, (cut, layer, part)
                assert (p.bias is None) == (q.bias is None) == (arch != "qwen2" and not bias)
                if p.bias is not None:
                    assert (q.bias - p.bias).abs().max() <= 1e-5 * p.bias.abs().max().clamp_min(1e-3)


def test_one_pass_fit_rejects_bad_cuts():
    from popcompile.kvfit.calibrate import ridge_fits

    model = tiny_model("llama", layers=4)
    for cuts in ([], [0, 2], [4]):
        with pytest.raises(ValueError, match="within 1..3"):
            ridge_fits(model, [torch.randint(0, 97, (1, 8))], cuts)


# --- a fitted bias where the model's projection has none (calibrate.ridge_fit(bias=True), the default) ---

def test_bias_is_fitted_for_every_projection_when_asked_and_recorded(tmp_path):
    model = tiny_model("llama", layers=4)
    batches = [torch.randint(0, 97, (2, 16))]
    with torch.no_grad():
        fits = {bias: ridge_fit(model, batches, 2, bias=bias) for bias in (False, True)}
    for bias, fit in fits.items():
        assert fit.info.bias is bias
        for parts in fit.weights.values():
            for p in parts.values():
                assert ((p.bias is not None) == bias
                        and (not bias or tuple(p.bias.shape) == (p.weight.shape[0],)))
    save_fit(fits[True], tmp_path / "kv.safetensors")
    assert load_fit(tmp_path / "kv.safetensors").info.bias is True
    with pytest.raises(ValueError, match="bias='yes' must be True"):
        ridge_fit(model, batches, 2, bias="yes")


def test_files_written_before_the_bias_field_load_as_they_were(tmp_path):
    """Fit files from before CalibrationInfo.bias have no such key in their metadata: bias only where the
    model's projection has one, which is what they hold (here: qwen2's own biases)."""
    import json

    from safetensors.torch import load_file as read
    from safetensors.torch import save_file

    model = tiny_model("qwen2", layers=4)
    with torch.no_grad():
        fit = ridge_fit(model, [torch.randint(0, 97, (2, 16))], 2, bias=False)
    save_fit(fit, tmp_path / "new.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "new.safetensors"), "pt") as handle:
        meta = json.loads(handle.metadata()["popcompile_kv_fit"])
    del meta["bias"]
    save_file(read(str(tmp_path / "new.safetensors")), str(tmp_path / "old.safetensors"),
              metadata={"popcompile_kv_fit": json.dumps(meta)})
    old = load_fit(tmp_path / "old.safetensors")
    assert old.info == fit.info and old.info.bias is False
    assert all(torch.equal(old.weights[i][part].bias, p.bias) for i, parts in fit.weights.items()
               for part, p in parts.items())


def test_shape_check_takes_a_fitted_bias_and_refuses_a_wrong_one():
    from popcompile.kvfit.calibrate import KVFit, check_fit_shapes
    from popcompile.passes.pop import Projection

    model = tiny_model("llama", layers=4)
    with torch.no_grad():
        fit = ridge_fit(model, [torch.randint(0, 97, (2, 16))], 2, bias=True)
    check_fit_shapes(fit, model)  # a bias [out] where llama's k/v projections have none
    k = fit.weights[3]["k_proj"]
    bad = KVFit(fit.info,
                {3: {**fit.weights[3], "k_proj": Projection(k.weight, torch.zeros(k.weight.shape[0] + 1))}})
    with pytest.raises(ValueError, match=r"layer 3 k_proj: shapes .*\(33,\).* do not match"):
        check_fit_shapes(bad, model)
    qwen = tiny_model("qwen2", layers=4)
    with torch.no_grad():
        own = ridge_fit(qwen, [torch.randint(0, 97, (2, 16))], 2, bias=False)
    k = own.weights[3]["k_proj"]
    missing = KVFit(own.info, {3: {**own.weights[3], "k_proj": Projection(k.weight, None)}})
    with pytest.raises(ValueError, match="layer 3 k_proj"):  # qwen2 has a bias: the fit must have one too
        check_fit_shapes(missing, qwen)


def _bias_fit(arch: str, path=None, bias: bool = True) -> object:
    """A ridge fit (with a bias for every projection unless ``bias=False``) of the model tiny_engine exports
    (same seed), cut 2, saved at ``path``; deterministic, so an engine built from it once per run
    (``_fitted_engine``) holds the fit a test recomputes."""
    model = tiny_model(arch)
    batches = [torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with torch.no_grad():
        fit = ridge_fit(model, batches, 2, bias=bias)
    if path is not None:
        save_fit(fit, path)
    return model, fit


def _fitted_engine(engines, arch: str, bias: bool = True, **export_kwargs):
    """tiny_engine(arch, cut=2) with ``_bias_fit``'s fit, built once per run (the fit file beside it)."""
    def build(out):
        fit_file = out.with_name(out.name.removesuffix(".staged") + ".kv.safetensors")
        _bias_fit(arch, fit_file, bias)
        tiny_engine(arch, out, cut=2, kv_calibration=fit_file, **export_kwargs)
    key = export_key({"cut": 2, "kv_calibration": "none", **export_kwargs})
    return engines.get(f"tiny-{arch}-fit", build, arch, bias, key)


@pytest.mark.parametrize("arch", sorted(DECODER_TYPES))
def test_engine_with_a_bias_fit_equals_the_pop_plus_reference(engines, arch):
    """The exported folded prefill (fused ORT graphs, packed [Wk|Wv] + one Add of [bk|bv]) on x_1..x_N:
    rows 1..N-1 of every layer are reference.prefill_cache with the fit; x_N's logits and row are the
    reference's boundary step (deep layers' x_N row from the model's own weights, no bias)."""
    import numpy as np
    from tiny import empty_past

    from popcompile.engine.manifest import EngineManifest
    from popcompile.runtime.ort import OrtSession

    model, fit = _bias_fit(arch)
    folder = _fitted_engine(engines, arch)
    manifest = EngineManifest.read(folder)
    prompt = torch.randint(0, 97, (1, 13))  # longer than the tiny sliding windows (4, 5)
    n = prompt.shape[1]
    feeds = {"input_ids": prompt.numpy(), "position_ids": np.arange(n)[None],
             "attention_mask": np.ones((1, n), np.int64),
             **dict(zip(manifest.kv_layout.past_names, (t.numpy() for t in empty_past(manifest.kv_layout))))}
    logits, *kv = OrtSession(folder).sessions["prefill"].run(None, feeds)
    variant = reference.Variant(2, kv_weights=fit.weights)
    with torch.no_grad():
        rows = reference.prefill_cache(model, prompt[:, :-1], 2, kv_weights=fit.weights)
        run = reference.PopRun(model, variant, n)
        first = run.prefill(prompt).numpy()
        plain = reference.prefill_cache(model, prompt[:, :-1], 2)
    np.testing.assert_allclose(logits, first, atol=ONNX_ATOL, rtol=0)
    for i, (layer, true) in enumerate(zip(rows.layers, run.cache.layers)):
        for name, got, want, last in (("K", kv[2 * i], layer.keys, true.keys),
                                      ("V", kv[2 * i + 1], layer.values, true.values)):
            np.testing.assert_allclose(got[:, :, :-1], want.numpy(), rtol=KV_TOL, atol=KV_TOL,
                                       err_msg=f"{name} {i}")
            np.testing.assert_allclose(got[:, :, -1:], last[:, :, -1:].numpy(), rtol=KV_TOL, atol=KV_TOL,
                                       err_msg=f"{name} {i} (x_N)")
    assert (rows.layers[3].values - plain.layers[3].values).abs().max() > 1e-3, "the fit must change layer 3"


def test_bias_fit_engines_quantise_and_pass_the_tensorrt_check(engines):
    """int8 (MatMulNBits, exporters/quantize.py): the packed k/v MatMul is quantised and its bias Add stays
    float after it; the standard-op graphs the tensorrt target writes pass its compatibility check."""
    import numpy as np
    from tiny import empty_past

    from popcompile.config import WeightQuantization
    from popcompile.engine.manifest import EngineManifest
    from popcompile.exporters.targets import OnnxTarget
    from popcompile.exporters.tensorrt_compat import check_engine
    from popcompile.runtime.ort import OrtSession

    int8 = OnnxTarget(WeightQuantization("int8", block_size=16))
    folders = {"float": _fitted_engine(engines, "llama"),
               "int8": _fitted_engine(engines, "llama", target=int8)}
    graph = onnx.load(str(folders["int8"] / "prefill.onnx"), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    biased = [n for n in graph.node if n.op_type == "Add" and n.name.startswith("pop_pack/")]
    assert len(biased) == 1 and producer[biased[0].input[0]].op_type == "MatMulNBits"  # layer 3's [bk|bv]
    manifest = EngineManifest.read(folders["float"])
    prompt = np.random.default_rng(0).integers(0, 97, (1, 11))
    feeds = {"input_ids": prompt, "position_ids": np.arange(11)[None],
             "attention_mask": np.ones((1, 11), np.int64),
             **dict(zip(manifest.kv_layout.past_names, (t.numpy() for t in empty_past(manifest.kv_layout))))}
    want, got = (OrtSession(folders[f]).sessions["prefill"].run(None, feeds) for f in ("float", "int8"))
    for a, b in zip(got, want):
        assert np.linalg.norm(a - b) <= 0.06 * np.linalg.norm(b)  # test_quantize.py's INT8_REL
    standard = _fitted_engine(engines, "llama", target=OnnxTarget(attention="standard"))
    assert check_engine(standard).ok
