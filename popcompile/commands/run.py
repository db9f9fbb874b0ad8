"""``popcompile run``: generate with an engine folder (POP or full)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..errors import InputError
from . import build_trt
from .common import CliError, add_provider_option, check_range, jsonl_texts, read_text

DEFAULT_PROMPT_NOTE = "text to complete; with a chat template it is sent as the user's message"
#: --prompts: prompts per generate call unless --batch-size says (the runtime's own maximum if lower:
#: a TensorRT folder's max batch)
DEFAULT_BATCH = 4

#: the `run` flags each registered runtime takes (``runtime.RUNTIMES``'s names; ``--runtime`` chooses among
#: them)
RUNTIME_FLAGS = {"onnxruntime": ("provider", "threads"), "tensorrt": ("kv_binding", "cuda_graph")}


def register(sub) -> None:
    p = sub.add_parser("run", help="generate text with an engine folder",
                       description="Generate with POP (the prefill graph on the prompt x_1..x_N returns "
                                   "x_N's logits, then the decode graph per new token; engines exported with "
                                   "--boundary separate prefill x_1..x_{N-1} and run x_N through the decode "
                                   "graph) or, with --full, the decode graph alone. Decoding follows the "
                                   "engine's generation_config.json (greedy unless it sets do_sample: true, "
                                   "with its temperature/top_k/top_p) unless --greedy or a sampling option "
                                   "says otherwise; --json reports the values used.")
    p.add_argument("engine", type=Path, help="engine folder written by `popcompile export`")
    p.add_argument("--prompt", help=DEFAULT_PROMPT_NOTE)
    p.add_argument("--prompt-file", type=Path,
                   help="read the prompt from a file; with --prompt too, the file's "
                        "text comes first and --prompt (an instruction) after it")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="several prompts, generated as batches: one a line (blank lines skipped), or, in a "
                        ".jsonl file, one JSON string or object a line (--prompts-field: its text). One "
                        "result a prompt, in order; --json: one JSON object a line")
    p.add_argument("--prompts-field", metavar="FIELD",
                   help="the text's field in --prompts .jsonl objects (default prompt)")
    p.add_argument("--batch-size", type=int,
                   help=f"with --prompts: prompts per generate call (default {DEFAULT_BATCH}, or the "
                        "engine's max batch if lower: a TensorRT folder's); the KV buffer holds batch x "
                        "max_seq rows, "
                        "and a batch prefills with POP when its shortest prompt reaches min_prompt_tokens")
    p.add_argument("--image", action="append", default=[], type=Path, metavar="PATH",
                   help="an image for a vision-language engine (repeatable): each goes where the prompt "
                        "writes the model's image token, or all before the text")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (default 64); the prompt and these fit the engine's "
                        "max_seq, its context limit (`popcompile info`: the KV layout's length)")
    p.add_argument("--greedy", action="store_true",
                   help="always take the most likely token, whatever generation_config.json says")
    p.add_argument("--temperature", type=float,
                   help="sample with this temperature; 0 = greedy (default: generation_config.json's, "
                        "else 1)")
    p.add_argument("--top-k", type=int,
                   help="sample from the k most likely tokens; 0 = off (default: generation_config.json's, "
                        "else off)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set with this total probability; "
                                               "1 = off (default: generation_config.json's, else off)")
    p.add_argument("--seed", type=int, help="random seed for sampling (default: a new one each run)")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template; without --prompt, hold a conversation: each line of "
                           "stdin is the user's next message, each turn prefills only its new tokens (the "
                           "cache keeps the earlier turns); an empty line or end of input ends it")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    path = p.add_mutually_exclusive_group()
    path.add_argument("--full", action="store_true",
                      help="no pruning: prefill with the decode graph (for comparison)")
    path.add_argument("--compare", action="store_true",
                      help="run the prompt with POP (always pruned) and with the full model; print both "
                           "texts, both TTFTs, the speedup next to its FLOP bound and whether the "
                           "texts agree")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --compare: runs per mode, interleaved; TTFTs are medians (default 1)")
    p.add_argument("--min-prompt-tokens", type=int, metavar="N",
                   help="prompts shorter than N prefill with the full model (default: the engine's, chosen "
                        "at export; 0: POP for every prompt)")
    add_provider_option(p, "onnxruntime's device: cpu (default) or cuda (onnxruntime-gpu); TensorRT is "
                           "--runtime tensorrt")
    p.add_argument("--threads", type=int,
                   help="onnxruntime's intra-op threads (default: onnxruntime's choice)")
    build_trt.add_runtime_options(p)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the very first call, with the runtime's one-time start-up in it (default: one "
                        "short untimed generation first, so TTFT is what every later call of a server "
                        "would see)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings)")
    p.set_defaults(handler=cmd_run)


def open_session(args):
    """The session `run` generates with: the runtime registered as ``--runtime``, given the flags of its that
    the user gave (the session's defaults for the others)."""
    from ..runtime import open_session as open_runtime

    runtime = getattr(args, "runtime", "onnxruntime")
    given = {flag: getattr(args, flag) for flag in RUNTIME_FLAGS.get(runtime, ())}
    return open_runtime(args.engine, runtime, **{flag: value for flag, value in given.items()
                                                  if value is not None})


def _check_runtime_flags(args) -> None:
    """CliError for a flag of a runtime other than --runtime's (it would be ignored)."""
    for runtime, flags in RUNTIME_FLAGS.items():
        stray = [f"--{flag.replace('_', '-')}" for flag in flags
                 if runtime != args.runtime and getattr(args, flag) is not None]
        if stray:
            raise CliError(f"{', '.join(stray)}: --runtime {runtime}'s, not {args.runtime}'s (ignored "
                           f"there): drop {'it' if len(stray) == 1 else 'them'} or give --runtime {runtime}")


def _sampling_options(args):
    """The user's decoding options, checked before the engine loads (ConfigError naming the flag)."""
    from ..runtime.defaults import SamplingOptions

    return SamplingOptions(greedy=True if args.greedy else None, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _describe(choice) -> str:
    """One line for stderr: greedy, or the sampling values; where they came from."""
    if choice.greedy:
        return f"greedy ({choice.sources['greedy']})"
    values = f"temperature {choice.temperature:g}, top-k {choice.top_k}, top-p {choice.top_p:g}"
    return f"sampling: {values} ({choice.sources['greedy']})"


def cmd_run(args) -> None:
    from ..runtime.defaults import resolve_sampling
    from ..runtime.vision import load_image

    prompt = _check_args(args)  # before the engine loads
    images = [load_image(path) for path in args.image]  # a missing or broken file, before the engine loads
    options = _sampling_options(args)
    session = open_session(args)
    if prompt is None:
        _converse(session, options, args)
        return
    if isinstance(prompt, list):
        _run_batches(session, prompt, options, args)
        return
    # a template or tokenizer problem, images for a text engine: here, before any note
    ids = session.encode(prompt, args.chat, images=len(images))
    choice = resolve_sampling(session.tokenizer.generation_config, options,
                              str(args.engine / "generation_config.json"))
    sampling = choice.config(args.max_new_tokens, tuple(args.stop))
    _note_ignored(choice)
    modes = ("full", "pop") if args.compare else ("full",) if args.full else ("pop",)
    # onnxruntime's first run allocates arenas and sets kernels up: ~0.5 s on CPU, once per graph
    if args.warmup:
        _warm_up(session, ids, modes)
    if args.compare:
        _compare(session, ids, sampling, choice, args, images)
        return
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = session.generate([ids], sampling, mode=modes[0], on_text=stream,
                              min_prompt_tokens=args.min_prompt_tokens, images=[images])[0]
    if args.json:
        print(json.dumps({**result.to_dict(), "sampling": choice.to_dict()}))
        return
    print(f"\n\n{_stats(result, choice, session, args)}", file=sys.stderr)


def _stats(result, choice, session, args, where: str = "") -> str:
    """One line for stderr: the path, TTFT, prefill and decode speeds, the decoding."""
    return (f"[{where}{result.mode}, prefill {result.prefill}] TTFT {result.ttft_s * 1000:.1f} ms | prefill "
            f"{result.prefill_tokens_per_s:.0f} tok/s ({len(result.prompt_token_ids)} tokens) | decode "
            f"{result.decode_tokens_per_s:.1f} tok/s "
            f"({len(result.token_ids)} tokens, {result.finish_reason}) | "
            f"{_describe(choice)}{_below_note(result, session, args)}")


def _note_ignored(choice) -> None:
    if choice.ignored:
        print("note: generation_config.json sets "
              f"{', '.join(f'{k}={v!r}' for k, v in choice.ignored.items())}, "
              "which popcompile does not apply", file=sys.stderr)


def _run_batches(session, prompts: list[str], options, args) -> None:
    """`run --prompts`: the prompts in batches of --batch-size through ``session.generate``; one result a
    prompt, in order, printed as each batch ends (--json: one object a line, with its index and prompt)."""
    from ..runtime.defaults import resolve_sampling

    ids = [session.encode(prompt, args.chat) for prompt in prompts]  # every prompt's problem before any work
    choice = resolve_sampling(session.tokenizer.generation_config, options,
                              str(args.engine / "generation_config.json"))
    sampling = choice.config(args.max_new_tokens, tuple(args.stop))
    _note_ignored(choice)
    mode = "full" if args.full else "pop"
    if args.warmup:
        _warm_up(session, ids[0], (mode,))
    size = args.batch_size or min(DEFAULT_BATCH, getattr(session, "max_batch", DEFAULT_BATCH))
    for start in range(0, len(ids), size):
        results = session.generate(ids[start:start + size], sampling, mode=mode,
                                   min_prompt_tokens=args.min_prompt_tokens)
        for index, (prompt, result) in enumerate(zip(prompts[start:start + size], results), start + 1):
            if args.json:
                print(json.dumps({"index": index, "prompt": prompt, **result.to_dict(),
                                  "sampling": choice.to_dict()}), flush=True)
                continue
            head = " ".join(prompt.split())
            print(f"--- {index}/{len(prompts)}: {head[:60]}{'...' if len(head) > 60 else ''}\n"
                  f"{result.text}\n", flush=True)
            print(_stats(result, choice, session, args, f"{index}/{len(prompts)}: "), file=sys.stderr)


def read_prompts(path: Path, field: str) -> list[str]:
    """--prompts: a .jsonl file's texts (a string or an object's ``field`` a line), else one prompt a line;
    blank lines skipped; InputError for a file that holds none."""
    text = read_text(path, "--prompts")
    if path.suffix == ".jsonl":
        try:
            prompts = jsonl_texts(text, field)
        except ValueError as err:
            raise InputError(f"--prompts {path}: {err}") from None
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"--prompts {path} holds no prompt: give one a line")
    return prompts


def _check_args(args) -> str | list[str] | None:
    """The prompt text (file first, then --prompt), the prompts of --prompts, None for a conversation (--chat
    alone); ConfigError/InputError for bad options."""
    check_range("--threads", args.threads, 1)
    _check_runtime_flags(args)
    check_range("--max-new-tokens", args.max_new_tokens, 1)
    check_range("--min-prompt-tokens", args.min_prompt_tokens, 0)
    check_range("--repeat", args.repeat, 1)
    check_range("--batch-size", args.batch_size, 1)
    if args.repeat != 1 and not args.compare:
        raise CliError("--repeat times --compare's runs: use it with --compare")
    if args.prompts is not None:
        single = (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                  ("--image", args.image or None), ("--compare", args.compare or None))
        given = [flag for flag, value in single if value is not None]
        if given:
            one = len(given) == 1
            raise CliError(f"--prompts runs a file of prompts; {', '.join(given)} {'is' if one else 'are'} "
                           f"for one prompt: drop {'it' if one else 'them'} or --prompts")
        if args.prompts_field is not None and args.prompts.suffix != ".jsonl":
            raise CliError(f"--prompts-field names the text in a .jsonl file's objects; {args.prompts} is "
                           "read as one prompt a line: drop --prompts-field, or name the file *.jsonl")
        return read_prompts(args.prompts, args.prompts_field or "prompt")
    for flag, value in (("--batch-size", args.batch_size), ("--prompts-field", args.prompts_field)):
        if value is not None:
            raise CliError(f"{flag} goes with --prompts FILE: add it or drop {flag}")
    if args.image and args.prompt is None and args.prompt_file is None:
        raise CliError("--image goes with a prompt: give --prompt TEXT (a conversation on stdin takes no "
                       "images)")
    if args.prompt is None and args.prompt_file is None:
        if args.chat and not args.compare:
            return None  # a conversation on stdin
        raise CliError("no prompt: give --prompt TEXT, --prompt-file FILE, or both (the file's text, then "
                       "TEXT); or --chat without them for a conversation")
    parts = [read_text(args.prompt_file, "--prompt-file")] if args.prompt_file is not None else []
    return "\n\n".join(parts + ([args.prompt] if args.prompt is not None else []))


def _converse(session, options, args) -> None:
    """`run --chat` without a prompt: each line of stdin is a user turn (session.chat); replies stream to
    stdout, or one JSON object per turn with --json."""
    from ..runtime.defaults import resolve_sampling

    choice = resolve_sampling(session.tokenizer.generation_config, options,
                              str(args.engine / "generation_config.json"))
    sampling, mode = choice.config(args.max_new_tokens, tuple(args.stop)), "full" if args.full else "pop"
    messages, ask = [], sys.stdin.isatty() and not args.json
    while True:
        if ask:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline().rstrip("\n")
        if not line.strip():
            return
        messages.append({"role": "user", "content": line})
        stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
        reply = session.chat(messages, sampling, mode=mode, on_text=stream,
                             min_prompt_tokens=args.min_prompt_tokens)
        messages.append({"role": "assistant", "content": reply.text})
        if args.json:
            print(json.dumps({**reply.to_dict(), "turn": len(messages) // 2}), flush=True)
            continue
        print(f"\n[turn {len(messages) // 2}: "
              f"{len(reply.prompt_token_ids) - reply.cached_tokens} new prompt tokens, "
              f"{reply.cached_tokens} cached | TTFT {reply.ttft_s * 1000:.1f} ms | decode "
              f"{reply.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)


def _warm_up(session, ids: list[int], modes: tuple[str, ...]) -> None:
    from ..runtime.sampling import SamplingConfig

    image = session.images and session.images.section.image_token_id
    text = [token for token in ids if token != image][:8] or ids[:1]  # the text graphs, no image to encode
    for mode in modes:  # min_prompt_tokens=0: the graphs the timed run will use, whatever the threshold
        session.generate([text], SamplingConfig(max_new_tokens=2), mode=mode, min_prompt_tokens=0)


def _compare(session, ids: list[int], sampling, choice, args, images: list) -> None:
    from ..runtime.compare import compare

    result = compare(session, [ids], sampling, repeats=args.repeat, images=[images])
    if args.min_prompt_tokens is not None:  # the threshold a plain run would use with this override
        result = dataclasses.replace(result, min_prompt_tokens=args.min_prompt_tokens)
    if args.json:
        print(json.dumps({**result.to_dict(), "sampling": choice.to_dict()}))
        return
    from .info import quality_line

    for name, run in (("POP", result.pop), ("full", result.full)):
        print(f"--- {name} ({len(run.token_ids)} tokens, {run.finish_reason}) ---\n{run.text.strip()}\n")
    print(result.summary())
    extra = getattr(session.manifest, "extra", None) or {}
    print(quality_line(extra.get("cut_choice")), end="")  # the engine's measured quality, when chosen so


def _below_note(result, session, args) -> str:
    if result.mode != "pop" or result.prefill == "pop":
        return ""
    threshold = session.min_prompt_tokens if args.min_prompt_tokens is None else args.min_prompt_tokens
    return (f" | prompt below min_prompt_tokens={threshold}: prefilled in full, where POP gains little "
            "(--min-prompt-tokens 0 forces POP)")
