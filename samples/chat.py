"""A short multi-turn chat with an engine folder: the chat template, the cache kept between turns,
text streamed.

    python samples/chat.py  # engines/smol (export_and_run.py's), compiled first if absent
    python samples/chat.py --out engines/gemma --model gemma3-270m --turn "Hi!" --turn "What did I just say?"

An engine already in ``--out`` is used as it is; otherwise ``--model`` is compiled into it first (add
``--kv-calibration none --min-prompt-tokens 0`` to skip the POP++ fit and the threshold measurement, the slow
part). Each turn prefills only what the cache does not hold of the conversation so far (POP when that
is long enough: the engine's min_prompt_tokens).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# [readme:chat]
import popcompile


def chat(folder, turns, max_new_tokens=48):
    session = popcompile.open_session(folder)
    messages = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        print(f"> {text}\n", end="", flush=True)
        # the engine's template
        reply = session.chat(messages, {"max_new_tokens": max_new_tokens, "greedy": True},
                             on_text=lambda piece: print(piece, end="", flush=True))  # streamed as it decodes
        new = len(reply.prompt_token_ids) - reply.cached_tokens  # earlier turns' rows stay in the cache
        print(f"\n[{new} new prompt tokens, {reply.cached_tokens} cached, {reply.prefill} prefill, "
              f"{reply.ttft_s:.3f} s to the first token]")
        messages.append({"role": "assistant", "content": reply.text})
    return messages
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="engines/smol",
                        help="engine folder (compiled from --model if it holds none)")
    parser.add_argument("--model", default="smollm2-135m", help="shipped name, .gguf or HF folder")
    parser.add_argument("--kv-calibration", default="auto",
                        help="auto (default: POP++ on a text model, POP+ on a vision-language model), "
                             "ridge (POP+), distill (POP++), none (the paper's POP) or a file from "
                             "`popcompile calibrate`")
    parser.add_argument("--min-prompt-tokens", default="auto", type=lambda v: v if v == "auto" else int(v))
    parser.add_argument("--turn", action="append",
                        help="a user message (repeat; default: two built-in turns)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    turns = args.turn or ["Name one use of a compiler.", "Say it again in five words."]
    try:
        if not (Path(args.out) / "popcompile.json").is_file():
            print(f"compiling {args.model} into {args.out}", file=sys.stderr)
            config = popcompile.PopConfig(kv_calibration=args.kv_calibration,
                                          min_prompt_tokens=args.min_prompt_tokens)
            popcompile.compile(args.model, config, out=args.out)
        chat(args.out, turns, args.max_new_tokens)
    except popcompile.PopcompileError as err:
        print(f"chat: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
