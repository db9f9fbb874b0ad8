"""Experiment (issue 17): the POP+ ridge fit with and without a k/v bias, on eval's greedy chat task.

One pass over the built-in calibration corpus (``calibrate.CutMoments``), solved twice (with and without the
ones column), then ``popcompile eval``'s generation task (the chat prompts, greedy, 64 tokens) through the
eager reference for full, pop and both fits; prints exact match and matched prefix per variant.

    .venv/bin/python experiments/bias_study.py --model smollm2-135m --cut 20
"""
from __future__ import annotations

import argparse
import json

import torch

from popcompile.frontend.models import load_model
from popcompile.kvfit.calibrate import CutMoments, default_batches
from popcompile.measure.eval.scoring import reference_generation_task
from popcompile.reference import Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cut", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    moments = CutMoments(model, [args.cut], bias=True)
    with torch.no_grad():
        for ids in default_batches(tokenizer):
            hidden = model.get_decoder()(ids, output_hidden_states=True).hidden_states
            moments.add({l: h.flatten(0, 1) for l, h in enumerate(hidden[:moments.num_layers])}, ids)
    with_bias = moments.fits()[args.cut]
    moments.bias = False  # the same statistics, solved without the ones column
    no_bias = moments.fits()[args.cut]
    layers = model.config.num_hidden_layers
    variants = {"full": Variant(layers), "pop": Variant(args.cut),
                "ridge, no bias": Variant(args.cut, kv_weights=no_bias.weights),
                "ridge, bias": Variant(args.cut, kv_weights=with_bias.weights)}
    result = reference_generation_task(model, tokenizer, variants, None, args.tokens)
    print(json.dumps({name: {k: v for k, v in scores.items() if not isinstance(v, list)}
                      for name, scores in result["variants"].items()}, indent=1))


if __name__ == "__main__":
    main()
