"""Anchors: TTFT and decode speed of popcompile's engines beside optimum-onnx and onnxruntime-genai.

SmolLM2-135M-Instruct on CPU, batch 1, onnxruntime's intra-op threads at 2 everywhere. Engines:

    optimum      optimum-cli export (fp32), run by optimum's ORTModelForCausalLM.generate  (/tmp/optimum-venv)
    genai-fp32   onnxruntime-genai model builder export, -p fp32 -e cpu, Generator API    (/tmp/genai-venv)
    genai-int4   the same, -p int4 -e cpu (builder defaults: MatMulNBits, block 32, accuracy level 4)
    NAME-full    a popcompile engine folder given as --engine NAME=PATH, OrtSession mode="full"   (.venv)
    NAME-pop     the same engine, mode="pop" (always pruned: min_prompt_tokens=0)

Method:
- ONE PROCESS PER MEASUREMENT. Each (engine, mode, prompt length) runs in a fresh process of its engine's
  own interpreter (benchmarks/anchors_worker.py): onnxruntime thread pools of several sessions in one
  process spin against each other on 2 cores. The worker loads the engine (not timed), runs one warm-up
  generation, then --reps timed ones, and reports their medians.
- Every generation: the same prompt token ids for every engine (random ids, fixed --seed, drawn from the
  model's vocabulary without its special tokens, no chat template; a length-n prompt is the first n of
  them), then --new-tokens greedy tokens; eos never ends a run early.
      TTFT          seconds from the start of the request to the first generated token id in hand
      decode tok/s  (new tokens - 1) / (seconds from the first to the last generated token), i.e. decoding
                    with about n cached tokens
  (per engine, exactly what is timed: benchmarks/anchors_worker.py's docstring).
- Rounds: at each length, round 1 measures every engine in order, round 2 in reverse order, and so on;
  the table shows the median over rounds of each worker's medians.
- Derived columns, for each popcompile engine NAME (its precision read from its manifest):
      NAME full vs anchor  TTFT row: full TTFT / TTFT of the fastest anchor of the engine's precision
                           (fp32: optimum, genai-fp32); decode row: full decode tok/s / the fastest
                           same-precision anchor's
      NAME POP vs anchor   TTFT row: POP TTFT / TTFT of the fastest anchor of any precision, target
                           <= 1/1.4 = 0.714 (marked ok / MISS); decode row: POP decode tok/s / the fastest
                           same-precision anchor's
  Each cell names the anchor it divides by.
- A popcompile engine needs max_seq >= n + new tokens - 1: the 4096 row needs an engine exported with
  --max-seq above 4096 (e.g. 8192); a length an engine cannot take is shown as "n/a".

Recipe (each setup script is idempotent; the exports go to ~/.cache/popcompile/bench-engines):

    bash benchmarks/optimum_env.sh          # /tmp/optimum-venv + optimum-smollm2 (fp32)
    bash benchmarks/genai_env.sh            # /tmp/genai-venv + genai-smollm2-fp32, genai-smollm2-int4
    .venv/bin/popcompile export smollm2-135m --out /tmp/eng-smol-8k --cut 20 --max-seq 8192
    .venv/bin/popcompile export smollm2-135m --out /tmp/eng-int4-8k --cut 20 --max-seq 8192 --weights int4
    .venv/bin/python benchmarks/anchors.py --engine popcompile=/tmp/eng-smol-8k \\
        --engine popcompile-int4=/tmp/eng-int4-8k \\
        --tokens 512 1024 2048 4096 --reps 3 --rounds 2 --json /tmp/anchors.json

    .venv/bin/python benchmarks/anchors.py --engine popcompile=/tmp/eng-smol --tokens 128 --reps 1 --rounds 1
    .venv/bin/python benchmarks/anchors.py --engines genai-int4 popcompile-int4-pop \\
        --engine popcompile-int4=/tmp/eng-int4 --tokens 256                        # a subset

(export's default --max-seq is 4096, which leaves the 4096 row n/a: hence --max-seq 8192.) One full run
(4 lengths, reps 3, rounds 2) of the 3 anchors and one popcompile engine is about 20-25 minutes on an idle
2-core machine; each further popcompile engine adds a few minutes.

This file needs only the standard library; the workers run under each engine's own interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "anchors_worker.py"
CACHE = Path.home() / ".cache" / "popcompile" / "bench-engines"
MODEL = Path.home() / ".cache" / "popcompile" / "models" / "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e"
MARKER = "ANCHORS_RESULT "
POP_TARGET = 1.4
ANCHORS = ("optimum", "genai-fp32", "genai-int4")


@dataclass
class Engine:
    """One column: an engine (and mode) measured by a worker under ``python``."""
    name: str
    kind: str            # optimum | genai | popcompile
    path: Path
    python: Path
    precision: str       # fp32 | fp16 | int4 | int8
    setup: str           # the command that makes a missing venv or export
    mode: str = "full"   # popcompile: full | pop
    group: str = ""      # popcompile: the --engine NAME both modes share
    max_seq: int | None = None
    versions: dict = field(default_factory=dict)

    @property
    def anchor(self) -> bool:
        return self.kind != "popcompile"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=PATH",
                        help="a popcompile engine folder, measured as NAME-full and NAME-pop "
                             "(repeatable; its precision, fp32 or intN, is read from its popcompile.json)")
    parser.add_argument("--engines", nargs="+", metavar="NAME",
                        help="measure only these: anchors (optimum, genai-fp32, genai-int4), --engine NAMEs "
                             "(both modes) or NAME-full / NAME-pop (default: all)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048, 4096],
                        help="prompt lengths (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed generations per worker, after one warm-up (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per length (every second round in reverse order) (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="greedy tokens per generation (>= 2) (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2,
                        help="onnxruntime intra-op threads in every engine (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random prompt ids (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write every raw number here")
    parser.add_argument("--model", type=Path, default=MODEL,
                        help="the Hugging Face folder whose vocabulary the prompt ids come from "
                             "(default: %(default)s)")
    parser.add_argument("--optimum-venv", type=Path, default=Path("/tmp/optimum-venv"),
                        help="optimum's venv (benchmarks/optimum_env.sh) (default: %(default)s)")
    parser.add_argument("--optimum-export", type=Path, default=CACHE / "optimum-smollm2",
                        help="optimum-cli export folder (model.onnx) (default: %(default)s)")
    parser.add_argument("--genai-venv", type=Path, default=Path("/tmp/genai-venv"),
                        help="onnxruntime-genai's venv (benchmarks/genai_env.sh) (default: %(default)s)")
    parser.add_argument("--genai-fp32", type=Path, default=CACHE / "genai-smollm2-fp32",
                        help="model builder export, fp32 (genai_config.json) (default: %(default)s)")
    parser.add_argument("--genai-int4", type=Path, default=CACHE / "genai-smollm2-int4",
                        help="model builder export, int4 (default: %(default)s)")
    parser.add_argument("--project-python", type=Path, default=ROOT / ".venv" / "bin" / "python",
                        help="interpreter with popcompile installed (runs the popcompile workers) "
                             "(default: %(default)s)")
    parser.add_argument("--worker-timeout", type=float, default=1800,
                        help="seconds before a worker is killed (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.reps < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--new-tokens must be >= 2; --reps, --rounds and --threads >= 1")
    if min(args.tokens) < 1:
        parser.error("--tokens must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------- engines
def popcompile_engines(specs: list[str], python: Path) -> list[Engine]:
    engines, seen = [], set()
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--engine {spec!r}: give NAME=PATH (e.g. popcompile=/tmp/eng-smol)")
        if name in seen or name in ANCHORS:
            raise SystemExit(f"--engine {spec!r}: the name {name!r} is taken")
        seen.add(name)
        folder = Path(path).expanduser()
        manifest = folder / "popcompile.json"
        if not manifest.is_file():
            raise SystemExit(f"{name}: {manifest} not found: give a popcompile engine folder "
                             f"(.venv/bin/popcompile export smollm2-135m --out {folder})")
        data = json.loads(manifest.read_text())
        bits = (data.get("quantization") or {}).get("bits")
        precision = (f"int{bits}" if bits
                     else {"float32": "fp32", "float16": "fp16"}.get(data.get("dtype"), "fp32"))
        for mode in ("full", "pop"):
            engines.append(Engine(f"{name}-{mode}", "popcompile", folder, python, precision,
                                  "python -m venv .venv && .venv/bin/pip install -e .", mode, name,
                                  data.get("kv_layout", {}).get("max_seq")))
    return engines


def all_engines(args) -> list[Engine]:
    optimum_py, genai_py = args.optimum_venv / "bin" / "python", args.genai_venv / "bin" / "python"
    optimum_setup = "bash benchmarks/optimum_env.sh" + _venv_arg(args.optimum_venv, "/tmp/optimum-venv")
    genai_setup = "bash benchmarks/genai_env.sh" + _venv_arg(args.genai_venv, "/tmp/genai-venv")
    engines = [
        Engine("optimum", "optimum", args.optimum_export, optimum_py, "fp32", optimum_setup),
        Engine("genai-fp32", "genai", args.genai_fp32, genai_py, "fp32", genai_setup),
        Engine("genai-int4", "genai", args.genai_int4, genai_py, "int4", genai_setup),
        *popcompile_engines(args.engine, args.project_python),
    ]
    if not args.engines:
        return engines
    chosen = [e for e in engines if e.name in args.engines or e.group in args.engines]
    known = {e.name for e in engines} | {e.group for e in engines if e.group}
    unknown = [name for name in args.engines if name not in known]
    if unknown:
        raise SystemExit(f"--engines {' '.join(unknown)}: unknown; "
                         f"choose from {', '.join(sorted(known))} "
                         f"(popcompile engines are named by --engine NAME=PATH)")
    return chosen


def _venv_arg(venv: Path, default: str) -> str:
    return "" if str(venv) == default else f" {shlex.quote(str(venv))}"


def check_ready(engines: list[Engine]) -> None:
    """One line naming the setup command for the first missing interpreter or export."""
    for engine in engines:
        if not engine.python.exists():
            raise SystemExit(f"{engine.name}: no interpreter {engine.python}: run `{engine.setup}`")
        marker = {"optimum": "model.onnx", "genai": "genai_config.json",
                  "popcompile": "popcompile.json"}[engine.kind]
        if not (engine.path / marker).is_file():
            raise SystemExit(f"{engine.name}: no export at {engine.path} ({marker} missing): "
                             f"run `{engine.setup}`")


def probe_versions(engines: list[Engine]) -> None:
    cache: dict[Path, dict] = {}
    for engine in engines:
        if engine.python not in cache:
            out = subprocess.run([str(engine.python), str(WORKER), "--versions"], capture_output=True,
                                 text=True, timeout=120)
            line = next((l for l in out.stdout.splitlines() if l.startswith(MARKER)), None)
            if line is None:
                raise SystemExit(f"{engine.name}: {engine.python} cannot run the worker "
                                 f"({(out.stderr.strip().splitlines() or ['no output'])[-1]}): "
                                 f"run `{engine.setup}`")
            cache[engine.python] = json.loads(line[len(MARKER):])
        engine.versions = cache[engine.python]
        needed = {"optimum": "optimum-onnx", "genai": "onnxruntime-genai",
                  "popcompile": "popcompile"}[engine.kind]
        if needed not in engine.versions:
            raise SystemExit(f"{engine.name}: {needed} is not installed in {engine.python}: "
                             f"run `{engine.setup}`")


# ---------------------------------------------------------------------------------------------- prompt
def prompt_ids(model: Path, length: int, seed: int) -> tuple[list[int], dict]:
    """``length`` random token ids of ``model``'s vocabulary, special (added) tokens left out."""
    config_path, tokenizer_path = model / "config.json", model / "tokenizer.json"
    if not config_path.is_file() or not tokenizer_path.is_file():
        raise SystemExit(f"--model {model}: config.json and tokenizer.json are needed "
                         f"(the prompt ids' vocabulary)")
    vocab = int(json.loads(config_path.read_text())["vocab_size"])
    added = json.loads(tokenizer_path.read_text()).get("added_tokens", [])
    special = sorted({int(t["id"]) for t in added if t.get("special")})
    allowed = [i for i in range(vocab) if i not in set(special)]
    rng = random.Random(seed)
    ids = [allowed[rng.randrange(len(allowed))] for _ in range(length)]
    return ids, {"seed": seed, "vocab_size": vocab, "excluded_special_ids": special, "model": str(model)}


