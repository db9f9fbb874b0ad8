"""``popcompile export``: capture, POP pass, write an engine folder."""
from __future__ import annotations

import sys
from pathlib import Path

from .common import CliError, add_cut_options, quiet_libraries
from .info import summary


def register(sub) -> None:
    p = sub.add_parser("export", help="capture a model, apply POP and write an engine folder",
                       description="Capture MODEL, derive the POP prefill graph and write both graphs, "
                                   "the manifest and the tokenizer into --out.")
    p.add_argument("model", help="shipped name (smollm2-135m, gemma3-270m), a .gguf file, a HF folder or a "
                                 "HF id already in the local cache")
    p.add_argument("--out", required=True, type=Path, help="engine folder to create (must not exist)")
    add_cut_options(p)
    p.add_argument("--max-seq", type=int, help="maximum tokens per sequence (default: min(4096, model limit))")
    p.add_argument("--kv-calibration", default="none", metavar="{none,auto,FILE}",
                   help="POP+: refit the pruned layers' K/V projections: none (default, the paper's POP), "
                        "auto (fit now on the built-in corpus), or a file from `popcompile calibrate`")
    p.add_argument("--target", choices=["onnx", "tensorrt"], default="onnx",
                   help="engine format (default onnx; tensorrt needs an NVIDIA GPU)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (only once the new one is complete)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON instead of a summary")
    p.set_defaults(handler=cmd_export)


def cmd_export(args) -> None:
    from tqdm import tqdm

    from ..exporters.onnx import export

    if args.target == "tensorrt":
        from ..exporters.tensorrt_compat import require_gpu

        require_gpu()
        raise CliError("building TensorRT engines is not implemented yet: export with --target onnx, "
                       "check it with `popcompile check DIR --target tensorrt`, and run it with --provider tensorrt")
    quiet_libraries()

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
    print(summary(args.out, manifest))
