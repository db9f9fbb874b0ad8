"""POP+: the closed-form K/V refit, its file format, and its place in the pass and the engine."""
from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch

from popcompile import reference
from popcompile.calibrate import check_fit, default_batches, fit_kv, load_fit, save_fit
from popcompile.corpus import CALIBRATION_MODULES, STDLIB_MODULES, encode, stdlib_texts
from popcompile.models import load_model
from tiny import tiny_model
from tiny_engine import tiny_engine

EXACT_ATOL = 1e-5  # the bound for an exactly linear case (float64 solve, float32 apply)


def _linear_deep_layers(model, cut):
    """Zero the deep layers' o_proj and down_proj: then h_l == h_cut for every l >= cut (linear, exactly)."""
    with torch.no_grad():
        for layer in model.get_decoder().layers[cut:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def test_fit_recovers_kv_when_deep_inputs_are_linear_in_h_cut():
    model, cut = tiny_model("llama", layers=4), 2
    _linear_deep_layers(model, cut)
    torch.manual_seed(3)
    with torch.no_grad():
        fit = fit_kv(model, [torch.randint(0, 97, (4, 64)) for _ in range(4)], cut, ridge=1e-10)
    held_out = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        h = model.get_decoder()(held_out, output_hidden_states=True).hidden_states
        for index in (3,):  # layer 2 = cut reads h_cut already and is not refitted
            layer = model.get_decoder().layers[index]
            x = layer.input_layernorm(h[cut])
            for part in ("k_proj", "v_proj"):
                target = getattr(layer.self_attn, part)(layer.input_layernorm(h[index]))
                p = fit.weights[index][part]
                got = torch.nn.functional.linear(x, p.weight, p.bias)
                assert (got - target).abs().max() <= EXACT_ATOL, (index, part)


def test_cut_equal_to_layers_changes_nothing(tmp_path):
    model = tiny_model("llama", layers=4)
    with pytest.raises(ValueError, match="prunes nothing"):
        fit_kv(model, [torch.randint(0, 97, (1, 8))], 4)
    from popcompile.distill import kv_fit

    assert kv_fit(model, None, 4, "auto") is None


def test_save_load_roundtrip_and_mismatch(tmp_path):
    model = tiny_model("qwen2", layers=4)
    with torch.no_grad():
        fit = fit_kv(model, [torch.randint(0, 97, (2, 16))], 2)
    save_fit(fit, tmp_path / "kv.safetensors")
    loaded = load_fit(tmp_path / "kv.safetensors")
    assert loaded.info == fit.info and [p.name for p in tmp_path.iterdir()] == ["kv.safetensors"]  # no side file
    for i, parts in fit.weights.items():
        for part, p in parts.items():
            assert torch.equal(loaded.weights[i][part].weight, p.weight)
            assert p.bias is not None and torch.equal(loaded.weights[i][part].bias, p.bias)  # qwen2 has biases
    with pytest.raises(ValueError, match="re-run `popcompile calibrate --cut 3`"):
        check_fit(loaded, 3, 4)
    with pytest.raises(ValueError, match="does not exist"):
        load_fit(tmp_path / "missing.safetensors")


#: ONNX ops that move or select data (no arithmetic on the sequence's rows)
MOVEMENT = {"Slice", "Transpose", "Unsqueeze", "Squeeze", "Reshape", "Concat", "ScatterND", "ScatterElements",
            "Expand", "Shape", "Gather", "Identity", "Cast", "Range", "Constant", "ConstantOfShape", "Sub", "Add"}


def _prefill_ops(folder) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph.node)


@pytest.mark.parametrize("boundary", ["separate", "folded"])
def test_calibrated_engine_has_the_same_nodes(tmp_path, boundary):
    """separate: the prefill graph's nodes are exactly the plain one's (only weights change). folded: x_N
    is in the same graph and keeps the model's own K/V weights, so each refitted projection adds one
    MatMul for that one row (and the ops that pick the row); nothing else computes more."""
    model = tiny_model("llama", layers=4)
    with torch.no_grad():
        fit = fit_kv(model, [torch.randint(0, 97, (2, 16))], 2)
    save_fit(fit, tmp_path / "kv.safetensors")
    plain = tiny_engine("llama", tmp_path / "plain", cut=2, boundary=boundary)
    refit = tiny_engine("llama", tmp_path / "refit", cut=2, kv_calibration=tmp_path / "kv.safetensors",
                        boundary=boundary)
    before, after = _prefill_ops(plain), _prefill_ops(refit)
    if boundary == "separate":
        assert before == after
    else:
        # k_proj and v_proj of layer 3 on x_N's row (layer 2 = cut already reads h_cut): one MatMul and its
        # Split, as the fused graphs pack the projections of one activation (exporters/ort_pack.py)
        assert after["MatMul"] + after["Gemm"] == before["MatMul"] + before["Gemm"] + 1
        assert after["Split"] == before["Split"] + 1
        changed = {op for op in before | after if before[op] != after[op]}
        assert changed <= MOVEMENT | {"MatMul", "Gemm", "Split"}, changed
    import json
    assert json.loads((refit / "popcompile.json").read_text())["extra"]["kv_calibration"]["cut"] == 2


def test_calibration_corpus_is_held_out_from_evaluation():
    assert not set(CALIBRATION_MODULES) & set(STDLIB_MODULES)


def test_smollm2_refit_reduces_kv_error_on_held_out_text():
    loaded = load_model("smollm2-135m")
    model, cut = loaded.model, 20
    with torch.no_grad():
        fit = fit_kv(model, default_batches(loaded.tokenizer, seq_len=256, max_tokens=8192), cut)
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


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
def test_one_pass_fit_of_every_cut_equals_fit_kv(arch):
    """fit_kv_cuts solves the same ridge problems as fit_kv from shared moments (RMS norm = scale * unit
    norm; Gemma 3's scale is 1 + w; Qwen2 has biases). Float64 moments of float32 activations: the
    weights agree to 1e-5 of their scale (measured 1e-7) (float32 rounding of x = norm(h) in fit_kv is the difference)."""
    from popcompile.calibrate import fit_kv_cuts

    model = tiny_model(arch, layers=5)
    torch.manual_seed(1)
    batches = [torch.randint(0, 97, (2, 48)) for _ in range(3)]
    with torch.no_grad():
        fits = fit_kv_cuts(model, batches, [2, 3, 4])
        single = {cut: fit_kv(model, batches, cut) for cut in (2, 3)}
    assert set(fits) == {2, 3, 4} and fits[4].weights == {}  # cut L-1: layer L-1 reads h_{L-1} anyway
    for cut, fit in single.items():
        assert fits[cut].info == fit.info and set(fits[cut].weights) == set(fit.weights) == set(range(cut + 1, 5))
        for layer, parts in fit.weights.items():
            for part, p in parts.items():
                q = fits[cut].weights[layer][part]
                scale = p.weight.abs().max()
                assert (q.weight - p.weight).abs().max() <= 1e-5 * scale, (cut, layer, part)
                assert (p.bias is None) == (q.bias is None) == (arch != "qwen2")
                if p.bias is not None:
                    assert (q.bias - p.bias).abs().max() <= 1e-5 * p.bias.abs().max().clamp_min(1e-3)


def test_one_pass_fit_rejects_bad_cuts():
    from popcompile.calibrate import fit_kv_cuts

    model = tiny_model("llama", layers=4)
    for cuts in ([], [0, 2], [4]):
        with pytest.raises(ValueError, match="within 1..3"):
            fit_kv_cuts(model, [torch.randint(0, 97, (1, 8))], cuts)
