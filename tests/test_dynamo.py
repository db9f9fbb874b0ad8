"""torch.compile(backend="pop"): generate() equals the eager POP reference; decode graphs untouched."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from tiny import MOE, tiny_model

from popcompile import reference, use_pop_experts
from popcompile.dynamo import PopBackend, PopFallbackWarning, PopOptions
from popcompile.errors import ConfigError
from popcompile.frontend.arch import DECODER_TYPES
from popcompile.passes.layers import layer_part

TOL = 1e-5  # fp32, same kernels, different op order (last-position copies)
PROMPT_LEN, NEW = 11, 5
ALWAYS = 0  # min_prompt_tokens: POP for every prompt (these prompts are shorter than the default threshold)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch: dynamo's caches are per code object, and every HF model's
    forward goes through the same transformers decorator, so tests would see each other's graphs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Recorder:
    """An inner backend that keeps the graphs it is given and runs them eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def compiled_generate(model, ids, backend, *, dynamic=True, **kwargs):
    model.forward = torch.compile(model.forward, backend=backend, dynamic=dynamic)
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    finally:
        del model.forward  # back to the class's forward
    return out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits]


@torch.no_grad()
def reference_logits(model, ids, variant, tokens):
    run = reference.PopRun(model, variant, ids.shape[1])
    logits, pos = [run.prefill(ids)[0]], ids.shape[1]
    for token in tokens[:-1]:
        logits.append(run.step(torch.tensor([[token]]), pos)[0, -1])
        pos += 1
    return logits


def settle_rope(model):
    """One eager forward before torch.compile, as docs/torch_compile.md asks of a LongRoPE model (Phi-3.5,
    Phi-4-mini): its first forward computes its long-context frequencies and keeps them on the rotary module,
    a setattr that breaks dynamo's graph there, so the first prompt would run unpruned. Other models: a
    no-op."""
    if getattr(model.get_decoder().rotary_emb, "rope_type", None) == "longrope":
        with torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long))


def prompt(seed=1, length=PROMPT_LEN):
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(DECODER_TYPES))
def test_generate_equals_pop_reference(arch):
    model, ids, cut = tiny_model(arch, layers=6), prompt(), 3
    if arch in MOE:
        use_pop_experts(model)  # what the backend needs of a mixture of experts (the next test)
    settle_rope(model)
    recorder = Recorder()
    backend = PopBackend(PopOptions(cut=cut, inner=recorder, min_prompt_tokens=ALWAYS))
    tokens, logits = compiled_generate(model, ids, backend, cache_implementation="static")
    expected = reference_logits(model, ids, reference.Variant(cut), tokens)
    full = reference_logits(model, ids, reference.Variant(6), tokens)
    for got, want in zip(logits, expected):
        assert (got - want).abs().max() < TOL
    assert (logits[0] - full[0]).abs().max() > 1e-3, "POP must differ from the full model here"
    kinds = [r.kind for r in backend.records]
    assert kinds[0] == "prefill-pop" and set(kinds[1:]) == {"decode"}
    assert all(r.nodes_after == r.nodes_before for r in backend.records if r.kind == "decode")


def test_a_mixture_of_experts_without_the_op_runs_unpruned_and_says_how():
    model, ids = tiny_model("qwen3_moe", layers=6), prompt()
    backend = PopBackend(PopOptions(cut=3, inner=Recorder(), min_prompt_tokens=ALWAYS))
    with pytest.warns(PopFallbackWarning, match=r"call popcompile.use_pop_experts\(model\)"):
        tokens, _ = compiled_generate(model, ids, backend, cache_implementation="static")
    assert backend.records[0].kind == "fallback"
    assert tokens == model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["stablelm"])
def test_a_family_popcompile_does_not_prune_runs_unpruned_and_is_named(family):
    """StableLM's layer norms and partial rotary are not in the table: refused by name, never pruned wrong."""
    import transformers

    torch.manual_seed(0)
    config_class, model_class = {
        "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM)}[family]
    config = config_class(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          pad_token_id=0)
    model, ids = model_class(config).eval(), prompt()
    backend = PopBackend(PopOptions(cut=3, inner=Recorder(), min_prompt_tokens=ALWAYS))
    with pytest.warns(PopFallbackWarning, match=f"transformers' {family} is not a family popcompile prunes"):
        tokens, _ = compiled_generate(model, ids, backend)
    assert backend.records[0].kind == "fallback"
    assert tokens == model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()


def test_prefill_graph_runs_deep_layers_on_the_last_position_only():
    model, ids, cut = tiny_model("llama", layers=6), prompt(), 3
    recorder = Recorder()
    compiled_generate(model, ids, PopBackend(PopOptions(cut=cut, inner=recorder, min_prompt_tokens=ALWAYS)),
                      cache_implementation="static")
    prefill = recorder.graphs[0]
    linears = {}
    for node in prefill.graph.nodes:
        found = layer_part(node)
        if found and getattr(node.target, "__name__", "") == "linear":
            linears.setdefault(found[0], []).append((found[1], node.name.endswith("_last")))
    for index, projections in linears.items():
        last = sorted(part for part, is_last in projections if is_last)
        whole = sorted(part for part, is_last in projections if not is_last)
        if index < cut:  # untouched
            assert not last and len(whole) == 7
        else:  # K/V over all positions; q, o and the MLP on x_N alone
            assert whole == ["self_attn.k_proj", "self_attn.v_proj"]
            assert last == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj",
                            "self_attn.q_proj"]


