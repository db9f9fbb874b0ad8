"""The seed paper's other baselines as weight transforms: Wanda and SliceGPT.

A weight transform is ``{"module path.param": replacement tensor}`` (any shape), applied by
``reference.Variant(weights=...)`` in every stage (prefill, boundary, decode). Both baselines prune the whole
model for prefill and decode alike; neither prunes layers (their variants run at cut = L).

Wanda (Sun et al. 2023, "A Simple and Effective Pruning Approach for LLMs"): in every linear layer inside the
decoder layers (q/k/v/o, gate/up/down; not the embedding nor the LM head) the weights with the lowest
``|W_ij| * ||X_j||_2`` within each output row are set to zero (``sparsity`` of each row), ``||X_j||`` being
the L2 norm over the calibration tokens of input channel j of that linear's input. Simplification: the
activations come from one forward pass of the dense model, where Wanda's code propagates the calibration
inputs through the already pruned earlier layers. Unstructured sparsity gives no speedup on dense kernels:
the matmuls are as large as the full model's (the paper's speedups need 2:4 sparse kernels).

SliceGPT (Ashkboos et al. 2024, "SliceGPT: Compress Large Language Models by Deleting Rows and Columns"),
simplified: every RMSNorm's scale is folded into the linears that read it, then ONE orthogonal rotation Q of
the residual stream (PCA: eigenvectors of the summed uncentered covariance of the residual stream wherever a
norm reads it, descending eigenvalues) is applied and only its first ``k = d - slicing*d`` columns kept:

    embedding  E' = E Q_k                      [V, k]
    readers    W' = W diag(s) Q_k              q/k/v (input norm s), gate/up (post-attention norm s) [out, k]
    writers    W' = Q_k^T W, b' = Q_k^T b      o_proj, down_proj [k, in]
    norms      scale sqrt(d/k)                 the RMS is now taken over k dims instead of d
    LM head    W' = W diag(s_final) Q_k        [V, k], untied from the embedding

With slicing 0 this is an exact rewrite of the model (RMSNorm commutes with an orthogonal Q). SliceGPT's
paper uses one Q per layer and carries the residual through a shortcut matrix ``Q_l^T Q_{l+1}``: that is an
extra matmul in the residual path, and a Hugging Face decoder layer has no place for it, so a single global Q
is used (some quality lost against per-layer Q). The hidden width of every layer's matmuls shrinks by
``slicing`` (q/k/v/gate/up read k dims, o/down write k dims): about that fraction of the layers' projection
FLOPs is saved in prefill and decode alike; attention over the heads is unchanged. Architectures with norms
on the branch outputs before the residual add (Gemma 3) are not rotation invariant and are refused.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ...errors import ConfigError
from ...frontend.arch import arch_spec
from ...reference import decoder_layers

#: "module path.param" -> replacement tensor
WeightTransform = dict[str, torch.Tensor]

#: module names inside a decoder layer that SliceGPT rewrites (besides ArchSpec's input_norm, k_proj, v_proj
#: or fused_qkv)
_ATTENTION_READERS = ("self_attn.q_proj",)
_MLP_NORM = "post_attention_layernorm"
_MLP_READERS = ("mlp.gate_proj", "mlp.up_proj")
_FUSED_MLP_READERS = ("mlp.gate_up_proj",)  # Phi-3's gate and up projections, one Linear
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")
_FINAL_NORM = "norm"  # inside the decoder (model.get_decoder())


@dataclass(frozen=True)
class BaselineOptions:
    sparsity: float = 0.3   # Wanda: the fraction of each output row's weights set to zero
    slicing: float = 0.25   # SliceGPT: the fraction of the hidden dimension removed

    def __post_init__(self) -> None:
        for name in ("sparsity", "slicing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be a fraction within 0 <= {name} < 1, got {value!r}")


# --- calibration statistics --------------------------------------------------------------------

@contextlib.contextmanager
def _pre_hooks(modules: Iterable[torch.nn.Module], hook: Callable) -> Iterator[None]:
    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def _run(model, batches: list[torch.Tensor], progress: Callable[[int], None] | None) -> None:
    for ids in batches:  # [B, T]
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if progress:
            progress(ids.numel())


def decoder_linears(model) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear inside the decoder layers by its module path (embedding and LM head excluded)."""
    paths = {id(m): name for name, m in model.named_modules()}
    return {paths[id(m)]: m for layer in decoder_layers(model) for m in layer.modules()
            if isinstance(m, torch.nn.Linear)}


