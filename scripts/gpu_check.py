#!/usr/bin/env python3
"""GPU check: TensorRT engines against the CPU results, and TTFT full vs POP (run by scripts/gpu_check.sh).

Phases, in order, each time-boxed against ``--budget`` (a phase that does not fit is skipped and says so):

    environment        GPU (nvidia-smi), torch/CUDA, tensorrt, cuda-python, onnxruntime providers
    export             SmolLM2-135M as an ONNX engine folder (out/gpu_check/smollm2-135m, max_seq 2112)
    trt-build          prefill.plan + decode.plan (popcompile build-trt; --precision, default bf16)
    trt-numerics       TrtSession vs PopSession on the CPU: first token, logits error, greedy agreement
    trt-ttft           TTFT full vs POP at 512/1024/2048 tokens beside the FLOP bound; decode tok/s with and
                       without a CUDA graph
    ort-cuda           (no TensorRT) the ONNX graphs on onnxruntime's CUDA provider: numerics and TTFT
    torch-smollm2      (no TensorRT) the PyTorch prefill/decode graphs on CUDA (bf16): numerics and TTFT
    torch-llama8b-6l   Llama-3.1-8B layer geometry, 6 layers (cut 4: the same third pruned), random bf16
                       weights, PyTorch graphs on CUDA: TTFT at batch 1 and 8

Results go to ``--out``.json and .md (default docs/gpu_results), rewritten after every phase, so a run
cut short still leaves what it measured. ``--device cpu --quick`` is a dry run of the same code on a tiny
random model (no GPU phases: they are skipped with the reason).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this working tree's popcompile, installed or not

TOKENS = (512, 1024, 2048)
MAX_SEQ = 2112
WORK = REPO / "out" / "gpu_check"


class Skip(Exception):
    """A phase that cannot run here; the message says why."""


class Report:
    def __init__(self, out: Path, meta: dict):
        self.out, self.data = out, {"meta": meta, "phases": {}}

    def record(self, name: str, status: str, **fields) -> None:
        self.data["phases"][name] = {"status": status, **fields}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_suffix(".json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        self.out.with_suffix(".md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = ["# GPU check results", "", f"Written by `scripts/gpu_check.sh` on {meta.get('date')}; "
             f"{meta.get('gpu', 'no GPU')}. Every speed figure stands beside the FLOP bound of the same cut.", ""]
    for name, phase in data["phases"].items():
        lines.append(f"## {name}: {phase['status']}" + (f" ({phase['seconds']:.0f} s)" if "seconds" in phase else ""))
        lines.append("")
        for key, value in phase.items():
            if key in ("status", "seconds", "rows", "traceback"):
                continue
            lines.append(f"- {key}: {json.dumps(value, default=str) if isinstance(value, (dict, list)) else value}")
        rows = phase.get("rows")
        if rows:
            header = list(rows[0])
            lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_cell(r.get(h)) for h in header) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_phase(report: Report, budget: Budget, name: str, needs_s: float, fn, *args):
    """Run fn(*args) -> dict of fields when ``needs_s`` seconds are left; record ok/skipped/failed."""
    if budget.left() < needs_s:
        report.record(name, "skipped", reason=f"{budget.left():.0f} s left, the phase needs about {needs_s:.0f} s")
        return None
    start = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        fields = fn(*args)
    except Skip as reason:
        report.record(name, "skipped", reason=str(reason))
        return None
    except Exception as err:  # noqa: BLE001 - a failed phase is a result; the next phases still run
        report.record(name, "failed", seconds=time.perf_counter() - start, error=f"{type(err).__name__}: {err}",
                      traceback=traceback.format_exc()[-4000:])
        return None
    report.record(name, "ok", seconds=time.perf_counter() - start, **fields)
    return fields


# --------------------------------------------------------------------------------------------- phases

def environment() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,driver_version,memory.total,compute_cap"
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True)
        info["gpus"] = out.stdout.strip().splitlines() or out.stderr.strip()
    for module in ("torch", "tensorrt", "onnxruntime", "transformers", "cuda.bindings", "cuda"):
        try:
            mod = __import__(module, fromlist=["_"])
            info[module] = getattr(mod, "__version__", "present")
        except Exception as err:  # noqa: BLE001 - absent or broken: both are facts to report
            info[module] = f"absent ({type(err).__name__})"
    with contextlib.suppress(Exception):
        import torch
        info["torch.cuda"] = torch.cuda.is_available() and torch.cuda.get_device_name(0)
    with contextlib.suppress(Exception):
        import onnxruntime
        info["onnxruntime providers"] = onnxruntime.get_available_providers()
    return info


def export_folder(args) -> dict:
    from popcompile.exporters.onnx import export

    folder = WORK / args.model_dir
    if not (folder / "popcompile.json").is_file():
        model = tiny_loaded() if args.quick else "smollm2-135m"
        export(model, folder, max_seq=args.max_seq, force=True, kv_calibration="none")  # runtimes, not quality
    return {"folder": str(folder)}


def tiny_loaded():
    """A tiny random Llama with a word-level tokenizer (the test suite's), for --quick dry runs."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import tiny_model
    from tiny_engine import tiny_tokenizer

    from popcompile.models import LoadedModel, ModelSource

    model = tiny_model("llama", max_position_embeddings=256)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = None  # never stop early: timings need the tokens
    return LoadedModel(model, tokenizer, ModelSource("tiny", "folder", "tiny", None))


def prompt_ids(folder: Path, n: int) -> list[int]:
    """The first n tokens of real text nobody here wrote (standard-library sources)."""
    from popcompile.runtime.tokenizer import EngineTokenizer

    import argparse as a, json.decoder as j, logging as g, textwrap as t  # noqa: E401
    text = "\n".join(inspect.getsource(m) for m in (j, t, a, g, inspect))
    ids = EngineTokenizer.from_folder(folder).encode(text)
    if len(ids) < n:
        ids = (ids * (n // max(len(ids), 1) + 1))
    return ids[:n]


@contextlib.contextmanager
def sampled_logits():
    """Collect the logits every generation step samples from (both runtimes use loop.Generation)."""
    from popcompile.runtime import loop

    collected, original = [], loop.Sampler

    class Recording(original):
        def __call__(self, logits):
            collected.append(__import__("numpy").array(logits, dtype="float32"))
            return super().__call__(logits)

    loop.Sampler = Recording
    try:
        yield collected
    finally:
        loop.Sampler = original


def compare(session, reference, folder: Path, tokens: int, new_tokens: int) -> list[dict]:
    """Greedy generation from both sessions on the same prompt; rows per mode."""
    import numpy as np

    from popcompile.runtime.generate import SamplingConfig

    ids = prompt_ids(folder, tokens)
    rows = []
    for mode in ("pop", "full"):
        runs = []
        for s in (session, reference):
            with sampled_logits() as logits:
                result = s.generate([ids], SamplingConfig(max_new_tokens=new_tokens), mode=mode)[0]
            runs.append((result.token_ids, logits[0][0]))
        (got, first), (want, ref_first) = runs
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        rows.append({"mode": mode, "prompt tokens": tokens, "first token equal": got[0] == want[0],
                     "greedy tokens agreeing": f"{agree}/{len(want)}",
                     "max |d logits|": float(np.abs(first - ref_first).max()),
                     "relative": float(np.abs(first - ref_first).max() / np.abs(ref_first).max())})
    return rows


def ttft_rows(session, folder: Path, tokens, reps: int, cut_info) -> list[dict]:
    """Interleaved TTFT medians of POP and full per prompt length, beside the FLOP bound."""
    from popcompile.cost import speedup_bound
    from popcompile.runtime.generate import SamplingConfig

    config, cut = cut_info
    one = SamplingConfig(max_new_tokens=1)
    rows = []
    for n in tokens:
        ids = prompt_ids(folder, n)
        times = {"pop": [], "full": []}
        for mode in times:  # warm-up
            session.generate([ids], one, mode=mode)
        for rep in range(reps):
            for mode in (("pop", "full") if rep % 2 == 0 else ("full", "pop")):
                times[mode].append(session.generate([ids], one, mode=mode)[0].ttft_s)
        pop, full = statistics.median(times["pop"]), statistics.median(times["full"])
        rows.append({"tokens": n, "full ms": full * 1e3, "POP ms": pop * 1e3, "ratio": full / pop,
                     "FLOP bound": speedup_bound(config, n, cut)})
    return rows


def _cut_info(folder: Path):
    from popcompile.exporters.manifest import EngineManifest

    return json.loads((folder / "config.json").read_text()), EngineManifest.read(folder).cut


def trt_build(args, folder: Path) -> dict:
    from popcompile.exporters.tensorrt import TrtBuildConfig, build_engines
    from popcompile.exporters.tensorrt_compat import TensorRTUnavailable

    config = TrtBuildConfig(precision=args.precision, opt_seq=1024, optimization_level=args.opt_level)
    try:
        section = build_engines(folder, config, progress=lambda s: print(f"  {s}", flush=True))
    except TensorRTUnavailable as err:
        raise Skip(str(err)) from None
    return {"tensorrt": section.tensorrt_version, "gpu": f"{section.gpu} (sm {section.compute_capability})",
            "precision": section.precision, "optimization level": args.opt_level,
            "build seconds": section.build_seconds, "decode KV binding": section.decode_kv,
            "plan MiB": {k: round(p["bytes"] / 2**20, 1) for k, p in section.plans.items()}}


def trt_numerics(args, folder: Path) -> dict:
    from popcompile.runtime.ort import PopSession
    from popcompile.runtime.trt import TrtSession

    rows = compare(TrtSession(folder), PopSession(folder), folder, args.tokens[0], 16)
    return {"reference": "onnxruntime CPU, float32", "rows": rows}


def trt_ttft(args, folder: Path) -> dict:
    from popcompile.runtime.generate import SamplingConfig
    from popcompile.runtime.trt import TrtSession

    session = TrtSession(folder)
    rows = ttft_rows(session, folder, args.tokens, args.reps, _cut_info(folder))
    decode = {}
    ids = prompt_ids(folder, args.tokens[0])
    for graph in (False, True):
        s = session if not graph else TrtSession(folder, cuda_graph=True)
        if graph and s.binding != "static":
            continue
        s.generate([ids], SamplingConfig(max_new_tokens=8))
        result = s.generate([ids], SamplingConfig(max_new_tokens=65))[0]
        decode["CUDA graph" if graph else "no graph"] = round(result.decode_tokens_per_s, 1)
    return {"rows": rows, "decode tokens/s (64 tokens after the prompt)": decode, "KV binding": session.binding}


def ort_cuda(args, folder: Path) -> dict:
    from popcompile.runtime.ort import PopSession

    provider = "cpu" if args.device == "cpu" else "cuda"
    try:
        session = PopSession(folder, provider=provider)
    except ValueError as err:
        raise Skip(str(err)) from None
    rows = compare(session, PopSession(folder), folder, args.tokens[0], 16)
    return {"provider": provider, "numerics vs CPU": rows,
            "rows": ttft_rows(session, folder, args.tokens, args.reps, _cut_info(folder))}


def torch_pair(model, cut: int, max_seq: int, device: str, dtype):
    """The PyTorch prefill/decode graphs on ``device``: captured on the CPU, then moved."""
    import torch
    from torch.export.passes import move_to_device_pass

    from popcompile.pipeline import build_graphs

    pair = build_graphs(model.to(dtype), cut=cut, max_seq=max_seq)
    move = (lambda ep: move_to_device_pass(ep, device).module()) if device != "cpu" else (lambda ep: ep.module())
    with torch.no_grad():
        return move(pair.prefill), move(pair.decode), pair.layout


def torch_ttft(prefill, decode, layout, vocab: int, tokens, batch: int, reps: int, device: str, config, cut):
    import torch

    from popcompile.cost import speedup_bound

    dtype = getattr(torch, layout.dtype)
    empty = [torch.zeros(batch, layout.num_kv_heads, 0, layout.head_dim, dtype=dtype, device=device)
             for _ in range(2 * layout.num_layers)]

    def call(graph, ids, start, past):
        pos = torch.arange(start, start + ids.shape[1], device=device).repeat(ids.shape[0], 1)
        return graph(ids, pos, torch.ones(ids.shape[0], start + ids.shape[1], dtype=torch.int64, device=device), *past)

    def full(ids):
        return call(decode, ids, 0, empty)[0]

    def pop(ids):  # the default folded prefill graph: x_1..x_N in, x_N's logits first among its outputs
        return call(prefill, ids, 0, empty)[0]

    def timed(fn, ids):
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        sync()
        start = time.perf_counter()
        fn(ids)
        sync()
        return time.perf_counter() - start

    rows = []
    with torch.inference_mode():
        for n in tokens:
            ids = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n)).to(device)
            timed(full, ids), timed(pop, ids)
            times = {"pop": [], "full": []}
            for rep in range(reps):
                for name, fn in ((("pop", pop), ("full", full)) if rep % 2 == 0 else (("full", full), ("pop", pop))):
                    times[name].append(timed(fn, ids))
            f, p = statistics.median(times["full"]), statistics.median(times["pop"])
            rows.append({"batch": batch, "tokens": n, "full ms": f * 1e3, "POP ms": p * 1e3, "ratio": f / p,
                         "FLOP bound": speedup_bound(config, n, cut)})
    return rows


def torch_smollm2(args, folder: Path) -> dict:
    import numpy as np
    import torch

    from popcompile.models import load_model
    from popcompile.runtime.ort import PopSession

    manifest_cut = _cut_info(folder)
    loaded = tiny_loaded() if args.quick else load_model("smollm2-135m")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    prefill, decode, layout = torch_pair(loaded.model, manifest_cut[1], args.max_seq, args.device, dtype)
    ids = prompt_ids(folder, args.tokens[0])
    with torch.inference_mode():
        x = torch.tensor([ids], device=args.device)
        pos = torch.arange(len(ids), device=args.device)[None]
        past = [torch.zeros(1, layout.num_kv_heads, 0, layout.head_dim, dtype=dtype, device=args.device)
                for _ in range(2 * layout.num_layers)]
        logits = decode(x, pos, torch.ones_like(x), *past)[0].float().cpu().numpy()
    reference = PopSession(folder).sessions["decode"].run(None, {
        "input_ids": np.array([ids]), "position_ids": np.arange(len(ids))[None],
        "attention_mask": np.ones((1, len(ids)), np.int64),
        **{n: np.zeros((1, layout.num_kv_heads, 0, layout.head_dim), np.float32) for n in layout.past_names}})[0]
    numerics = {"first token equal": int(logits.argmax()) == int(reference.argmax()),
                "max |d logits| vs onnxruntime CPU float32": float(np.abs(logits - reference).max()),
                "dtype": str(dtype)}
    rows = torch_ttft(prefill, decode, layout, loaded.model.config.vocab_size, args.tokens, 1, args.reps,
                      args.device, manifest_cut[0], manifest_cut[1])
    return {"numerics (decode graph, full prompt)": numerics, "rows": rows}


def torch_llama8b(args) -> dict:
    import torch
    import transformers

    layers, cut = (6, 4) if not args.quick else (3, 2)
    width = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 128256} if not args.quick else {
             "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 97}
    config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=4096, rope_theta=500000.0,
                                      tie_word_embeddings=True, **width)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    prefill, decode, layout = torch_pair(model, cut, args.max_seq, args.device, dtype)
    del model
    rows = []
    for batch in (1, 8):
        rows += torch_ttft(prefill, decode, layout, config.vocab_size, args.tokens, batch, args.reps, args.device,
                           config, cut)
    return {"model": f"Llama-3.1-8B geometry, {layers} layers, cut {cut}, random weights, {dtype}", "rows": rows}