def test_cut_at_depth_equals_plain_generate():
    model, ids = tiny_model("qwen3", layers=4), prompt()
    plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, cache_implementation="static")
    backend = PopBackend(PopOptions(cut=4, inner="eager", min_prompt_tokens=ALWAYS))
    tokens, logits = compiled_generate(model, ids, backend, cache_implementation="static")
    assert tokens == plain.sequences[0, PROMPT_LEN:].tolist()
    for got, want in zip(logits, plain.logits):
        assert (got - want[0]).abs().max() < TOL


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3"])
def test_kv_calibration_equals_pop_plus_reference(tmp_path, arch):
    """qwen2: k/v projections with a bias; llama: a fitted bias on projections that have none (x_N's row keeps
    the model's own projection, passes/boundary.py); phi3: the fit of a fused qkv_proj's K/V rows, checked
    against the rows' shapes in the graph (passes/fused.py)."""
    from popcompile.kvfit.calibrate import ridge_fit, save_fit

    model, ids, cut = tiny_model(arch, layers=6), prompt(), 3
    settle_rope(model)
    batches = [torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with torch.no_grad():
        fit = ridge_fit(model, batches, cut, bias=True)
    assert all(p.bias is not None for parts in fit.weights.values() for p in parts.values())
    save_fit(fit, tmp_path / "fit.safetensors")
    backend = PopBackend(PopOptions(cut=cut, inner="eager", kv_calibration=str(tmp_path / "fit.safetensors"),
                                    min_prompt_tokens=ALWAYS))
    tokens, logits = compiled_generate(model, ids, backend, cache_implementation="static")
    expected = reference_logits(model, ids, reference.Variant(cut, kv_weights=fit.weights), tokens)
    plain = reference_logits(model, ids, reference.Variant(cut), tokens)
    assert max((g - w).abs().max() for g, w in zip(logits, expected)) < TOL
    assert (expected[0] - plain[0]).abs().max() > 1e-4, "the refit must change something here"


def test_kv_calibration_for_another_cut_is_an_error_naming_the_fix(tmp_path):
    from popcompile.kvfit.calibrate import ridge_fit, save_fit

    model, ids = tiny_model("llama", layers=6), prompt()
    with torch.no_grad():
        fit = ridge_fit(model, [torch.randint(0, 97, (2, 24))], 4)
    save_fit(fit, tmp_path / "fit.safetensors")
    backend = PopBackend(PopOptions(cut=3, inner="eager", kv_calibration=str(tmp_path / "fit.safetensors"),
                                    min_prompt_tokens=ALWAYS))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="calibrate --cut 3"):
        compiled_generate(model, ids, backend, cache_implementation="static")


def test_kv_calibration_of_another_model_is_refused_like_export_refuses_it(tmp_path):
    """A fit for the same cut and depth but other k/v shapes (kv_heads 1, not 2): the backend checks it
    against the graph's projections (kvfit.calibrate.check_kv_shapes, the check export makes against the
    model)."""
    from popcompile.kvfit.calibrate import ridge_fit, save_fit

    other, model, ids = tiny_model("llama", layers=6, kv_heads=1), tiny_model("llama", layers=6), prompt()
    with torch.no_grad():
        fit = ridge_fit(other, [torch.randint(0, 97, (2, 24))], 3)
    save_fit(fit, tmp_path / "fit.safetensors")
    backend = PopBackend(PopOptions(cut=3, inner="eager", kv_calibration=str(tmp_path / "fit.safetensors"),
                                    min_prompt_tokens=ALWAYS))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match=r"layer 4 k_proj: shapes .*\(16, 64\).* do not match .*\(32, 64\).*calibrate"):
        compiled_generate(model, ids, backend, cache_implementation="static")


def test_default_dynamic_cache_works_too():
    model, ids, cut = tiny_model("llama", layers=6), prompt(), 3
    backend = PopBackend(PopOptions(cut=cut, inner="eager", min_prompt_tokens=ALWAYS))
    tokens, logits = compiled_generate(model, ids, backend)
    expected = reference_logits(model, ids, reference.Variant(cut), tokens)
    assert max((g - w).abs().max() for g, w in zip(logits, expected)) < TOL


