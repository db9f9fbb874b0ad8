"""Reference: TTFT of popcompile's engine (full and POP) against optimum-onnx's export of the same model.

Is popcompile's FULL-model ONNX engine no slower at prefill than what a user would get from
``optimum-cli export onnx --task text-generation-with-past``? Both run with onnxruntime on CPU, default
SessionOptions (default threads), batch 1, float32, the same prompt token ids (real text: standard-library
sources, tokenized with the engine folder's tokenizer):

    optimum:          model.onnx, one forward on x_1..x_N with an empty past (past_key_values.* of
                      shape [1, kv_heads, 0, head_dim]); TTFT = that forward + argmax of the last logits.
                      The export returns logits for ALL N positions (an [N, vocab] LM head matmul and
                      output), which is what a user of the export gets; reported as is.
    popcompile full:  OrtSession(engine).generate(ids, max_new_tokens=1, mode="full").ttft_s
    popcompile POP:   the same with mode="pop" (prefill graph on x_1..x_{N-1}, decode graph on x_N)

With ``--last-logits`` a fourth column is timed as a diagnostic, not as what a user gets: optimum's graph
with a Slice to the last position inserted before its LM head MatMul ("optimum last"), which separates
the cost of all-position logits from the rest of the graph.

Repetitions are interleaved (the order rotates each repetition), one warm-up each per
length, medians are reported. Before timing, the last-position logits of optimum and of popcompile's
full mode are compared on one prompt (max abs diff), so that both are the same model.

Setup (optimum lives in its own venv, the export in ~/.cache/popcompile/bench-engines/optimum-smollm2):

    bash benchmarks/optimum_env.sh
    .venv/bin/python benchmarks/optimum_reference.py --tokens 512 1024 2048 --reps 5

Needs only onnxruntime, numpy and popcompile's runtime (no torch, no optimum in this interpreter).
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
import onnxruntime as ort

from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig
from popcompile.runtime.tokenizer import EngineTokenizer

CACHE = Path.home() / ".cache" / "popcompile" / "bench-engines"
ENGINE = CACHE / "smollm2-135m-maxseq4096"
OPTIMUM = CACHE / "optimum-smollm2"


def real_text() -> str:
    """Standard-library sources (the same text as benchmarks/ttft.py)."""
    import argparse as a
    import inspect as i
    import json.decoder as j
    import logging as g
    import textwrap as t
    return "\n".join(inspect.getsource(m) for m in (j, t, a, g, i))


class OptimumModel:
    """optimum's model.onnx, run the way its ORTModelForCausalLM runs a first (empty-past) step."""

    def __init__(self, folder: Path):
        self.session = ort.InferenceSession(str(folder / "model.onnx"), ort.SessionOptions(),
                                            providers=["CPUExecutionProvider"])
        self.inputs = {arg.name: arg for arg in self.session.get_inputs()}
        self.past = [name for name in self.inputs if name.startswith("past_key_values.")]
        shape = self.inputs[self.past[0]].shape  # [batch, kv_heads, past, head_dim]
        self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])

    def feeds(self, ids: list[int]) -> dict[str, np.ndarray]:
        n = len(ids)
        feeds = {"input_ids": np.asarray([ids], dtype=np.int64),
                 "attention_mask": np.ones((1, n), dtype=np.int64)}
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.arange(n, dtype=np.int64)[None]
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)
        feeds.update({name: empty for name in self.past})
        return feeds

    def last_logits(self, ids: list[int]) -> np.ndarray:
        return self.session.run(["logits"], self.feeds(ids))[0][0, -1]

    def ttft(self, ids: list[int]) -> float:
        start = time.perf_counter()
        outputs = self.session.run(None, self.feeds(ids))
        int(np.argmax(outputs[0][0, -1]))
        return time.perf_counter() - start


def last_logits_variant(src: Path, dst: Path) -> Path:
    """optimum's model.onnx with the LM head applied to the last position only (logits [B, 1, V])."""
    target = dst / "model.onnx"
    if target.exists():
        return dst
    import onnx
    from onnx import helper
    model = onnx.load(str(src / "model.onnx"))
    graph = model.graph
    head = next(node for node in graph.node if "logits" in node.output)
    if head.op_type != "MatMul":
        raise SystemExit(f"the logits come from a {head.op_type}, not a MatMul: cannot cut the LM head")
    consts = [helper.make_tensor(f"last_pos_{k}", onnx.TensorProto.INT64, [1], [v])
              for k, v in (("start", -1), ("end", 2**62), ("axis", 1))]
    graph.initializer.extend(consts)
    hidden = head.input[0]
    graph.node.insert(list(graph.node).index(head), helper.make_node(
        "Slice", [hidden, "last_pos_start", "last_pos_end", "last_pos_axis"], ["last_pos_hidden"]))
    head.input[0] = "last_pos_hidden"
    out = next(o for o in graph.output if o.name == "logits")
    out.type.tensor_type.shape.dim[1].dim_value = 1
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(target))
    return dst


