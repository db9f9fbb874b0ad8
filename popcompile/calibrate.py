"""POP+: closed-form refit of the pruned layers' K/V projections (zero inference overhead).

POP's prefill feeds every deep layer ``x = input_norm_l(h_cut)`` instead of ``input_norm_l(h_l)``.
For each layer ``l > cut`` (layer ``cut`` reads ``h_cut`` in the full model too) we fit, on calibration text run through the full model,

    [W'_K | b'_K] = argmin || [x, 1] W - k_proj_l(input_norm_l(h_l)) ||^2 + lam ||W||^2     (same for V)

(the bias column only where the projection has a bias, e.g. Qwen2: elsewhere a bias would add an
Add node to the prefill graph, and POP+ promises the same nodes).

by ridge regression. ``X^T X`` and ``X^T Y`` are accumulated in float64 over batches, so memory is
O(d^2) per layer whatever the corpus size; ``lam = ridge * mean(diag(X^T X))``. The prefill graph's
deep k/v projections then read W' (``pop_pass(kv_weights=...)``): same nodes, same cost. k_norm and
RoPE are untouched; the decode graph keeps the original weights.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file, save_file

from .arch import arch_spec
from .passes.pop import Projection

PARTS = ("k_proj", "v_proj")


@dataclass(frozen=True)
class CalibrationInfo:
    """What a fit was made on, stored next to the weights."""

    cut: int
    num_layers: int
    ridge: float
    tokens: int
    corpus_sha256: str
    model: str = ""


@dataclass(frozen=True)
class KVFit:
    info: CalibrationInfo
    weights: dict[int, dict[str, Projection]]  # layer -> {"k_proj": ..., "v_proj": ...}


class _Moments:
    """Running X^T X and X^T Y (float64) of one projection; X gets a ones column when a bias is fitted."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        self.bias = bias
        width = d_in + int(bias)
        self.xtx = torch.zeros(width, width, dtype=torch.float64)
        self.xty = torch.zeros(width, d_out, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # x: [tokens, d_in], y: [tokens, d_out]
        x = x.double()
        if self.bias:
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        self.xtx += x.T @ x
        self.xty += x.T @ y.double()

    def solve(self, ridge: float) -> Projection:
        lam = ridge * self.xtx.diagonal().mean()
        eye = torch.eye(self.xtx.shape[0], dtype=torch.float64)
        if self.bias:
            eye[-1, -1] = 0.0  # the bias is not regularised
        w = torch.linalg.solve(self.xtx + lam * eye, self.xty)  # [d_in (+1), d_out]
        if not self.bias:
            return Projection(weight=w.T.float().contiguous())
        return Projection(weight=w[:-1].T.float().contiguous(), bias=w[-1].float().contiguous())


@torch.no_grad()
def fit_kv(
    model: torch.nn.Module, batches: Iterable[torch.Tensor], cut: int, *, ridge: float = 1e-3,
    progress: Callable[[int], None] | None = None,
) -> KVFit:
    """Fit replacement k/v projections for layers ``cut+1..L-1`` on token batches [B, T] (no padding)."""
    spec, layers = arch_spec(model.config), model.get_decoder().layers
    if not 1 <= cut < len(layers):
        raise ValueError(f"cut={cut} prunes nothing to calibrate: use 1..{len(layers) - 1}")
    moments: dict[tuple[int, str], _Moments] = {}
    digest, tokens = hashlib.sha256(), 0
    for ids in batches:
        digest.update(ids.numpy().tobytes())
        tokens += ids.numel()
        hidden = model.get_decoder()(ids, output_hidden_states=True).hidden_states  # [l]: input of layer l
        for index in range(cut + 1, len(layers)):  # layer `cut` already reads h_cut: nothing to fit
            layer = layers[index]
            norm = layer.get_submodule(spec.input_norm)
            x = norm(hidden[cut]).flatten(0, 1)
            x_true = norm(hidden[index]).flatten(0, 1)
            for part in PARTS:
                proj = layer.get_submodule(getattr(spec, part))
                key = (index, part)
                # a bias only where the projection has one: the prefill graph keeps exactly its nodes
                fresh = _Moments(proj.in_features, proj.out_features, proj.bias is not None)
                moments.setdefault(key, fresh).add(x, proj(x_true))
        if progress is not None:
            progress(ids.numel())
    if tokens == 0:
        raise ValueError("no calibration tokens: give a non-empty corpus")
    weights: dict[int, dict[str, Projection]] = {}
    for (index, part), m in moments.items():
        weights.setdefault(index, {})[part] = m.solve(ridge)
    info = CalibrationInfo(cut, len(layers), ridge, tokens, digest.hexdigest())
    return KVFit(info, weights)


def save_fit(fit: KVFit, path: str | Path) -> None:
    """safetensors with ``layers.{l}.{k_proj|v_proj}.{weight|bias}``; the info in its metadata and a .json."""
    tensors = {f"layers.{i}.{part}.{name}": getattr(p, name)
               for i, parts in fit.weights.items() for part, p in parts.items()
               for name in ("weight", "bias") if getattr(p, name) is not None}
    path = Path(path)
    save_file(tensors, str(path), metadata={"popcompile_kv_fit": json.dumps(asdict(fit.info))})
    path.with_suffix(".json").write_text(json.dumps(asdict(fit.info), indent=2) + "\n")


def load_fit(path: str | Path) -> KVFit:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"KV calibration file {path} does not exist: make one with `popcompile calibrate`")
    with safe_open(str(path), "pt") as handle:
        meta = (handle.metadata() or {}).get("popcompile_kv_fit")
    if meta is None:
        raise ValueError(f"{path} is not a popcompile KV calibration file (no metadata): re-run calibrate")
    weights: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in load_file(str(path)).items():
        _, index, part, name = key.split(".")
        weights.setdefault(int(index), {}).setdefault(part, {})[name] = tensor
    projections = {i: {part: Projection(t["weight"], t.get("bias")) for part, t in parts.items()}
                   for i, parts in weights.items()}
    return KVFit(CalibrationInfo(**json.loads(meta)), projections)


def check_fit(fit: KVFit, cut: int, num_layers: int) -> None:
    if (fit.info.cut, fit.info.num_layers) != (cut, num_layers):
        raise ValueError(f"KV calibration was fitted for cut {fit.info.cut} of {fit.info.num_layers} layers, "
                         f"not cut {cut} of {num_layers}: re-run `popcompile calibrate --cut {cut}`")


def token_batches(token_lists: Iterable[list[int]], seq_len: int, batch: int) -> Iterable[torch.Tensor]:
    """Cut documents into [batch, seq_len] windows (no padding; short leftovers are dropped)."""
    windows = [ids[i:i + seq_len] for ids in token_lists for i in range(0, len(ids) - seq_len + 1, seq_len)]
    for start in range(0, len(windows), batch):
        yield torch.tensor(windows[start:start + batch])


def default_batches(tokenizer, *, seq_len: int = 512, max_tokens: int = 65536, batch: int = 4):
    """The default calibration corpus (stdlib modules disjoint from the evaluation's) as [B, T] batches."""
    from .eval_data import CALIBRATION_MODULES, encode, stdlib_texts

    docs = [encode(tokenizer, text) for _, text in stdlib_texts(CALIBRATION_MODULES)]
    windows = list(token_batches(docs, seq_len, batch))
    return windows[: max(1, max_tokens // (seq_len * batch))]
