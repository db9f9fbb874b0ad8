"""TTFT of POP vs full with onnxruntime, side by side in one run, and decode speed of both.

For each model an engine folder is exported once (cached in ~/.cache/popcompile/bench-engines) and one
OrtSession runs both modes on the same prompt token ids (real text: standard-library sources):

    pop:  prefill.onnx on x_1..x_N, x_N's logits out       (boundary folded, the default engine)
          prefill.onnx on x_1..x_{N-1}, decode.onnx on x_N  (--boundary separate)
    full: decode.onnx on x_1..x_N                           (TTFT = until the first token is sampled)

Repetitions are interleaved (pop, full, full, pop, ...) and the table shows medians, their ratio and the
FLOP bound of the same cut (popcompile.cost). Decode tokens/s is measured over 32 greedy tokens per mode,
reps/2 (at least 2) interleaved runs each; "dec ratio" is the median paired POP/full decode speed.
``--split`` also times the graphs alone (InferenceSession.run, no generation loop), interleaved: the full
graph on x_1..x_N, the prefill graph on x_1..x_{N-1} and the boundary step, to show where POP's time goes.

    python benchmarks/ttft.py --models smollm2-135m gemma3-270m --tokens 512 1024 2048 --reps 5
    python benchmarks/ttft.py --models smollm2-135m --tokens 1024 --no-io-binding  # plain run(), to compare
    python benchmarks/ttft.py --dtype float16 --provider cuda    # float16 needs a GPU provider
    python benchmarks/ttft.py --kv-calibration auto              # also POP+ beside POP
    python benchmarks/ttft.py --compare-separate                 # folded vs separate x_N
    python benchmarks/ttft.py --models smollm2-135m --step-cost 512 1024 2048 --reps 9 # docs/kv.md's table
    python benchmarks/ttft.py --engine E --tokens 512 2048 --reps 3  # an engine already exported

An ``--engine`` folder (e.g. benchmarks/real_shapes.py --keep-engine) runs on random token ids of its
vocabulary (seed 0): those models' word-level tokenizers know no real text, and the speed does not
depend on it.
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime

from popcompile.cost import speedup_bound
from popcompile.driver import export
from popcompile.engine.manifest import BOUNDARIES
from popcompile.runtime.kvbuffer import KVBuffer
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

CACHE = Path.home() / ".cache" / "popcompile" / "bench-engines"
MAX_SEQ = 4096


def engine(model: str, dtype: str = "float32", kv_calibration: str = "none",
           boundary: str = "folded") -> Path:
    suffix = ("" if dtype == "float32" else f"-{dtype}") + ("" if kv_calibration == "none" else "-kvfit")
    folder = CACHE / f"{model}-maxseq{MAX_SEQ}-{boundary}{suffix}"
    if not folder.exists():
        export(model, folder, max_seq=MAX_SEQ, dtype=dtype, kv_calibration=kv_calibration, boundary=boundary,
               min_prompt_tokens=0)
    return folder


def real_text() -> str:
    """Standard-library sources: real text nobody here wrote, long enough for 2k+ tokens."""
    import argparse as a
    import inspect as i
    import json.decoder as j
    import logging as g
    import textwrap as t
    return "\n".join(inspect.getsource(m) for m in (j, t, a, g, i))


def random_ids(config: dict, n: int) -> list[int]:
    """``n`` token ids drawn from the vocabulary (seed 0), past the first 3 (special ids)."""
    vocab = config.get("text_config", config)["vocab_size"]
    return np.random.default_rng(0).integers(3, vocab, n).tolist()


def time_mode(session: OrtSession, ids: list[int], mode: str, new_tokens: int = 1):
    result = session.generate([ids], SamplingConfig(max_new_tokens=new_tokens), mode=mode)[0]
    return result.ttft_s, result.decode_tokens_per_s


def measure(session: OrtSession, ids: list[int], reps: int,
            others: dict[str, OrtSession] | None = None) -> dict:
    """Interleaved medians of TTFT (and decode tok/s) of full and POP, and of POP in each of ``others``
    (another engine of the same model: "popplus", refitted K/V weights; "separate", the boundary step
    as its own call), with the median of its paired TTFT ratio to POP's as ``{name}_over_pop``."""
    modes = {"pop": (session, "pop"), "full": (session, "full")}
    modes.update({name: (other, "pop") for name, other in (others or {}).items()})
    order = list(modes)
    ttft: dict[str, list[float]] = {name: [] for name in modes}
    for which, mode in modes.values():  # warm-up: first runs allocate arenas
        time_mode(which, ids, mode)
    for rep in range(reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            which, mode = modes[name]
            ttft[name].append(time_mode(which, ids, mode)[0])
    decode: dict[str, list[float]] = {"pop": [], "full": []}
    for rep in range(max(2, reps // 2)):  # interleaved too: the same graph runs in both modes
        for mode in (("pop", "full") if rep % 2 == 0 else ("full", "pop")):
            decode[mode].append(time_mode(session, ids, mode, 33)[1])
    pairs = [f / p for f, p in zip(ttft["full"], ttft["pop"])]
    row = {f"{name}_ttft_s": statistics.median(values) for name, values in ttft.items()}
    row.update({"pair_ratio": statistics.median(pairs),
                "full_decode_tok_s": statistics.median(decode["full"]),
                "pop_decode_tok_s": statistics.median(decode["pop"]),
                "decode_pair_ratio": statistics.median(p / f for p, f in zip(decode["pop"], decode["full"]))})
    for name in others or {}:
        row[f"{name}_over_pop"] = statistics.median(c / p for c, p in zip(ttft[name], ttft["pop"]))
    return row


def split(session: OrtSession, ids: list[int], reps: int) -> dict:
    """Graph-only medians (s): full graph on N tokens; prefill graph on N-1 and the boundary step over
    its rows (fed straight from the prefill's outputs); interleaved, one warm-up round."""
    layout, n = session.layout, len(ids)
    dtype = np.float16 if layout.dtype == "float16" else np.float32
    tokens = np.array([ids], dtype=np.int64)

    def run(graph: str, start: int, seq: slice, past: list | None = None) -> tuple[float, list]:
        chunk = tokens[:, seq]
        past = past or [np.zeros((1, layout.num_kv_heads, 0, layout.head_dim), dtype)
                        for _ in layout.past_names]
        feeds = {"input_ids": chunk, "position_ids": np.arange(start, start + chunk.shape[1])[None],
                 "attention_mask": np.ones((1, start + chunk.shape[1]), np.int64),
                 **dict(zip(layout.past_names, past))}
        began = time.perf_counter()
        outputs = session.sessions[graph].run(None, feeds)
        return time.perf_counter() - began, outputs

    times: dict[str, list[float]] = {"full": [], "prefill": [], "boundary": []}
    folded = session.manifest.boundary == "folded"
    for rep in range(reps + 1):
        for mode in (("full", "pop") if rep % 2 == 0 else ("pop", "full")):
            if mode == "full":
                times["full"].append(run("decode", 0, slice(None))[0])
                continue
            if folded:  # one graph on x_1..x_N: no boundary step
                times["prefill"].append(run("prefill", 0, slice(None))[0])
                times["boundary"].append(0.0)
                continue
            seconds, present = run("prefill", 0, slice(0, n - 1))
            times["prefill"].append(seconds)
            times["boundary"].append(run("decode", n - 1, slice(n - 1, n), present)[0])
    return {f"{name}_graph_s": statistics.median(values[1:]) for name, values in times.items()}


def step_costs(session: OrtSession, rows: int, reps: int) -> dict:
    """One decode step after ``rows`` cached rows (ms, medians, interleaved): the decode graph's run,
    gathering the past into fresh arrays (the runtime before IO binding) or into the staging area
    (now), and the zero-copy alternative: the graph over the whole max_seq buffer, masked."""
    layout, decode = session.layout, session.sessions["decode"]
    buffer = KVBuffer(layout, 1)
    buffer.data[:] = (np.random.default_rng(0).standard_normal(buffer.data.shape).astype(buffer.data.dtype)
                      * 0.1)
    buffer.length, total = rows, layout.max_seq - 1

    def feeds(past: list, seen: int) -> dict:
        mask = np.zeros((1, seen + 1), np.int64)
        mask[:, :rows], mask[:, -1] = 1, 1  # rows rows..seen-1 of a whole buffer are unwritten
        return {"input_ids": np.array([[42]], np.int64), "position_ids": np.array([[rows]], np.int64),
                "attention_mask": mask, **dict(zip(layout.past_names, past))}

    whole = [np.ascontiguousarray(buffer.data[i // 2, i % 2, :1, :, :total])
             for i in range(len(layout.past_names))]
    runs = {"fresh copies": lambda: [np.ascontiguousarray(buffer.data[i // 2, i % 2, :1, :, :rows])
                                     for i in range(len(layout.past_names))],
            "staging": lambda: (buffer.reset(), setattr(buffer, "length", rows), buffer.past(1)),
            "decode step": lambda: decode.run(None, feeds(buffer.past(1), rows)),
            "whole buffer": lambda: decode.run(None, feeds(whole, total))}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps + 1):
        for name, work in runs.items():
            began = time.perf_counter()
            work()
            times[name].append(time.perf_counter() - began)
    return {name: 1000 * statistics.median(values[1:]) for name, values in times.items()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+",
                        help="shipped model names (default: smollm2-135m gemma3-270m unless --engine)")
    parser.add_argument("--engine", type=Path, action="append", default=[],
                        help="an exported engine folder to time as it is (repeat for several)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048], help="prompt lengths")
    parser.add_argument("--reps", type=int, default=5,
                        help="interleaved repetitions per mode (after a warm-up)")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                        help="engine precision (float16 needs --provider cuda or tensorrt)")
    parser.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                        help="onnxruntime execution provider")
    parser.add_argument("--threads", type=int,
                        help="onnxruntime intra-op threads (default: onnxruntime's, one per core)")
    parser.add_argument("--io-binding", action=argparse.BooleanOptionalAction, default=True,
                        help="run with IO binding (default) or plain InferenceSession.run")
    parser.add_argument("--split", action="store_true",
                        help="also time the full graph, the prefill graph and the boundary step alone")
    parser.add_argument("--step-cost", nargs="+", type=int, metavar="ROWS",
                        help="instead: per decode step after ROWS cached rows, the cost of the past's copies "
                             "against the step (docs/kv.md)")
    parser.add_argument("--boundary", choices=BOUNDARIES, default="folded",
                        help="engine layout: x_N folded into the prefill graph (default) "
                             "or a separate decode call")
    parser.add_argument("--kv-calibration", choices=["none", "auto"], default="none",
                        help="auto: also time POP+ (a second engine with refitted K/V weights), "
                             "interleaved with POP")
    parser.add_argument("--compare-separate", action="store_true",
                        help="also time POP on a separate-boundary engine, interleaved "
                             "(what folding x_N saves)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.models is None:
        args.models = [] if args.engine else ["smollm2-135m", "gemma3-270m"]
    if args.step_cost:
        print_step_costs(args)
        return
    rows = []
    print(f"onnxruntime {onnxruntime.__version__} {args.provider}, "
          f"{platform.processor() or platform.machine()}, "
          f"{args.dtype}, io_binding={args.io_binding}, threads={args.threads or 'default'}")
    print(f"{'model':14} {'tokens':>6} {'full s':>8} {'POP s':>8} {'ratio':>6} {'paired':>6} {'bound':>6} "
          f"{'of bound':>8} {'dec full':>8} {'dec POP':>8} {'dec ratio':>9}")
    targets = [(model, lambda model=model: engine(model, args.dtype, boundary=args.boundary))
               for model in args.models]
    targets += [(folder.name, lambda folder=folder: folder) for folder in args.engine]
    for model, folder_of in targets:
        folder = folder_of()
        session = OrtSession(folder, provider=args.provider, threads=args.threads, io_binding=args.io_binding)
        def other(kv_calibration: str, boundary: str, model: str = model) -> OrtSession:
            return OrtSession(engine(model, args.dtype, kv_calibration, boundary), provider=args.provider,
                              threads=args.threads, io_binding=args.io_binding)

        others = {}
        if args.kv_calibration != "none":
            others["popplus"] = other(args.kv_calibration, args.boundary)
        if args.compare_separate:
            others["separate"] = other("none", "separate")
        config = json.loads((folder / "config.json").read_text())
        text_ids = (session.tokenizer.encode(real_text()) if model in args.models
                    else random_ids(config, max(args.tokens)))
        for n in args.tokens:
            row = {"model": model, "tokens": n, "cut": session.manifest.cut,
                   **measure(session, text_ids[:n], args.reps, others)}
            row["ratio"] = row["full_ttft_s"] / row["pop_ttft_s"]
            row["bound"] = speedup_bound(config, n, session.manifest.cut)
            rows.append(row)
            print(_row_line(row), flush=True)
            for name, label in (("popplus", "POP+ (refitted K/V)"),
                                ("separate", "POP, separate boundary step")):
                if name in others:
                    print(f"{'':14} {label}: TTFT {row[f'{name}_ttft_s']:.3f} s, paired {name}/POP "
                          f"{row[f'{name}_over_pop']:.3f}, "
                          f"full/{name} {row['full_ttft_s'] / row[f'{name}_ttft_s']:.3f}",
                          flush=True)
            if args.split:
                row.update(split(session, text_ids[:n], args.reps))
                print(_split_line(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def print_step_costs(args) -> None:
    for model in args.models:
        session = OrtSession(engine(model, args.dtype, boundary=args.boundary), provider=args.provider,
                             threads=args.threads)
        for rows in args.step_cost:
            cost = step_costs(session, rows, args.reps)
            step = cost["decode step"]
            print(f"{model:14} past {rows:>5}: decode step {step:.1f} ms; "
                  f"fresh copies {cost['fresh copies']:.2f} ms "
                  f"({100 * cost['fresh copies'] / step:.0f}%); staging {cost['staging']:.2f} ms "
                  f"({100 * cost['staging'] / step:.0f}%); "
                  f"whole buffer, masked: {cost['whole buffer']:.1f} ms",
                  flush=True)


def _row_line(row: dict) -> str:
    return (f"{row['model']:14} {row['tokens']:>6} {row['full_ttft_s']:>8.3f} {row['pop_ttft_s']:>8.3f} "
            f"{row['ratio']:>6.3f} {row['pair_ratio']:>6.3f} {row['bound']:>6.3f} "
            f"{100 * row['ratio'] / row['bound']:>7.1f}% {row['full_decode_tok_s']:>8.1f} "
            f"{row['pop_decode_tok_s']:>8.1f} {row['decode_pair_ratio']:>9.3f}")


def _split_line(row: dict) -> str:
    full, prefill, boundary = row["full_graph_s"], row["prefill_graph_s"], row["boundary_graph_s"]
    return (f"{'':14} graphs alone: full {full:.3f} s, prefill {prefill:.3f} s, "
            f"boundary {1000 * boundary:.1f} ms "
            f"({100 * boundary / (prefill + boundary):.1f}% of POP); full/prefill {full / prefill:.3f}, "
            f"full/(prefill+boundary) {full / (prefill + boundary):.3f}")


if __name__ == "__main__":
    main()
