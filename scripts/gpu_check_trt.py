"""The TensorRT and onnxruntime-CUDA parts of the GPU check (scripts/gpu_check.py), on an exported engine
folder.

They run only where their packages import (``tensorrt``; ``onnxruntime`` with ``CUDAExecutionProvider``)
and an engine folder is given (``--engine DIR``: ``popcompile export`` output); elsewhere gpu_check.py
records them as skipped with the reason. The H200 machine this project gets has neither package.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import statistics
from pathlib import Path


class Skip(Exception):
    """A phase that cannot run here; the message says why."""


def prompt_ids(folder: Path, n: int) -> list[int]:
    """The first n tokens of real text nobody here wrote (standard-library sources)."""
    import argparse as a  # noqa: E401
    import json.decoder as j
    import logging as g
    import textwrap as t

    from popcompile.runtime.tokenizer import EngineTokenizer
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

    from popcompile.runtime.sampling import SamplingConfig

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
    from popcompile.runtime.sampling import SamplingConfig

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
    from popcompile.engine.manifest import EngineManifest

    return json.loads((folder / "config.json").read_text()), EngineManifest.read(folder).cut


def trt_build(args, folder: Path) -> dict:
    from popcompile.engine.tensorrt import TensorRTUnavailable
    from popcompile.exporters.tensorrt import TrtBuildConfig, build_engines

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
    from popcompile.runtime.ort import OrtSession
    from popcompile.runtime.trt import TrtSession

    rows = compare(TrtSession(folder), OrtSession(folder), folder, args.tokens[0], 16)
    return {"reference": "onnxruntime CPU, float32", "rows": rows}


def trt_ttft(args, folder: Path) -> dict:
    from popcompile.runtime.sampling import SamplingConfig
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
    return {"rows": rows, "decode tokens/s (64 tokens after the prompt)": decode,
            "KV binding": session.binding}


def ort_cuda(args, folder: Path) -> dict:
    from popcompile.runtime.ort import OrtSession

    provider = "cpu" if args.device == "cpu" else "cuda"
    try:
        session = OrtSession(folder, provider=provider)
    except ValueError as err:
        raise Skip(str(err)) from None
    rows = compare(session, OrtSession(folder), folder, args.tokens[0], 16)
    return {"provider": provider, "numerics vs CPU": rows,
            "rows": ttft_rows(session, folder, args.tokens, args.reps, _cut_info(folder))}
