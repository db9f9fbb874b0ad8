"""The ``popcompile`` command: export | run | info.

Errors a user can fix exit with code 2 and one line naming the problem and the fix (no traceback).
Heavy imports (torch, transformers) happen inside the commands that need them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PROMPT_NOTE = "text to complete; with a chat template it is sent as the user's message"


class CliError(Exception):
    """A bad invocation: printed as one line, exit code 2."""


def _add_cut_options(parser) -> None:
    cut = parser.add_mutually_exclusive_group()
    cut.add_argument("--cut", type=int, help="first pruned layer (1..L; L prunes nothing)")
    cut.add_argument("--prune-ratio", type=float, help="fraction of layers to prune from the top "
                                                       "(default 1/3: cut = L - floor(L/3))")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="capture a model, apply POP and write an engine folder",
                       description="Capture MODEL, derive the POP prefill graph and write both graphs, "
                                   "the manifest and the tokenizer into --out.")
    p.add_argument("model", help="shipped name (smollm2-135m, gemma3-270m), a .gguf file, a HF folder or a "
                                 "HF id already in the local cache")
    p.add_argument("--out", required=True, type=Path, help="engine folder to create (must not exist)")
    _add_cut_options(p)
    p.add_argument("--max-seq", type=int, help="maximum tokens per sequence (default: min(4096, model limit))")
    p.add_argument("--kv-calibration", default="none", metavar="{none,auto,FILE}",
                   help="POP+: refit the pruned layers' K/V projections: none (default, the paper's POP), "
                        "auto (fit now on the built-in corpus), or a file from `popcompile calibrate`")
    p.add_argument("--target", choices=["onnx", "tensorrt"], default="onnx",
                   help="engine format (default onnx; tensorrt needs an NVIDIA GPU)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (only once the new one is complete)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON instead of a summary")
    p.set_defaults(handler=cmd_export)


def _add_run(sub) -> None:
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
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings)")
    p.set_defaults(handler=cmd_run)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="describe an engine folder")
    p.add_argument("engine", type=Path, help="engine folder")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=cmd_info)


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="fit POP+ K/V projections for the pruned layers (closed form)",
                       description="Ridge-fit, for every pruned layer, k/v projections that map input_norm(h_cut) "
                                   "to the K/V the full model makes; write them as safetensors + JSON.")
    p.add_argument("model", help="shipped name, a .gguf file or a HF folder")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors file (a .json is written beside it)")
    _add_cut_options(p)
    p.add_argument("--text", type=Path, action="append", default=[],
                   help="calibrate on this text file instead of the built-in corpus (repeatable)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--max-tokens", type=int, default=65536, help="calibration tokens at most (default 65536)")
    p.add_argument("--ridge", type=float, default=1e-3, help="regulariser, relative to mean diag(X^T X) (1e-3)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.set_defaults(handler=cmd_calibrate)


def cmd_calibrate(args) -> None:
    import torch
    from tqdm import tqdm

    from .calibrate import default_batches, fit_kv, save_fit, token_batches
    from .models import load_model
    from .passes.pop import resolve_cut

    if args.out.exists() and not args.force:
        raise CliError(f"{args.out} exists: choose another --out or pass --force")
    _quiet_libraries()
    loaded = load_model(args.model)
    cut = resolve_cut(loaded.model.config.num_hidden_layers, cut=args.cut, prune_ratio=args.prune_ratio)
    if args.text:
        docs = [loaded.tokenizer(_read(path)).input_ids for path in args.text]
        batches = list(token_batches(docs, args.seq_len, 4))[: max(1, args.max_tokens // (4 * args.seq_len))]
    else:
        batches = default_batches(loaded.tokenizer, seq_len=args.seq_len, max_tokens=args.max_tokens)
    if not batches:
        raise CliError(f"the calibration text has fewer than --seq-len={args.seq_len} tokens: give more text")
    with torch.no_grad(), tqdm(total=sum(b.numel() for b in batches), unit="tok", desc="calibrate",
                               file=sys.stderr, disable=None) as bar:
        fit = fit_kv(loaded.model, batches, cut, ridge=args.ridge, progress=bar.update)
    save_fit(fit, args.out)
    print(f"{args.out}: K/V projections of layers {cut}..{fit.info.num_layers - 1} fitted on "
          f"{fit.info.tokens} tokens (ridge {fit.info.ridge})")


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="check an engine folder's graphs against a deployment target",
                       description="Check every op, dtype, opset and dynamic dimension of both graphs against "
                                   "what the target's ONNX parser supports (no GPU needed).")
    p.add_argument("engine", type=Path, help="engine folder")
    p.add_argument("--target", choices=["tensorrt"], default="tensorrt", help="deployment target (tensorrt)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(handler=cmd_check)


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval", help="compare POP's quality with the full model and the ablations",
        description="Score the variants (full, pop, pop-no-boundary, pop-no-kv, shortgpt) on the same real data: teacher-forced "
                    "continuation of stdlib/HumanEval sources, greedy chat generations, HumanEval pass@1.")
    p.add_argument("model", help="shipped name (smollm2-135m, gemma3-270m), a .gguf file or a HF folder")
    p.add_argument("--tasks", help="comma list of continuation, generation, humaneval (default: continuation,generation; "
                                   "none with --sweep)")
    p.add_argument("--variants", help="comma list of variants (default: all)")
    _add_cut_options(p)
    p.add_argument("--limit", type=int, help="documents / prompts / problems per task (default: all)")
    p.add_argument("--prefix-len", type=int, default=512, help="prefilled tokens per document (default 512)")
    p.add_argument("--cont-len", type=int, default=48, help="scored continuation tokens (default 48)")
    p.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per chat prompt (default 64)")
    p.add_argument("--code-tokens", type=int, default=256, help="max tokens per HumanEval completion (default 256)")
    p.add_argument("--batch-size", type=int, help="documents per forward (default: by vocabulary size)")
    p.add_argument("--sweep", action="store_true", help="continuation task for pop at every cut L..ceil(L/2)")
    p.add_argument("--min-agreement", type=float, default=0.95, help="agreement for the sweep's auto cut (0.95)")
    p.add_argument("--allow-code-exec", action="store_true",
                   help="allow the humaneval task to execute model-written code (in a subprocess with a timeout)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HumanEval test program (default 10)")
    p.add_argument("--out", required=True, type=Path, help="folder for results.json, quality.png, sweep.png")
    p.add_argument("--json", action="store_true", help="print results.json instead of the tables")
    p.set_defaults(handler=cmd_eval)


def cmd_eval(args) -> None:
    from .evaluate import parse_tasks, report, run_eval

    _quiet_libraries()
    results = run_eval(
        args.model, args.out, tasks=parse_tasks(args.tasks, args.sweep),
        variant_names=args.variants and [v.strip() for v in args.variants.split(",") if v.strip()], cut=args.cut,
        prune_ratio=args.prune_ratio, limit=args.limit, prefix_len=args.prefix_len, cont_len=args.cont_len,
        gen_tokens=args.gen_tokens, code_tokens=args.code_tokens, batch_size=args.batch_size,
        do_sweep=args.sweep, min_agreement=args.min_agreement, allow_code_exec=args.allow_code_exec,
        timeout=args.timeout)
    print(json.dumps(results, indent=1) if args.json else report(results))
    if not args.json:
        print(f"\nwrote {args.out / 'results.json'}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popcompile", description=(
        "Prefill-Only Pruning compiler: export a decoder LLM as a pruned prefill graph and its untouched "
        "decode graph sharing one KV layout, and run them."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_export, _add_run, _add_info, _add_check, _add_eval, _add_calibrate):
        add(sub)
    return parser


def _quiet_libraries() -> None:
    """The CLI shows its own progress: silence the libraries' bars and notices (not their errors)."""
    import logging
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices from torch/transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)


