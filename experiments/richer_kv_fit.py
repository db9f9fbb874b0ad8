"""Experiment (issue 9): can a richer but still cheap correction than POP+ reach 0.95 top-1 agreement?

POP+ (calibrate.py) refits each pruned layer's K/V projections from ``x_l = input_norm_l(h_cut)`` alone.
Here every pruned layer ``l > cut`` predicts its K/V (before k_norm and RoPE) by ridge regression from
richer features, all available in the pruned prefill graph:

    x       s_l * n(h_cut)                   POP+'s input (n = weightless RMS norm, s_l the layer's scale)
    prev    s_l * n(h_cut) of the previous token (zeros at position 0)        token mixing, O(d)
    mean    s_l * causal mean over positions <= t of n(h_cut)                 token mixing, O(d)
    two     s_l * n(h_{cut-1})               the hidden state one layer earlier ("two hidden states")
    early   s_l * n(h_{cut/2})               the hidden state at an earlier cut
    rf      gelu(n(h_cut) P), P fixed Gaussian [d, r] / sqrt(d)               a non-linear term, rank r
    +pcaR   the non-x blocks compressed to R dimensions shared by all layers (principal directions of
            their part not explained by x): the per-layer cost becomes R * 2 * kv_width

One pass over the calibration corpus accumulates the moments of the superset of all blocks
(float64, ``F^T F`` and ``F^T Y_l`` for every pruned layer); each feature set's fit is a sub-block
of them, so all sets are fitted and then scored on the same evaluation data as ``popcompile eval``
(continuation: 12 documents, prefix 512, continuation 48; agreement = top-1 equal to the full model's).
The FLOP cost of each set is its extra multiply-adds per prefilled token, set against the POP bound.

    nice -n 10 .venv/bin/python experiments/richer_kv_fit.py --out out/richer-kv   # SmolLM2, cut 20/30
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from popcompile import reference
from popcompile.cost import prefill_flops, speedup_bound
from popcompile.kvfit.calibrate import default_batches, norm_eps, norm_scale, rms_unit
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval import scoring
from popcompile.reference import Variant

LINEAR_BLOCKS = ("x", "prev", "mean", "two", "early")  # scaled by s_l like x
RIDGE = 1e-3


@dataclass(frozen=True)
class FeatureSet:
    """Blocks of the regression input (always starts with ``x``) and an optional shared compression."""

    name: str
    blocks: tuple[str, ...]
    pca_rank: int | None = None

    def __post_init__(self) -> None:
        if not self.blocks or self.blocks[0] != "x":
            raise ValueError(f"{self.name}: the blocks must start with 'x', got {self.blocks}")
        if self.pca_rank is not None and (self.pca_rank < 1 or len(self.blocks) < 2):
            raise ValueError(f"{self.name}: pca_rank needs a positive rank and blocks beyond 'x'")


FEATURE_SETS = (
    FeatureSet("pop+ (x)", ("x",)),
    FeatureSet("x+prev", ("x", "prev")),
    FeatureSet("x+mean", ("x", "mean")),
    FeatureSet("x+prev+mean", ("x", "prev", "mean")),
    FeatureSet("x+two (h_cut-1)", ("x", "two")),
    FeatureSet("x+early (h_cut/2)", ("x", "early")),
    FeatureSet("x+rf", ("x", "rf")),
    FeatureSet("x+prev+mean+two+early+rf", ("x", "prev", "mean", "two", "early", "rf")),
    FeatureSet("x+prev+mean, pca64", ("x", "prev", "mean"), 64),
    FeatureSet("all, pca128", ("x", "prev", "mean", "two", "early", "rf"), 128),
)


# --- features ------------------------------------------------------------------------------------

def unit_blocks(hidden: dict[str, torch.Tensor], eps: float,
                projection: torch.Tensor) -> dict[str, torch.Tensor]:
    """Unscaled blocks [B, T, w] (float64) from the hidden states ``cut``, ``two``, ``early`` [B, T, d]."""
    n = rms_unit(hidden["cut"], eps)
    prev = torch.cat([torch.zeros_like(n[:, :1]), n[:, :-1]], dim=1)
    count = torch.arange(1, n.shape[1] + 1, dtype=torch.float64)[None, :, None]
    return {"x": n, "prev": prev, "mean": n.cumsum(1) / count,
            "two": rms_unit(hidden["two"], eps), "early": rms_unit(hidden["early"], eps),
            "rf": torch.nn.functional.gelu(n @ projection)}


def superset(blocks: dict[str, torch.Tensor]) -> torch.Tensor:
    """[tokens, W] : every block in BLOCK_ORDER, then a ones column."""
    flat = [blocks[name].flatten(0, 1) for name in BLOCK_ORDER]
    return torch.cat(flat + [torch.ones(flat[0].shape[0], 1, dtype=torch.float64)], dim=1)


BLOCK_ORDER = ("x", "prev", "mean", "two", "early", "rf")


def block_slices(width: int, rank: int) -> dict[str, slice]:
    sizes = {name: (rank if name == "rf" else width) for name in BLOCK_ORDER}
    out, start = {}, 0
    for name in BLOCK_ORDER:
        out[name] = slice(start, start + sizes[name])
        start += sizes[name]
    out["one"] = slice(start, start + 1)
    return out


# --- moments and fits ------------------------------------------------------------------------------

class Moments:
    """G = F^T F of the superset and F^T Y_l per pruned layer (float64)."""

    def __init__(self, total: int, layers: list[int], out: int):
        self.g = torch.zeros(total, total, dtype=torch.float64)
        self.fy = {l: torch.zeros(total, out, dtype=torch.float64) for l in layers}
        self.tokens = 0

    def add(self, f: torch.Tensor, targets: dict[int, torch.Tensor]) -> None:
        self.g += f.T @ f
        for l, y in targets.items():
            self.fy[l] += f.T @ y
        self.tokens += f.shape[0]


def _indices(slices: dict[str, slice], names) -> torch.Tensor:
    return torch.cat([torch.arange(slices[n].start, slices[n].stop) for n in names])


def compression(m: Moments, slices: dict[str, slice], fs: FeatureSet) -> torch.Tensor:
    """V [w_extra, R]: top principal directions of the extra blocks' part not explained by [x, 1]."""
    a = _indices(slices, ("x", "one"))
    e = _indices(slices, fs.blocks[1:])
    g_aa, g_ae, g_ee = m.g[a][:, a], m.g[a][:, e], m.g[e][:, e]
    residual = g_ee - g_ae.T @ torch.linalg.solve(g_aa + 1e-9 * torch.eye(len(a), dtype=torch.float64), g_ae)
    _, vectors = torch.linalg.eigh(residual)
    return vectors[:, -fs.pca_rank:]


