"""The quality floor's curve on the shipped models: what POP keeps at every cut, and what the choice costs.

For each model: ``quality.floor.search`` as ``export --cut auto`` runs it (POP+ fitted at every candidate cut
on the built-in corpus, then the 64 held-out floor prompts), timed, with the estimate printed before it;
one row per cut: pruned layers, the FLOP bound of the cut at 256 (the floor prompts' length) and 2048 tokens,
first-token agreement and matched prefix (of 32 greedy tokens) against the full model. With ``--shipped``,
POP++ (the export's default fit) is also fitted at the chosen cut and at the paper's third and both are
measured on the same prompts (``check_shipped``) and on eval's 118 held-out greedy prompts (measure/eval/
prompts.py, the issue's target: first token equal on 95%): the speed the floor gives up against the quality
it keeps.

    python benchmarks/quality_floor.py --models smollm2-135m gemma3-270m --json floor.json
    python benchmarks/quality_floor.py --models smollm2-135m --shipped
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from popcompile.config import KVFitConfig, QualityFloor, resolve_cut
from popcompile.cost import speedup_bound
from popcompile.frontend.models import load_model
from popcompile.kvfit.fit import fit_builtin
from popcompile.measure.eval.prompts import greedy_prompts
from popcompile.quality.floor import check_shipped, estimate_s, measure_cuts, search


def run(model: str, floor: QualityFloor, shipped: bool) -> dict:
    loaded = load_model(model)
    text = loaded.model.config.get_text_config()
    fit = KVFitConfig(method="ridge")
    estimate = estimate_s(loaded.model, floor, fitted=True, seq_len=fit.seq_len)
    print(f"{model}: floor search estimated at {estimate:.0f} s", flush=True)
    started = time.perf_counter()
    with torch.no_grad():
        found = search(loaded.model, loaded.tokenizer, floor, fitted=True, ridge=fit.ridge,
                       bias=fit.fits_bias, seq_len=fit.seq_len)
    seconds = time.perf_counter() - started
    rows = [{**q.to_dict(), "pruned": text.num_hidden_layers - q.cut,
             "bound_256": round(speedup_bound(text, 256, q.cut), 3),
             "bound_2048": round(speedup_bound(text, 2048, q.cut), 3)} for q in found.curve.values()]
    result = {"model": model, "layers": text.num_hidden_layers, "chosen": found.cut,
              "search_s": round(seconds, 1), "estimate_s": round(estimate, 1),
              "min_agreement": floor.min_agreement, "curve": rows,
              "summary": found.summary()}
    print(table(result), flush=True)  # the curve now; the shipped fits take minutes more
    if shipped:
        evaluation = greedy_prompts(loaded.tokenizer)[0]  # eval's 118 held-out prompts (the target)
        third = resolve_cut(text.num_hidden_layers)
        result["pop++"], fits = {}, {}
        for cut in sorted({found.cut, third}):
            if cut >= text.num_hidden_layers:
                continue
            config = replace(KVFitConfig(), method="distill", budget_s=None)
            fits[cut] = fit_builtin(loaded.model, loaded.tokenizer, cut, config).weights
            result["pop++"][cut] = check_shipped(loaded.model, replace(found, cut=cut), fits[cut]).to_dict()
            print(f"POP++ at cut {cut}: floor prompts: {result['pop++'][cut]}", flush=True)
        # one teacher pass over eval's prompts for every cut
        for cut, held_out in measure_cuts(loaded.model, evaluation, fits, floor.continuation).items():
            result["pop++"][cut]["eval_118"] = held_out.to_dict()
    return result


def table(result: dict) -> str:
    lines = [f"{result['model']} ({result['layers']} layers): chosen cut {result['chosen']} "
             f"(floor {result['min_agreement']:.0%}), search {result['search_s']:.0f} s "
             f"(estimated {result['estimate_s']:.0f} s)",
             "| cut | pruned | FLOP bound @256 | @2048 | first token (POP+) | matched prefix /32 |",
             "|---|---|---|---|---|---|"]
    for row in result["curve"]:
        mark = " **chosen**" if row["cut"] == result["chosen"] else ""
        lines.append(f"| {row['cut']}{mark} | {row['pruned']} | {row['bound_256']:.3f} | "
                     f"{row['bound_2048']:.3f} | {row['first_token']:.1%} | {row['matched_prefix']:.1f} |")
    for cut, quality in result.get("pop++", {}).items():
        held = quality["eval_118"]
        lines.append(f"POP++ at cut {cut}: floor prompts: first token {quality['first_token']:.1%}, matched "
                     f"prefix {quality['matched_prefix']:.1f}/32; eval's {held['prompts']} greedy prompts: "
                     f"{held['first_token']:.1%}, {held['matched_prefix']:.1f}/32")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--min-agreement", type=float, default=QualityFloor.min_agreement)
    parser.add_argument("--shipped", action="store_true",
                        help="also fit POP++ at the chosen cut and the paper's third, and measure both")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    floor = QualityFloor(min_agreement=args.min_agreement)
    results = []
    for model in args.models:
        results.append(run(model, floor, args.shipped))
        if args.shipped:
            print(table(results[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
