"""torch.compile TTFT: backend="inductor" vs backend="pop" (inner inductor), side by side in one run.

Both compile the same model's forward with ``dynamic=True``; one prefill call of N prompt tokens
(``logits_to_keep=1``, as ``generate`` makes it) is the TTFT. Compile time (the first call at the
first length, which traces and compiles) is reported apart and excluded from the table. Calls are
interleaved (inductor, pop, then pop, inductor, ...) so that drifting load hits both alike; the
table shows medians, their ratio, and the FLOP bound of the same cut (popcompile.cost). A few
decode steps after each prefill check that decode speed is unchanged (its graph is untouched).

    python benchmarks/compile_ttft.py --reps 5 --tokens 512 1024 2048 --json out/compile_ttft.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from popcompile.config import resolve_cut
from popcompile.cost import speedup_bound
from popcompile.dynamo import PopBackend, PopOptions
from popcompile.frontend.models import load_model


def prefill(fn, ids: torch.Tensor):
    """One prefill call: seconds, and the cache it filled (for the decode steps)."""
    start = time.perf_counter()
    out = fn(input_ids=ids, logits_to_keep=1, use_cache=True)
    return time.perf_counter() - start, out


def decode(fn, out, ids: torch.Tensor, steps: int) -> float:
    """Seconds per greedy decode step after the prefill ``out`` of ``ids``."""
    cache, token, n = out.past_key_values, out.logits[:, -1:].argmax(-1), ids.shape[1]
    start = time.perf_counter()
    for i in range(steps):
        position = torch.tensor([[n + i]])
        out = fn(input_ids=token, position_ids=position, past_key_values=cache, logits_to_keep=1,
                 use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps


def compiled(model, name: str, cut: int):
    # min_prompt_tokens=0: POP at every --tokens length (the backend's default runs short prompts in full)
    backend = "inductor" if name == "inductor" else PopBackend(PopOptions(cut=cut, inner="inductor",
                                                                          min_prompt_tokens=0))
    return torch.compile(model.forward, backend=backend, dynamic=True)


def run(args) -> dict:
    loaded = load_model(args.model)
    model = loaded.model
    layers = model.config.num_hidden_layers
    cut = resolve_cut(layers, cut=args.cut)
    vocab = model.config.vocab_size
    ids = {n: torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))
           for n in args.tokens}
    fns, compile_s = {}, {}
    with torch.no_grad():
        for name in ("inductor", "pop"):
            torch._dynamo.reset()
            fns[name] = compiled(model, name, cut)
            first = prefill(fns[name], ids[args.tokens[0]])
            decode(fns[name], first[1], ids[args.tokens[0]], 1)
            compile_s[name] = first[0]  # trace + compile + one run; later lengths reuse the dynamic graph
        times = {(name, n): [] for name in fns for n in args.tokens}
        steps = {name: [] for name in fns}
        for rep in range(args.reps):
            order = ("inductor", "pop") if rep % 2 == 0 else ("pop", "inductor")
            for n in args.tokens:
                for name in order:
                    seconds, out = prefill(fns[name], ids[n])
                    times[(name, n)].append(seconds)
                    if n == args.tokens[-1]:
                        steps[name].append(decode(fns[name], out, ids[n], args.decode_steps))
    rows = [{"tokens": n, "inductor_s": statistics.median(times[("inductor", n)]),
             "pop_s": statistics.median(times[("pop", n)]),
             "bound": speedup_bound(model.config, n, cut)} for n in args.tokens]
    for row in rows:
        row["speedup"] = row["inductor_s"] / row["pop_s"]
        row["of_bound"] = (row["speedup"] - 1) / (row["bound"] - 1) if row["bound"] > 1 else None
    decode_ratio = statistics.median(steps["inductor"]) / statistics.median(steps["pop"])
    return {"model": args.model, "cut": cut, "num_layers": layers, "reps": args.reps, "rows": rows,
            "compile_s": compile_s, "decode_step_s": {k: statistics.median(v) for k, v in steps.items()},
            "decode_speed_ratio": decode_ratio, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def table(result: dict) -> str:
    lines = [f"{result['model']}, cut {result['cut']}/{result['num_layers']}, medians of {result['reps']} "
             f"interleaved runs, torch {result['torch']}, {result['threads']} threads",
             "| prompt tokens | inductor TTFT (s) | pop TTFT (s) | speedup | FLOP bound "
             "| share of bound gain |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        share = f"{r['of_bound']:.0%}" if r["of_bound"] is not None else "-"
        lines.append(f"| {r['tokens']} | {r['inductor_s']:.3f} | {r['pop_s']:.3f} | {r['speedup']:.2f}x | "
                     f"{r['bound']:.2f}x | {share} |")
    d = result["decode_step_s"]
    lines.append(f"\ndecode step: inductor {d['inductor'] * 1000:.1f} ms, pop {d['pop'] * 1000:.1f} ms "
                 f"(speed ratio pop/inductor {result['decode_speed_ratio']:.3f})")
    c = result["compile_s"]
    lines.append(f"compile (first call, excluded above): inductor {c['inductor']:.0f} s, "
                 f"pop {c['pop']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped model name (default smollm2-135m)")
    parser.add_argument("--cut", type=int, help="first pruned layer (default: 1/3 of the layers pruned)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048], help="prompt lengths")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps timed after each prefill")
    parser.add_argument("--json", help="also write the result as JSON to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    result = run(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
