"""POP in vLLM: export a folder for vLLM, then generate from it with ``vllm.LLM`` (docs/vllm.md).

    .venv-vllm/bin/python samples/vllm_serve.py  # SmolLM2-135M, POP++ (fits first: minutes)
    .venv-vllm/bin/python samples/vllm_serve.py --kv-calibration none     # the paper's POP: seconds to export
    .venv-vllm/bin/python samples/vllm_serve.py --model path/to/hf-folder --out served/x --force

Needs vLLM 0.32.0 (scripts/setup_vllm.sh on CPU; ``pip install "popcompile[vllm]"`` elsewhere). Prints the
greedy continuation of one prompt; the same folder serves over HTTP with ``vllm serve OUT``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import popcompile

PROMPT = ("A compiler turns source code into a program. Its front end parses the text into a tree, "
          "and its back end")


# [readme:vllm]
def serve_with_pop(model, out, prompt, max_new_tokens=32, kv_calibration="auto", force=False):
    from vllm import LLM, SamplingParams

    config = popcompile.PopConfig(kv_calibration=kv_calibration)
    popcompile.compile(model, config, out=out, target="vllm", force=force)  # a Hugging Face folder
    llm = LLM(str(out), dtype="float32")  # the POP class, by popcompile's vLLM plugin; torch.compile'd
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    return llm.generate(prompt, params)[0].outputs[0].text
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped name, .gguf or HF folder")
    parser.add_argument("--out", type=Path, default=Path("served/smollm2-135m"), help="the folder for vLLM")
    parser.add_argument("--force", action="store_true", help="replace --out if popcompile wrote it")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--kv-calibration", default="auto",
                        help="auto (default: POP++ on a text model, POP+ on a vision-language model), "
                             "ridge (POP+), distill (POP++), none (the paper's POP) or a file from "
                             "`popcompile calibrate`")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        text = serve_with_pop(args.model, args.out, args.prompt, args.max_new_tokens, args.kv_calibration,
                              args.force)
    except popcompile.PopcompileError as err:
        print(f"vllm_serve: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.prompt}{text}")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run on import
    sys.exit(main())
