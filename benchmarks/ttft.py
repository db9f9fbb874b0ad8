"""TTFT of POP vs full with onnxruntime (CPU), side by side in one run, and decode speed of both.

For each model an engine folder is exported once (cached in ~/.cache/popcompile/bench-engines) and one
PopSession runs both modes on the same prompt token ids (real text: standard-library sources):

    pop:  prefill.onnx on x_1..x_{N-1}, decode.onnx on x_N     (TTFT = until the first token is sampled)
    full: decode.onnx on x_1..x_N

Repetitions are interleaved (pop, full, full, pop, ...) and the table shows medians, their ratio and the
FLOP bound of the same cut (popcompile.cost). Decode tokens/s is measured over 32 greedy tokens per mode.

    python benchmarks/ttft.py --models smollm2-135m gemma3-270m --tokens 512 1024 2048 --reps 5
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
from pathlib import Path

import onnxruntime

from popcompile.cost import speedup_bound
from popcompile.exporters.onnx import export
from popcompile.runtime.generate import SamplingConfig
from popcompile.runtime.ort import PopSession

CACHE = Path.home() / ".cache" / "popcompile" / "bench-engines"
MAX_SEQ = 4096


def engine(model: str) -> Path:
    folder = CACHE / f"{model}-maxseq{MAX_SEQ}"
    if not folder.exists():
        export(model, folder, max_seq=MAX_SEQ)
    return folder


def real_text() -> str:
    """Standard-library sources: real text nobody here wrote, long enough for 2k+ tokens."""
    import argparse as a, inspect as i, json.decoder as j, logging as g, textwrap as t
    return "\n".join(inspect.getsource(m) for m in (j, t, a, g, i))


def time_mode(session: PopSession, ids: list[int], mode: str, new_tokens: int = 1):
    result = session.generate([ids], SamplingConfig(max_new_tokens=new_tokens), mode=mode)[0]
    return result.ttft_s, result.decode_tokens_per_s


def measure(session: PopSession, ids: list[int], reps: int) -> dict:
    ttft = {"pop": [], "full": []}
    for mode in ("pop", "full"):  # warm-up: first runs allocate arenas
        time_mode(session, ids, mode)
    for rep in range(reps):
        for mode in (("pop", "full") if rep % 2 == 0 else ("full", "pop")):
            ttft[mode].append(time_mode(session, ids, mode)[0])
    decode = {mode: statistics.median(time_mode(session, ids, mode, 33)[1] for _ in range(2))
              for mode in ("pop", "full")}
    pairs = [f / p for f, p in zip(ttft["full"], ttft["pop"])]
    return {"full_ttft_s": statistics.median(ttft["full"]), "pop_ttft_s": statistics.median(ttft["pop"]),
            "pair_ratio": statistics.median(pairs), "full_decode_tok_s": decode["full"],
            "pop_decode_tok_s": decode["pop"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"onnxruntime {onnxruntime.__version__} CPU, {platform.processor() or platform.machine()}")
    print(f"{'model':14} {'tokens':>6} {'full s':>8} {'POP s':>8} {'ratio':>6} {'bound':>6} {'of bound':>8} "
          f"{'dec full':>8} {'dec POP':>8}")
    for model in args.models:
        folder = engine(model)
        session = PopSession(folder)
        config = json.loads((folder / "config.json").read_text())
        text_ids = session.tokenizer.encode(real_text())
        for n in args.tokens:
            row = {"model": model, "tokens": n, "cut": session.manifest.cut,
                   **measure(session, text_ids[:n], args.reps)}
            row["ratio"] = row["full_ttft_s"] / row["pop_ttft_s"]
            row["bound"] = speedup_bound(config, n, session.manifest.cut)
            rows.append(row)
            print(f"{model:14} {n:>6} {row['full_ttft_s']:>8.3f} {row['pop_ttft_s']:>8.3f} {row['ratio']:>6.3f} "
                  f"{row['bound']:>6.3f} {100 * row['ratio'] / row['bound']:>7.1f}% "
                  f"{row['full_decode_tok_s']:>8.1f} {row['pop_decode_tok_s']:>8.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
