"""POP where it pays: TTFT speedup and quality cost by prompt length, per runtime (docs/prompt_length.md).

For each model and runtime, at prompt lengths 16..2048 tokens:

- speed: TTFT of full and POP (interleaved repetitions, medians), their ratio full/POP and the FLOP bound
  of the same cut (popcompile.cost);
- quality: over the first tokens of real stdlib sources (corpus.stdlib_texts) cut to each length,
  the greedy matched prefix of POP against full (``scoring.matched_prefix``, ``compare_generations``)
  and the teacher-forced top-1 agreement with full on the true continuation (``score_continuations``);
- the threshold ``choose_min_prompt_tokens`` (popcompile/threshold.py) picks from the speed curve.

Runtimes (the table RUNTIMES):

    onnxruntime     an exported engine folder (its cut and K/V weights: POP+ by default); both modes through
                    ``tools.eval.engine.EngineRun`` (the session's public prefill/step, no runtime
                    threshold in the way): pop = prefill graph on x_1..x_N, full = decode graph on x_1..x_N
    torch-compile   speed: ``torch.compile(model.forward, dynamic=True)`` with backend "inductor" (full) and
                    ``PopBackend(cut, inner="inductor", min_prompt_tokens=0)`` (pop: POP at every length), one
                    compiled graph per backend for every length (compile time reported apart); quality:
                    reference.py ``Variant(cut)`` (the paper's POP, which the backend computes by default:
                    tests/test_dynamo.py) against ``Variant(L)``

Each part runs in a process of its own (``all`` starts them one after another: quality, then speed, then
the report), so no two onnxruntime thread pools or compiled models share a process:

    python benchmarks/prompt_length.py all --engines /work/cache/engines --out out/prompt_length \\
        --figure docs/prompt_length.png
    python benchmarks/prompt_length.py quality --runtime onnxruntime --model smollm2-135m \\
        --engines /work/cache/engines --out out/prompt_length
    python benchmarks/prompt_length.py speed --runtime torch-compile --model gemma3-270m \\
        --out out/prompt_length
    python benchmarks/prompt_length.py report --out out/prompt_length --figure docs/prompt_length.png
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from popcompile.cost import speedup_bound
from popcompile.errors import ConfigError
from popcompile.kvfit import corpus
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval.scoring import compare_generations, matched_prefix, score_continuations
from popcompile.threshold import DEFAULT_MIN_SPEEDUP, choose_min_prompt_tokens

LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
MODELS = ("smollm2-135m", "gemma3-270m")
MODES = ("full", "pop")  # the baseline first, as score_continuations wants


@dataclass(frozen=True)
class Setup:
    """What a part measures with: a tokenizer, the cut, the model config (for the bound), and how the two
    modes run. ``logits(mode, prefix [B, N], continuation [B, C]) -> [B, C, V]``; ``generate(mode, ids) ->
    new ids`` (greedy); ``ttft(mode, n) -> seconds`` to the first token of the first ``n`` prompt tokens."""

    tokenizer: object
    cut: int
    num_layers: int
    config: object
    pop_weights: str  # "POP+ (refitted K/V)" or "POP (paper)"
    logits: Callable | None = None
    generate: Callable | None = None
    ttft: Callable | None = None
    details: dict | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.cut < self.num_layers:
            raise ValueError(f"cut {self.cut} prunes nothing of {self.num_layers} layers")


# --- the two runtimes ------------------------------------------------------------------------------

def ort_setup(args, part: str) -> Setup:
    import numpy as np

    from popcompile.measure.eval.engine import (
        ENGINE_VARIANTS,
        EngineRun,
        EvalTokenizer,
        continuation_logits,
        greedy,
    )
    from popcompile.runtime.ort import OrtSession

    folder = Path(args.engines) / args.model
    session = OrtSession(folder, threads=args.threads)
    run, tok = EngineRun(session), EvalTokenizer(session.tokenizer)
    manifest = session.manifest
    config = json.loads((folder / "config.json").read_text())
    weights = "POP+ (refitted K/V)" if manifest.extra.get("kv_calibration") else "POP (paper)"
    logits = lambda mode, prefix, target: torch.from_numpy(
        continuation_logits(run, prefix.numpy(), target.numpy(), ENGINE_VARIANTS[mode]))
    generate = lambda mode, ids: greedy(run, ids, ENGINE_VARIANTS[mode], args.new_tokens,
                                        session.tokenizer.eos_token_ids)
    prompt = np.array([text_ids(tok, max(args.lengths))], dtype=np.int64) if part == "speed" else None

    def ttft(mode: str, n: int) -> float:
        start = time.perf_counter()
        int(run.start(prompt[:, :n], mode)[0].argmax())
        return time.perf_counter() - start

    import onnxruntime
    details = {"engine": str(folder), "boundary": manifest.boundary, "onnxruntime": onnxruntime.__version__,
               "threads": args.threads or "default"}
    return Setup(tok, manifest.cut, manifest.num_layers, config, weights, logits, generate, ttft, details)


def torch_setup(args, part: str) -> Setup:
    from popcompile import reference
    from popcompile.config import resolve_cut
    from popcompile.frontend.models import load_model
    from popcompile.measure.eval.scoring import continuation_logits, last_logits_only

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    layers = model.config.num_hidden_layers
    cut = resolve_cut(layers)  # the backend's default (1/3 pruned)
    details = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if part == "speed":
        return Setup(tok, cut, layers, model.config, "POP (paper)",
                     ttft=compiled_ttft(model, tok, cut, args, details), details=details)
    variants = {"full": reference.Variant(layers), "pop": reference.Variant(cut)}
    logits = lambda mode, prefix, target: continuation_logits(model, prefix, target, variants[mode])

    def generate(mode: str, ids: list[int]) -> list[int]:
        # generate reads the last row only; Gemma 3's all-row head costs more than its layers
        with last_logits_only(model):
            return reference.generate(model, torch.tensor([ids]), args.new_tokens, variants[mode],
                                      tok.eos_token_id)
    details["quality_path"] = "reference.py (eager), the specification the backend is tested against"
    return Setup(tok, cut, layers, model.config, "POP (paper)", logits, generate, details=details)


def compiled_ttft(model, tok, cut: int, args, details: dict) -> Callable[[str, int], float]:
    """ttft(mode, n): one prefill call (logits_to_keep=1, as generate makes it) of the compiled forward;
    the first call of each backend (trace + compile) goes into ``details["compile_s"]``."""
    from compile_ttft import prefill  # benchmarks/compile_ttft.py, on sys.path as this script's folder

    from popcompile.dynamo import PopBackend, PopOptions

    # min_prompt_tokens=0: POP at every length (the backend's default runs short prompts in full)
    backend = PopBackend(PopOptions(cut=cut, inner=args.inner, min_prompt_tokens=0))
    fns = {"full": torch.compile(model.forward, backend=args.inner, dynamic=True),
           "pop": torch.compile(model.forward, backend=backend, dynamic=True)}
    details["inner"] = args.inner
    ids = torch.tensor([text_ids(tok, max(args.lengths))])
    details["compile_s"] = {}
    with torch.no_grad():
        for mode, fn in fns.items():
            details["compile_s"][mode] = prefill(fn, ids[:, :args.lengths[0]])[0]
    kinds = [record.kind for record in backend.records]
    if "prefill-pop" not in kinds:
        raise RuntimeError(f"the pop backend pruned no graph (records: {kinds}): "
                           f"the timing would be full vs full")
    details["pop_graphs"] = kinds

    def ttft(mode: str, n: int) -> float:
        with torch.no_grad():
            return prefill(fns[mode], ids[:, :n])[0]
    return ttft


#: runtime -> Setup factory(args, part)
RUNTIMES: dict[str, Callable] = {"onnxruntime": ort_setup, "torch-compile": torch_setup}


# --- data --------------------------------------------------------------------------------------

def long_texts(tok, count: int, need: int) -> list[tuple[str, str]]:
    """The first ``count`` stdlib sources (sorted) of at least ``need`` tokens: the same texts at every
    length."""
    texts = [(name, text) for name, text in corpus.stdlib_texts() if len(corpus.encode(tok, text)) >= need]
    if len(texts) < count:
        raise ValueError(f"only {len(texts)} stdlib sources have {need} tokens; ask for fewer --docs")
    return texts[:count]


def text_ids(tok, n: int) -> list[int]:
    return corpus.encode(tok, long_texts(tok, 1, n)[0][1])[:n]


# --- the two parts -----------------------------------------------------------------------------

def quality(setup: Setup, args) -> list[dict]:
    """Per length: teacher-forced agreement (and NLL, KL) of POP with full on the true next ``--cont``
    tokens, and the greedy matched prefix of ``--new-tokens`` new tokens, over ``--docs`` documents."""
    texts = long_texts(setup.tokenizer, args.docs, max(args.lengths) + args.cont)
    rows = []
    for n in args.lengths:
        docs, _ = eval_data.make_documents({"stdlib": texts}, setup.tokenizer, n, args.cont)
        scores = score_continuations(docs, list(MODES), setup.logits, batch_size=len(docs),
                                     desc=f"{n} tokens")
        gens = compare_generations([list(d.prefix) for d in docs], list(MODES), setup.generate)
        prefixes = [matched_prefix(p, f) for p, f in zip(gens["pop"]["tokens"], gens["full"]["tokens"])]
        rows.append({"tokens": n, "documents": [d.name for d in docs],
                     "agreement": scores["pop"]["agreement"], "doc_agreement": scores["pop"]["doc_agreement"],
                     "kl_to_full": scores["pop"]["kl_to_full"],
                     "nll_full": scores["full"]["nll"], "nll_pop": scores["pop"]["nll"],
                     "matched_prefix": statistics.mean(prefixes), "doc_matched_prefix": prefixes,
                     "exact_match": gens["pop"]["exact_match"], "full_length": gens["full"]["mean_length"]})
        print(f"{n:>5} tokens: agreement {rows[-1]['agreement']:.3f}, "
              f"matched prefix {rows[-1]['matched_prefix']:.1f}"
              f"/{args.new_tokens} {prefixes}", flush=True)
    return rows


def speed(setup: Setup, args) -> list[dict]:
    """Per length: medians of TTFT in both modes over interleaved repetitions (full, pop / pop, full), after
    one warm-up call of each; lengths up to 256 tokens get 3x the repetitions (they cost little)."""
    reps = {n: args.reps * (3 if n <= 256 else 1) for n in args.lengths}
    times = {(mode, n): [] for mode in MODES for n in args.lengths}
    for n in args.lengths:
        for mode in MODES:
            setup.ttft(mode, n)
    for rep in range(max(reps.values())):
        for n in (n for n in args.lengths if rep < reps[n]):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                times[(mode, n)].append(setup.ttft(mode, n))
    rows = []
    for n in args.lengths:
        full, pop = times[("full", n)], times[("pop", n)]
        rows.append({"tokens": n, "reps": reps[n], "full_s": statistics.median(full),
                     "pop_s": statistics.median(pop),
                     "speedup": statistics.median(full) / statistics.median(pop),
                     "paired": statistics.median(f / p for f, p in zip(full, pop)),
                     "bound": speedup_bound(setup.config, n, setup.cut), "full_all": full, "pop_all": pop})
        print(f"{n:>5} tokens: full {rows[-1]['full_s']:.4f} s, pop {rows[-1]['pop_s']:.4f} s, speedup "
              f"{rows[-1]['speedup']:.3f} (paired {rows[-1]['paired']:.3f}), bound {rows[-1]['bound']:.3f}",
              flush=True)
    return rows


PARTS: dict[str, Callable[[Setup, object], list[dict]]] = {"quality": quality, "speed": speed}


def measure(args) -> None:
    began, start, load = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.time(), os.getloadavg()
    setup = RUNTIMES[args.runtime](args, args.part)
    rows = PARTS[args.part](setup, args)
    result = {"model": args.model, "runtime": args.runtime, "part": args.part, "cut": setup.cut,
              "num_layers": setup.num_layers, "pop_weights": setup.pop_weights, "started": began,
              "load_before": load, "load_after": os.getloadavg(), "seconds": time.time() - start,
              "options": _options(args),
              **(setup.details or {}), "rows": rows}
    path = result_path(args.out, args.model, args.runtime, args.part)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def _options(args) -> dict:
    return {k: getattr(args, k)
            for k in ("lengths", "docs", "cont", "new_tokens", "reps", "inner", "threads")}


def result_path(out: str | Path, model: str, runtime: str, part: str) -> Path:
    return Path(out) / f"{model}-{runtime}-{part}.json"


# --- driver and report -------------------------------------------------------------------------

def run_all(args) -> None:
    """Every part in a fresh process: quality first (deterministic), speed last (noisy), then the report."""
    common = ["--out", str(args.out), "--lengths", *map(str, args.lengths), "--docs", str(args.docs),
              "--cont", str(args.cont), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
              "--inner", args.inner, *(["--threads", str(args.threads)] if args.threads else [])]
    for part in args.parts:
        for model in args.models:
            for runtime in args.runtimes:
                if result_path(args.out, model, runtime, part).exists() and not args.force:
                    print(f"kept {result_path(args.out, model, runtime, part)} (--force to measure again)")
                    continue
                command = [sys.executable, __file__, part, "--runtime", runtime, "--model", model, *common]
                command += ["--engines", str(args.engines)] if runtime == "onnxruntime" else []
                print(f"$ {' '.join(command[1:])}   (load {os.getloadavg()[0]:.2f})", flush=True)
                subprocess.run(command, check=True)
    report(args)


def load_results(out: Path, model: str, runtime: str) -> dict[str, dict]:
    return {part: json.loads(path.read_text()) for part in PARTS
            if (path := result_path(out, model, runtime, part)).exists()}


def merged_rows(parts: dict[str, dict]) -> list[dict]:
    by_length: dict[int, dict] = {}
    for part in parts.values():
        for row in part["rows"]:
            by_length.setdefault(row["tokens"], {}).update(row)
    return [by_length[n] for n in sorted(by_length)]


def threshold(rows: list[dict], min_speedup: float) -> int | None:
    speeds = {r["tokens"]: r["speedup"] for r in rows if "speedup" in r}
    try:
        return choose_min_prompt_tokens(speeds, min_speedup) if speeds else None
    except ConfigError:
        return None


def table(model: str, runtime: str, parts: dict[str, dict], min_speedup: float) -> str:
    rows, any_part = merged_rows(parts), next(iter(parts.values()))
    new_tokens = any_part["options"]["new_tokens"]
    cell = lambda row, key, fmt: format(row[key], fmt) if key in row else "-"
    chosen = threshold(rows, min_speedup) or ("none (no length pays)" if "speed" in parts else "not timed")
    lines = [f"**{model}, {runtime}** (cut {any_part['cut']}/{any_part['num_layers']}, "
             f"{any_part['pop_weights']}; min_prompt_tokens = {chosen})", "",
             "| prompt tokens | full TTFT s | POP TTFT s | speedup | paired | FLOP bound | matched prefix "
             f"(of {new_tokens}) | exact | agreement |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {cell(r, 'full_s', '.4f')} | {cell(r, 'pop_s', '.4f')} | "
                     f"{cell(r, 'speedup', '.3f')} | {cell(r, 'paired', '.3f')} | "
                     f"{cell(r, 'bound', '.3f')} | {cell(r, 'matched_prefix', '.1f')} | "
                     f"{cell(r, 'exact_match', '.2f')} | {cell(r, 'agreement', '.3f')} |")
    speed_part = parts.get("speed")
    if speed_part:
        inner = f"inner backend {speed_part['inner']}, " if "inner" in speed_part else ""
        lines.append(f"\nspeed: {inner}{speed_part['started']}, "
                     f"load average before {speed_part['load_before'][0]:.2f}, "
                     f"after {speed_part['load_after'][0]:.2f}"
                     + (f", compile s {json.dumps({k: round(v) for k, v in speed_part['compile_s'].items()})}"
                        if "compile_s" in speed_part else ""))
    return "\n".join(lines)


def report(args) -> None:
    found = {(m, r): parts for m in args.models for r in args.runtimes
             if (parts := load_results(Path(args.out), m, r))}
    for (model, runtime), parts in found.items():
        print(table(model, runtime, parts, args.min_speedup) + "\n")
    if args.figure and found:
        plot(found, args.models, args.min_speedup, Path(args.figure))
        print(f"wrote {args.figure}")


STYLES = {"onnxruntime": "tab:blue", "torch-compile": "tab:orange"}


def plot(found: dict, models: list[str], min_speedup: float, path: Path) -> None:
    """One row per model: speedup (with the FLOP bound and the threshold) | quality (matched prefix share
    and agreement) against prompt length, both runtimes in each panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in models if any(key[0] == m for key in found)]
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    for (model, runtime), parts in found.items():
        speed_ax, quality_ax = axes[models.index(model)]
        _plot_speed(speed_ax, model, runtime, merged_rows(parts), min_speedup)
        _plot_quality(quality_ax, model, runtime, merged_rows(parts), next(iter(parts.values()))["options"])
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("POP by prompt length (shared 2-vCPU machine: timings noisy, see docs/prompt_length.md)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _plot_speed(ax, model: str, runtime: str, rows: list[dict], min_speedup: float) -> None:
    timed = [r for r in rows if "speedup" in r]
    if not timed:
        return
    color, x = STYLES[runtime], [r["tokens"] for r in timed]
    ax.plot(x, [r["speedup"] for r in timed], "o-", color=color, label=f"{runtime} full/POP TTFT")
    ax.plot(x, [r["bound"] for r in timed], ":", color="gray",
            label="FLOP bound" if runtime == "onnxruntime" else None)
    ax.axhline(min_speedup, color="red", lw=0.8, ls="--")
    chosen = threshold(rows, min_speedup)
    if chosen:
        ax.axvline(chosen, color=color, lw=0.8, ls="--", label=f"{runtime} min_prompt_tokens = {chosen}")
    ax.set_title(f"{model}: TTFT speedup (red: {min_speedup}x)")
    ax.set_ylabel("full TTFT / POP TTFT")


def _plot_quality(ax, model: str, runtime: str, rows: list[dict], options: dict) -> None:
    scored = [r for r in rows if "agreement" in r]
    if not scored:
        return
    color, x = STYLES[runtime], [r["tokens"] for r in scored]
    ax.plot(x, [r["agreement"] for r in scored], "o-", color=color,
            label=f"{runtime}: teacher-forced top-1 agreement ({options['cont']} tokens)")
    ax.plot(x, [r["matched_prefix"] / options["new_tokens"] for r in scored], "s--", color=color,
            label=f"{runtime}: greedy matched prefix / {options['new_tokens']}")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{model}: POP vs full, {options['docs']} stdlib sources per length")
    ax.set_ylabel("share equal to full")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=[*PARTS, "all", "report"])
    parser.add_argument("--out", type=Path, required=True, help="folder of the result JSON files")
    parser.add_argument("--runtime", choices=RUNTIMES, help="quality/speed: the runtime to measure")
    parser.add_argument("--model", choices=MODELS, help="quality/speed: the model")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="all/report: models")
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), help="all/report: runtimes")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), help="all: parts, in this order")
    parser.add_argument("--engines", help="folder holding an engine folder per model name (onnxruntime)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                        help="prompt lengths (ascending)")
    parser.add_argument("--docs", type=int, default=4, help="stdlib sources per length (quality)")
    parser.add_argument("--cont", type=int, default=32, help="teacher-forced continuation tokens (quality)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy new tokens (quality)")
    parser.add_argument("--reps", type=int, default=5,
                        help="interleaved repetitions per length (speed; x3 up to 256)")
    parser.add_argument("--inner", choices=["inductor", "eager"], default="inductor",
                        help="torch-compile speed: full's backend and pop's inner backend "
                             "(eager: no inductor compile, the same graphs run op by op)")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: one per core)")
    parser.add_argument("--min-speedup", type=float, default=DEFAULT_MIN_SPEEDUP,
                        help="report: the threshold rule's bar")
    parser.add_argument("--figure", help="report/all: write the figure here")
    parser.add_argument("--force", action="store_true", help="all: measure parts whose result file exists")
    args = parser.parse_args()
    if args.part in PARTS and (args.runtime is None or args.model is None):
        parser.error(f"{args.part} needs --runtime and --model")
    if "onnxruntime" in ([args.runtime] if args.part in PARTS else args.runtimes) and args.part != "report" \
            and not args.engines:
        parser.error("the onnxruntime runtime needs --engines (a folder with an engine folder per model)")
    if args.lengths != sorted(args.lengths) or min(args.lengths) < 2:
        parser.error("--lengths must be ascending and >= 2")
    return args


COMMANDS = {"quality": measure, "speed": measure, "all": run_all, "report": report}


if __name__ == "__main__":
    arguments = parse_args()
    COMMANDS[arguments.part](arguments)
