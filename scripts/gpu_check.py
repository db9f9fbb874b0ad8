#!/usr/bin/env python3
"""GPU check: POP vs full prefill on CUDA through PyTorch, bf16, on a Llama-3.1-8B-shaped model
(gpu_check.sh runs it).

Needs only torch (CUDA), transformers and this source tree on PYTHONPATH: no download, no venv, no
TensorRT. Phases, in order, each time-boxed against ``--budget`` (one that does not fit is skipped and
says so; the results file is rewritten after every phase, so a run cut short keeps what it measured):

    environment   GPU, torch/CUDA, triton, transformers, onnxruntime providers, tensorrt (imports or not)
    matmul-peak   the measured bf16 GEMM peak (8192^3): the yardstick for achieved TFLOP/s
    model         Llama-3.1-8B geometry (32 layers, 4096 hidden, 32/8 heads, 14336 FFN, 128256 vocab),
                  random bf16 weights; cut 22 (1/3 of the layers pruned, the default)
    graphs        (a) the captured decode graph (= full prefill) and the folded POP prefill graph
                  (capture + passes/boundary.py), eager on CUDA: TTFT at 512/2048/8192 tokens, batch 1
                  and 8, beside the FLOP bound (popcompile/cost.py) and achieved TFLOP/s; a decode step
                  after each prefill (same graph, same cache layout: the ratio should be 1)
    compile       (b) ``torch.compile(forward, backend=PopBackend(inner inductor), dynamic=True)`` against
                  ``backend="inductor"``: compile seconds, then TTFT as above
    tensorrt      only where ``tensorrt`` imports and ``--engine DIR`` is given (gpu_check_trt.py)
    ort-cuda      only where onnxruntime has CUDAExecutionProvider and ``--engine DIR`` is given

``--dry-run``: the same phases on the CPU with a tiny geometry, float32 and inner "eager" (seconds).
Results: ``--out``.md and .json (default docs/gpu_results), copied into $OUT when that is set.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this working tree's popcompile, installed or not

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "num_hidden_layers": 32,
            "rope_theta": 500000.0}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 97, "num_hidden_layers": 3, "rope_theta": 10000.0}


@dataclass(frozen=True)
class Plan:
    """What one run measures: the GPU run or its CPU dry run."""

    device: str
    dtype: str
    geometry: dict
    tokens: tuple
    batches: tuple
    reps: int
    inner: str
    peak_size: int

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"plan: device={self.device!r} dtype={self.dtype!r}")
        if not self.tokens or min(self.tokens) < 2 or not self.batches or self.reps < 1:
            raise ValueError(f"plan: tokens={self.tokens} batches={self.batches} reps={self.reps}")


GPU_PLAN = Plan("cuda", "bfloat16", LLAMA_8B, (512, 2048, 8192), (1, 8), 3, "inductor", 8192)
DRY_PLAN = Plan("cpu", "float32", TINY, (16, 32), (1, 2), 1, "eager", 256)


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
             f"{meta.get('gpu', 'no GPU')}; {meta.get('plan')}. Speed ratios stand beside the FLOP bound of "
             "the same cut, achieved TFLOP/s beside the measured matmul peak.", ""]
    for name, phase in data["phases"].items():
        lines.append(f"## {name}: {phase['status']}"
                     + (f" ({phase['seconds']:.0f} s)" if "seconds" in phase else ""))
        lines.append("")
        for key, value in phase.items():
            if key in ("status", "seconds", "rows", "traceback"):
                continue
            lines.append(f"- {key}: "
                         f"{json.dumps(value, default=str) if isinstance(value, (dict, list)) else value}")
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
        report.record(name, "skipped",
                      reason=f"{budget.left():.0f} s left, the phase needs about {needs_s:.0f} s")
        return None
    start = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        fields = fn(*args)
    except Skip as reason:
        report.record(name, "skipped", reason=str(reason))
        return None
    except Exception as err:  # noqa: BLE001 - a failed phase is a result; the next phases still run
        report.record(name, "failed", seconds=time.perf_counter() - start,
                      error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
        return None
    report.record(name, "ok", seconds=time.perf_counter() - start, **fields)
    return fields


# --------------------------------------------------------------------------------------------- phases

def environment() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform()}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,driver_version,memory.total,compute_cap"
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True)
        info["gpus"] = out.stdout.strip().splitlines() or out.stderr.strip()
    for module in ("torch", "triton", "transformers", "onnx", "onnxruntime", "tensorrt"):
        try:
            info[module] = getattr(__import__(module), "__version__", "present")
        except Exception as err:  # noqa: BLE001 - absent or broken: both are facts to report
            info[module] = f"absent ({type(err).__name__})"
    with contextlib.suppress(Exception):
        import torch
        info["torch.cuda"] = (torch.cuda.is_available()
                              and f"{torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    with contextlib.suppress(Exception):
        import onnxruntime
        info["onnxruntime providers"] = onnxruntime.get_available_providers()
    return info


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def matmul_peak(plan: Plan) -> dict:
    import torch

    n, dtype = plan.peak_size, getattr(torch, plan.dtype)
    a, b = (torch.randn(n, n, device=plan.device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    seconds = min(timed(lambda: [a @ b for _ in range(10)], plan.device) for _ in range(3)) / 10
    return {"size": f"{n}x{n}x{n} {plan.dtype}", "TFLOP/s": 2 * n**3 / seconds / 1e12}


def build_model(plan: Plan):
    """The geometry's Llama on the CPU, weights allocated but not initialised (capture only needs shapes;
    ``randomise`` fills them on the device)."""
    import torch
    import transformers

    geometry = dict(plan.geometry)
    theta = geometry.pop("rope_theta")
    config = transformers.LlamaConfig(max_position_embeddings=max(plan.tokens) + 64,
                                      tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": theta},
                                      **geometry)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, plan.dtype))
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its inv_freq buffer, computed again
    return model.eval()


def randomise(module, device: str) -> None:
    """Same random weights for the same parameter name in every module: seeded by the name."""
    import torch

    with torch.no_grad():
        for name, param in module.named_parameters():
            generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def cut_of(plan: Plan) -> int:
    from popcompile.config import resolve_cut

    return resolve_cut(plan.geometry["num_hidden_layers"])


def prefill_flops(plan: Plan, tokens: int, batch: int, cut: int | None) -> float:
    from popcompile.cost import prefill_flops as flops

    return batch * flops(plan.geometry, tokens, cut)


def ttft_table(plan: Plan, budget: Budget, run_full, run_pop, after: float, decode=None,
               batch_cost: float = 0.0) -> tuple[list, list]:
    """Interleaved medians of full and POP prefill per (batch, tokens); rows beside the FLOP bound.

    run_*(ids) -> the prefill's outputs; decode(outputs, ids) -> seconds of one decode step after it.
    A row starts only with ``after`` seconds left (``+ batch_cost`` for a new batch size: a recompile
    under torch.compile); a row that runs out of memory is reported and the next one tried."""
    import torch

    from popcompile.cost import speedup_bound

    cut, rows, skipped = cut_of(plan), [], []
    for index, batch in enumerate(plan.batches):
        for n in plan.tokens:
            needs = after + (batch_cost if index and n == plan.tokens[0] else 0.0)
            if budget.left() < needs:
                skipped.append(f"batch {batch} x {n} tokens: {budget.left():.0f} s left, needs {needs:.0f} s")
                continue
            try:
                times, steps = measure(plan, run_full, run_pop, decode, batch, n)
            except torch.OutOfMemoryError as err:
                skipped.append(f"batch {batch} x {n} tokens: out of memory ({str(err)[:120]})")
                torch.cuda.empty_cache()
                continue
            full, pop = statistics.median(times["full"]), statistics.median(times["pop"])
            row = {"batch": batch, "tokens": n, "full ms": full * 1e3, "POP ms": pop * 1e3,
                   "ratio": full / pop,
                   "FLOP bound": speedup_bound(plan.geometry, n, cut),
                   "full TFLOP/s": prefill_flops(plan, n, batch, None) / full / 1e12,
                   "POP TFLOP/s": prefill_flops(plan, n, batch, cut) / pop / 1e12}
            if decode is not None:
                row["decode step ratio (after full / after POP)"] = steps["full"][0] / steps["pop"][0]
            rows.append(row)
            if plan.device == "cuda":
                torch.cuda.empty_cache()
    return rows, skipped


def measure(plan: Plan, run_full, run_pop, decode, batch: int, n: int) -> tuple[dict, dict]:
    """Seconds per prefill call of each mode (interleaved after a warm-up), and decode steps after them."""
    import torch

    ids = torch.randint(0, plan.geometry["vocab_size"], (batch, n), device=plan.device)
    times, steps = {"full": [], "pop": []}, {"full": [], "pop": []}
    fns = {"full": run_full, "pop": run_pop}
    for fn in fns.values():  # warm-up (and, under torch.compile, a new shape's first run)
        timed(lambda fn=fn: fn(ids), plan.device)
    for rep in range(plan.reps):
        for name in (("pop", "full") if rep % 2 == 0 else ("full", "pop")):
            out = {}  # this call's outputs, kept for the decode step after it, then dropped
            times[name].append(timed(lambda run=fns[name], out=out: out.setdefault("o", run(ids)),
                                     plan.device))
            if decode is not None and rep == 0:
                steps[name].append(decode(out["o"], ids))
            del out
    return times, steps


def graphs_phase(plan: Plan, budget: Budget, model) -> dict:
    """(a) The captured decode graph and the folded POP prefill graph, eager on the device."""
    import torch
    from torch.export.passes import move_to_device_pass

    from popcompile.driver import build_graphs

    start = time.perf_counter()
    pair = build_graphs(model, cut=cut_of(plan), max_seq=max(plan.tokens) + 16)
    built = time.perf_counter() - start
    prefill, decode = (move_to_device_pass(ep, plan.device).module() if plan.device != "cpu" else ep.module()
                       for ep in (pair.prefill, pair.decode))
    del pair
    for graph in (prefill, decode):
        randomise(graph, plan.device)
    dtype = getattr(torch, plan.dtype)
    kv_heads, head_dim, layers = (plan.geometry[k]
                                  for k in ("num_key_value_heads", "head_dim", "num_hidden_layers"))

    def call(graph, ids, start_pos, past):
        batch, n = ids.shape
        pos = torch.arange(start_pos, start_pos + n, device=plan.device).repeat(batch, 1)
        mask = torch.ones(batch, start_pos + n, dtype=torch.int64, device=plan.device)
        return graph(ids, pos, mask, *past)

    def empty(batch):
        return [torch.zeros(batch, kv_heads, 0, head_dim, dtype=dtype, device=plan.device)
                for _ in range(2 * layers)]

    def step(outputs, ids):  # one decode step on the cache the prefill made
        logits, *present = outputs
        token = logits.argmax(-1, keepdim=True)
        return timed(lambda: call(decode, token, ids.shape[1], present), plan.device)

    with torch.inference_mode():
        rows, skipped = ttft_table(plan, budget, lambda ids: call(decode, ids, 0, empty(ids.shape[0])),
                                   lambda ids: call(prefill, ids, 0, empty(ids.shape[0])), 20, step)
    return {"graphs": "captured decode graph (full prefill) vs folded POP prefill graph, eager",
            "capture + pass seconds": round(built, 1), "not measured (time)": skipped, "rows": rows}


def compile_phase(plan: Plan, budget: Budget, model) -> dict:
    """(b) torch.compile: backend=PopBackend(inner) against the inner backend alone, dynamic=True."""
    import torch

    from popcompile.dynamo import PopBackend, PopOptions

    if plan.device == "cuda":
        torch.cuda.empty_cache()  # the graphs phase's copies are gone
    model = model.to(plan.device)
    randomise(model, plan.device)
    # min_prompt_tokens=0: POP at every measured length (the backend's default runs short prompts in full)
    backend = PopBackend(PopOptions(cut=cut_of(plan), inner=plan.inner, min_prompt_tokens=0))
    fns = {name: torch.compile(model.forward, backend=b, dynamic=True)
           for name, b in (("full", plan.inner), ("pop", backend))}
    first = torch.randint(0, plan.geometry["vocab_size"], (plan.batches[0], plan.tokens[0]),
                          device=plan.device)
    compile_s = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            compile_s[name] = timed(lambda fn=fn: fn(input_ids=first, logits_to_keep=1), plan.device)
        rows, skipped = ttft_table(plan, budget, lambda ids: fns["full"](input_ids=ids, logits_to_keep=1),
                                   lambda ids: fns["pop"](input_ids=ids, logits_to_keep=1), 30,
                                   batch_cost=2 * sum(compile_s.values()))  # both backends recompile
    kinds = [r.kind for r in backend.records]
    if "prefill-pop" not in kinds:
        raise RuntimeError(f"the pop backend pruned no graph: {backend.records}")
    return {"compile": f"torch.compile(model.forward, dynamic=True), backend {plan.inner!r} vs "
                       f"PopBackend(inner={plan.inner!r})", "compile seconds (first call)": compile_s,
            "graphs the pop backend saw": kinds, "not measured (time)": skipped, "rows": rows}


def engine_phase(kind: str, args) -> dict:
    """TensorRT or onnxruntime-CUDA on an engine folder: only where the package imports (gpu_check_trt.py)."""
    import importlib.util

    if kind == "tensorrt" and importlib.util.find_spec("tensorrt") is None:
        raise Skip("tensorrt does not import on this machine: no TensorRT plans built or timed")
    if kind == "ort-cuda":
        try:
            import onnxruntime
        except ImportError:
            raise Skip("onnxruntime does not import on this machine") from None
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise Skip(f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider here "
                       f"(a CPU build)")
    if args.engine is None:
        raise Skip(f"{kind} imports, but no engine folder was given (--engine DIR, from `popcompile export`)")
    import gpu_check_trt as trt

    engine_args = argparse.Namespace(precision="bf16", opt_level=2, tokens=(512, 1024, 2048), reps=3,
                                     device="cuda")
    try:
        if kind == "tensorrt":
            return {"build": trt.trt_build(engine_args, args.engine),
                    **trt.trt_ttft(engine_args, args.engine)}
        return trt.ort_cuda(engine_args, args.engine)
    except trt.Skip as err:
        raise Skip(str(err)) from None


# --------------------------------------------------------------------------------------------- main

PHASES = ("matmul-peak", "graphs", "compile", "tensorrt", "ort-cuda")

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=450, help="seconds for all phases (default 450)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "gpu_results",
                   help="results path without suffix: .json and .md are written (default docs/gpu_results)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny geometry, float32, inner eager: seconds")
    p.add_argument("--engine", type=Path, help="an exported engine folder for the TensorRT / ort-cuda phases")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=PHASES, metavar="PHASE",
                   help=f"run only these phases (default all: {' '.join(PHASES)}); environment always runs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    budget = Budget(args.budget)
    env = environment()
    gpu = env["gpus"][0] if isinstance(env.get("gpus"), list) and env["gpus"] else "no GPU"
    described = (f"{'dry run, ' if args.dry_run else ''}{plan.device}, {plan.dtype}, "
                 f"{plan.geometry['num_hidden_layers']} layers, cut {cut_of(plan)}, inner {plan.inner}")
    report = Report(args.out, {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": gpu, "plan": described,
                               "budget_s": args.budget})
    report.record("environment", "ok", **env)
    if plan.device == "cuda" and not env.get("torch.cuda"):
        report.record("matmul-peak", "skipped",
                      reason="torch sees no CUDA device: run with --dry-run on a CPU")
    else:
        if "matmul-peak" in args.phases:
            run_phase(report, budget, "matmul-peak", 10, matmul_peak, plan)
        model = build_model(plan) if {"graphs", "compile"} & set(args.phases) else None
        if "graphs" in args.phases:
            run_phase(report, budget, "graphs", 120 if plan.device == "cuda" else 5, graphs_phase, plan,
                      budget, model)
        if "compile" in args.phases:
            run_phase(report, budget, "compile", 150 if plan.device == "cuda" else 5, compile_phase, plan,
                      budget, model)
    for kind in ("tensorrt", "ort-cuda"):
        if kind in args.phases:
            run_phase(report, budget, kind, 0, engine_phase, kind, args)
    print(f"[gpu_check] results: {args.out.with_suffix('.md')}", flush=True)
    out = os.environ.get("OUT")
    if out:  # the device tool brings back what is under $OUT
        for suffix in (".json", ".md"):
            shutil.copy(args.out.with_suffix(suffix), Path(out) / f"gpu_results{suffix}")
    failed = [name for name, phase in report.data["phases"].items() if phase["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