# --------------------------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=420, help="seconds for all phases (default 420)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "gpu_results",
                   help="results path without suffix: .json and .md are written (default docs/gpu_results)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"], help="TensorRT precision")
    p.add_argument("--opt-level", type=int, default=2, help="TensorRT builder optimization level (default 2: "
                                                            "faster builds, for the time limit)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per mode and length (default 5)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the driver")
    p.add_argument("--quick", action="store_true", help="tiny random model and short prompts (dry runs)")
    args = p.parse_args(argv)
    args.tokens = (16, 32) if args.quick else TOKENS
    args.max_seq = 80 if args.quick else MAX_SEQ
    args.model_dir = "tiny" if args.quick else "smollm2-135m"
    args.reps = min(args.reps, 2) if args.quick else args.reps
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget)
    env = environment()
    gpu = (env.get("gpus") or ["no GPU"])[0] if isinstance(env.get("gpus"), list) else "no GPU"
    report = Report(args.out, {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": gpu, "device": args.device,
                               "quick": args.quick, "budget_s": args.budget})
    report.record("environment", "ok", **env)
    exported = run_phase(report, budget, "export", 30 if args.quick else 150, export_folder, args)
    folder = Path(exported["folder"]) if exported else None
    has_trt = False
    if folder is not None:
        built = run_phase(report, budget, "trt-build", 200, trt_build, args, folder)
        has_trt = built is not None
        if has_trt:
            run_phase(report, budget, "trt-numerics", 40, trt_numerics, args, folder)
            run_phase(report, budget, "trt-ttft", 60, trt_ttft, args, folder)
        else:  # where TensorRT is absent: onnxruntime's CUDA provider and the PyTorch graphs on CUDA
            run_phase(report, budget, "ort-cuda", 60, ort_cuda, args, folder)
            run_phase(report, budget, "torch-smollm2", 90, torch_smollm2, args, folder)
    run_phase(report, budget, "torch-llama8b-6l", 20 if args.quick else 120, torch_llama8b, args)
    print(f"[gpu_check] results: {args.out.with_suffix('.md')}", flush=True)
    out = os.environ.get("OUT")
    if out:  # the device tool brings back what is under $OUT
        for suffix in (".json", ".md"):
            shutil.copy(args.out.with_suffix(suffix), Path(out) / f"gpu_results{suffix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
