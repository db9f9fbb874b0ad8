"""``popcompile calibrate``: POP+ closed-form K/V projections for the pruned layers."""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import InputError, OutputError
from ..fsutil import check_destination
from .common import (add_corpus_options, add_cut_options, check_range, precheck_model, quiet_libraries,
                     user_sources)


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit POP+ K/V projections for the pruned layers (closed form)",
                       description="Ridge-fit, for every pruned layer, k/v projections that map input_norm(h_cut) "
                                   "to the K/V the full model makes; write them as safetensors + JSON.")
    p.add_argument("model", help="shipped name, a .gguf file or a HF folder")
    p.add_argument("--out", required=True, type=Path, help="output .safetensors file (the fit's details are in its metadata; "
                                                             "nothing else is written)")
    add_cut_options(p)
    add_corpus_options(p, "calibrate")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--max-tokens", type=int, default=65536, help="calibration tokens at most (default 65536)")
    p.add_argument("--ridge", type=float, default=1e-3, help="regulariser, relative to mean diag(X^T X) (1e-3)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.set_defaults(handler=cmd_calibrate)


def cmd_calibrate(args) -> None:
    check_range("--seq-len", args.seq_len, 1)  # before torch is imported: bad options fail in a second
    check_range("--max-tokens", args.max_tokens, 1)
    check_range("--prune-ratio", args.prune_ratio, 0.0, 1.0, below_high=True)
    check_range("--ridge", args.ridge, 0.0)
    check_output_file(args.out, args.force)
    precheck_model(args.model)
    import torch
    from tqdm import tqdm

    from ..calibrate import default_batches, fit_kv, save_fit, token_batches
    from ..models import load_model
    from ..config import resolve_cut

    sources = user_sources(args)  # before the model loads: a bad file fails in a second
    quiet_libraries()
    loaded = load_model(args.model)
    cut = resolve_cut(loaded.model.config.num_hidden_layers, cut=args.cut, prune_ratio=args.prune_ratio)
    if sources:
        docs = [loaded.tokenizer(text).input_ids for texts in sources.values() for text in texts]
        batches = list(token_batches(docs, args.seq_len, 4))[: max(1, args.max_tokens // (4 * args.seq_len))]
    else:
        batches = default_batches(loaded.tokenizer, seq_len=args.seq_len, max_tokens=args.max_tokens)
    if not batches:
        raise InputError(f"the calibration text has fewer than --seq-len={args.seq_len} tokens: give more text")
    with torch.no_grad(), tqdm(total=sum(b.numel() for b in batches), unit="tok", desc="calibrate",
                               file=sys.stderr, disable=None) as bar:
        fit = fit_kv(loaded.model, batches, cut, ridge=args.ridge, progress=bar.update)
    check_output_file(args.out, args.force)  # again: the file may have appeared during the fit
    save_fit(fit, args.out)
    print(f"{args.out}: K/V projections of layers {cut}..{fit.info.num_layers - 1} fitted on "
          f"{fit.info.tokens} tokens (ridge {fit.info.ridge})")


def check_output_file(out: Path, force: bool) -> None:
    """OutputError unless ``out`` is a new file in a writable folder, or an existing file and ``force``."""
    if out.is_dir():
        raise OutputError(f"--out {out} is a folder: give a file name such as {out / 'kv.safetensors'}")
    if out.exists() and not force:
        raise OutputError(f"--out {out} exists: choose another --out or pass --force")
    check_destination(out)
