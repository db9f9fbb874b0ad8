"""POP+: closed-form refit of the pruned layers' K/V projections (zero inference overhead).

POP's prefill feeds every deep layer ``x = input_norm_l(h_cut)`` instead of ``input_norm_l(h_l)`` (``h_cut``
itself in a post-norm layer, which has no input norm: OLMo 2).
For each layer ``l > cut`` (layer ``cut`` reads ``h_cut`` in the full model too) we fit, on calibration
text run through the full model,

    [W'_K | b'_K] = argmin || [x, 1] W - k_proj_l(input_norm_l(h_l)) ||^2 + lam ||W||^2     (same for V)

by ridge regression. By default (``bias=False``) the bias column is fitted only where the projection has
a bias (Qwen2): exactly the model's nodes. ``bias=True`` fits one for every projection; where the model's
projection has none (Llama, SmolLM2, Mistral, Gemma 3) it costs one Add [T, kv_width] per refitted layer
in the prefill graph (none in decode). Measured on SmolLM2 at cut 20 (docs/results.md): continuation
agreement unchanged within noise, greedy chat matched prefix 17.5 -> 11.8 tokens: off for the ridge fit;
distill.ridge_then_distill, whose measured configuration has it, turns it on.

A batch is token ids [B, T] (the decoder's own forward) or, for a vision-language model, an
``images.ImageWindow`` (image+text windows through the text decoder, images.py); ``BATCH_KINDS`` says how each
is run. ``X^T X`` and ``X^T Y`` are accumulated in float64 over batches, so memory is
O(d^2) per layer whatever the corpus size; ``lam = ridge * mean(diag(X^T X))``. The prefill graph's
deep k/v projections then read W' (``pop_graphs(..., kv_weights)``): same nodes, same cost. k_norm and
RoPE are untouched; the decode graph keeps the original weights.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from ..config import DEFAULT_FIT_BIAS, KVCalibration, KVFitConfig
from ..errors import ConfigError, InputError, UnsupportedModelError
from ..frontend.arch import KV_PARTS, arch_spec, kv_projections
from ..fsutil import atomic_path
from ..passes.pop import Projection
from .images import ImageWindow
from .images import layer_inputs as image_layer_inputs

PARTS = KV_PARTS
#: how the weights were made: closed-form ridge (this module) or distilled on the output (distill.py)
METHODS = ("ridge", "distill")


@dataclass(frozen=True)
class CalibrationInfo:
    """What a fit was made on, stored next to the weights."""

    cut: int
    num_layers: int
    ridge: float
    tokens: int
    corpus_sha256: str
    model: str = ""
    method: str = "ridge"  # one of METHODS; files written before it existed are ridge fits
    #: True: a bias fitted for every projection; False: only where the model's projection has one (the only
    #: behaviour before the field existed, so files written then load as False)
    bias: bool = DEFAULT_FIT_BIAS["ridge"]


@dataclass(frozen=True)
class KVFit:
    info: CalibrationInfo
    weights: dict[int, dict[str, Projection]]  # layer -> {"k_proj": ..., "v_proj": ...}
    #: how a fit made while compiling was made (kvfit/budget.FitPlan.record: method asked and run, device,
    #: estimate, budget, time taken, an early stop); the manifest's ``extra.kv_fit``. Not saved in files.
    record: dict | None = field(default=None, compare=False)


def _text_layer_inputs(model: torch.nn.Module, ids: torch.Tensor) -> Sequence[torch.Tensor]:
    return model.get_decoder()(ids, output_hidden_states=True).hidden_states  # [l]: input of layer l


@dataclass(frozen=True)
class BatchKind:
    """How the fit runs one kind of calibration batch: its token ids [B, T] (the corpus digest, the progress
    count) and one forward giving ``[l]``: the input of decoder layer l, [B, T, d] (at least every layer)."""

    ids: Callable[[Any], torch.Tensor]
    layer_inputs: Callable[[torch.nn.Module, Any], Sequence[torch.Tensor]]
    to: Callable[[Any, torch.device], Any]  # the batch on a device


#: a calibration batch's type -> how it is run: token ids, or a VLM's image+text windows (images.py)
BATCH_KINDS: dict[type, BatchKind] = {
    torch.Tensor: BatchKind(lambda ids: ids, _text_layer_inputs, lambda ids, device: ids.to(device)),
    ImageWindow: BatchKind(lambda window: window.ids, image_layer_inputs,
                           lambda window, device: window.to(device)),
}


def batch_kind(batch: Any) -> BatchKind:
    kind = BATCH_KINDS.get(type(batch))
    if kind is None:
        raise InputError(f"a calibration batch is token ids [B, T] or an ImageWindow, not "
                         f"{type(batch).__name__}: build batches with default_batches or image_windows")
    return kind


def ridge_solve(xtx: torch.Tensor, xty: torch.Tensor, ridge: float, bias: bool) -> Projection:
    """``argmin ||X W - Y||^2 + lam ||W||^2`` from the moments (float64), ``lam = ridge * mean(diag(X^T X))``.

    With ``bias`` the last row/column of ``xtx`` belongs to X's ones column; that weight is not regularised.
    """
    lam = ridge * xtx.diagonal().mean()
    eye = torch.eye(xtx.shape[0], dtype=torch.float64)
    if bias:
        eye[-1, -1] = 0.0
    try:
        w = torch.linalg.solve(xtx + lam * eye, xty)  # [d_in (+1), d_out]
    except torch.linalg.LinAlgError:
        raise InputError(f"the calibration system is singular at ridge {ridge}: give a larger --ridge "
                         "or more text") from None
    if not bias:
        return Projection(weight=w.T.float().contiguous())
    return Projection(weight=w[:-1].T.float().contiguous(), bias=w[-1].float().contiguous())


def ridge_fit(
    model: torch.nn.Module, batches: Iterable[torch.Tensor], cut: int, *, ridge: float = KVFitConfig.ridge,
    bias: bool = DEFAULT_FIT_BIAS["ridge"], progress: Callable[[int], None] | None = None,
) -> KVFit:
    """Fit replacement k/v projections for layers ``cut+1..L-1`` on calibration batches (BATCH_KINDS: token
    ids [B, T], no padding, or a VLM's ImageWindows); a bias for every projection with ``bias``, else only
    where the model's projection has one. ``ridge_fits`` at one cut: one ridge solver (CutMoments)."""
    layers = len(model.get_decoder().layers)
    if not 1 <= cut < layers:
        raise ConfigError(f"cut={cut} prunes nothing to calibrate: use 1..{layers - 1}")
    return ridge_fits(model, batches, [cut], ridge=ridge, bias=bias, progress=progress)[cut]


# --- every cut in one pass ------------------------------------------------------------------------
#
# input_norm_l(h) = s_l * n(h) with n(h) = h / sqrt(mean(h^2) + eps) (weightless RMS norm) and s_l a
# per-channel scale (Llama: w, Gemma 3: 1 + w). With N_c = [n(h_c), 1] ([T, d+1]) and S'_l = diag(s_l, 1):
#     X^T X = S'_l (N_c^T N_c) S'_l,    X^T Y_l = S'_l (N_c^T Y_l)
# N_c^T N_c depends only on the cut, N_c^T Y_l on the cut and the layer: one pass over the corpus
# accumulates both for every cut, and each cut's fit is then ridge_solve on these moments.
# A post-norm layer (OLMo 2: no input norm, ArchSpec.input_norm None) projects h itself: n(h) = h, s_l = 1.
# Memory (float64): sum over cuts of (d+1)^2 + (d+1) * 2 * kv_width * (L-1-c); SmolLM2, cuts 15..28:
# 15 * 2.7 MB + 105 * 1.8 MB = 226 MB; Gemma-3-270M, cuts 9..16: 8 * 3.3 MB + 36 * 2.6 MB = 120 MB.

def norm_eps(norm: torch.nn.Module) -> float:
    """The epsilon of an RMS norm module (``variance_epsilon`` in Llama/Qwen/Mistral, ``eps`` in Gemma 3)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    raise UnsupportedModelError(f"{type(norm).__name__} has no variance_epsilon/eps: the K/V fit needs an "
                                "RMS norm")


def rms_unit(h: torch.Tensor, eps: float) -> torch.Tensor:
    """n(h) = h / sqrt(mean(h^2) + eps) over the last dim, float64."""
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def norm_scale(norm: torch.nn.Module, width: int) -> torch.Tensor:
    """s with norm(h) == s * n(h), float64 [width] on the CPU: n(ones) = 1/sqrt(1+eps), so
    s = norm(ones) * sqrt(1+eps)."""
    weight = next(norm.parameters(), None)
    ones = torch.ones(1, width, device=None if weight is None else weight.device)
    return norm(ones)[0].double().cpu() * (1.0 + norm_eps(norm)) ** 0.5


def _check_factorises(norm: torch.nn.Module, h: torch.Tensor, scale: torch.Tensor, unit: Callable) -> None:
    got, want = scale * unit(h.cpu()), norm(h).cpu().double()
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    if err > 1e-4:
        raise UnsupportedModelError(f"{type(norm).__name__}(h) is not s * rms_unit(h) (relative error "
                                    f"{err:.2e}): the K/V fit needs an RMS norm with a per-channel scale")


class _AllCutMoments:
    """N_c^T N_c per cut and N_c^T [Y_{c+1} .. Y_{L-1}] per cut (float64, on the model's ``device``; the
    moments of a fit come back on the CPU), N_c with a ones column."""

    def __init__(self, cuts: list[int], num_layers: int, width: int, out: int, device: torch.device):
        self.cuts, self.num_layers, self.out = cuts, num_layers, out
        self.device = torch.device("cpu") if device.type == "mps" else device  # MPS has no float64
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=self.device)
        self.ntn = {c: zeros(width + 1, width + 1) for c in cuts}
        self.nty = {c: zeros(width + 1, out * (num_layers - 1 - c)) for c in cuts}

    def add(self, units: dict[int, torch.Tensor], targets: dict[int, torch.Tensor]) -> None:
        # units[c]: n(h_c) [T, d] float64; targets[l]: [k_proj | v_proj] of layer l's true input [T, out]
        for c in self.cuts:
            ones = torch.ones(units[c].shape[0], 1, dtype=torch.float64, device=units[c].device)
            n = torch.cat([units[c], ones], dim=1)
            self.ntn[c] += n.T @ n
            if c < self.num_layers - 1:
                self.nty[c] += n.T @ torch.cat([targets[l] for l in range(c + 1, self.num_layers)], dim=1)

    def moments(self, cut: int, layer: int, scale: torch.Tensor,
                bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(X^T X, X^T Y) of layer ``layer``'s fit at ``cut`` with X = input_norm_layer(h_cut) (+ ones if
        bias)."""
        width = scale.shape[0] + int(bias)
        s = torch.cat([scale, torch.ones(1, dtype=torch.float64)])[:width]
        start = (layer - cut - 1) * self.out
        xtx = s[:, None] * self.ntn[cut][:width, :width].cpu() * s[None, :]
        return xtx, s[:, None] * self.nty[cut][:width, start:start + self.out].cpu()


class CutMoments:
    """The ridge statistics of every cut in ``cuts`` (``_AllCutMoments``), accumulated from the full model's
    hidden states: ``ridge_fits`` feeds it forwards of its own, distill.py the forward it precomputes
    anyway."""

    def __init__(self, model: torch.nn.Module, cuts: Iterable[int], *, ridge: float = KVFitConfig.ridge,
                 bias: bool = DEFAULT_FIT_BIAS["ridge"]):
        check_ridge(ridge)
        check_bias(bias)
        spec, layers = arch_spec(model.config), model.get_decoder().layers
        self.num_layers, self.cuts, self.ridge, self.bias = len(layers), sorted(set(cuts)), ridge, bias
        if not self.cuts or not all(1 <= c < self.num_layers for c in self.cuts):
            raise ConfigError(f"cuts {self.cuts} must be non-empty and within 1..{self.num_layers - 1} "
                              "(a cut of L prunes nothing)")
        self.projs = [[kv_projections(spec, layer)[part] for part in PARTS] for layer in layers]
        width = model.config.get_text_config().hidden_size  # a VLM's text decoder's
        if spec.input_norm is None:  # post-norm layers: the projections read h itself, n(h) = h, s = 1
            self.norms = [torch.nn.Identity() for _ in layers]
            self.unit = lambda h: h.double()
            self.scales = [torch.ones(width, dtype=torch.float64) for _ in layers]
        else:
            self.norms = [layer.get_submodule(spec.input_norm) for layer in layers]
            eps = norm_eps(self.norms[0])
            self.unit = lambda h: rms_unit(h, eps)
            self.scales = [norm_scale(norm, width) for norm in self.norms]
        self.split = self.projs[-1][0].out_features  # K columns, then V columns
        self.moments = _AllCutMoments(self.cuts, self.num_layers, width,
                                      self.split + self.projs[-1][1].out_features,
                                      next(model.parameters()).device)
        self.digest, self.tokens = hashlib.sha256(), 0

    @torch.no_grad()
    def add(self, hidden: Mapping[int, torch.Tensor], ids: torch.Tensor) -> None:
        """``hidden[l]`` [T, d]: the input of layer l (every l from the first cut on) over the tokens
        ``ids``."""
        if self.tokens == 0:
            # a pair the fits use
            _check_factorises(self.norms[-1], hidden[self.cuts[0]], self.scales[-1], self.unit)
        self.digest.update(ids.cpu().numpy().tobytes())
        self.tokens += ids.numel()
        targets, device = {}, self.moments.device
        for l in range(self.cuts[0] + 1, self.num_layers):
            x_true = self.norms[l](hidden[l])
            targets[l] = torch.cat([p(x_true) for p in self.projs[l]], dim=1).to(device).double()
        self.moments.add({c: self.unit(hidden[c].to(device)) for c in self.cuts}, targets)

    def fits(self) -> dict[int, KVFit]:
        """``{cut: its ridge fit}`` from what was added."""
        if self.tokens == 0:
            raise InputError("no calibration tokens: give a non-empty corpus")
        info = lambda c: CalibrationInfo(c, self.num_layers, self.ridge, self.tokens, self.digest.hexdigest(),
                                         bias=self.bias)
        return {c: check_finite(KVFit(info(c), self._solve(c)), f"the fit for cut {c}") for c in self.cuts}

    def _solve(self, cut: int) -> dict[int, dict[str, Projection]]:
        weights: dict[int, dict[str, Projection]] = {}
        for layer in range(cut + 1, self.num_layers):
            for part, proj, cols in zip(PARTS, self.projs[layer],
                                        (slice(0, self.split), slice(self.split, None))):
                with_bias = fits_bias(proj, self.bias)
                xtx, xty = self.moments.moments(cut, layer, self.scales[layer], with_bias)
                weights.setdefault(layer, {})[part] = ridge_solve(xtx, xty[:, cols], self.ridge, with_bias)
        return weights


@torch.no_grad()
def ridge_fits(
    model: torch.nn.Module, batches: Iterable[torch.Tensor], cuts: Iterable[int], *,
    ridge: float = KVFitConfig.ridge, bias: bool = DEFAULT_FIT_BIAS["ridge"],
    progress: Callable[[int], None] | None = None, stop: Callable[[], bool] = lambda: False,
) -> dict[int, KVFit]:
    """``{cut: ridge_fit(model, batches, cut, bias=bias)}`` for every cut in one pass over the corpus (see
    above); ``batches`` as ridge_fit takes them, run on the model's device. ``stop()`` (the time budget) is
    asked after every batch: the fits are then those of the batches so far (their ``info.tokens``)."""
    moments = CutMoments(model, cuts, ridge=ridge, bias=bias)
    device = next(model.parameters()).device
    for batch in batches:
        kind = batch_kind(batch)
        batch = kind.to(batch, device)
        hidden = kind.layer_inputs(model, batch)  # [l]: input of layer l, [B, T, d]
        moments.add({l: h.flatten(0, 1) for l, h in enumerate(hidden[:moments.num_layers])}, kind.ids(batch))
        if progress is not None:
            progress(kind.ids(batch).numel())
        if stop():
            break
    return moments.fits()


def fits_bias(proj: torch.nn.Module, bias: bool) -> bool:
    """Whether the fit of ``proj`` gets a bias column: always with ``bias``, else where the model has one."""
    return bias or proj.bias is not None


def check_bias(bias: bool) -> None:
    if not isinstance(bias, bool):
        raise ConfigError(f"bias={bias!r} must be True (fit a bias for every projection) or False (only "
                          "where the model's projection has one)")


def check_ridge(ridge: float) -> None:
    KVFitConfig(ridge=ridge)  # its rule: ConfigError naming --ridge unless finite and >= 0


def check_finite(fit: KVFit, what: str) -> KVFit:
    """``fit`` unless a weight is NaN or infinite (a singular system with ridge 0, or a damaged file)."""
    for layer, parts in fit.weights.items():
        for part, p in parts.items():
            for name, tensor in (("weight", p.weight), ("bias", p.bias)):
                if tensor is not None and not bool(torch.isfinite(tensor).all()):
                    raise InputError(f"{what} has non-finite values in layer {layer} {part}.{name}: "
                                     "calibrate again with more text or a larger --ridge")
    return fit


def save_fit(fit: KVFit, path: str | Path) -> None:
    """safetensors with ``layers.{l}.{k_proj|v_proj}.{weight|bias}`` and the info in its metadata
    (no side file: nothing beside ``path`` is touched). Written to a temporary sibling, then renamed."""
    tensors = {f"layers.{i}.{part}.{name}": getattr(p, name)
               for i, parts in fit.weights.items() for part, p in parts.items()
               for name in ("weight", "bias") if getattr(p, name) is not None}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"popcompile_kv_fit": json.dumps(asdict(fit.info))})


