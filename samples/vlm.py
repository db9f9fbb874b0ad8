"""POP for a vision-language model (Qwen3-VL): compile it, then ask about an image with POP's prefill next to
the full model's.

    python samples/vlm.py --model path/to/Qwen3-VL-2B-Instruct --image photo.jpg
    python samples/vlm.py --out engines/qwen3-vl --image a.png --image b.png --question "Compare them."

An engine already in ``--out`` is used as it is. The README's snippet is the region between the ``readme``
markers (tests/test_samples.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import popcompile


# [readme:vlm]
def ask_about_images(engine="engines/qwen3-vl", images=("photo.jpg",), question="What is in this picture?",
                     max_new_tokens=32):
    session = popcompile.open_session(engine)  # vision.onnx, prefill.onnx, decode.onnx
    for mode in ("pop", "full"):  # the images' tokens are pruned like any prompt token
        result = session.generate(question, {"max_new_tokens": max_new_tokens, "greedy": True},
                                  images=list(images), mode=mode)[0]  # paths or PIL images
        print(f"{mode}: {len(result.prompt_token_ids)} prompt tokens, first token after "
              f"{result.ttft_s:.3f} s ({result.image_s:.3f} s in the vision tower): {result.text!r}")
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Qwen3-VL Hugging Face folder (compiled into --out unless it holds "
                                        "an engine)")
    parser.add_argument("--out", default="engines/qwen3-vl", help="engine folder")
    parser.add_argument("--image", action="append", required=True, help="an image file (repeatable)")
    parser.add_argument("--question", default="What is in this picture?")
    parser.add_argument("--kv-calibration", default="auto",
                        help="auto (default: POP+ on a vision-language model), ridge (POP+), "
                             "none (the paper's POP) or a file from `popcompile calibrate`")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        if not (Path(args.out) / "popcompile.json").is_file():
            if args.model is None:
                raise popcompile.ConfigError(f"{args.out} holds no engine: give --model to compile one")
            print(f"compiling {args.model} into {args.out}", file=sys.stderr)
            popcompile.compile(args.model, popcompile.PopConfig(kv_calibration=args.kv_calibration,
                                                                min_prompt_tokens=0), out=args.out)
        ask_about_images(args.out, args.image, args.question, args.max_new_tokens)
    except popcompile.PopcompileError as err:
        print(f"vlm: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