def cmd_export(args) -> None:
    from tqdm import tqdm

    from .exporters.onnx import export

    if args.target == "tensorrt":
        from .exporters.tensorrt_compat import require_gpu

        require_gpu()
        raise CliError("building TensorRT engines is not implemented yet: export with --target onnx, "
                       "check it with `popcompile check DIR --target tensorrt`, and run it with --provider tensorrt")
    _quiet_libraries()

    steps = ["load", "capture + POP pass", "export decode graph", "export prefill graph", "write engine folder"]
    with tqdm(total=len(steps), desc="export", unit="step", file=sys.stderr, disable=None) as bar:
        def progress(name: str) -> None:
            if bar.n or name != steps[0]:
                bar.update(1)
            bar.set_description(name)

        manifest = export(args.model, args.out, cut=args.cut, prune_ratio=args.prune_ratio,
                          max_seq=args.max_seq, force=args.force, kv_calibration=args.kv_calibration,
                          progress=progress)
        bar.update(bar.total - bar.n)
    if args.json:
        print(manifest.to_json())
        return
    print(_summary(args.out, manifest))


def _summary(folder: Path, manifest) -> str:
    size = sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
    layout = manifest.kv_layout
    return (f"{folder}: {manifest.model['name']} ({manifest.model['model_type']}), {manifest.num_layers} layers, "
            f"cut {manifest.cut} (layers {manifest.cut}..{manifest.num_layers - 1} pruned in prefill)\n"
            f"KV layout: {layout.num_layers} x [batch, {layout.num_kv_heads}, {layout.max_seq}, {layout.head_dim}] "
            f"{layout.dtype}; folder {size / 2**20:.1f} MiB (weights shared by both graphs)")


