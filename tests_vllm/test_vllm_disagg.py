"""Prefill/decode disaggregation (popcompile.vllm_plugin.connector): a POP prefill instance hands the prompt's
K/V rows to a full-model decode instance through PopConnector; the decode instance's greedy tokens equal
single-instance POP (popcompile/reference.py), token for token.

Each instance is its own vLLM engine in its own process (greedy.py), run one after the other over one
hand-off folder: the prefill instance with max_tokens=1 (as a router sends it), then the decode instance
with the same prompts. vLLM's CPU block size here is 128: prompts of 129 and 257 tokens hand over exactly
one and two whole blocks (N - 1 rows), the others end in a partial block.
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
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import transformers
from serving import Run, calibrate, engine, export, load, start
from tokenizers import Tokenizer

from popcompile.kvfit.calibrate import load_fit
from popcompile.kvfit.corpus import stdlib_texts
from popcompile.reference import Variant, generate

HERE = Path(__file__).resolve().parent
NEW = 12
ENGINE = {"max_num_batched_tokens": 256, "max_model_len": 1024}  # the 700-token prompt: 3 chunks


def instance(tmp: Path, folder: Path, store: Path, role: str, prompts: list[list[int]], new: int) -> Run:
    """One instance of the pair on ``prompts`` (greedy.py, its own process: ``run[0]`` its records: tokens,
    cached = rows loaded)."""
    transfer = {"kv_connector": "PopConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return engine(tmp / role, folder, [{"prompts": prompts}], new, **ENGINE, kv_transfer_config=transfer)


def split(tmp: Path, folder: Path, handed: list[list[int]], missing: list[list[int]] = ()) -> list[dict]:
    """Prefill ``handed`` on the prefill instance, then decode ``handed`` and ``missing`` (never prefilled)
    on the decode instance; the decode instance's records, in that order."""
    store = tmp / "store"
    prefill = instance(tmp, folder, store, "kv_producer", handed, 1)[0]
    assert all(len(r["tokens"]) == 1 for r in prefill)
    return instance(tmp, folder, store, "kv_consumer", [*handed, *missing], NEW)[0]


@pytest.fixture(scope="module")
def smollm2(folders) -> Path:
    """SmolLM2's POP folder (cut 20, no calibration, POP for every prompt): conftest.py's, shared with
    test_vllm_plugin.py (the instances only read it; their hand-off folders are their own)."""
    return folders["pop"]


