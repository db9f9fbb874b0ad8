"""POP through vLLM vs the same vLLM without it: single-request TTFT, decode speed and a load test (CPU).

Two folders of one model, made once with popcompile (cached in ~/.cache/popcompile/bench-vllm):
``pop`` (export --target vllm, POP's cut, --kv-calibration none) and ``vanilla`` (the same files with the
stock architecture and no popcompile entry). Each measurement block is one vLLM engine in its own process;
blocks alternate vanilla / pop / pop / vanilla ... over ``--rounds``, and the table shows medians.

    TTFT      one request at a time, max_tokens=1, prefix caching off, no chunking (max_num_batched_tokens
              covers the prompt); ratio = vanilla / pop, next to the FLOP bound of the cut (popcompile.cost)
    decode    64 greedy tokens after a 512-token prompt: (t_64 - t_1) / 63 per token
    load      --load N requests of --load-tokens prompts, 64 output tokens each, Poisson arrivals at --rate
              requests/s (same seed for both): mean / p90 TTFT and output tokens/s over the whole run

    .venv-vllm/bin/python benchmarks/vllm_ttft.py --tokens 512 1024 2048 --reps 5 --rounds 2 --load 16
    .venv-vllm/bin/python benchmarks/vllm_ttft.py --in-process --load 0      # single requests, one process
    .venv-vllm/bin/python benchmarks/vllm_ttft.py --eager  # enforce_eager (default: torch.compile)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from popcompile.exporters.vllm import stock_view

CACHE = Path.home() / ".cache" / "popcompile" / "bench-vllm"
ENGINE = dict(dtype="float32", max_model_len=4096, enable_prefix_caching=False,
              max_num_batched_tokens=4096, seed=0)


def folders(model: str) -> dict[str, Path]:
    """The pop and vanilla folders of ``model``, exported on first use."""
    pop, vanilla = CACHE / model / "pop", CACHE / model / "vanilla"
    if not pop.is_dir():
        subprocess.run([sys.executable, "-m", "popcompile.cli", "export", model, "--target", "vllm", "--out",
                        str(pop), "--kv-calibration", "none", "--prune-ratio", "1/3"], check=True)
    if not vanilla.is_dir():
        stock_view(pop, vanilla)
    return {"vanilla": vanilla, "pop": pop}


def prompts(folder: Path, lengths: list[int], count: int = 1) -> dict[int, list[list[int]]]:
    """``count`` distinct token-id prompts per length, cut from standard-library sources (no download)."""
    from tokenizers import Tokenizer

    from popcompile.kvfit.corpus import stdlib_texts

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    stream = [i for _, text in stdlib_texts() for i in tokenizer.encode(text).ids]
    return {n: [stream[k * n:(k + 1) * n] for k in range(count)] for n in lengths}


# --- one engine, in its own process ----------------------------------------------------------------

def measure_single(folder: Path, lengths: list[int], reps: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), **engine_args())
    first, decode = SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0, max_tokens=64,
                                                                                ignore_eos=True)
    by_length = prompts(folder, lengths)
    timed = lambda ids, params: _timed(
        lambda: llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False))
    for n in lengths:
        timed(by_length[n][0], first)  # warm-up
    ttft = {n: [] for n in lengths}
    for _ in range(reps):
        for n in lengths:
            ttft[n].append(timed(by_length[n][0], first))
    short = prompts(folder, [512])[512][0]
    per_token = [(timed(short, decode) - timed(short, first)) / 63 for _ in range(max(2, reps // 2))]
    return {"ttft": ttft, "decode_s_per_token": per_token}


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def engine_args() -> dict:
    return {**ENGINE, "enforce_eager": os.environ.get("POP_BENCH_EAGER") == "1"}


def measure_load(folder: Path, requests: int, tokens: int, rate: float) -> dict:
    return asyncio.run(_load(folder, requests, tokens, rate))


async def _load(folder: Path, requests: int, tokens: int, rate: float) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(folder), **engine_args()))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    batch = prompts(folder, [tokens], requests + 1)[tokens]
    async for _ in engine.generate({"prompt_token_ids": batch[-1]}, params, "warm-up"):
        pass
    gaps = random.Random(0)
    start, ttft = time.perf_counter(), []

    async def one(i: int, at: float) -> int:
        await asyncio.sleep(at)
        sent, count = time.perf_counter(), 0
        async for out in engine.generate({"prompt_token_ids": batch[i]}, params, str(i)):
            if count == 0:
                ttft.append(time.perf_counter() - sent)
            count = len(out.outputs[0].token_ids)
        return count

    arrivals = [sum(gaps.expovariate(rate) for _ in range(i)) for i in range(requests)]
    counts = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    seconds = time.perf_counter() - start
    engine.shutdown()
    return {"ttft": ttft, "output_tokens_per_s": sum(counts) / seconds}


# --- the driver: alternating blocks, medians, the table -------------------------------------------

def run_block(args, folder: Path, kind: str) -> dict:
    result = CACHE / f"block-{kind}.json"
    command = [sys.executable, __file__, "--worker", kind, "--folder", str(folder), "--result", str(result),
               "--tokens", *map(str, args.tokens), "--reps", str(args.reps), "--load", str(args.load),
               "--load-tokens", str(args.load_tokens), "--rate", str(args.rate)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    if args.in_process:  # engine core and worker in the measuring process: no polling processes beside it
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.eager:  # read by engine_args() in the block's process
        env["POP_BENCH_EAGER"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    return json.loads(result.read_text())


def table(args, results: dict, cut: int, config) -> str:
    from popcompile.cost import speedup_bound

    median = statistics.median
    rows = ["| prompt tokens | vanilla TTFT ms | POP TTFT ms | speedup | FLOP bound | % of bound |",
            "|---|---|---|---|---|---|"]
    for n in args.tokens:
        full = median(t for r in results["vanilla"] for t in r["ttft"][str(n)])
        pop = median(t for r in results["pop"] for t in r["ttft"][str(n)])
        bound = speedup_bound(config, n, cut)
        rows.append(f"| {n} | {full * 1e3:.0f} | {pop * 1e3:.0f} | {full / pop:.2f}x | {bound:.2f}x | "
                    f"{100 * (full / pop - 1) / (bound - 1):.0f}% |")
    decode = {k: median(t for r in results[k] for t in r["decode_s_per_token"]) for k in ("vanilla", "pop")}
    rows.append(f"\ndecode (512-token prompt, 64 tokens): vanilla {1 / decode['vanilla']:.1f} tok/s, POP "
                f"{1 / decode['pop']:.1f} tok/s, ratio {decode['vanilla'] / decode['pop']:.3f}")
    return "\n".join(rows)


def load_table(args, results: dict) -> str:
    rows = [f"\nload: {args.load} requests x {args.load_tokens} tokens, 64 out, Poisson {args.rate}/s",
            "| engine | mean TTFT s | p90 TTFT s | output tok/s |", "|---|---|---|---|"]
    for kind in ("vanilla", "pop"):
        ttft = sorted(t for r in results[kind] for t in r["load"]["ttft"])
        speed = statistics.median(r["load"]["output_tokens_per_s"] for r in results[kind])
        rows.append(f"| {kind} | {statistics.mean(ttft):.2f} | {ttft[int(0.9 * (len(ttft) - 1))]:.2f} | "
                    f"{speed:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="vanilla/pop block pairs, alternating order")
    parser.add_argument("--load", type=int, default=16, help="requests in the load test (0: none)")
    parser.add_argument("--load-tokens", type=int, default=2048)
    parser.add_argument("--rate", type=float, default=0.5, help="load test arrivals per second")
    parser.add_argument("--json", type=Path, help="also write the raw measurements here")
    parser.add_argument("--in-process", action="store_true",
                        help="VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's engine in the measuring process "
                             "(on 2 cores its default front-end/engine/worker processes take CPU "
                             "from the model)")
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager=True (`vllm serve --enforce-eager`) "
                             "instead of vLLM's default torch.compile")
    parser.add_argument("--worker", choices=["vanilla", "pop"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = measure_single(args.folder, args.tokens, args.reps)
        if args.load:
            result["load"] = measure_load(args.folder, args.load, args.load_tokens, args.rate)
        args.result.write_text(json.dumps(result))  # a file: vLLM writes its own lines to stdout
        return
    import transformers

    paths = folders(args.model)
    results = {"vanilla": [], "pop": []}
    for r in range(args.rounds):
        for kind in (("vanilla", "pop") if r % 2 == 0 else ("pop", "vanilla")):
            results[kind].append(run_block(args, paths[kind], kind))
            print(f"round {r + 1}/{args.rounds}: {kind} done", file=sys.stderr)
    config = transformers.AutoConfig.from_pretrained(paths["vanilla"])
    cut = json.loads((paths["pop"] / "config.json").read_text())["popcompile"]["cut"]
    where = ((", in-process engine" if args.in_process else "")
             + (", enforce_eager" if args.eager else ", torch.compile"))
    print(f"vLLM {__import__('vllm').__version__} CPU, {args.model}, "
          f"cut {cut} of {config.num_hidden_layers}, "
          f"{os.cpu_count()} cores{where}\n" + table(args, results, cut, config)
          + (load_table(args, results) if args.load else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