def load_fit(path: str | Path) -> KVFit:
    """The fit in a file from ``save_fit``; InputError naming the file for anything else."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"KV calibration file {path} does not exist: make one with `popcompile calibrate`")
    try:
        info, tensors = _read_fit(path)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' reader raises its own types for a damaged file
        raise InputError(f"{path} is not a readable KV calibration file ({type(err).__name__}: {err}): "
                         "re-run `popcompile calibrate`") from None
    weights: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        index, part, name = _split_key(path, key)
        weights.setdefault(index, {}).setdefault(part, {})[name] = tensor
    projections = {i: {part: _projection(path, i, part, t) for part, t in parts.items()}
                   for i, parts in weights.items()}
    return check_finite(KVFit(info, projections), f"KV calibration file {path}")


def _read_fit(path: Path) -> tuple[CalibrationInfo, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        meta = (handle.metadata() or {}).get("popcompile_kv_fit")
    if meta is None:
        raise InputError(f"{path} is not a popcompile KV calibration file (no metadata): re-run calibrate")
    try:
        info = CalibrationInfo(**json.loads(meta))
    except (ValueError, TypeError) as err:
        raise InputError(f"{path}: its calibration metadata is malformed ({err}): re-run calibrate") from None
    if not isinstance(info.bias, bool):
        raise InputError(f"{path}: its calibration metadata has bias={info.bias!r}, not true/false: "
                         "re-run calibrate")
    if not all(isinstance(getattr(info, n), int) for n in ("cut", "num_layers", "tokens")):
        raise InputError(f"{path}: its calibration metadata has non-integer cut/num_layers/tokens: "
                         "re-run calibrate")
    if info.method not in METHODS:
        raise InputError(f"{path}: its calibration method {info.method!r} is not one of "
                         f"{', '.join(METHODS)}: re-run calibrate")
    return info, load_file(str(path))


def _split_key(path: Path, key: str) -> tuple[int, str, str]:
    parts = key.split(".")
    if len(parts) != 4 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in PARTS \
            or parts[3] not in ("weight", "bias"):
        raise InputError(f"{path}: unexpected tensor {key!r} (want layers.N.k_proj|v_proj.weight|bias): "
                         "re-run calibrate")
    return int(parts[1]), parts[2], parts[3]


def _projection(path: Path, layer: int, part: str, tensors: dict[str, torch.Tensor]) -> Projection:
    if "weight" not in tensors:
        raise InputError(f"{path}: layer {layer} {part} has a bias but no weight: re-run calibrate")
    return Projection(tensors["weight"], tensors.get("bias"))


def check_fit(fit: KVFit, cut: int, num_layers: int) -> None:
    if (fit.info.cut, fit.info.num_layers) != (cut, num_layers):
        raise InputError(f"KV calibration was fitted for cut {fit.info.cut} of {fit.info.num_layers} layers, "
                         f"not cut {cut} of {num_layers}: re-run `popcompile calibrate --cut {cut}`")


#: layer -> part (k_proj | v_proj) -> (weight shape, bias shape or None): what a fit's projections must match
KVShapes = Mapping[int, Mapping[str, tuple]]


def model_kv_shapes(model: torch.nn.Module, first: int) -> KVShapes:
    """``KVShapes`` of the model's layers ``first``..L-1 (a graph's: passes.pop.kv_projection_shapes)."""
    spec, layers = arch_spec(model.config), model.get_decoder().layers
    shapes = {}
    for index in range(first, len(layers)):
        for part, proj in kv_projections(spec, layers[index]).items():
            shapes.setdefault(index, {})[part] = (tuple(proj.weight.shape),
                                                  None if proj.bias is None else tuple(proj.bias.shape))
    return shapes


def check_fit_shapes(fit: KVFit, model: torch.nn.Module) -> None:
    """``check_kv_shapes`` against the model's own projections."""
    check_kv_shapes(fit, model_kv_shapes(model, fit.info.cut + 1))


