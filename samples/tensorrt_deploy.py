"""Compile to TensorRT and generate with the TensorRT runtime (an NVIDIA GPU and
``pip install "popcompile[gpu]"``).

    python samples/tensorrt_deploy.py                      # SmolLM2-135M, bf16 plans in engines/smol-trt
    python samples/tensorrt_deploy.py --precision fp32 --cuda-graph
    python samples/tensorrt_deploy.py --model path/to/hf-folder --kv-calibration none --min-prompt-tokens 0

Without a GPU it stops at once with one line saying what is missing (exit code 3, as the CLI's for a machine
that lacks what is asked; nothing written).
"""
from __future__ import annotations

import argparse
import sys

# [readme:tensorrt_deploy]
import popcompile


def tensorrt_deploy(model="smollm2-135m", out="engines/smol-trt", config=popcompile.PopConfig(),
                    precision="bf16", cuda_graph=False, prompt="Write a haiku about compilers.",
                    max_new_tokens=32):
    target = popcompile.TensorRTTarget(popcompile.TrtBuildConfig(precision=precision))
    popcompile.compile(model, config, out=out, target=target, force=True)  # checks the GPU, ONNX, then plans
    session = popcompile.open_session(out, runtime="tensorrt", cuda_graph=cuda_graph)
    result = session.generate(prompt, {"max_new_tokens": max_new_tokens, "greedy": True})[0]
    print(f"{result.prefill} prefill, first token after {result.ttft_s * 1e3:.1f} ms: {result.text!r}")
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped name, .gguf or HF folder")
    parser.add_argument("--out", default="engines/smol-trt",
                        help="engine folder to write (replaced if one is there)")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--cuda-graph", action="store_true", help="replay decode steps as a CUDA graph")
    parser.add_argument("--prompt", default="Write a haiku about compilers.")
    parser.add_argument("--kv-calibration", default="auto",
                        help="auto (default: POP++ on a text model, POP+ on a vision-language model), "
                             "ridge (POP+), distill (POP++), none (the paper's POP) or a file from "
                             "`popcompile calibrate`")
    parser.add_argument("--min-prompt-tokens", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser.add_argument("--max-seq", type=int, help="KV buffer length (default: min(4096, model limit))")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        config = popcompile.PopConfig(kv_calibration=args.kv_calibration,
                                      min_prompt_tokens=args.min_prompt_tokens, max_seq=args.max_seq)
        tensorrt_deploy(args.model, args.out, config, args.precision, args.cuda_graph, args.prompt,
                        args.max_new_tokens)
    except popcompile.PopcompileError as err:  # no GPU / tensorrt: TensorRTUnavailable, before any work
        print(f"tensorrt_deploy: {err}", file=sys.stderr)
        return 3 if isinstance(err, popcompile.EnvironmentUnavailable) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
