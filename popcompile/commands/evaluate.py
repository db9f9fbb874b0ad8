"""``popcompile eval``: POP's quality against the full model and the ablations."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..measure.eval.config import PROMPT_FORMATS, check_output_folder
from .common import (
    add_corpus_options,
    add_cut_options,
    add_model_argument,
    add_provider_option,
    quiet_libraries,
    user_sources,
)


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="compare POP's quality with the full model and the ablations, or score an engine folder",
        description="Score the variants (full, pop, pop-kvfit, pop-distill, pop-no-boundary, pop-no-kv, "
                    "shortgpt, and the seed paper's other baselines wanda (30% unstructured sparsity) and "
                    "slicegpt (25% of the hidden dimension sliced; not Gemma 3)) on the same real "
                    "data: teacher-forced continuation of stdlib/HumanEval sources (or of your own text: "
                    "--text, --jsonl), greedy chat generations, HumanEval pass@1. Given an exported engine "
                    "folder instead of a model, run the engine itself with onnxruntime: full (the decode "
                    "graph on the whole prompt) and pop (its prefill graph at the exported cut); the "
                    "ablations, --cut and --sweep need the model.")
    add_model_argument(p, also=", or an engine folder from `popcompile export`")
    p.add_argument("--tasks", help="comma list of continuation, generation, greedy, humaneval, chat "
                                   "(default: continuation,generation; continuation with --text/--jsonl; "
                                   "none with --sweep; greedy: the first "
                                   "generated token and the matched prefix vs full on 118 held-out prompts, "
                                   "with 95%% intervals; chat: three-turn conversations, POP with the cache "
                                   "carried across turns vs re-prefilled, a model only)")
    p.add_argument("--variants", help="comma list of variants (default: all; full,pop for an engine folder; "
                                      "pop-distill distils the pruned K/V for its cut first: minutes on CPU; "
                                      "wanda and slicegpt calibrate on the built-in corpus first)")
    add_cut_options(p)
    add_corpus_options(p, "score the continuation task (and --sweep)",
                       windows="cut into windows of --prefix-len + --cont-len tokens, each a document; "
                               "alone, continuation is the only default task")
    p.add_argument("--limit", type=int, help="documents / prompts / problems per task (default: all)")
    p.add_argument("--prefix-len", type=int, default=512, help="prefilled tokens per document (default 512)")
    p.add_argument("--cont-len", type=int, default=48, help="scored continuation tokens (default 48)")
    p.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per chat prompt (default 64)")
    p.add_argument("--greedy-tokens", type=int, default=32,
                   help="greedy task: the full model's greedy tokens each variant is scored on (default 32)")
    p.add_argument("--code-tokens", type=int, default=256,
                   help="max tokens per HumanEval completion (default 256)")
    p.add_argument("--code-prompt", choices=PROMPT_FORMATS, default="auto",
                   help="HumanEval prompt: chat (the problem as a request under the chat template, code "
                        "block extracted), raw (the bare prompt to continue), auto (chat when the tokenizer "
                        "has a template)")
    p.add_argument("--batch-size", type=int, help="documents per forward (default: by vocabulary size)")
    p.add_argument("--sweep", action="store_true",
                   help="continuation task at every cut L..ceil(L/2) for pop and "
                        "pop-kvfit (pop-distill too when in --variants: minutes per cut)")
    p.add_argument("--min-agreement", type=float, default=0.95,
                   help="agreement for the sweep's auto cut (0.95)")
    p.add_argument("--allow-code-exec", action="store_true",
                   help="allow the humaneval task to execute model-written code (in a subprocess with a "
                        "timeout)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds per HumanEval test program (default 10)")
    add_provider_option(p, "onnxruntime's device for an engine folder: cpu (default) or cuda")
    p.add_argument("--threads", type=int, help="onnxruntime intra-op threads for an engine folder "
                                               "(default: onnxruntime's, one per core)")
    p.add_argument("--out", required=True, type=Path, help="folder for results.json, quality.png, sweep.png")
    p.add_argument("--force", action="store_true", help="replace results.json and the plots in --out")
    p.add_argument("--json", action="store_true", help="print results.json instead of the tables")
    p.set_defaults(handler=cmd_eval)


def config_from_args(args):
    """The EvalConfig of the parsed flags (validated there: bad values are one-line ConfigErrors); the
    user's --text / --jsonl files are read here (a bad file fails in a second)."""
    from ..measure.eval.config import EvalConfig, parse_tasks

    variants = args.variants and tuple(v.strip() for v in args.variants.split(",") if v.strip())
    sources = user_sources(args)
    return EvalConfig(
        tasks=parse_tasks(args.tasks, args.sweep, own_text=bool(sources)), variants=variants or None,
        cut=args.cut, texts=tuple(sources.items()) if sources else None,
        prune_ratio=args.prune_ratio, limit=args.limit, prefix_len=args.prefix_len, cont_len=args.cont_len,
        gen_tokens=args.gen_tokens, greedy_tokens=args.greedy_tokens, code_tokens=args.code_tokens,
        batch_size=args.batch_size,
        sweep=args.sweep,
        min_agreement=args.min_agreement, allow_code_exec=args.allow_code_exec, timeout=args.timeout,
        code_prompt=args.code_prompt, provider=args.provider, threads=args.threads, force=args.force,
        revision=args.revision)


def cmd_eval(args) -> None:
    config = config_from_args(args)  # before torch is imported: bad options fail in a second
    check_output_folder(args.out, config.force)
    from ..measure.eval.report import report
    from ..measure.eval.run import run_eval

    quiet_libraries()
    results = run_eval(args.model, args.out, config)
    print(json.dumps(results, indent=1) if args.json else report(results))
    if not args.json:
        print(f"\nwrote {args.out / 'results.json'}", file=sys.stderr)

