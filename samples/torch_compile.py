"""POP inside PyTorch, no export: ``model.compile(backend="pop")`` prunes the prefill, the decode stays
untouched.

    python samples/torch_compile.py                # SmolLM2-135M, inductor (a few minutes to compile on CPU)
    python samples/torch_compile.py --inner eager  # no kernel compilation: seconds
    python samples/torch_compile.py --model path/to/hf-folder --min-prompt-tokens 0

Prints the eager (full model) and POP greedy continuations of one prompt and how many leading tokens agree.
"""
from __future__ import annotations

import argparse
import sys

import popcompile

PROMPT = ("A compiler turns source code into a program. Its front end parses the text into a tree and "
          "checks the types of every expression; its middle end rewrites that tree into a simpler form and "
          "removes the work a program never needs; its back end chooses instructions for the target machine. "
          "Between the front end and the")


# [readme:torch_compile]
def generate_with_pop(model, input_ids, max_new_tokens=32, options=None):
    options = options or {"prune_ratio": 1 / 3, "inner": "inductor"}  # prompts >= 64 tokens prefill with POP
    model.compile(backend="pop", dynamic=True, options=options)
    return model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                          cache_implementation="static")  # pruned prefill, untouched decode
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped name, .gguf or HF folder")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--inner", default="inductor",
                        help="the backend the rewritten graphs run on (eager: fast)")
    parser.add_argument("--min-prompt-tokens", type=int, default=64, help="shorter prompts prefill in full")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        loaded = popcompile.load_model(args.model)
    except popcompile.PopcompileError as err:
        print(f"torch_compile: {err}", file=sys.stderr)
        return 2
    ids = loaded.tokenizer(args.prompt, return_tensors="pt").input_ids
    full = loaded.model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 cache_implementation="static")[0, ids.shape[1]:].tolist()
    options = {"prune_ratio": 1 / 3, "inner": args.inner, "min_prompt_tokens": args.min_prompt_tokens}
    pop = generate_with_pop(loaded.model, ids, args.max_new_tokens, options)[0, ids.shape[1]:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(full, pop)) if a != b), min(len(full), len(pop)))
    print(f"prompt: {ids.shape[1]} tokens")
    print(f"full: {full}\n      {loaded.tokenizer.decode(full)!r}")
    print(f"pop:  {pop}\n      {loaded.tokenizer.decode(pop)!r}")
    print(f"the first {agree} of {len(full)} tokens agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