def _sampling(args):
    from .runtime.generate import SamplingConfig

    sampled = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    if args.greedy and sampled:
        raise CliError("--greedy cannot be combined with --temperature/--top-k/--top-p: choose one")
    return SamplingConfig(
        greedy=not sampled, temperature=args.temperature or 1.0, top_k=args.top_k or 0,
        top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))


def cmd_run(args) -> None:
    from .runtime.ort import PopSession

    prompt = args.prompt if args.prompt is not None else _read(args.prompt_file)
    sampling = _sampling(args)
    session = PopSession(args.engine, provider=args.provider, threads=args.threads)
    stream = None if args.json else (lambda piece: print(piece, end="", flush=True))
    result = session.generate(prompt, sampling, mode="full" if args.full else "pop", chat=args.chat,
                              on_text=stream)[0]
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(f"\n\n[{result.mode}] TTFT {result.ttft_s * 1000:.1f} ms | prefill {result.prefill_tokens_per_s:.0f} tok/s "
          f"({len(result.prompt_token_ids)} tokens) | decode {result.decode_tokens_per_s:.1f} tok/s "
          f"({len(result.token_ids)} tokens, {result.finish_reason})", file=sys.stderr)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise CliError(f"cannot read --prompt-file {path}: {err.strerror}") from None


def cmd_info(args) -> None:
    from .exporters.manifest import EngineManifest

    manifest = EngineManifest.read(args.engine)
    print(manifest.to_json() if args.json else _summary(args.engine, manifest))


def cmd_check(args) -> None:
    from dataclasses import asdict

    from .exporters.tensorrt_compat import check_engine, format_table

    report = check_engine(args.engine)
    if args.json:
        print(json.dumps({"ok": report.ok, "tensorrt_version": report.tensorrt_version,
                          "findings": [asdict(f) for f in (*report.failures, *report.warnings)]}))
    else:
        print(format_table(report))
    if not report.ok:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (CliError, ValueError, FileNotFoundError) as err:  # EngineError is a ValueError
        print(f"popcompile {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
