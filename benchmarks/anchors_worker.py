"""One measurement of benchmarks/anchors.py: one engine, one mode, one prompt length, in a fresh process.

    PYTHON benchmarks/anchors_worker.py --kind genai --path FOLDER --ids IDS.json --tokens 512 \\
        --reps 3 --new-tokens 32 --threads 2
    PYTHON benchmarks/anchors_worker.py --versions

PYTHON is the interpreter of the engine's own environment (optimum: /tmp/optimum-venv, genai:
/tmp/genai-venv, popcompile: the project's .venv), so this file imports nothing but the standard
library at the top: each kind imports its runtime inside its own function.

The worker loads the engine (not timed), runs one warm-up generation of ``--new-tokens`` greedy tokens
after the first ``--tokens`` ids of IDS.json (a JSON list of token ids), then ``--reps`` timed ones, and
prints one line ``ANCHORS_RESULT {json}`` with the medians (and every value) of

    ttft_s        seconds from the start of the request to the first generated token id in hand
    decode_tok_s  (new tokens - 1) / (seconds from the first to the last generated token)

per kind:

    popcompile  OrtSession(folder, threads=T).generate([ids], SamplingConfig(greedy, max_new_tokens=N),
                mode=full|pop, min_prompt_tokens=0): GenerationResult.ttft_s (prefill start -> first
                token sampled) and .decode_tokens_per_s (steps / time after the first token). eos does not
                stop it (the tokenizer's eos_token_ids are cleared), so every run makes N tokens.
    optimum     ORTModelForCausalLM.from_pretrained(folder, session_options=intra_op T).generate(ids,
                do_sample=False, max_new_tokens=N, min_new_tokens=N, streamer=clock): TTFT from the
                generate() call to the streamer's first new token, decode from it to the last one.
    genai       og.Model(og.Config(folder) + session_options intra_op T); per request GeneratorParams
                (greedy, max_length = min_length = prompt + N), Generator, append_tokens,
                generate_next_token: TTFT from the Generator's creation to the first token, decode
                from it to the last. (Generator creation alone is reported as setup_s.)

onnxruntime's intra-op thread count is T (default 2) in every kind; inter-op is left to onnxruntime
(sequential execution: no inter-op pool runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

MARKER = "ANCHORS_RESULT "
PACKAGES = ("onnxruntime", "onnxruntime-genai", "optimum", "optimum-onnx", "transformers", "torch", "numpy",
            "popcompile")


def versions() -> dict:
    import importlib.metadata as metadata
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    found["python"] = sys.version.split()[0]
    return found


# ---------------------------------------------------------------------------------------------- engines
class Popcompile:
    def __init__(self, path: str, mode: str, threads: int, new_tokens: int):
        from popcompile.runtime.ort import OrtSession
        from popcompile.runtime.sampling import SamplingConfig
        self.session = OrtSession(path, threads=threads)
        self.session.tokenizer.eos_token_ids = ()  # generate exactly new_tokens tokens, like the others
        self.sampling = SamplingConfig(greedy=True, max_new_tokens=new_tokens)
        self.mode, self.new_tokens = mode, new_tokens
        self.max_seq = self.session.layout.max_seq

    def check(self, n: int) -> None:
        # the prompt's rows and every decode step but the last sit in the KV buffer
        if n + self.new_tokens - 1 > self.max_seq:
            raise SystemExit(f"engine max_seq {self.max_seq} < {n} + {self.new_tokens} - 1 tokens: "
                             f"re-export it with a larger --max-seq (e.g. {2 * self.max_seq})")

    def run(self, ids: list[int]) -> dict:
        began = time.perf_counter()
        result = self.session.generate([ids], self.sampling, mode=self.mode, min_prompt_tokens=0)[0]
        wall = time.perf_counter() - began
        steps = len(result.token_ids) - 1
        decode_s = steps / result.decode_tokens_per_s if result.decode_tokens_per_s else 0.0
        return {"ttft_s": result.ttft_s, "decode_tok_s": result.decode_tokens_per_s,
                "tokens": result.token_ids, "prefill": result.prefill,
                "outside_s": wall - result.ttft_s - decode_s}


class Optimum:
    def __init__(self, path: str, threads: int, new_tokens: int):
        import onnxruntime as ort
        import torch
        from optimum.onnxruntime import ORTModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        # torch only runs generate()'s small ops (argmax, cat); its own pool of one thread per core would
        # fight onnxruntime's spinning intra-op pool for the same cores (2x slower decode on 2 cores)
        torch.set_num_threads(1)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.torch, self.new_tokens = torch, new_tokens
        self.model = ORTModelForCausalLM.from_pretrained(path, session_options=options,
                                                         provider="CPUExecutionProvider",
                                                         use_cache=True, local_files_only=True)

    def check(self, n: int) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit and n + self.new_tokens > limit:
            raise SystemExit(f"{n} + {self.new_tokens} tokens > max_position_embeddings {limit}")

    def run(self, ids: list[int]) -> dict:
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            def __init__(self):
                self.prompt, self.times, self.tokens = True, [], []

            def put(self, value):
                if self.prompt:  # generate() first puts the prompt
                    self.prompt = False
                    return
                self.times.append(time.perf_counter())
                self.tokens.extend(int(t) for t in value.reshape(-1).tolist())

            def end(self):
                pass

        torch, clock = self.torch, Clock()
        input_ids = torch.tensor([ids], dtype=torch.int64)
        began = time.perf_counter()
        self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            num_beams=1, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                            streamer=clock)
        first, last = clock.times[0], clock.times[-1]
        steps = len(clock.times) - 1
        return {"ttft_s": first - began, "decode_tok_s": steps / (last - first) if steps else 0.0,
                "tokens": clock.tokens}


class Genai:
    def __init__(self, path: str, threads: int, new_tokens: int):
        import numpy as np
        import onnxruntime_genai as og
        if hasattr(og, "disable_telemetry_events"):
            og.disable_telemetry_events()
        config = og.Config(path)
        config.overlay(json.dumps(
            {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.og, self.np, self.new_tokens = og, np, new_tokens
        self.model = og.Model(config)
        with open(os.path.join(path, "genai_config.json")) as f:
            self.context = json.load(f)["model"]["context_length"]

    def check(self, n: int) -> None:
        if n + self.new_tokens > self.context:
            raise SystemExit(f"{n} + {self.new_tokens} tokens > context_length {self.context}")

    def run(self, ids: list[int]) -> dict:
        og, total = self.og, len(ids) + self.new_tokens
        prompt = self.np.asarray(ids, dtype=self.np.int32)
        params = og.GeneratorParams(self.model)
        # min_length: eos does not end the run (its logit is masked), so every run makes new_tokens tokens
        params.set_search_options(do_sample=False, num_beams=1, max_length=total, min_length=total)
        began = time.perf_counter()
        generator = og.Generator(self.model, params)
        setup = time.perf_counter() - began
        generator.append_tokens(prompt)
        generator.generate_next_token()
        tokens = [int(generator.get_next_tokens()[0])]
        first = last = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            last = time.perf_counter()
        steps = len(tokens) - 1
        return {"ttft_s": first - began, "decode_tok_s": steps / (last - first) if steps else 0.0,
                "tokens": tokens, "setup_s": setup}


# ---------------------------------------------------------------------------------------------- main
def measure(args) -> dict:
    with open(args.ids) as f:
        all_ids = json.load(f)
    if args.tokens > len(all_ids):
        raise SystemExit(f"--tokens {args.tokens} > the {len(all_ids)} ids in {args.ids}")
    ids = all_ids[:args.tokens]
    began = time.perf_counter()
    if args.kind == "popcompile":
        engine = Popcompile(args.path, args.mode, args.threads, args.new_tokens)
    elif args.kind == "optimum":
        engine = Optimum(args.path, args.threads, args.new_tokens)
    else:
        engine = Genai(args.path, args.threads, args.new_tokens)
    load_s = time.perf_counter() - began
    engine.check(len(ids))
    warmup = engine.run(ids)
    runs = [engine.run(ids) for _ in range(args.reps)]
    for run in [warmup, *runs]:
        if len(run["tokens"]) != args.new_tokens:
            raise SystemExit(f"generated {len(run['tokens'])} tokens, not {args.new_tokens}")
    result = {"kind": args.kind, "path": args.path, "mode": args.mode, "prompt_tokens": len(ids),
              "new_tokens": args.new_tokens, "reps": args.reps, "threads": args.threads, "load_s": load_s,
              "ttft_s": statistics.median(r["ttft_s"] for r in runs),
              "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
              "ttft_all": [r["ttft_s"] for r in runs], "decode_all": [r["decode_tok_s"] for r in runs],
              "warmup_ttft_s": warmup["ttft_s"], "warmup_decode_tok_s": warmup["decode_tok_s"],
              "token_ids": runs[0]["tokens"], "versions": versions(), "pid": os.getpid()}
    for key in ("setup_s", "outside_s"):
        if key in runs[0]:
            result[key] = statistics.median(r[key] for r in runs)
    if "prefill" in runs[0]:
        result["prefill"] = sorted({r["prefill"] for r in [warmup, *runs]})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", action="store_true",
                        help="print this interpreter's package versions and exit")
    parser.add_argument("--kind", choices=["popcompile", "optimum", "genai"])
    parser.add_argument("--path", help="the engine or export folder")
    parser.add_argument("--mode", choices=["full", "pop"], default="full", help="popcompile only")
    parser.add_argument("--ids", help="JSON file: a list of prompt token ids (the first --tokens are used)")
    parser.add_argument("--tokens", type=int, help="prompt length")
    parser.add_argument("--reps", type=int, default=3, help="timed generations after one warm-up")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per generation")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args()
    if args.versions:
        print(MARKER + json.dumps(versions()), flush=True)
        return
    if not (args.kind and args.path and args.ids and args.tokens):
        parser.error("--kind, --path, --ids and --tokens are needed (or --versions)")
    if args.new_tokens < 2 or args.reps < 1 or args.tokens < 1:
        parser.error("--new-tokens must be >= 2, --reps and --tokens >= 1")
    try:
        result = measure(args)
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            raise
        print(MARKER + json.dumps({"error": str(stop.code)}), flush=True)
        sys.exit(2)
    except Exception as err:  # noqa: BLE001 - reported to anchors.py as one line
        traceback.print_exc()
        print(MARKER + json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
        sys.exit(1)
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