@dataclass(frozen=True)
class Fit:
    """C = D0^T G D0 and E_l = D0^T F^T Y_l of one feature set (D0: selection and compression, no layer
    scale); the layer scale enters as X_l = F D0 diag(c_l): X^T X = c C c, X^T Y = c E_l."""

    c: torch.Tensor
    e: dict[int, torch.Tensor]
    scaled: torch.Tensor  # [w + 1] bool: columns that take s_l
    v: torch.Tensor | None


def prepare(m: Moments, slices: dict[str, slice], fs: FeatureSet) -> Fit:
    if fs.pca_rank is None:
        idx = _indices(slices, (*fs.blocks, "one"))
        scaled = torch.cat([torch.full((slices[n].stop - slices[n].start,), n in LINEAR_BLOCKS)
                            for n in fs.blocks]
                           + [torch.tensor([False])])
        return Fit(m.g[idx][:, idx], {l: y[idx] for l, y in m.fy.items()}, scaled, None)
    v = compression(m, slices, fs)
    a, e, o = (_indices(slices, names) for names in (("x",), fs.blocks[1:], ("one",)))
    idx = torch.cat([a, e, o])
    d0 = torch.block_diag(torch.eye(len(a), dtype=torch.float64), v, torch.ones(1, 1, dtype=torch.float64))
    g = m.g[idx][:, idx]
    scaled = torch.cat([torch.ones(len(a), dtype=torch.bool), torch.zeros(v.shape[1] + 1, dtype=torch.bool)])
    return Fit(d0.T @ g @ d0, {l: d0.T @ y[idx] for l, y in m.fy.items()}, scaled, v)


