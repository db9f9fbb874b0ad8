"""``popcompile analyze``: stage-aware layer importance (virtual gates) and a recommended cut.

Defaults live in ``popcompile.measure.analyze.AnalyzeConfig``: options left out here stay None so that the
one dataclass decides them (the help texts name the same numbers; a test keeps them in step).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import OutputError
from ..fsutil import check_destination
from ..progress import progress_bar
from .common import add_corpus_options, add_model_argument, precheck_model, quiet_libraries, user_sources

CONFIG_OPTIONS = ("samples", "context_len", "gen_len", "batch_size", "budget")


def register(sub) -> None:
    p = sub.add_parser("analyze", help="measure prefill vs decode importance of every layer (virtual gates)",
                       description="Gate every residual branch (attention, MLP) of every layer, separately "
                                   "on the prompt (prefill) and on the generated positions (decode); score "
                                   "each gate by E[(dL/dg)^2] on real text; write a table, analyze.json and "
                                   "analyze.png, and recommend a cut. A vision-language model (Qwen3-VL) is "
                                   "scored on image+text prompts: a synthetic image before each text.")
    add_model_argument(p)
    p.add_argument("--out", required=True, type=Path,
                   help="folder for analyze.json and analyze.png (created)")
    p.add_argument("--samples", type=int, help="sequences to score (default 32)")
    p.add_argument("--context-len", type=int, help="prompt tokens per sequence; POP prefills all but the "
                                                   "last (default 512)")
    p.add_argument("--gen-len", type=int,
                   help="tokens predicted after the prompt: the decode stage (default 32)")
    add_corpus_options(p, "score")
    p.add_argument("--budget", type=float, help="share of the total prefill importance the recommended cut "
                                                "may prune (default 0.01)")
    p.add_argument("--batch-size", type=int,
                   help="sequences per forward-backward; memory grows with it (default 2)")
    p.add_argument("--force", action="store_true", help="overwrite analyze.json/analyze.png in --out")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.set_defaults(handler=cmd_analyze)


def config_from_args(args):
    """The AnalyzeConfig of the options given (the dataclass's defaults for the others)."""
    from ..measure.analyze import AnalyzeConfig

    given = {name: getattr(args, name) for name in CONFIG_OPTIONS if getattr(args, name) is not None}
    return AnalyzeConfig(**given)


def model_folder(loaded) -> str | None:
    """The folder a model was loaded from (a VLM's preprocessor_config.json is there); None if unknown."""
    return getattr(getattr(loaded, "source", None), "path", None)


def cmd_analyze(args) -> None:
    from ..frontend.models import load_model
    from ..measure.analyze import REPORT_JSON, REPORT_PNG, format_table, run_analyze, write_outputs

    config = config_from_args(args)
    if args.out.exists() and not args.out.is_dir():
        raise OutputError(f"--out {args.out} is a file: give a folder")
    taken = [args.out / name for name in (REPORT_JSON, REPORT_PNG) if (args.out / name).exists()]
    if taken and not args.force:
        raise OutputError(f"{taken[0]} exists: choose another --out or pass --force")
    check_destination(args.out / REPORT_JSON)
    precheck_model(args.model)
    sources = user_sources(args)
    quiet_libraries()
    loaded = load_model(args.model, revision=args.revision)
    with progress_bar(desc="analyze", unit="seq") as bar:  # a bar on a terminal, a line per 10% in a log
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done)

        report = run_analyze(loaded.model, loaded.tokenizer, config, sources=sources, name=args.model,
                             folder=model_folder(loaded), progress=progress)
    json_path, png_path = write_outputs(report, args.out)
    if args.json:
        print(report.to_json())
        return
    print(format_table(report))
    print(f"wrote {json_path} and {png_path}")
