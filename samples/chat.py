"""A short multi-turn chat with an engine folder: the chat template over the whole conversation, text streamed.

    python samples/chat.py engines/smol                   # an engine from `popcompile export` or export_and_run.py
    python samples/chat.py engines/smol --turn "Hi!" --turn "What did I just say?"

Each turn prefills the whole conversation so far (POP when it is long enough: the engine's min_prompt_tokens).
"""
from __future__ import annotations

import argparse
import sys

# [readme:chat]
import popcompile


def chat(folder, turns, max_new_tokens=48):
    session = popcompile.open_session(folder)
    messages = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        print(f"> {text}\n", end="", flush=True)
        ids = session.tokenizer.encode_chat(messages)  # the engine's own chat template, no transformers
        reply = session.generate([ids], {"max_new_tokens": max_new_tokens, "greedy": True},
                                 on_text=lambda piece: print(piece, end="", flush=True))[0]
        print(f"\n[{len(ids)} prompt tokens, {reply.prefill} prefill, {reply.ttft_s:.3f} s to the first token]")
        messages.append({"role": "assistant", "content": reply.text})
    return messages
# [/readme]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", help="engine folder")
    parser.add_argument("--turn", action="append", help="a user message (repeat; default: two built-in turns)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    turns = args.turn or ["Name one use of a compiler.", "Say it again in five words."]
    try:
        chat(args.engine, turns, args.max_new_tokens)
    except popcompile.PopcompileError as err:
        print(f"chat: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