def solve(fit: Fit, layer: int, scale: torch.Tensor) -> torch.Tensor:
    """Ridge weights [w + 1, out] (last row: bias, unregularised), lam = RIDGE * mean diag
    (as calibrate.py)."""
    c = torch.ones(fit.c.shape[0], dtype=torch.float64)
    width = int(fit.scaled.sum())
    c[fit.scaled] = scale.repeat(width // scale.shape[0])
    xtx = c[:, None] * fit.c * c[None, :]
    xty = c[:, None] * fit.e[layer]
    eye = torch.eye(xtx.shape[0], dtype=torch.float64)
    eye[-1, -1] = 0.0
    return torch.linalg.solve(xtx + RIDGE * xtx.diagonal().mean() * eye, xty)


# --- calibration pass --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    cut: int
    early: int
    deep: tuple[int, ...]
    eps: float
    scales: tuple[torch.Tensor, ...]  # per layer, float64 [d]
    projection: torch.Tensor          # rf's P [d, r]
    split: int                         # K columns, then V


def make_setup(model, cut: int, rank: int) -> Setup:
    layers = reference.decoder_layers(model)
    width = model.config.hidden_size
    torch.manual_seed(0)
    projection = torch.randn(width, rank, dtype=torch.float64) / math.sqrt(width)
    return Setup(cut, cut // 2, tuple(range(cut + 1, len(layers))), norm_eps(layers[0].input_layernorm),
                 tuple(norm_scale(layer.input_layernorm, width) for layer in layers), projection,
                 layers[-1].self_attn.k_proj.out_features)


@torch.no_grad()
def calibrate(model, batches, setup: Setup) -> Moments:
    layers = reference.decoder_layers(model)
    out = setup.split + layers[-1].self_attn.v_proj.out_features
    slices = block_slices(model.config.hidden_size, setup.projection.shape[1])
    m = Moments(slices["one"].stop, list(setup.deep), out)
    for i, ids in enumerate(batches):
        hidden = model.get_decoder()(ids, output_hidden_states=True).hidden_states  # [l]: input of layer l
        picked = {"cut": hidden[setup.cut], "two": hidden[setup.cut - 1], "early": hidden[setup.early]}
        f = superset(unit_blocks(picked, setup.eps, setup.projection))
        targets = {}
        for l in setup.deep:
            attn = layers[l].self_attn
            x_true = layers[l].input_layernorm(hidden[l])
            targets[l] = torch.cat([attn.k_proj(x_true), attn.v_proj(x_true)], dim=-1).flatten(0, 1).double()
        m.add(f, targets)
        print(f"calibration batch {i + 1}/{len(batches)}", file=sys.stderr, flush=True)
    return m


# --- scoring --------------------------------------------------------------------------------------

class FeatureRun(reference.PopRun):
    """POP's stages; in the pruned stage every deep k/v projection computes F_l W_l instead."""

    def __init__(self, model, variant, prompt_len, setup: Setup, fs: FeatureSet, weights: dict, v):
        super().__init__(model, variant, prompt_len)
        self.setup, self.fs, self.weights, self.v = setup, fs, weights, v

    def stage(self, pruned: bool):
        stack = super().stage(pruned)
        if pruned:
            stack.enter_context(feature_hooks(self.model, self.setup, self.fs, self.weights, self.v))
        return stack


def features_for(blocks: dict, setup: Setup, fs: FeatureSet, layer: int, v) -> torch.Tensor:
    scale = setup.scales[layer]
    scaled = lambda name: blocks[name] * (scale if name in LINEAR_BLOCKS else 1.0)
    parts = [scaled(n) for n in fs.blocks] if v is None else [
        scaled("x"), torch.cat([blocks[n] for n in fs.blocks[1:]], dim=-1) @ v]
    x = torch.cat(parts, dim=-1)
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=torch.float64)], dim=-1)


def feature_hooks(model, setup: Setup, fs: FeatureSet, weights: dict, v):
    import contextlib

    layers = reference.decoder_layers(model)
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def capture(key):
        def hook(module, args, kwargs):
            captured[key] = args[0] if args else kwargs["hidden_states"]
            if key == "cut":  # layers early < cut-1 < cut run in order: every state is here now
                captured["blocks"] = unit_blocks(captured, setup.eps, setup.projection)
        return hook

    for key, index in (("early", setup.early), ("two", setup.cut - 1), ("cut", setup.cut)):
        handles.append(layers[index].register_forward_pre_hook(capture(key), with_kwargs=True))
    for l in setup.deep:
        for part, cols in (("k_proj", slice(0, setup.split)), ("v_proj", slice(setup.split, None))):
            def replace(module, args, output, l=l, cols=cols):
                return (features_for(captured["blocks"], setup, fs, l, v)
                        @ weights[l][:, cols]).to(output.dtype)
            handles.append(getattr(layers[l].self_attn, part).register_forward_hook(replace))
    stack = contextlib.ExitStack()
    stack.callback(lambda: [h.remove() for h in handles])
    return stack


def batches_of(docs, size: int = 4):
    for start in range(0, len(docs), size):
        batch = docs[start:start + size]
        yield torch.tensor([d.prefix for d in batch]), torch.tensor([d.continuation for d in batch])