def input_square_norms(model, batches: list[torch.Tensor], progress=None) -> dict[str, torch.Tensor]:
    """Module path -> ``sum over calibration tokens of x_j^2`` [in] of each decoder linear's input
    x [B, T, in]."""
    linears = decoder_linears(model)
    sums = {path: torch.zeros(m.in_features, dtype=torch.float64) for path, m in linears.items()}
    by_module = {id(m): sums[path] for path, m in linears.items()}

    def accumulate(module, args):
        by_module[id(module)].add_(args[0].detach().double().square().flatten(0, -2).sum(0))

    with _pre_hooks(linears.values(), accumulate):
        _run(model, batches, progress)
    return sums


def residual_covariance(model, batches: list[torch.Tensor], progress=None) -> torch.Tensor:
    """``sum X^T X`` [d, d] (float64, uncentered) of the residual stream at every norm that reads it: each
    layer's input norm and post-attention norm, and the final norm; X [tokens, d]."""
    norms = _residual_norms(model)
    d = model.get_input_embeddings().weight.shape[1]
    total = torch.zeros(d, d, dtype=torch.float64)

    def accumulate(module, args):
        x = args[0].detach().float().flatten(0, -2)  # [tokens, d]
        total.add_((x.T @ x).double())

    with _pre_hooks(norms, accumulate):
        _run(model, batches, progress)
    return total


# --- Wanda -------------------------------------------------------------------------------------

def wanda_prune(weight: torch.Tensor, square_norm: torch.Tensor, sparsity: float) -> torch.Tensor:
    """``weight`` [out, in] with the ``int(in * sparsity)`` lowest ``|W_ij| * sqrt(square_norm_j)`` of each
    row set to zero; ``square_norm`` [in] (sum of the squared input channel over calibration tokens)."""
    count = int(weight.shape[1] * sparsity)
    if count == 0:
        return weight.detach().clone()
    score = weight.detach().abs().double() * square_norm.double().sqrt()[None, :]
    lowest = torch.topk(score, count, dim=1, largest=False).indices  # [out, count]
    return weight.detach().clone().scatter_(1, lowest, 0.0)


def wanda_weights(model, batches: list[torch.Tensor], options: BaselineOptions = BaselineOptions(),
                  progress=None) -> WeightTransform:
    """Wanda's pruned weight of every decoder linear, activations of the dense model on ``batches`` [B, T]."""
    norms = input_square_norms(model, batches, progress)
    return {f"{path}.weight": wanda_prune(m.weight, norms[path], options.sparsity)
            for path, m in decoder_linears(model).items()}


# --- SliceGPT ----------------------------------------------------------------------------------

def slicegpt_refusal(config) -> str | None:
    """Why SliceGPT cannot rewrite this architecture (one line), or None when it can."""
    if arch_spec(config).branch_output_norms:
        return (f"slicegpt cannot rotate {config.model_type}: its post-attention / post-feedforward norms "
                "act on each branch output before the residual add, so the residual stream is not rotation "
                "invariant; "
                "use the wanda variant for this model")
    return None


def _attention_readers(spec) -> tuple[str, ...]:
    """The linears reading the input norm: q, k and v, or the one fused [q; k; v] projection (Phi-3)."""
    return (spec.fused_qkv,) if spec.fused_qkv else (spec.k_proj, spec.v_proj, *_ATTENTION_READERS)


def _mlp_readers(layer: torch.nn.Module) -> tuple[str, ...]:
    """The linears reading the post-attention norm: gate and up, or Phi-3's one gate_up_proj."""
    fused = all(_has(layer, name) for name in _FUSED_MLP_READERS)
    return _FUSED_MLP_READERS if fused else _MLP_READERS


