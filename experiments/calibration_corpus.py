"""Experiment (issue 9): does POP+ depend on what it is calibrated on?

POP+'s built-in corpus is Python source (26 stdlib modules). At SmolLM2's default cut it lifts
continuation agreement on held-out code, but one chat prompt ("What is the capital of France?")
answered exactly under POP goes wrong under POP+. This fits POP+ on three corpora of the same
token budget and scores each on both evaluation tasks of ``popcompile eval``:

    code    the built-in corpus (calibrate.default_batches)
    prose   Python's own documentation prose (``pydoc_data.topics``, written by the CPython team),
            each topic as an assistant reply under the model's chat template (raw text without one)
    mixed   half of each

    nice -n 10 .venv/bin/python experiments/calibration_corpus.py --out out/calib-corpus   # SmolLM2, cut 20
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from popcompile.kvfit import corpus
from popcompile.kvfit.calibrate import default_batches, ridge_fit, token_batches
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval import scoring
from popcompile.reference import Variant

SEQ_LEN, BATCH, TOKENS = 512, 4, 65536


def prose_documents(tokenizer) -> list[list[int]]:
    """pydoc topics in a fixed order; under the chat template as the answer to a one-line question."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        text = topics[name]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Explain the Python topic '{name}'."},
                 {"role": "assistant", "content": text}], tokenize=False)
            docs.append(corpus.encode(tokenizer, text, add_special_tokens=False))
        else:
            docs.append(corpus.encode(tokenizer, text))
    return docs


def corpora(tokenizer) -> dict[str, list[torch.Tensor]]:
    per_batch = SEQ_LEN * BATCH
    code = default_batches(tokenizer, seq_len=SEQ_LEN, max_tokens=TOKENS, batch=BATCH)
    prose = list(token_batches(prose_documents(tokenizer), SEQ_LEN, BATCH))[: TOKENS // per_batch]
    half = TOKENS // per_batch // 2
    return {"code": code, "prose": prose, "mixed": code[:half] + prose[:half]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped model name (default smollm2-135m)")
    parser.add_argument("--cut", type=int, help="first pruned layer (default: 1/3 pruned)")
    parser.add_argument("--limit", type=int, default=12, help="documents and chat prompts (default 12)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    args = parser.parse_args(argv)
    from popcompile.config import resolve_cut
    from popcompile.frontend.models import load_model

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    layers = len(model.get_decoder().layers)
    cut = resolve_cut(layers, args.cut)
    variants, fits = {"full": Variant(layers), "pop": Variant(cut)}, {}
    for name, batches in corpora(tok).items():
        start = time.perf_counter()
        with torch.no_grad():
            fit = ridge_fit(model, batches, cut)
        fits[name] = {"tokens": fit.info.tokens, "seconds": time.perf_counter() - start}
        variants[f"pop-kvfit-{name}"] = Variant(cut, kv_weights=fit.weights)
        print(f"fitted on {name}: {fits[name]}", file=sys.stderr, flush=True)
    docs, _ = eval_data.continuation_documents(tok, 512, 48, args.limit)
    cont = scoring.continuation_eval(model, docs, variants)
    prompts = [eval_data.chat_prompt_ids(tok, p) for p in eval_data.CHAT_PROMPTS[: args.limit]]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    gen = scoring.generation_eval(model, prompts, variants, 64, tok.eos_token_id, decode)
    rows = [{"variant": n, **{k: cont[n][k] for k in ("nll", "perplexity", "agreement")},
             "exact_match": gen[n]["exact_match"], "matched_prefix": gen[n]["matched_prefix"],
             "texts": gen[n]["texts"]} for n in variants]
    for r in rows:
        print(f"{r['variant']:18s} PPL {r['perplexity']:.3f} agree {r['agreement']:.3f} "
              f"exact {r['exact_match']:.3f} prefix {r['matched_prefix']:.1f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"model": args.model, "cut": cut, "num_layers": layers, "fits": fits, "documents": len(docs),
         "prompts": len(prompts), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