@torch.no_grad()
def full_argmax(model, docs) -> list[torch.Tensor]:
    full = Variant(len(reference.decoder_layers(model)))
    return [scoring.continuation_logits(model, p, t, full).argmax(-1) for p, t in batches_of(docs)]


@torch.no_grad()
def score(model, docs, full: list[torch.Tensor], make_run) -> dict:
    """Continuation NLL / agreement of ``make_run(prefix_len)`` against the full model's argmax ``full``."""
    nll, agree = [], []
    for (prefix, target), full_top in zip(batches_of(docs), full):
        run = make_run(prefix.shape[1])
        with scoring.last_logits_only(model):
            first = run.prefill(prefix)[:, None]
        logits = torch.cat([first, run.step(target[:, :-1], prefix.shape[1])], dim=1)
        logp = torch.log_softmax(logits.float(), -1)
        nll.append(-logp.gather(-1, target[..., None])[..., 0])
        agree.append(logits.argmax(-1) == full_top)
    mean_nll = float(torch.cat(nll).mean())
    return {"nll": mean_nll, "perplexity": math.exp(mean_nll),
            "agreement": float(torch.cat(agree).float().mean())}


# --- cost -------------------------------------------------------------------------------------------

def extra_flops_per_token(fs: FeatureSet, width: int, rank: int, out: int, deep: int) -> int:
    """Multiply-adds (x2) per prefilled token beyond POP's own k/v projections (bias adds ignored)."""
    sizes = {n: (rank if n == "rf" else width) for n in BLOCK_ORDER}
    shared = 2 * width * rank if "rf" in fs.blocks else 0  # n(h_cut) P, once per token
    extra = sum(sizes[n] for n in fs.blocks[1:])
    if fs.pca_rank is None:
        return shared + deep * 2 * extra * out
    return shared + 2 * extra * fs.pca_rank + deep * 2 * fs.pca_rank * out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="shipped model name (default smollm2-135m)")
    parser.add_argument("--cut", type=int, help="first pruned layer (default: 1/3 pruned)")
    parser.add_argument("--limit", type=int, default=12, help="evaluation documents (default 12)")
    parser.add_argument("--rank", type=int, default=256,
                        help="width r of the random-feature block (default 256)")
    parser.add_argument("--calib-tokens", type=int, default=65536,
                        help="calibration tokens (default 65536, the built-in corpus's default budget)")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json")
    args = parser.parse_args(argv)
    from popcompile.config import resolve_cut
    from popcompile.frontend.models import load_model

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    num_layers = len(reference.decoder_layers(model))
    cut = resolve_cut(num_layers, args.cut)
    setup = make_setup(model, cut, args.rank)
    start = time.perf_counter()
    m = calibrate(model, default_batches(tok, max_tokens=args.calib_tokens), setup)
    fit_seconds = time.perf_counter() - start
    slices = block_slices(model.config.hidden_size, args.rank)
    docs, _ = eval_data.continuation_documents(tok, 512, 48, args.limit)
    out_width = m.fy[setup.deep[0]].shape[1]
    n = len(docs[0].prefix)
    base = prefill_flops(model.config, n, cut)
    full = full_argmax(model, docs)
    rows = [{"name": "pop (no refit)", "extra_flops_per_token": 0,
             "speedup_bound": speedup_bound(model.config, n, cut),
             **score(model, docs, full, lambda p: reference.PopRun(model, Variant(cut), p))}]
    print(json.dumps(rows[-1]), flush=True)
    for fs in FEATURE_SETS:
        fit = prepare(m, slices, fs)
        v = fit.v
        weights = {l: solve(fit, l, setup.scales[l]) for l in setup.deep}
        extra = extra_flops_per_token(fs, model.config.hidden_size, args.rank, out_width, len(setup.deep))
        rows.append({"name": fs.name, "blocks": list(fs.blocks), "pca_rank": fs.pca_rank,
                     "extra_flops_per_token": extra,
                     "speedup_bound": prefill_flops(model.config, n) / (base + extra * (n - 1)),
                     **score(model, docs, full,
                             lambda p, fs=fs, weights=weights, v=v:
                                 FeatureRun(model, Variant(cut), p, setup, fs, weights, v))})
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "cut": cut, "num_layers": num_layers, "documents": len(docs),
              "prefix_len": n, "calibration_tokens": m.tokens, "rf_rank": args.rank, "ridge": RIDGE,
              "calibration_seconds": fit_seconds, "pop_prefill_flops_per_token": base / n, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