def _has(layer: torch.nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def _layer_parts(model, layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules SliceGPT rewrites in one decoder layer; ConfigError naming what is missing."""
    spec = arch_spec(model.config)
    names = (spec.input_norm, *_attention_readers(spec), _MLP_NORM, *_mlp_readers(layer), *_WRITERS)
    try:
        return {name: layer.get_submodule(name) for name in names}
    except AttributeError as missing:
        raise ConfigError(f"slicegpt needs the decoder layer modules {', '.join(names)}: {missing}") from None


def _residual_norms(model) -> list[torch.nn.Module]:
    spec, decoder = arch_spec(model.config), model.get_decoder()
    layers = [_layer_parts(model, layer) for layer in decoder_layers(model)]
    return [m for parts in layers for m in (parts[spec.input_norm], parts[_MLP_NORM])] + [
        decoder.get_submodule(_FINAL_NORM)]


def pca_rotation(covariance: torch.Tensor) -> torch.Tensor:
    """Orthogonal Q [d, d] (float64): eigenvectors of the symmetric ``covariance`` [d, d], eigenvalues
    descending."""
    values, vectors = torch.linalg.eigh(covariance.double())
    return vectors[:, values.argsort(descending=True)]


def kept_dims(hidden: int, slicing: float) -> int:
    """Hidden dims SliceGPT keeps of ``hidden`` at ``slicing`` (at least 1)."""
    return max(1, hidden - int(hidden * slicing))


def _read(weight: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A reader W [out, d] of a norm with scale s [d] -> W diag(s) Q_k [out, k]."""
    return ((weight.double() * scale.double()[None, :]) @ q).to(weight.dtype)


def _write(tensor: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A writer's W [d, in] or bias [d] -> Q_k^T W [k, in] or Q_k^T b [k]."""
    return (q.T @ tensor.double()).to(tensor.dtype)


def slice_model(model, rotation: torch.Tensor, slicing: float) -> WeightTransform:
    """SliceGPT's rewrite of ``model`` with the global rotation Q [d, d] (module docstring's table)."""
    d = rotation.shape[0]
    k = kept_dims(d, slicing)
    q = rotation[:, :k]  # [d, k]
    paths = {id(m): name for name, m in model.named_modules()}
    spec, decoder = arch_spec(model.config), model.get_decoder()
    norm_scale = lambda norm: torch.full((k,), math.sqrt(d / k), dtype=norm.weight.dtype)
    out: WeightTransform = {}
    for layer in decoder_layers(model):
        parts = _layer_parts(model, layer)
        for norm, readers in ((spec.input_norm, _attention_readers(spec)), (_MLP_NORM, _mlp_readers(layer))):
            scale = parts[norm].weight
            out[f"{paths[id(parts[norm])]}.weight"] = norm_scale(parts[norm])
            out.update({f"{paths[id(parts[r])]}.weight": _read(parts[r].weight, scale, q) for r in readers})
        for w in _WRITERS:
            out[f"{paths[id(parts[w])]}.weight"] = _write(parts[w].weight, q)
            if parts[w].bias is not None:
                out[f"{paths[id(parts[w])]}.bias"] = _write(parts[w].bias, q)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    final = decoder.get_submodule(_FINAL_NORM)
    out[f"{paths[id(embedding)]}.weight"] = (embedding.weight.double() @ q).to(embedding.weight.dtype)
    out[f"{paths[id(final)]}.weight"] = norm_scale(final)
    out[f"{paths[id(head)]}.weight"] = _read(head.weight, final.weight, q)
    return out


def slicegpt_weights(model, batches: list[torch.Tensor], options: BaselineOptions = BaselineOptions(),
                     progress=None) -> WeightTransform:
    """SliceGPT's sliced weights, the rotation from the residual stream's covariance on ``batches`` [B, T]."""
    reason = slicegpt_refusal(model.config)
    if reason:
        raise ConfigError(reason)
    return slice_model(model, pca_rotation(residual_covariance(model, batches, progress)), options.slicing)


#: baseline name -> (model, batches, options, progress) -> its weight transform
TRANSFORMS: dict[str, Callable[..., WeightTransform]] = {"wanda": wanda_weights, "slicegpt": slicegpt_weights}
