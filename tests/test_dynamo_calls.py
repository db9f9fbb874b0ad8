"""torch.compile(backend="pop") as users call it: no dynamic=, the whole module, model.compile,
min_prompt_tokens.

Tiny models, inner "eager" (fp32, the same kernels as the reference: logits within TOL). The real-model
tests (SmolLM2-135M, Gemma 3 270M) use inner "eager" too: greedy tokens equal the reference exactly.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from tiny import tiny_model

from popcompile import reference
from popcompile.dynamo import MIN_PROMPT_TOKENS, PopBackend, PopFallbackWarning, PopOptions

TOL = 1e-5  # fp32, same kernels, different op order (last-position copies)
NEW = 4
CUT, LAYERS = 3, 6
ALWAYS = 0  # min_prompt_tokens: POP for every prompt (most prompts here are shorter than the default)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    """No id 0: it is Gemma's pad token, which generate() masks out and the reference does not."""
    return torch.randint(1, 97, (1, length), generator=torch.Generator().manual_seed(seed + length))


@torch.no_grad()
def reference_logits(model, ids, cut, tokens):
    """Logits of the prefill and of each decode step of ``tokens`` under POP at ``cut`` (cut == L: full)."""
    run = reference.PopRun(model, reference.Variant(cut), ids.shape[1])
    logits, pos = [run.prefill(ids)[0]], ids.shape[1]
    for token in tokens[:-1]:
        logits.append(run.step(torch.tensor([[token]]), pos)[0, -1])
        pos += 1
    return logits


def generate(model, ids, **kwargs):
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits]


def max_error(got, want) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def expected(model, lengths, cut=CUT):
    """Reference tokens/logits per prompt length, computed before any compile (the reference adds hooks)."""
    result = {}
    for n in lengths:
        ids = prompt(n)
        tokens = reference.generate(model, ids, NEW, reference.Variant(cut))
        result[n] = (ids, tokens, reference_logits(model, ids, cut, tokens))
    return result


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_no_dynamic_flag_prunes_from_the_first_prompt_and_recompiles_once(arch):
    """dynamo traces the first prompt static: it is pruned; the second length recompiles once (dynamo's
    automatic dynamic), after which one dynamic prefill graph serves every length."""
    model = tiny_model(arch, layers=LAYERS)
    want = expected(model, (11, 13, 19, 27))
    backend = PopBackend(PopOptions(cut=CUT, inner="eager", min_prompt_tokens=ALWAYS))
    model.forward = torch.compile(model.forward, backend=backend)  # no dynamic=
    counters = torch._dynamo.utils.counters
    counters.clear()
    prefills = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", PopFallbackWarning)
        for n, (ids, tokens, logits) in want.items():
            got_tokens, got_logits = generate(model, ids, cache_implementation="static")
            assert got_tokens == tokens and max_error(got_logits, logits) < TOL, n
            prefills.append([(r.kind, r.static_len) for r in backend.records if r.kind.startswith("prefill")])
            if n == 13:
                graphs = counters["stats"]["unique_graphs"]
    del model.forward
    assert prefills[0] == [("prefill-pop", 11)]  # the first prompt, static and pruned
    assert prefills[1] == [("prefill-pop", 11), ("prefill-pop", None)]  # one recompile, dynamic
    assert prefills[3] == prefills[1]  # 19 and 27 tokens: no prefill compiled
    assert counters["stats"]["unique_graphs"] == graphs  # nor any other graph


@pytest.mark.parametrize("length", [2, 4, 8, 16, 32, 12])
def test_static_length_that_is_also_another_size_falls_back_with_a_warning(length):
    """tiny llama: head dim 16, rotary half 8, kv width 32, heads 4, kv heads 2. A static N equal to one of
    them cannot be told from it: that graph runs the full model with a warning; any other N is pruned."""
    model, ids = tiny_model("llama", layers=LAYERS), prompt(length)
    pop = reference_logits(model, ids, CUT, [])[0]
    full = reference_logits(model, ids, LAYERS, [])[0]
    assert (pop - full).abs().max() > 1e-3
    backend = PopBackend(PopOptions(cut=CUT, inner="eager", min_prompt_tokens=ALWAYS))
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = compiled(ids, logits_to_keep=1).logits[0, -1]
    ours = [str(w.message) for w in caught if issubclass(w.category, PopFallbackWarning)]
    if length == 12:
        assert not ours and backend.records[0].kind == "prefill-pop" and (got - pop).abs().max() < TOL
    else:
        assert len(ours) == 1 and "cannot be told apart" in ours[0] and "dynamic=True" in ours[0]
        assert (got - full).abs().max() < TOL