def check_kv_shapes(fit: KVFit, shapes: KVShapes) -> None:
    """InputError unless ``fit`` has, for every layer of ``shapes`` (cut+1..L-1), k/v weights shaped like the
    model's and a bias [out] wherever the model's projection has one (a fitted bias [out] where it has none is
    accepted too). A shape the graph does not know (None) is not compared."""
    if set(fit.weights) != set(shapes):
        raise InputError(f"KV calibration has layers {sorted(fit.weights)}, the model needs "
                         f"{sorted(shapes)}: re-run `popcompile calibrate` for this model")
    for index in sorted(shapes):
        for part in PARTS:
            weight, bias = shapes[index][part]
            got = fit.weights[index].get(part)
            if weight is None or got is None:
                if got is None:
                    raise InputError(f"KV calibration layer {index} has no {part}: "
                                     "re-run `popcompile calibrate` for this model")
                continue
            want_bias = (weight[0],) if bias is not None or got.bias is not None else None
            got_shapes = (tuple(got.weight.shape), None if got.bias is None else tuple(got.bias.shape))
            if got_shapes != (weight, want_bias):
                raise InputError(f"KV calibration layer {index} {part}: shapes {got_shapes} do not match the "
                                 f"model's {(weight, want_bias)}: re-run `popcompile calibrate` for this "
                                 "model")