# ---------------------------------------------------------------------------------------------- running
def run_worker(engine: Engine, ids_file: Path, n: int, args) -> dict:
    if engine.max_seq is not None and n + args.new_tokens - 1 > engine.max_seq:
        return {"error": f"max_seq {engine.max_seq} < {n} + {args.new_tokens} - 1: "
                         f"re-export with a larger --max-seq",
                "skipped": True}
    command = [str(engine.python), str(WORKER), "--kind", engine.kind, "--path", str(engine.path),
               "--mode", engine.mode, "--ids", str(ids_file), "--tokens", str(n), "--reps", str(args.reps),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    began = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=args.worker_timeout, env=env,
                             cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {args.worker_timeout:.0f} s",
                "command": shlex.join(command)}
    line = next((l for l in reversed(out.stdout.splitlines()) if l.startswith(MARKER)), None)
    if line is None:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        result = {"error": f"worker exited {out.returncode}: {tail}"}
    else:
        result = json.loads(line[len(MARKER):])
    result["wall_s"] = time.perf_counter() - began
    result["command"] = shlex.join(command)
    return result


def measure(engines: list[Engine], ids_file: Path, args) -> dict:
    """{(engine name, n): [worker results, one per round]}, rounds alternating the order."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for n in args.tokens:
        for round_ in range(args.rounds):
            order = engines if round_ % 2 == 0 else engines[::-1]
            for engine in order:
                result = run_worker(engine, ids_file, n, args)
                result["round"] = round_
                runs.setdefault((engine.name, n), []).append(result)
                if "error" in result:
                    status = f"ERROR {result['error']}"
                else:
                    status = (f"TTFT {result['ttft_s']:.3f} s  decode {result['decode_tok_s']:.1f} tok/s  "
                              f"(load {result['load_s']:.1f} s, worker {result['wall_s']:.1f} s)")
                print(f"  n={n:<5} round {round_ + 1}/{args.rounds}  {engine.name:<22} {status}", flush=True)
    return runs


def summarize(engines: list[Engine], runs: dict, tokens: list[int]) -> dict:
    """{engine: {n: {ttft_s, decode_tok_s, rounds}}} medians over the rounds that succeeded."""
    summary: dict[str, dict[int, dict]] = {}
    for engine in engines:
        for n in tokens:
            good = [r for r in runs.get((engine.name, n), []) if "error" not in r]
            errors = sorted({r["error"] for r in runs.get((engine.name, n), []) if "error" in r})
            summary.setdefault(engine.name, {})[n] = {
                "ttft_s": statistics.median(r["ttft_s"] for r in good) if good else None,
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in good) if good else None,
                "rounds": len(good), "errors": errors,
                "token_ids": good[0]["token_ids"] if good else None}
    return summary


# ---------------------------------------------------------------------------------------------- report
def fastest(engines: list[Engine], summary: dict, n: int, metric: str, precision: str | None) -> tuple | None:
    """(value, name) of the best anchor at n: lowest TTFT / highest decode; ``precision`` None: any."""
    values = [(summary[e.name][n][metric], e.name) for e in engines
              if e.anchor and (precision is None or e.precision == precision) and summary[e.name][n][metric]]
    if not values:
        return None
    return min(values) if metric == "ttft_s" else max(values)


def derived(engines: list[Engine], summary: dict, n: int) -> dict:
    """Per popcompile engine group: the ratios the table's derived columns show (None where no anchor)."""
    out = {}
    for group in dict.fromkeys(e.group for e in engines if e.group):
        members = {e.mode: e for e in engines if e.group == group}
        precision = next(iter(members.values())).precision
        same_ttft = fastest(engines, summary, n, "ttft_s", precision)
        any_ttft = fastest(engines, summary, n, "ttft_s", None)
        same_decode = fastest(engines, summary, n, "decode_tok_s", precision)
        row = {"precision": precision}
        for mode, engine in members.items():
            mine = summary[engine.name][n]
            ttft_anchor = same_ttft if mode == "full" else any_ttft
            if mine["ttft_s"] and ttft_anchor:
                row[f"{mode}_ttft_over_anchor"] = mine["ttft_s"] / ttft_anchor[0]
                row[f"{mode}_ttft_anchor"] = ttft_anchor[1]
            if mine["decode_tok_s"] and same_decode:
                row[f"{mode}_decode_over_anchor"] = mine["decode_tok_s"] / same_decode[0]
                row[f"{mode}_decode_anchor"] = same_decode[1]
        if "pop_ttft_over_anchor" in row:
            row["pop_meets_target"] = row["pop_ttft_over_anchor"] <= 1 / POP_TARGET
        out[group] = row
    return out


