"""Experiment (issue 17): POP++ against POP and POP+ on held-out continuation, SmolLM2-135M.

Ridge (POP+, calibrate.fit_kv) on ``--ridge-windows`` windows of the built-in calibration corpus
(``CALIBRATION_MODULES``, 560 tokens: a 512-token prompt, then the 48 tokens distillation scores), then
``distill.distill_kv`` from it on ``--windows`` windows of the same corpus, then ``popcompile eval``'s
continuation scoring (prefix 512, continuation 48, evaluation texts disjoint from the corpus) of pop, the
ridge fit and the distilled fit against the full model. One thread: the times compare with the issue's
10-minute goal on 2 cores.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/distill_study.py --cut 20 --ridge-windows 64 --windows 96 \
        --steps 600 --lr 3e-4 --limit 40
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from popcompile.calibrate import default_batches, fit_kv
from popcompile.config import DistillConfig
from popcompile.distill import DEFAULT_SEQ_LEN, distill_kv
from popcompile.models import load_model
from popcompile.reference import Variant
from popcompile.tools.eval import data as eval_data
from popcompile.tools.eval.scoring import continuation_eval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cut", type=int, default=20)
    parser.add_argument("--ridge-windows", type=int, default=64)
    parser.add_argument("--windows", type=int, default=96)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--limit", type=int, default=40, help="evaluation documents at most")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    start = time.perf_counter()
    with torch.no_grad():
        ridge = fit_kv(model, default_batches(tokenizer, seq_len=DEFAULT_SEQ_LEN,
                                              max_tokens=DEFAULT_SEQ_LEN * args.ridge_windows), args.cut)
    ridge_s = time.perf_counter() - start
    windows = torch.cat(default_batches(tokenizer, seq_len=DEFAULT_SEQ_LEN, max_tokens=DEFAULT_SEQ_LEN * args.windows))
    result = distill_kv(model, windows, ridge, DistillConfig(steps=args.steps, lr=args.lr))
    distill_s = time.perf_counter() - start - ridge_s
    docs, _ = eval_data.continuation_documents(tokenizer, 512, 48, args.limit)
    layers = model.config.num_hidden_layers
    variants = {"full": Variant(layers), "pop": Variant(args.cut),
                "pop-kvfit": Variant(args.cut, kv_weights=ridge.weights),
                "pop-distill": Variant(args.cut, kv_weights=result.fit.weights)}
    scores = continuation_eval(model, docs, variants)
    print(json.dumps({"documents": len(docs), "ridge_s": round(ridge_s), "distill_s": round(distill_s),
                      "held_out_kl": [result.initial_kl, result.best_kl], "best_step": result.best_step,
                      "steps_run": result.steps_run,
                      **{name: {k: s[k] for k in ("agreement", "kl_to_full", "nll")} for name, s in scores.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
