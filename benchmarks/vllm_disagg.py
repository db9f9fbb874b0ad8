"""Prefill/decode disaggregation with POP on vLLM (CPU): one fixed mix of requests under four deployments.

    (a) full         one instance, the unpruned model (vanilla vLLM on the same files), both cores
    (b) pop          one instance, the POP folder, both cores
    (c) pop+full     POP prefill instance (core 0) -> PopConnector -> full decode instance (core 1)
    (d) full+full    full prefill instance (core 0) -> PopConnector -> full decode instance (core 1)

The mix (same prompts, all sent at once): ``--long`` requests with long prompts and short answers and
``--short`` requests the other way round. Single instances are streamed (TTFT = the first streamed token);
a pair is driven as samples/vllm_disagg.py routes it: the prompt to the prefill instance with max_tokens=1
(TTFT = its answer: a router forwards that token at once), then the unchanged request to the decode
instance. Reported per deployment: mean TTFT of the long-prompt requests and of the short ones, p90 TTFT,
output tokens/s over the whole mix (all output tokens / wall time), and, for the pairs, the prefill
instance's mean time per long prompt next to the FLOP bound of the cut (popcompile.cost). Every server runs
``--enforce-eager`` with float32 and its own hand-off folder; VLLM_CPU_OMP_THREADS_BIND pins the cores.

    .venv-vllm/bin/python benchmarks/vllm_disagg.py > disagg.md      # SmolLM2-135M, cut 20 of 30
    .venv-vllm/bin/python benchmarks/vllm_disagg.py --only pop+full full+full

The hand-off itself (``--transfer``): the bytes of K/V per prompt token and the time to write and read an
entry of ``--long-tokens`` rows through HandoffStore, in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from popcompile.exporters.vllm import stock_view

CACHE = Path.home() / ".cache" / "popcompile" / "bench-disagg"
CUT, LAYERS = 20, 30
DEPLOYMENTS = ("full", "pop", "pop+full", "full+full")


def folders(model: str) -> dict[str, Path]:
    """pop (cut 20), unpruned (cut 30: the same POP class, no pruning; the full prefill instance) and
    vanilla (stock architecture) folders of ``model``, exported on first use."""
    out = {"pop": CACHE / "pop", "unpruned": CACHE / "unpruned", "vanilla": CACHE / "vanilla"}
    for name, cut in (("pop", CUT), ("unpruned", LAYERS)):
        if not out[name].is_dir():
            subprocess.run([sys.executable, "-m", "popcompile.cli", "export", model, "--target", "vllm",
                            "--out", str(out[name]), "--cut", str(cut), "--kv-calibration", "none"],
                           check=True)
    if not out["vanilla"].is_dir():
        stock_view(out["pop"], out["vanilla"])
    return out


def mix(folder: Path, long: int, long_tokens: int, short: int, short_tokens: int, long_out: int,
        short_out: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of the mix, cut from standard-library sources (no download)."""
    from tokenizers import Tokenizer

    from popcompile.kvfit.corpus import stdlib_texts

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [i for _, text in stdlib_texts() for i in tokenizer.encode(text).ids]
    requests, at = [], 0
    for count, tokens, out in ((long, long_tokens, long_out), (short, short_tokens, short_out)):
        for _ in range(count):
            requests.append((ids[at:at + tokens], out))
            at += tokens
    return requests


