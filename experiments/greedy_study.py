"""Experiment (issue 37): which K/V refit makes greedy generations closest to the full model's?

Fits, for one model at its default cut (1/3 pruned), each variant's K/V weights and scores them all on the
same data:

    pop              the paper's POP (no refit)
    pop-kvfit        POP+, the export default (``--kv-calibration auto``: ridge, no bias)
    pop-kvfit-bias   the same fit with a bias on every k/v projection
    pop-distill-doc  POP++ as it was (KL on the document's next 48 tokens, 116 windows of 560 code tokens,
                     selected by held-out KL): DistillConfig(targets="document", ...)
    pop-distill      POP++ now (the DistillConfig defaults: the full model's own greedy tokens, boundary
                     weighted, code/prose/chat prompts, selected by held-out matched prefix)

Scores: ``eval --tasks greedy`` (first token and matched prefix vs full on 118 held-out prompts, 32
greedy tokens, bootstrap intervals, paired differences vs pop-kvfit) and teacher-forced continuation
agreement (prefix 512, continuation 48, ``--docs`` held-out documents). Calibration seconds are wall-clock
on this machine with ``--threads``; run it with nothing else on the machine for the timing column.

    .venv/bin/python experiments/greedy_study.py --model smollm2-135m --out out/greedy-study-smol.json
    .venv/bin/python experiments/greedy_study.py --model gemma3-270m --skip pop-distill-doc --out ...
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from popcompile.config import DistillConfig, KVFitConfig, resolve_cut
from popcompile.frontend.models import load_model
from popcompile.kvfit.fit import builtin_tokens, fit_on_tokens
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval.greedy import reference_greedy_task
from popcompile.measure.eval.scoring import continuation_eval
from popcompile.reference import Variant

#: POP++ as measured on 2026-12-05 (docs/results.md "POP++ on both models")
DOCUMENT = DistillConfig(targets="document", continuation=48, held_out=0.125, boundary_weight=1.0,
                         vocab_top_k=0, select="kl")
FITS = {
    "pop-kvfit": KVFitConfig(),
    "pop-kvfit-bias": KVFitConfig(bias=True),
    "pop-distill-doc": KVFitConfig(method="distill", distill=DOCUMENT),
    "pop-distill": KVFitConfig(method="distill"),
}


def fit(loaded, cut: int, name: str, overrides: dict) -> tuple[dict, float, dict]:
    """(weights, seconds, the distillation's record) of one variant."""
    config = FITS[name]
    if name == "pop-distill" and overrides:
        config = replace(config, distill=replace(config.distill, **overrides))
    if name == "pop-distill-doc":  # the 2026-12-05 windows: 116 of 512 + 48 code tokens
        tokens = builtin_tokens(loaded.tokenizer, replace(config, distill=replace(DOCUMENT, windows=116)))
    else:
        tokens = builtin_tokens(loaded.tokenizer, config)
    start = time.perf_counter()
    found, result = fit_on_tokens(loaded.model, tokens, cut, config)
    seconds = time.perf_counter() - start
    record = {} if result is None else {
        "best_step": result.best_step, "steps_run": result.steps_run, "windows": int(tokens.shape[0]),
        "held_out_initial": vars(result.initial), "held_out_best": vars(result.best)}
    return found.weights, seconds, record


def markdown(result: dict) -> str:
    """The docs/results.md table of a result."""
    span = lambda s, f: f"{s['mean']:{f}} [{s['ci95'][0]:{f}}, {s['ci95'][1]:{f}}]"
    rows = ["| variant | first token | matched prefix (of 32) | first token vs pop-kvfit | matched prefix vs "
            "pop-kvfit | teacher-forced agreement | KL to full | calibration s |", "|" + "---|" * 8]
    for name, v in result["variants"].items():
        if name == "full":
            continue
        vs = v["vs_pop_kvfit"]
        calibration = v["calibration"]["seconds"] if v["calibration"] else "-"
        rows.append(f"| {name} | {span(v['first_token'], '.3f')} | {span(v['matched_prefix'], '.2f')} | "
                    f"{span(vs['first_token'], '+.3f') if vs else '-'} | "
                    f"{span(vs['matched_prefix'], '+.2f') if vs else '-'} | "
                    f"{v['teacher_forced_agreement']:.3f} | {v['kl_to_full']:.3f} | {calibration} |")
    kinds = ["| variant | " + " | ".join(f"{k}: first / prefix" for k in result["kinds"]) + " |",
             "|" + "---|" * (len(result["kinds"]) + 1)]
    kinds += [f"| {name} | " + " | ".join(f"{b['first_token']:.3f} / {b['matched_prefix']:.2f}"
                                          for b in v["by_kind"].values()) + " |"
              for name, v in result["variants"].items() if name != "full"]
    return "\n".join(rows + [""] + kinds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip", default="", help="comma list of fits to leave out")
    parser.add_argument("--docs", type=int, default=25, help="continuation documents (teacher-forced)")
    parser.add_argument("--limit", type=int, help="greedy prompts (default all 118)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distill", default="{}", help="JSON overrides of DistillConfig for pop-distill")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--render", action="store_true", help="print the tables of an existing --out")
    args = parser.parse_args()
    if args.render:
        print(markdown(json.loads(args.out.read_text())))
        return
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    layers = model.config.get_text_config().num_hidden_layers
    cut = resolve_cut(layers, None, None)
    skip = {s for s in args.skip.split(",") if s}
    variants = {"full": Variant(layers), "pop": Variant(cut)}
    calibration = {}
    for name in FITS:
        if name in skip:
            continue
        weights, seconds, record = fit(loaded, cut, name, json.loads(args.distill))
        variants[name] = Variant(cut, kv_weights=weights)
        calibration[name] = {"seconds": round(seconds, 1), **record}
        print(name, calibration[name], flush=True)
    greedy = reference_greedy_task(model, tok, variants, args.limit, 32)
    docs, _ = eval_data.continuation_documents(tok, 512, 48, args.docs)
    continuation = continuation_eval(model, docs, variants)
    table = {name: {"first_token": g["first_token"], "matched_prefix": g["matched_prefix"],
                    "greedy_agreement": g["agreement"], "by_kind": g["by_kind"],
                    "vs_pop_kvfit": g.get("vs_pop-kvfit"),
                    "teacher_forced_agreement": continuation[name]["agreement"],
                    "kl_to_full": continuation[name]["kl_to_full"], "nll": continuation[name]["nll"],
                    "calibration": calibration.get(name)}
             for name, g in greedy["variants"].items()}
    result = {"model": args.model, "cut": cut, "layers": layers, "prompts": greedy["prompts"],
              "kinds": greedy["kinds"], "documents": len(docs), "threads": args.threads, "variants": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    for name, row in table.items():
        print(f"{name:16s} first {row['first_token']['mean']:.3f} {row['first_token']['ci95']}  prefix "
              f"{row['matched_prefix']['mean']:.2f} {row['matched_prefix']['ci95']}  tf "
              f"{row['teacher_forced_agreement']:.3f}  calibration s "
              f"{row['calibration'] and row['calibration']['seconds']}")


if __name__ == "__main__":
    main()
