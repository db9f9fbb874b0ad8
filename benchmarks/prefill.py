"""Prefill time to first token, full model vs POP, side by side in one run (PyTorch, CPU).

    full = decode graph on x_1..x_N with an empty past           -> logits [1, V] (last position only)
    POP  = prefill graph on x_1..x_N (boundary folded, default)  -> logits [1, V] and N rows per layer
      or = prefill graph on x_1..x_{N-1}, then the decode graph  -> logits [1, V]   (--boundary separate)
           on x_N with those N-1 rows

Repetitions are interleaved (full, POP, then POP, full, ...) so that drifting machine load hits both
alike; the table shows medians, their ratio, the median of the per-pair ratios, and the FLOP bound
of the same cut (popcompile.cost).

    python benchmarks/prefill.py --reps 5 --json results.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import transformers

from popcompile.cost import speedup_bound
from popcompile.driver import build_graphs
from popcompile.engine.manifest import BOUNDARIES
from popcompile.frontend.models import load_model
from popcompile.passes.prefill import GraphPair

SMOLLM2 = "smollm2-135m"
LLAMA8B_3L = "llama3.1-8b-geometry-3l"
#: model name -> (cut, default prompt lengths)
MODELS: dict[str, tuple[int, tuple[int, ...]]] = {
    SMOLLM2: (20, (512, 1024, 2048)),
    LLAMA8B_3L: (2, (512, 1024)),
}


@dataclass(frozen=True)
class Result:
    """Timings (seconds, one entry per repetition) of one model at one prompt length."""

    model: str
    tokens: int
    cut: int
    num_layers: int
    full_s: list[float]
    pop_s: list[float]
    bound: float

    @property
    def full_median(self) -> float:
        return statistics.median(self.full_s)

    @property
    def pop_median(self) -> float:
        return statistics.median(self.pop_s)

    @property
    def ratio(self) -> float:
        """median(full) / median(POP)."""
        return self.full_median / self.pop_median

    @property
    def paired_ratio(self) -> float:
        """Median over repetitions of full_i / POP_i: each pair ran back to back, under the same load."""
        return statistics.median(f / p for f, p in zip(self.full_s, self.pop_s))


def llama8b_geometry_model(layers: int = 3, seed: int = 0) -> transformers.LlamaForCausalLM:
    """Llama-3.1-8B layer geometry (4096 hidden, 32/8 heads, head dim 128, FFN 14336, vocab 128256)
    with only ``layers`` layers and random float32 weights; tied embeddings keep it at ~4.7 GB."""
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, num_hidden_layers=layers, max_position_embeddings=4096,
        rope_theta=500000.0, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def load_benchmark_model(name: str) -> torch.nn.Module:
    if name == SMOLLM2:
        return load_model(SMOLLM2).model
    if name == LLAMA8B_3L:
        return llama8b_geometry_model()
    raise ValueError(f"unknown model {name!r}: use one of {sorted(MODELS)}")


def _inputs(ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, T] from ``start`` and an all-ones attention_mask [B, start+T]."""
    batch, seq = ids.shape
    pos = torch.arange(start, start + seq).repeat(batch, 1)
    return pos, torch.ones(batch, start + seq, dtype=torch.int64)


def empty_past(pair: GraphPair, batch: int) -> list[torch.Tensor]:
    """2L tensors [B, H_kv, 0, D]."""
    layout = pair.layout
    return [torch.zeros(batch, layout.num_kv_heads, 0, layout.head_dim) for _ in range(2 * layout.num_layers)]


def full_prefill(decode: Callable, ids: torch.Tensor, past: list[torch.Tensor]) -> torch.Tensor:
    """Decode graph on all of ids [B, N] after an empty past; returns logits [B, V]."""
    pos, mask = _inputs(ids, 0)
    return decode(ids, pos, mask, *past)[0]


