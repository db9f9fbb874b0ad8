"""Compile a model with POP into an engine folder, then generate from it: POP's prefill next to the full
model's.

    python samples/export_and_run.py  # SmolLM2-135M: ~7 min on 2 CPU cores (POP++ fit, threshold)
    python samples/export_and_run.py --model gemma3-270m --out engines/gemma
    python samples/export_and_run.py --model path/to/hf-folder --kv-calibration none --min-prompt-tokens 0

The README's "From Python" snippet is the region between the ``readme`` markers (tests/test_samples.py).
"""
from __future__ import annotations

import argparse
import sys

# [readme:export_and_run]
import popcompile


def export_and_run(model="smollm2-135m", out="engines/smol", prompt="Write a haiku about compilers.",
                   config=popcompile.PopConfig(),  # POP++, deep third pruned, threshold measured
                   max_new_tokens=32):
    manifest = popcompile.compile(model, config, out=out, force=True)  # force: replace an older engine folder
    session = popcompile.open_session(out)  # onnxruntime on the CPU; runtime="tensorrt" on an NVIDIA GPU
    for mode in ("pop", "full"):  # POP's prefill, then the full model's; the decode graph is the same
        result = session.generate(prompt, {"max_new_tokens": max_new_tokens, "greedy": True}, mode=mode)[0]
        print(f"{mode} (cut {manifest.cut}/{manifest.num_layers}, {result.prefill} prefill): "
              f"first token after {result.ttft_s:.3f} s: {result.text!r}")
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped name, .gguf or HF folder")
    parser.add_argument("--out", default="engines/smol",
                        help="engine folder to write (replaced if one is there)")
    parser.add_argument("--prompt", default="Write a haiku about compilers.")
    parser.add_argument("--kv-calibration", default="auto",
                        help="auto (default: POP++ on a text model, POP+ on a vision-language model), "
                             "ridge (POP+), distill (POP++), none (the paper's POP) or a file from "
                             "`popcompile calibrate`")
    parser.add_argument("--min-prompt-tokens", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser.add_argument("--max-seq", type=int, help="KV buffer length (default: min(4096, model limit))")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    config = popcompile.PopConfig(kv_calibration=args.kv_calibration,
                                  min_prompt_tokens=args.min_prompt_tokens, max_seq=args.max_seq)
    try:
        export_and_run(args.model, args.out, args.prompt, config, args.max_new_tokens)
    except popcompile.PopcompileError as err:
        print(f"export_and_run: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