def test_another_prompt_length_does_not_recompile():
    model, cut = tiny_model("llama", layers=6), 3
    backend = PopBackend(PopOptions(cut=cut, inner="eager", min_prompt_tokens=ALWAYS))
    model.forward = torch.compile(model.forward, backend=backend, dynamic=True)
    torch._dynamo.utils.counters.clear()
    model.generate(prompt(1, 11), max_new_tokens=NEW, do_sample=False, cache_implementation="static")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = len(backend.records)
    model.generate(prompt(2, 17), max_new_tokens=NEW, do_sample=False, cache_implementation="static")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert len(backend.records) == compiled  # neither the decode nor the prefill graph was compiled again
    del model.forward


def test_non_decoder_module_falls_back_and_warns_once():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    backend = PopBackend(PopOptions(inner="eager"))
    compiled = torch.compile(mlp, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (3, 5, 7):
            x = torch.randn(batch, 8)
            assert torch.equal(compiled(x), mlp(x))
    ours = [w for w in caught if issubclass(w.category, PopFallbackWarning)]
    assert len(ours) == 1 and "no decoder layers" in str(ours[0].message)


def test_static_sequence_length_is_pruned_too():
    """dynamic=False: every prompt length is its own static graph, and each is pruned (test_dynamo_calls.py
    covers the default, dynamic unset)."""
    model, ids = tiny_model("llama", layers=6), prompt()
    backend = PopBackend(PopOptions(cut=3, inner="eager", min_prompt_tokens=ALWAYS))
    tokens, logits = compiled_generate(model, ids, backend, dynamic=False, cache_implementation="static")
    expected = reference_logits(model, ids, reference.Variant(3), tokens)
    assert max((g - w).abs().max() for g, w in zip(logits, expected)) < TOL
    assert [(r.kind, r.static_len) for r in backend.records][0] == ("prefill-pop", PROMPT_LEN)


def test_all_position_logits_run_the_full_graph():
    model, ids = tiny_model("llama", layers=6), prompt()
    # full only for the logits
    backend = PopBackend(PopOptions(cut=3, inner="eager", min_prompt_tokens=ALWAYS))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with pytest.warns(PopFallbackWarning, match="logits_to_keep=1"):
        got = compiled(ids).logits  # every position, as a training-style forward asks
    with torch.no_grad():
        assert (got - model(ids).logits).abs().max() < TOL


def test_options_are_validated():
    with pytest.raises(ConfigError, match="unknown options"):
        PopOptions.from_dict({"prune": 0.3})
    with pytest.raises(ValueError, match="not both"):
        PopOptions(cut=3, prune_ratio=0.25)
    with pytest.raises(ValueError, match="prune_ratio"):
        PopOptions(prune_ratio=1.5)
    assert PopOptions.from_dict({"prune_ratio": 0.5}).resolve_cut(30) == 15
    assert PopOptions().resolve_cut(30) == 20
    # minutes of fitting
    for mode, fix in (("auto", "--out FILE --method distill`"), ("ridge", "--out FILE`"),
                      ("distill", "--out FILE --method distill`")):
        with pytest.raises(ConfigError, match=f"kv_calibration='{mode}' fits at export time only.*{fix}"):
            PopOptions(kv_calibration=mode)


def test_backend_name_resolves_without_importing_popcompile():
    code = ("import sys, torch\n"
            "from torch._dynamo import lookup_backend\n"
            "backend = lookup_backend('pop')\n"
            "print(type(backend).__module__, 'popcompile' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["popcompile.dynamo", "True"]  # loaded by torch through the entry point


@pytest.fixture(scope="module")
def smollm2(real_model):
    return real_model("smollm2-135m")


def test_smollm2_generate_equals_eager_pop_token_for_token(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    text = ("The Python standard library's json module encodes and decodes JSON. To read a file, open it and "
            "call json.load on the file object; to write one, call json.dump with the object and the file.")
    ids = tokenizer(text, return_tensors="pt").input_ids
    cut = 20  # the default: 1/3 of 30 layers pruned
    backend = PopBackend(PopOptions(inner="eager", min_prompt_tokens=ALWAYS))  # a prompt under the default
    model.forward = torch.compile(model.forward, backend=backend, dynamic=True)
    try:
        got = model.generate(ids, max_new_tokens=16, do_sample=False, cache_implementation="static")
    finally:
        del model.forward
    want = reference.generate(model, ids, 16, reference.Variant(cut))
    assert got[0, ids.shape[1]:].tolist() == want
    assert backend.records[0].kind == "prefill-pop" and backend.records[0].cut == cut
    torch._dynamo.reset()
    depth = PopBackend(PopOptions(cut=30, inner="eager", min_prompt_tokens=ALWAYS))
    model.forward = torch.compile(model.forward, backend=depth, dynamic=True)
    try:
        got_full = model.generate(ids, max_new_tokens=16, do_sample=False, cache_implementation="static")
    finally:
        del model.forward
    plain = model.generate(ids, max_new_tokens=16, do_sample=False, cache_implementation="static")
    assert torch.equal(got_full, plain)