def load_file_fit(kv: KVCalibration) -> KVFit | None:
    """The file's fit, read and checked for finite values before any model loads (None for the other modes;
    kvfit.fit.resolve_fit makes or checks every mode's weights)."""
    return load_fit(kv.path) if kv.mode == "file" else None


def token_batches(token_lists: Iterable[list[int]], seq_len: int, batch: int) -> Iterable[torch.Tensor]:
    """Cut documents into [batch, seq_len] windows (no padding; short leftovers are dropped)."""
    windows = [ids[i:i + seq_len] for ids in token_lists for i in range(0, len(ids) - seq_len + 1, seq_len)]
    for start in range(0, len(windows), batch):
        yield torch.tensor(windows[start:start + batch])


def default_batches(tokenizer, *, seq_len: int = KVFitConfig.seq_len,
                    max_tokens: int = KVFitConfig.max_tokens, batch: int = 4):
    """The default calibration corpus (stdlib modules disjoint from the evaluation's) as [B, T] batches."""
    from .corpus import CALIBRATION_MODULES, encode, stdlib_texts

    docs = [encode(tokenizer, text) for _, text in stdlib_texts(CALIBRATION_MODULES)]
    windows = list(token_batches(docs, seq_len, batch))
    return windows[: max(1, max_tokens // (seq_len * batch))]