def test_whole_module_compile_prunes_its_calls():
    """``torch.compile(model, backend="pop")``: calls of the returned module run POP (generate() of that
    wrapper calls the original module: docs/torch_compile.md)."""
    model, ids = tiny_model("qwen3", layers=LAYERS), prompt(11)
    want = reference_logits(model, ids, CUT, [])[0]
    compiled = torch.compile(model, backend="pop", options={"cut": CUT, "inner": "eager",
                                                                "min_prompt_tokens": ALWAYS})
    with torch.no_grad():
        got = compiled(ids, logits_to_keep=1).logits[0, -1]
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_model_compile_generate_equals_pop_reference(cache):
    """``model.compile(backend="pop")`` compiles ``_call_impl``: generate() runs it, no dynamic= needed."""
    model = tiny_model("mistral", layers=LAYERS)
    want = expected(model, (11, 17))
    backend = PopBackend(PopOptions(cut=CUT, inner="eager", min_prompt_tokens=ALWAYS))
    model.compile(backend=backend)
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}
    try:
        for ids, tokens, logits in want.values():
            got_tokens, got_logits = generate(model, ids, **kwargs)
            assert got_tokens == tokens and max_error(got_logits, logits) < TOL
    finally:
        model._compiled_call_impl = None  # back to the eager __call__
    assert [r.static_len for r in backend.records if r.kind == "prefill-pop"] == [11, None]


def test_min_prompt_tokens_picks_the_full_graph_below_and_pop_at_or_above():
    model = tiny_model("llama", layers=LAYERS)
    lengths = (9, 11, 13, 10)  # static 9 (full), then dynamic: 11 (POP), 13 (POP), 10 (full)
    pop = expected(model, lengths)
    full = expected(model, lengths, cut=LAYERS)
    backend = PopBackend(PopOptions(cut=CUT, inner="eager", min_prompt_tokens=11))
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        for n in lengths:
            ids = pop[n][0]
            tokens, logits = generate(model, ids, cache_implementation="static")
            ref_tokens, ref_logits = (pop if n >= 11 else full)[n][1:]
            other = (full if n >= 11 else pop)[n][2]
            assert tokens == ref_tokens and max_error(logits, ref_logits) < TOL, n
            assert (logits[0] - other[0]).abs().max() > 1e-3, f"{n}: POP and full must differ here"
    finally:
        del model.forward
    assert [(r.kind, r.static_len) for r in backend.records if r.kind.startswith("prefill")] == \
        [("prefill-full", 9), ("prefill-pop", None)]


def test_default_min_prompt_tokens_runs_short_prompts_in_full_and_pop_from_the_constant():
    """backend="pop" with no min_prompt_tokens option: a short prompt (static graph) and one token under
    MIN_PROMPT_TOKENS (dynamic graph) give the full model's tokens, MIN_PROMPT_TOKENS tokens give POP's."""
    from popcompile.dynamo import pop  # the instance behind backend="pop"

    model = tiny_model("llama", layers=LAYERS)
    lengths = (11, MIN_PROMPT_TOKENS, MIN_PROMPT_TOKENS - 1)  # static 11 (full), then dynamic: POP, full
    want_pop = expected(model, lengths)
    want_full = expected(model, lengths, cut=LAYERS)
    pop.records.clear()
    model.forward = torch.compile(model.forward, backend="pop", options={"cut": CUT, "inner": "eager"})
    try:
        for n in lengths:
            tokens, logits = generate(model, want_pop[n][0], cache_implementation="static")
            ref, other = (want_pop, want_full) if n >= MIN_PROMPT_TOKENS else (want_full, want_pop)
            assert tokens == ref[n][1] and max_error(logits, ref[n][2]) < TOL, n
            assert (logits[0] - other[n][2][0]).abs().max() > 1e-3, f"{n}: POP and full must differ here"
    finally:
        del model.forward
    assert [(r.kind, r.static_len) for r in pop.records if r.kind.startswith("prefill")] == \
        [("prefill-full", 11), ("prefill-pop", None)]