def popcompile_logits(session: OrtSession, ids: list[int], mode: str) -> tuple[np.ndarray, int]:
    """The logits the first token is sampled from (the decode graph's last output) and that token."""
    captured = []
    run = session._run

    def capture(graph, feeds):
        outputs = run(graph, feeds)
        if graph == "decode":
            captured.append(outputs[0])
        return outputs

    session._run = capture
    try:
        result = session.generate([ids], SamplingConfig(max_new_tokens=1), mode=mode)[0]
    finally:
        del session._run
    return captured[0][0], result.token_ids[0]


def check_same_model(optimum: OptimumModel, session: OrtSession, ids: list[int]) -> dict:
    ref = optimum.last_logits(ids)
    full, full_token = popcompile_logits(session, ids, "full")
    pop, pop_token = popcompile_logits(session, ids, "pop")
    return {"tokens": len(ids), "full_vs_optimum_max_abs": float(np.abs(full - ref).max()),
            "pop_vs_optimum_max_abs": float(np.abs(pop - ref).max()),
            "logit_scale": float(np.abs(ref).max()),
            "argmax": {"optimum": int(np.argmax(ref)), "full": full_token, "pop": pop_token}}


def measure(optimum: OptimumModel, session: OrtSession, ids: list[int], reps: int,
            last: OptimumModel | None = None) -> dict:
    runs = {
        "optimum": lambda: optimum.ttft(ids),
        "full": lambda: session.generate([ids], SamplingConfig(max_new_tokens=1), mode="full")[0].ttft_s,
        "pop": lambda: session.generate([ids], SamplingConfig(max_new_tokens=1), mode="pop")[0].ttft_s,
    }
    if last is not None:
        runs["optimum_last"] = lambda: last.ttft(ids)
    names = list(runs)
    for name in names:  # warm-up: first runs allocate arenas
        runs[name]()
    times = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(runs[name]())
    med = {name: statistics.median(values) for name, values in times.items()}
    return {"tokens": len(ids), "optimum_s": med["optimum"], "full_s": med["full"], "pop_s": med["pop"],
            "full_over_optimum": med["full"] / med["optimum"],
            "optimum_over_pop": med["optimum"] / med["pop"],
            "paired_full_over_optimum": statistics.median(
                f / o for f, o in zip(times["full"], times["optimum"])),
            "times": times, **({"optimum_last_s": med["optimum_last"],
                                "full_over_optimum_last": med["full"] / med["optimum_last"]} if last else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, default=ENGINE, help="popcompile engine folder")
    parser.add_argument("--optimum", type=Path, default=OPTIMUM,
                        help="optimum-cli export folder (model.onnx)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--check-tokens", type=int, default=512, help="prompt length of the logits check")
    parser.add_argument("--last-logits", action="store_true",
                        help="also time optimum's graph with the LM head on the last position only "
                             "(diagnostic)")
    parser.add_argument("--last-logits-dir", type=Path, default=Path("/tmp/optimum-smollm2-last-logits"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    session = OrtSession(args.engine)
    optimum = OptimumModel(args.optimum)
    last = OptimumModel(last_logits_variant(args.optimum, args.last_logits_dir)) if args.last_logits else None
    ids_all = EngineTokenizer.from_folder(args.engine).encode(real_text())
    if max(args.tokens + [args.check_tokens]) > len(ids_all):
        raise SystemExit(f"the text has only {len(ids_all)} tokens")
    print(f"onnxruntime {ort.__version__} CPU, {platform.processor() or platform.machine()}, "
          f"default SessionOptions; engine {args.engine.name} (cut {session.manifest.cut}), "
          f"optimum {args.optimum}")

    check = check_same_model(optimum, session, ids_all[:args.check_tokens])
    print(f"logits check on {check['tokens']} tokens: "
          f"max|full - optimum| = {check['full_vs_optimum_max_abs']:.2e}, "
          f"max|POP - optimum| = {check['pop_vs_optimum_max_abs']:.2e} "
          f"(max|logit| {check['logit_scale']:.1f}); "
          f"argmax optimum/full/POP = {check['argmax']}", flush=True)
    if last is not None:
        probe = ids_all[:args.check_tokens]
        diff = float(np.abs(last.last_logits(probe) - optimum.last_logits(probe)).max())
        check["optimum_last_vs_optimum_max_abs"] = diff
        print(f"optimum last-position variant: max|last - optimum| = {diff:.2e}")

    extra = f" {'opt last s':>10} {'full/last':>9}" if last else ""
    print(f"{'tokens':>6} {'optimum s':>9} {'full s':>8} {'POP s':>8} {'full/opt':>8} {'opt/POP':>8} "
          f"{'paired f/o':>10}"
          + extra)
    rows = []
    for n in args.tokens:
        row = measure(optimum, session, ids_all[:n], args.reps, last)
        rows.append(row)
        extra = f" {row['optimum_last_s']:>10.3f} {row['full_over_optimum_last']:>8.3f}x" if last else ""
        print(f"{n:>6} {row['optimum_s']:>9.3f} {row['full_s']:>8.3f} {row['pop_s']:>8.3f} "
              f"{row['full_over_optimum']:>7.3f}x {row['optimum_over_pop']:>7.3f}x "
              f"{row['paired_full_over_optimum']:>9.3f}x" + extra, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"check": check, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