def pop_prefill(prefill: Callable, decode: Callable, ids: torch.Tensor, past: list[torch.Tensor],
                folded: bool = True) -> torch.Tensor:
    """Folded: the prefill graph on all of ids [B, N]. Separate: the prefill graph on ids[:, :N-1], then
    the decode graph on ids[:, N-1:] over those rows. Returns logits [B, V]."""
    if folded:
        pos, mask = _inputs(ids, 0)
        return prefill(ids, pos, mask, *past)[0]
    n = ids.shape[1]
    pos, mask = _inputs(ids[:, : n - 1], 0)
    present = prefill(ids[:, : n - 1], pos, mask, *past)
    pos, mask = _inputs(ids[:, n - 1:], n - 1)
    return decode(ids[:, n - 1:], pos, mask, *present)[0]


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    pair: GraphPair, vocab_size: int, tokens: int, reps: int, warmup: int, seed: int = 0,
) -> tuple[list[float], list[float]]:
    """Interleaved timings of full and POP prefill of a random prompt [1, tokens]; warm-ups excluded."""
    decode, prefill = pair.decode.module(), pair.prefill.module()
    ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    past = empty_past(pair, 1)
    run_full = lambda: full_prefill(decode, ids, past)  # noqa: E731
    run_pop = lambda: pop_prefill(prefill, decode, ids, past, pair.boundary == "folded")  # noqa: E731
    full_s: list[float] = []
    pop_s: list[float] = []
    with torch.inference_mode():
        for _ in range(warmup):
            run_full(), run_pop()
        for rep in range(reps):
            order = [(run_full, full_s), (run_pop, pop_s)]
            for fn, out in order if rep % 2 == 0 else order[::-1]:
                out.append(seconds(fn))
    return full_s, pop_s


def run_model(name: str, tokens: Sequence[int], reps: int, warmup: int,
              boundary: str = "folded") -> list[Result]:
    cut, _ = MODELS[name]
    model = load_benchmark_model(name)
    pair = build_graphs(model, cut=cut, max_seq=max(max(tokens), 2), boundary=boundary)
    results = []
    for n in tokens:
        full_s, pop_s = measure(pair, model.config.vocab_size, n, reps, warmup)
        results.append(Result(name, n, cut, pair.num_layers, full_s, pop_s,
                              speedup_bound(model.config, n, cut)))
        print(format_row(results[-1]), flush=True)
    return results


HEADER = ("model", "tokens", "cut", "full median s", "POP median s", "measured ratio", "paired ratio",
          "FLOP bound", "ratio/bound")


def format_row(r: Result) -> str:
    cells = (r.model, str(r.tokens), f"{r.cut}/{r.num_layers}", f"{r.full_median:.3f}",
             f"{r.pop_median:.3f}", f"{r.ratio:.3f}x", f"{r.paired_ratio:.3f}x", f"{r.bound:.3f}x",
             f"{100 * r.ratio / r.bound:.1f}%")
    return "| " + " | ".join(cells) + " |"


def format_table(results: Sequence[Result]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + [format_row(r) for r in results])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated prompt lengths for every model (default: per model, "
                             + "; ".join(f"{m}: {','.join(map(str, t))}" for m, (_, t) in MODELS.items())
                             + ")")
    parser.add_argument("--reps", type=int, default=5,
                        help="timed repetitions of each variant (default 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs of each variant first (default 1)")
    parser.add_argument("--boundary", choices=BOUNDARIES, default="folded",
                        help="POP's prefill graph: x_N folded in (default) or a separate decode-graph step")
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: use {', '.join(MODELS)}")
    if args.tokens is not None:
        args.tokens = [int(t) for t in args.tokens.split(",")]
        if any(t < 2 for t in args.tokens):
            parser.error("--tokens must be >= 2 (POP prefills N-1 tokens)")
    if args.reps < 1 or args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {machine}, "
          f"reps {args.reps}, warm-up {args.warmup}", flush=True)
    results: list[Result] = []
    for name in args.models:
        results += run_model(name, args.tokens or MODELS[name][1], args.reps, args.warmup, args.boundary)
    print(format_table(results))
    if args.json:
        meta = {"torch": torch.__version__, "transformers": transformers.__version__,
                "threads": torch.get_num_threads(), "machine": platform.machine(), "reps": args.reps,
                "warmup": args.warmup, "date": time.strftime("%Y-%m-%d")}
        rows = [{**asdict(r), "full_median_s": r.full_median, "pop_median_s": r.pop_median, "ratio": r.ratio,
                 "paired_ratio": r.paired_ratio}
                for r in results]
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