def test_min_prompt_tokens_option_is_validated_and_defaults_to_the_constant():
    assert MIN_PROMPT_TOKENS == 64  # docs/prompt_length.md: the 1.2x rule on this backend's measured curve
    assert PopOptions().min_prompt_tokens == PopOptions.from_dict({}).min_prompt_tokens == MIN_PROMPT_TOKENS
    assert PopOptions.from_dict({"min_prompt_tokens": 256}).min_prompt_tokens == 256
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="min_prompt_tokens"):
            PopOptions(min_prompt_tokens=bad)


REAL = {"smollm2-135m": 20, "gemma3-270m": 12}  # default cut: 1/3 of 30 / 18 layers pruned


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_model_generate_without_dynamic_equals_eager_pop(name, real_model):
    """The issue's call, no dynamic= and the default min_prompt_tokens: the first prompt and a second of
    another length give the eager POP reference's greedy tokens exactly (inner "eager": the reference's
    kernels)."""
    loaded = real_model(name)
    model, tokenizer = loaded.model, loaded.tokenizer
    texts = ["The json module encodes and decodes JSON. To read a file, open it and call json.load on the "
             "file object; to write one, call json.dump with the object and the file. Both take keyword "
             "arguments: indent pretty-prints nested objects, sort_keys orders the keys of every object, and "
             "ensure_ascii escapes every character outside ASCII. Strings are parsed with json.loads and "
             "written with json.dumps, which return and take text instead of a file. Both take",
             "A compiler turns source code into a program. Its front end parses the text into a tree and "
             "checks the types of every expression; its middle end rewrites that tree into a simpler form "
             "and removes the work a program never needs; its back end chooses instructions for the target "
             "machine, assigns registers and writes the object file. Between the front end and the"]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    # both at least MIN_PROMPT_TOKENS long: the backend's defaults prune them, no option needed
    assert (prompts[0].shape[1] != prompts[1].shape[1]
            and min(p.shape[1] for p in prompts) >= MIN_PROMPT_TOKENS)
    want = [reference.generate(model, ids, 10, reference.Variant(REAL[name])) for ids in prompts]
    from popcompile.dynamo import pop  # the instance behind backend="pop"

    pop.records.clear()
    model.forward = torch.compile(model.forward, backend="pop", options={"inner": "eager"})
    try:
        got = [model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static")
               [0, ids.shape[1]:].tolist() for ids in prompts]
    finally:
        del model.forward
    assert got == want
    prefills = [(r.kind, r.static_len, r.cut) for r in pop.records if r.kind.startswith("prefill")]
    assert prefills == [("prefill-pop", prompts[0].shape[1], REAL[name]), ("prefill-pop", None, REAL[name])]


@pytest.mark.parametrize("batch, length, pruned", [(2, 11, True), (3, 3, False)])
def test_static_batches_prune_unless_batch_equals_the_length(batch, length, pruned):
    """A static [B, N] prompt is pruned like the dynamic one; with B == N the sequence dim of input_ids
    is ambiguous, so that graph runs the full model with a warning."""
    model = tiny_model("llama", layers=LAYERS)
    ids = torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(batch))
    results = {}
    for name, cut, dynamic in (("static", CUT, None), ("dynamic", CUT, True), ("full", LAYERS, True)):
        torch._dynamo.reset()
        backend = PopBackend(PopOptions(cut=cut, inner="eager", min_prompt_tokens=ALWAYS))
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            results[name] = torch.compile(model, backend=backend, dynamic=dynamic)(
                ids, logits_to_keep=1).logits
        if name == "static":
            ours = [str(w.message) for w in caught if issubclass(w.category, PopFallbackWarning)]
            assert (not ours) if pruned else ("batch size too" in ours[0])
    assert (results["static"] - results["dynamic" if pruned else "full"]).abs().max() < TOL
    # (with B == N, dynamo's duck sizing gives the dynamic graph one symbol for both: unpruned too)
    if pruned:
        assert (results["dynamic"] - results["full"]).abs().max() > 1e-3