def table(engines: list[Engine], summary: dict, tokens: list[int], ratios: dict[int, dict]) -> str:
    groups = list(dict.fromkeys(e.group for e in engines if e.group))
    modes = {group: [m for m in ("full", "pop") if any(e.group == group and e.mode == m for e in engines)]
             for group in groups}
    header = ["tokens", "metric", *(e.name for e in engines)]
    for group in groups:
        header += [f"{group} {'full' if mode == 'full' else 'POP'} vs anchor" for mode in modes[group]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
    for n in tokens:
        for metric, label, fmt in (("ttft_s", "TTFT s", "{:.3f}"),
                                   ("decode_tok_s", "decode tok/s", "{:.1f}")):
            cells = [str(n), label]
            for e in engines:
                cell = summary[e.name][n]
                cells.append(fmt.format(cell[metric]) if cell[metric] is not None else
                             ("n/a" if cell["errors"] else "-"))
            kind = "ttft" if metric == "ttft_s" else "decode"
            for group in groups:
                row = ratios[n].get(group, {})
                for mode in modes[group]:
                    value = row.get(f"{mode}_{kind}_over_anchor")
                    if value is None:
                        cells.append("-")
                        continue
                    mark = ""
                    if kind == "ttft" and mode == "pop":
                        mark = " ok" if row["pop_meets_target"] else " MISS"
                    cells.append(f"{value:.3f}{mark} ({row[f'{mode}_{kind}_anchor']})")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement(engines: list[Engine], summary: dict, tokens: list[int]) -> list[str]:
    """A same-model check per length and precision: each engine's greedy tokens against a reference of its
    precision (that precision's first popcompile full engine, else its first engine)."""
    lines = []
    for precision in dict.fromkeys(e.precision for e in engines):
        members = [e for e in engines if e.precision == precision]
        reference = next((e for e in members if e.mode == "full" and not e.anchor), members[0])
        for n in tokens:
            ref = summary[reference.name][n]["token_ids"]
            parts = []
            for e in members:
                mine = summary[e.name][n]["token_ids"]
                if e is reference or not mine or not ref:
                    continue
                same = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b),
                            min(len(ref), len(mine)))
                parts.append(f"{e.name} {same}/{len(ref)}")
            if parts:
                lines.append(f"n={n} {precision}: greedy tokens equal to {reference.name}'s for the first k: "
                             + ", ".join(parts))
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    engines = all_engines(args)
    if not engines:
        raise SystemExit("no engine selected")
    check_ready(engines)
    probe_versions(engines)
    command = shlex.join([sys.executable, *sys.argv])
    ids, prompt = prompt_ids(args.model, max(args.tokens), args.seed)

    print(f"command: {command}")
    by_python = {}
    for e in engines:
        by_python.setdefault(str(e.python), (e.versions, []))[1].append(e.name)
    for python, (versions, names) in by_python.items():
        shown = ", ".join(f"{k} {v}" for k, v in versions.items())
        print(f"versions [{', '.join(names)}] ({python}): {shown}")
    print(f"CPU: {os.cpu_count()} cores; onnxruntime intra-op threads {args.threads}; "
          f"one process per measurement; "
          f"prompt: {max(args.tokens)} random ids (seed {args.seed}, vocab {prompt['vocab_size']}, "
          f"{len(prompt['excluded_special_ids'])} special ids excluded), "
          f"{args.new_tokens} greedy new tokens, "
          f"{args.reps} reps after a warm-up, {args.rounds} rounds")
    if not any(e.group for e in engines):
        print("no popcompile engine (--engine NAME=PATH): only the anchors are measured")
    for e in engines:
        if e.max_seq is not None and max(args.tokens) + args.new_tokens - 1 > e.max_seq:
            print(f"note: {e.name} has max_seq {e.max_seq}: lengths above {e.max_seq - args.new_tokens + 1} "
                  f"are n/a (export it with a larger --max-seq)")

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="anchors-") as tmp:
        ids_file = Path(tmp) / "prompt_ids.json"
        ids_file.write_text(json.dumps(ids))
        runs = measure(engines, ids_file, args)
    elapsed = time.perf_counter() - began
    summary = summarize(engines, runs, args.tokens)
    ratios = {n: derived(engines, summary, n) for n in args.tokens}

    print()
    print(table(engines, summary, args.tokens, ratios))
    print()
    print(f"Medians over rounds of each worker's median (TTFT s: lower is better; decode tok/s after n "
          f"cached tokens: higher is better). 'full vs anchor': TTFT / the fastest anchor of the engine's "
          f"precision (fp32: optimum, genai-fp32), decode / the fastest same-precision anchor. "
          f"'POP vs anchor': TTFT / the fastest anchor of any precision, "
          f"target <= 1/{POP_TARGET} = {1 / POP_TARGET:.3f} (ok / MISS); "
          f"decode / the fastest same-precision anchor. Engine precisions: "
          + ", ".join(f"{e.name} {e.precision}" for e in engines) + ".")
    for line in agreement(engines, summary, args.tokens):
        print(line)
    errors = {(name, n): r["error"] for (name, n), rs in runs.items() for r in rs if "error" in r}
    for (name, n), error in errors.items():
        print(f"error {name} n={n}: {error}")
    print(f"total {elapsed / 60:.1f} min")

    if args.json:
        args.json.write_text(json.dumps({
            "command": command, "argv": sys.argv, "elapsed_s": elapsed, "prompt": prompt,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "engines": [{"name": e.name, "kind": e.kind, "mode": e.mode, "group": e.group,
                         "path": str(e.path), "python": str(e.python), "precision": e.precision,
                         "max_seq": e.max_seq, "versions": e.versions} for e in engines],
            "summary": {name: {str(n): v for n, v in per.items()} for name, per in summary.items()},
            "derived": {str(n): v for n, v in ratios.items()},
            "runs": [{"engine": name, "tokens": n, **r} for (name, n), rs in runs.items() for r in rs],
        }, indent=2))
        print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
