"""Experiment (issue 17): POP++ against POP and POP+ on held-out continuation, SmolLM2-135M.

``distill.ridge_then_distill`` (what ``calibrate --method distill`` and ``export --kv-calibration distill``
run) on ``--windows`` windows of the built-in calibration corpus (``CALIBRATION_MODULES``, 560 tokens: a
512-token prompt, then the 48 tokens distillation scores): the ridge fit (POP+, with a bias) and the
distillation's inputs from one full-model pass, then training; then ``popcompile eval``'s continuation
scoring (prefix 512, continuation 48, evaluation texts disjoint from the corpus) of pop, the ridge fit and
the distilled fit against the full model. ``--threads`` 2 is the issue's 10-minute budget on 2 cores.

    .venv/bin/python experiments/distill_study.py --cut 20 --windows 116 --steps 900 --lr 3e-4 --limit 40
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from popcompile.config import DistillConfig
from popcompile.frontend.models import load_model
from popcompile.kvfit.calibrate import default_batches
from popcompile.kvfit.distill import DEFAULT_SEQ_LEN, ridge_then_distill
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval.scoring import continuation_eval
from popcompile.reference import Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cut", type=int, default=20)
    parser.add_argument("--windows", type=int, default=116, help="560-token windows (116: the whole corpus)")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--limit", type=int, default=40, help="evaluation documents at most")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    windows = torch.cat(default_batches(tokenizer, seq_len=DEFAULT_SEQ_LEN,
                                        max_tokens=DEFAULT_SEQ_LEN * args.windows))
    first = {}  # phase -> when its first report came: "train" ends the full-model pass

    def report(event) -> None:
        first.setdefault(event.phase, time.perf_counter())
    start = time.perf_counter()
    result = ridge_then_distill(model, windows, args.cut, DistillConfig(steps=args.steps, lr=args.lr),
                                progress=report)
    total_s, pass_s = time.perf_counter() - start, first["train"] - start
    docs, _ = eval_data.continuation_documents(tokenizer, 512, 48, args.limit)
    layers = model.config.num_hidden_layers
    variants = {"full": Variant(layers), "pop": Variant(args.cut),
                "pop-kvfit": Variant(args.cut, kv_weights=result.init.weights),
                "pop-distill": Variant(args.cut, kv_weights=result.fit.weights)}
    scores = continuation_eval(model, docs, variants)
    print(json.dumps({"documents": len(docs), "one_pass_s": round(pass_s), "total_s": round(total_s),
                      "held_out_kl": [result.initial_kl, result.best_kl], "best_step": result.best_step,
                      "steps_run": result.steps_run,
                      **{name: {k: s[k] for k in ("agreement", "kl_to_full", "nll")}
                         for name, s in scores.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