def smollm2_prompts(folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(handed: prompts of 40 to 700 tokens, prefilled on the prefill instance; missing: one it never saw)."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = tokenizer.encode("".join(text for _, text in stdlib_texts()[:2])).ids
    return [text[:n] for n in (40, 129, 200, 257)] + [text[300:1000]], [text[50:350]]


def tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (60, 129, 300)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny random Llama (head_dim 32: the CPU backend's smallest), its POP+ folder (cut 2 of 4) and fit
    (``popcompile calibrate --cut 2 --max-tokens 4096``), in the pytest process, the model loaded once."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_engine import tiny_hf_folder

    root = tmp_path_factory.mktemp("tiny")
    hf = tiny_hf_folder(root / "hf", "llama", layers=4, head_dim=32, initializer_range=0.1,
                        max_position_embeddings=1024)
    loaded = load(hf)
    fit = calibrate(loaded, root / "fit.safetensors", cut=2, max_tokens=4096)
    export(loaded, root / "pop+", cut=2, kv_calibration=fit)
    return hf, root / "pop+", fit


def tiny_pair_then_refused(tmp: Path, folder: Path, smollm2: Path, refused: bool) -> tuple[list[dict], Run]:
    """The tiny POP+ pair over one hand-off folder (the decode instance's records), then, with ``refused``,
    SmolLM2 as a decode instance on that hand-off folder, which holds the tiny model's layout now."""
    served = split(tmp, folder, tiny_prompts())
    assert (tmp / "store" / "layout.json").is_file()
    return served, refused and instance(tmp / "refused", smollm2, tmp / "store", "kv_consumer",
                                        [[5, 6, 7, 8]], 4)


#: the tests that read each pair's run
PAIRS = {"smollm2": {"test_pop_prefill_then_full_decode_equals_single_instance_pop"},
         "tiny": {"test_pop_plus_prefill_hands_over_the_fitted_rows",
                  "test_a_decode_instance_of_another_model_is_refused"}}


@pytest.fixture(scope="module")
def pairs(request, smollm2, tiny, tmp_path_factory) -> dict[str, Future]:
    """The prefill/decode pairs the selected tests read, started now in the background, side by side
    (serving.start): SmolLM2's POP pair, and the tiny POP+ pair followed by SmolLM2 as its decode instance.
    A test computes its references, then waits for its pair."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    root, runs = tmp_path_factory.mktemp("pairs"), {}
    if PAIRS["smollm2"] & selected:
        runs["smollm2"] = start(split, root / "smollm2", smollm2, *smollm2_prompts(smollm2))
    if PAIRS["tiny"] & selected:
        refused = "test_a_decode_instance_of_another_model_is_refused" in selected
        runs["tiny"] = start(tiny_pair_then_refused, root / "tiny", tiny[1], smollm2, refused)
    return runs


def test_pop_prefill_then_full_decode_equals_single_instance_pop(pairs, smollm2):
    handed, missing = smollm2_prompts(smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    pop = [generate(model, torch.tensor([ids]), NEW, Variant(cut=20)) for ids in handed]
    full = generate(model, torch.tensor(missing), NEW, Variant(cut=30))
    handed_full = [generate(model, torch.tensor([ids]), NEW, Variant(cut=30)) for ids in handed]
    served = pairs["smollm2"].result()
    assert [r["tokens"] for r in served] == [*pop, full]
    # the decode instance loaded every prompt row but the last (x_N runs there, through the full model) and
    # prefilled the prompt it had no rows for in full
    assert [r["cached"] for r in served] == [len(ids) - 1 for ids in handed] + [0]
    # POP changed at least one completion: the rows really are POP's
    assert pop != handed_full


def test_pop_plus_prefill_hands_over_the_fitted_rows(tiny, pairs):
    hf, folder, fit = tiny
    config = json.loads((folder / "config.json").read_text())
    assert config["popcompile"]["kv_weights"] == "pop_kv.safetensors"
    handed = tiny_prompts()
    weights = load_fit(fit).weights
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    pop_plus = Variant(cut=2, kv_weights=weights)
    expected = [generate(model, torch.tensor([ids]), NEW, pop_plus) for ids in handed]
    pop = [generate(model, torch.tensor([ids]), NEW, Variant(cut=2)) for ids in handed]
    served, _ = pairs["tiny"].result()
    assert [r["tokens"] for r in served] == expected
    assert expected != pop


def test_a_decode_instance_of_another_model_is_refused(pairs):
    """The tiny pair's hand-off folder holds the tiny model's layout (its prefill instance wrote it):
    SmolLM2 as a decode instance on it does not start."""
    done = pairs["tiny"].result()[1].done
    assert done.returncode != 0
    assert "belongs to another model layout" in done.stderr and "num_layers 4 vs 30" in done.stderr, \
        done.stderr[-3000:]


def test_the_router_sample_serves_pop_over_two_servers(tiny, tmp_path):
    """samples/vllm_disagg.py in front of two `vllm serve` processes (prefill, decode) on the POP+ folder:
    an OpenAI completion through the router gives the single-instance POP+ tokens."""
    hf, folder, fit = tiny
    store = tmp_path / "store"
    servers = [_serve(folder, role, store, tmp_path / f"{role}.log")
               for role in ("kv_producer", "kv_consumer")]
    router_port = _free_port()
    router = sample_process("vllm_disagg.py", "--prefill", servers[0][1], "--decode", servers[1][1], "--port",
                            str(router_port))
    try:
        for proc, url, log in servers:
            _wait_healthy(proc, url, log)
        _wait_healthy(router, f"http://127.0.0.1:{router_port}", None)
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (90, 200)]
        answers = [_complete(f"http://127.0.0.1:{router_port}", str(folder), ids) for ids in prompts]
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        pop_plus = Variant(cut=2, kv_weights=load_fit(fit).weights)
        assert answers == [generate(model, torch.tensor([ids]), NEW, pop_plus) for ids in prompts]
        streamed = _post(f"http://127.0.0.1:{router_port}/v1/completions", {"prompt": [5], "stream": True})
        assert streamed[0] == 400 and "stream" in streamed[1]
    finally:
        for proc in [router, *(s[0] for s in servers)]:
            proc.terminate()
            proc.wait(timeout=120)


def sample_process(name: str, *args: str) -> subprocess.Popen:
    """A long-running sample (a server) in its own process (tests/test_samples.py counts it as run)."""
    return subprocess.Popen([sys.executable, str(HERE.parent / "samples" / name), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(folder: Path, role: str, store: Path, log: Path):
    port = _free_port()
    transfer = {"kv_connector": "PopConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(folder), "--port", str(port), "--enforce-eager", "--dtype", "float32",
                             "--max-model-len", "1024", "--kv-transfer-config", json.dumps(transfer)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    return proc, f"http://127.0.0.1:{port}", log


def _wait_healthy(proc, url: str, log: Path | None) -> None:
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log and log.read_text()[-3000:]
            time.sleep(1)


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _complete(url: str, model: str, prompt: list[int]) -> list[int]:
    status, body = _post(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": NEW,
                                                   "temperature": 0, "ignore_eos": True,
                                                   "return_token_ids": True})
    assert status == 200, body
    return json.loads(body)["choices"][0]["token_ids"]