class Server:
    """``vllm serve``'s API server on ``folder``, pinned to ``cores``, with an optional KV role."""

    def __init__(self, folder: Path, cores: str, log: Path, role: str | None = None,
                 store: Path | None = None):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                   "--port", str(self.port), "--enforce-eager", "--dtype", "float32", "--max-model-len",
                   "4096", "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching"]
        if role:
            command += ["--kv-transfer-config", json.dumps({
                "kv_connector": "PopConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)}})]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": cores}
        self.log = log.open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url, self.model = f"http://127.0.0.1:{self.port}", str(folder)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server on {self.model} did not start: {self.log.name}") from None
                time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        self.log.close()


def complete(server: Server, prompt: list[int], max_tokens: int, stream: bool) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, output tokens) of one greedy completion."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start, first, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=1800) as response:
        if not stream:
            answer = json.loads(response.read())
            end = time.perf_counter() - start
            return end, end, answer["usage"]["completion_tokens"]
        for line in response:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                if first is None:
                    first = time.perf_counter() - start
                tokens += 1
    return first, time.perf_counter() - start, tokens


def run_single(server: Server, requests) -> list[dict]:
    def one(item):
        ttft, end, tokens = complete(server, item[0], item[1], stream=True)
        return {"ttft": ttft, "end": end, "tokens": tokens, "prompt": len(item[0])}
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def run_pair(prefill: Server, decode: Server, requests) -> list[dict]:
    def one(item):
        start = time.perf_counter()
        ttft, _, _ = complete(prefill, item[0], 1, stream=False)
        _, _, tokens = complete(decode, item[0], item[1], stream=False)
        return {"ttft": ttft, "prefill": ttft, "end": time.perf_counter() - start, "tokens": tokens,
                "prompt": len(item[0])}
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def deploy(name: str, paths: dict[str, Path], requests, logs: Path) -> dict:
    """Start the deployment's servers, warm them with one request, run the mix, stop them."""
    store = Path(tempfile.mkdtemp(prefix="pop-kv-"))
    if name in ("full", "pop"):
        servers = [Server(paths["vanilla" if name == "full" else "pop"], "0-1", logs / f"{name}.log")]
    else:
        source = paths["pop" if name == "pop+full" else "unpruned"]
        servers = [Server(source, "0", logs / f"{name}-prefill.log", "kv_producer", store),
                   Server(paths["pop"], "1", logs / f"{name}-decode.log", "kv_consumer", store)]
    try:
        for server in servers:
            server.wait()
        warm = [(requests[-1][0][:64], 2)]
        _ = run_single(servers[0], warm) if len(servers) == 1 else run_pair(*servers, warm)
        start = time.perf_counter()
        start = time.perf_counter()
        runs = run_single(servers[0], requests) if len(servers) == 1 else run_pair(*servers, requests)
        wall = time.perf_counter() - start
    finally:
        for server in servers:
            server.stop()
    return {"name": name, "runs": runs, "wall": wall}


def summarize(result: dict, long_tokens: int) -> dict:
    runs = result["runs"]
    long = [r for r in runs if r["prompt"] == long_tokens]
    short = [r for r in runs if r["prompt"] != long_tokens]
    ttfts = sorted(r["ttft"] for r in runs)
    row = {"deployment": result["name"], "ttft_long": statistics.mean(r["ttft"] for r in long),
           "ttft_short": statistics.mean(r["ttft"] for r in short),
           "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
           "tokens_per_s": sum(r["tokens"] for r in runs) / result["wall"], "wall": result["wall"]}
    return row


def transfer_cost(folder: Path, rows: int) -> dict:
    """K/V bytes per prompt token, and HandoffStore write/read seconds for ``rows`` rows (this process)."""
    import torch

    from popcompile.vllm_plugin.handoff import HandoffStore, Layout, entry_key

    config = json.loads((folder / "config.json").read_text())
    heads, dim = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    tensors = {f"model.layers.{i}.self_attn.attn": torch.randn(rows, heads, 2, dim) for i in range(layers)}
    with tempfile.TemporaryDirectory() as root:
        store = HandoffStore(root, Layout("x", layers, heads, dim, "float32", "w"))
        start = time.perf_counter()
        store.write(entry_key(range(rows)), tensors)
        write = time.perf_counter() - start
        start = time.perf_counter()
        store.read(entry_key(range(rows)))
        read = time.perf_counter() - start
    per_token = 2 * layers * heads * dim * 4
    return {"bytes_per_token": per_token, "rows": rows, "write_s": write, "read_s": read,
            "write_gb_s": per_token * rows / write / 1e9, "read_gb_s": per_token * rows / read / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long", type=int, default=4, help="requests with long prompts, short answers")
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--long-out", type=int, default=8)
    parser.add_argument("--short", type=int, default=4, help="requests with short prompts, long answers")
    parser.add_argument("--short-tokens", type=int, default=128)
    parser.add_argument("--short-out", type=int, default=96)
    parser.add_argument("--only", nargs="+", choices=DEPLOYMENTS, default=list(DEPLOYMENTS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    paths = folders(args.model)
    requests = mix(paths["pop"], args.long, args.long_tokens, args.short, args.short_tokens, args.long_out,
                   args.short_out)
    logs = Path(tempfile.mkdtemp(prefix="disagg-logs-"))
    rows = []
    for name in args.only:
        rows.append(summarize(deploy(name, paths, requests, logs), args.long_tokens))
        print(f"done {name}", file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows, args, transfer_cost(paths["pop"], args.long_tokens)))


def table(rows: list[dict], args, transfer: dict) -> str:
    import transformers

    from popcompile.cost import speedup_bound

    bound = speedup_bound(transformers.AutoConfig.from_pretrained(CACHE / "pop"), args.long_tokens, CUT)
    lines = [f"{args.model}, cut {CUT} of {LAYERS}; mix: {args.long} x {args.long_tokens}-token prompts / "
             f"{args.long_out} new tokens + {args.short} x {args.short_tokens} / {args.short_out}, sent at "
             "once; vLLM CPU, float32, enforce_eager", "",
             "| deployment | TTFT long s | TTFT short s | TTFT p90 s | output tok/s | wall s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['deployment']} | {r['ttft_long']:.2f} | {r['ttft_short']:.2f} | {r['ttft_p90']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['wall']:.1f} |" for r in rows]
    pair = {r["deployment"]: r for r in rows}
    if "pop+full" in pair and "full+full" in pair:
        ratio = pair["full+full"]["ttft_long"] / pair["pop+full"]["ttft_long"]
        lines += ["", f"prefill instance, long prompts: full / POP TTFT = {ratio:.3f}, FLOP bound of the cut "
                      f"{bound:.3f} ({ratio / bound:.1%} of it)"]
    lines += ["", f"hand-off: {transfer['bytes_per_token'] / 1024:.1f} KiB of K/V per prompt token; an entry "
                  f"of {transfer['rows']} rows written in {transfer['write_s']:.3f} s "
                  f"({transfer['write_gb_s']:.2f} GB/s), read in {transfer['read_s']:.3f} s "
                  f"({transfer['read_gb_s']:.2f} GB/s), local disk"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
