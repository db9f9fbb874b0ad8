"""``popcompile run``: generate with an engine folder (POP or full)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from . import build_trt
from .common import CliError, read_text

DEFAULT_PROMPT_NOTE = "text to complete; with a chat template it is sent as the user's message"


def register(sub) -> None:
    p = sub.add_parser("run", help="generate text with an engine folder",
                       description="Generate with POP (prefill graph on x_1..x_{N-1}, decode graph from x_N) "
                                   "or, with --full, the decode graph alone.")
    p.add_argument("engine", type=Path, help="engine folder written by `popcompile export`")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help=DEFAULT_PROMPT_NOTE)
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default unless a sampling option is given)")
    p.add_argument("--temperature", type=float, help="sample with this temperature")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample from the smallest set with this total probability")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None, help="apply the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    p.add_argument("--full", action="store_true", help="no pruning: prefill with the decode graph (for comparison)")
    p.add_argument("--provider", default="cpu", help="onnxruntime execution provider: cpu, cuda or tensorrt")
    p.add_argument("--threads", type=int, help="intra-op threads (default: onnxruntime's choice)")
    build_trt.add_runtime_options(p)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the very first call, with the runtime's one-time start-up in it (default: one short "
                        "untimed generation first, so TTFT is what every later call of a server would see)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings)")
    p.set_defaults(handler=cmd_run)


def _sampling(args):
    from ..runtime.generate import SamplingConfig

    sampled = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    if args.greedy and sampled:
        raise CliError("--greedy cannot be combined with --temperature/--top-k/--top-p: choose one")
    return SamplingConfig(
        greedy=not sampled, temperature=args.temperature or 1.0, top_k=args.top_k or 0,
        top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))


def cmd_run(args) -> None:
    prompt = args.prompt if args.prompt is not None else read_text(args.prompt_file, "--prompt-file")
    sampling = _sampling(args)
    session = build_trt.open_session(args)
    mode = "full" if args.full else "pop"
    if args.warmup:  # onnxruntime's first run allocates arenas and sets kernels up: ~0.5 s on CPU, once
        from ..runtime.generate import SamplingConfig

        session.generate([session.encode(prompt, args.chat)[:8]], SamplingConfig(max_new_tokens=2), mode=mode)
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = session.generate(prompt, sampling, mode=mode, chat=args.chat, on_text=stream)[0]
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(f"\n\n[{result.mode}] TTFT {result.ttft_s * 1000:.1f} ms | prefill {result.prefill_tokens_per_s:.0f} tok/s "
          f"({len(result.prompt_token_ids)} tokens) | decode {result.decode_tokens_per_s:.1f} tok/s "
          f"({len(result.token_ids)} tokens, {result.finish_reason})", file=sys.stderr)
