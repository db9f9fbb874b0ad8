"""POP++: distil the pruned layers' K/V projections on the output (zero inference overhead).

POP+ (calibrate.py) fits each deep layer's K/V to the full model's K/V. What a user sees is the output,
so here the same weights W'_K, W'_V (and biases where the projection has one) of layers ``cut+1..L-1``
start from a fit (the ridge one) and are trained to minimise, over windows ``x_1..x_{N+C}`` of text,

    KL(full || POP) = mean over t = N..N+C-1 of  sum_v p_full(v | x_<=t) (log p_full - log p_POP)(v | x_<=t)

teacher-forced: ``x_1..x_{N-1}`` are prefilled under POP, ``x_N`` (the boundary) and the continuation
``x_{N+1}..x_{N+C-1}`` run through the full model (reference.continuation_logits, prefix N, C tokens).

Why a step is cheap: layers ``0..cut-1`` and ``h_cut`` never depend on the trained weights (the shallow
layers are exact in POP), so one full-model forward per window, without gradients, gives everything a
step needs (P = N-1 pruned rows, C scored rows, d hidden width)::

    h_cut    [1, P, d]   input of layer cut at the pruned rows (every deep layer's K/V source in POP)
    h_in     [1, C, d]   input of layer cut at the boundary and continuation rows (exact in POP too)
    teacher  [1, C, d]   the full model's last hidden state before the final norm at those rows

and, from the first window (every window has the same length), each deep layer's call arguments for
the C rows (mask, RoPE tables, positions) and its RoPE tables (cos, sin) [1, P, D] of the pruned rows.
A step then runs only layers ``cut..L-1``, with gradients, on the C rows; their cache holds

    k_l = RoPE_l(k_norm_l(input_norm_l(h_cut) W'_K^T + b'_K)),   v_l = input_norm_l(h_cut) W'_V^T + b'_V

(layer ``cut`` keeps its own weights: it reads ``h_cut`` in the full model too). Adam on the mean KL of
one window per step; a held-out share of the windows is scored every ``eval_every`` steps, the best
weights by held-out KL are kept, and training stops after ``patience`` evaluations without improvement.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..config import DEFAULT_FIT_BIAS, DistillConfig, KVFitConfig
from ..errors import ConfigError, InputError, UnsupportedModelError
from ..frontend.arch import arch_spec, pruned_kv
from ..frontend.capture import cache_keyword
from ..passes.pop import Projection
from .calibrate import (
    PARTS,
    CutMoments,
    KVFit,
    check_finite,
    check_fit_shapes,
    default_batches,
)

#: tokens per window of the built-in corpus: a 512-token prompt, then DistillConfig.continuation (48) scored
DEFAULT_SEQ_LEN = KVFitConfig.seq_len + DistillConfig.continuation
#: float32 logits [B, C, V] of one held-out forward stay near 128 MiB (SmolLM2 at C=48: 8 windows, Gemma 3: 2)
EVAL_LOGITS = 2**25


@dataclass(frozen=True)
class DistillProgress:
    """One report: ``phase`` "teacher" (``done`` of ``total`` windows run through the full model) or
    "train" (``done`` of ``total`` steps; the last step's KL and the last held-out KL, nats)."""

    phase: str
    done: int
    total: int
    loss: float | None = None
    held_out: float | None = None


@dataclass(frozen=True)
class DistillResult:
    fit: KVFit            # the best weights by held-out KL (the init's if training never improved on it)
    initial_kl: float     # held-out KL(full || POP) with the init weights
    best_kl: float        # held-out KL of ``fit``
    best_step: int        # the step ``fit`` was taken at (0: the init)
    steps_run: int        # steps done before the end or the early stop
    held_out: tuple[int, ...]  # the windows (rows of ``windows``) scored for early stopping, never trained on
    init: KVFit           # the fit training started from (ridge_then_distill's ridge fit)


@dataclass(frozen=True)
class _Geometry:
    """What every window shares: each deep layer's call arguments for the C scored rows (its cache
    argument replaced per step) and its RoPE tables (cos, sin) [1, P, D] of the P pruned rows."""

    layer_kwargs: dict[int, dict[str, Any]]
    prefix_rope: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Windows:
    h_cut: torch.Tensor    # [W, P, d]
    h_in: torch.Tensor     # [W, C, d]
    teacher: torch.Tensor  # [W, C, d]
    geometry: _Geometry


# --- precompute (no gradients) ------------------------------------------------------------------

@contextlib.contextmanager
def _recorded_calls(modules: dict[int, torch.nn.Module]) -> Iterator[dict[int, tuple[tuple, dict]]]:
    """``{key: (args, kwargs)}`` of the last call of each module while the context is open."""
    calls: dict[int, tuple[tuple, dict]] = {}
    handles = [m.register_forward_pre_hook(lambda _, a, k, key=key: calls.__setitem__(key, (a, k)),
                                           with_kwargs=True)
               for key, m in modules.items()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _hidden(call: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _forward(model, ids: torch.Tensor, cache: DynamicCache, start: int) -> None:
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
          **{cache_keyword(model): cache})


@torch.no_grad()
def _run_window(model, ids: torch.Tensor, cut: int, continuation: int, moments: CutMoments | None = None):
    """The full model over one window ``ids`` [1, T] in two forwards (pruned rows, then the C scored rows);
    returns (h_cut, h_in, teacher, geometry) as in the module docstring. With ``moments``, the deep layers'
    inputs over rows 0..T-2 also go into the ridge fit's statistics: its forward is this one."""
    layers, norm = model.get_decoder().layers, model.get_decoder().norm
    deep = {i: layers[i] for i in range(cut, len(layers))}
    rows, cache = ids.shape[1] - continuation - 1, DynamicCache()
    with _recorded_calls(deep) as calls:
        _forward(model, ids[:, :rows], cache, 0)
    pruned = {i: _hidden(call) for i, call in calls.items()}  # [1, P, d] per deep layer
    prefix_rope = {i: tuple(kwargs["position_embeddings"]) for i, (_, kwargs) in calls.items()}
    with _recorded_calls({**deep, -1: norm}) as calls:
        _forward(model, ids[:, rows:-1], cache, rows)
    teacher = _hidden(calls.pop(-1))
    if moments is not None:
        moments.add({i: torch.cat([pruned[i], _hidden(call)], dim=1)[0] for i, call in calls.items()},
                    ids[:, :-1])
    layer_kwargs = {i: kwargs for i, (_, kwargs) in calls.items()}
    return pruned[cut], _hidden(calls[cut]), teacher, _Geometry(layer_kwargs, prefix_rope)


def _precompute(model, windows: torch.Tensor, cut: int, continuation: int,
                report: Callable[[int], None], moments: CutMoments | None = None) -> _Windows:
    """``_run_window`` over every window [W, T]; the geometry is the first window's (all share one length)."""
    runs, geometry = [], None
    for i in range(windows.shape[0]):
        *tensors, found = _run_window(model, windows[i:i + 1], cut, continuation, moments)
        runs.append(tensors)
        geometry = geometry or found
        report(i + 1)
    h_cut, h_in, teacher = (torch.cat(parts) for parts in zip(*runs))
    return _Windows(h_cut, h_in, teacher, geometry)


# --- the student: deep layers on the scored rows, cache from the trainable projections -----------

def _rope_function(attention: torch.nn.Module) -> Callable:
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` of the attention module's own modeling file."""
    rope = getattr(inspect.getmodule(type(attention)), "apply_rotary_pos_emb", None)
    if rope is None:
        raise UnsupportedModelError(f"{type(attention).__name__}'s module has no apply_rotary_pos_emb: "
                                    "distillation supports the architectures in popcompile/frontend/arch.py")
    return rope


def _prefix_kv(model, index: int, h_cut: torch.Tensor, parts: dict[str, Projection],
               rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s POP cache rows: K, V [B, kv_heads, P, D] from ``h_cut`` [B, P, d]."""
    spec, layer = arch_spec(model.config), model.get_decoder().layers[index]
    attention = layer.get_submodule(spec.k_proj.rsplit(".", 1)[0])

    def project(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, P, d] -> [B, P, kv_heads * D] each
        return tuple(torch.nn.functional.linear(x, parts[part].weight, parts[part].bias) for part in PARTS)

    k, v = pruned_kv(spec, layer, h_cut, project, attention.head_dim)
    shape = (*k.shape[:-1], -1, attention.head_dim)  # [B, P, kv_heads, D]
    k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
    cos, sin = rope
    return _rope_function(attention)(k, k, cos, sin)[1], v


def _own_projections(model, index: int) -> dict[str, Projection]:
    spec, layer = arch_spec(model.config), model.get_decoder().layers[index]
    return {part: Projection(p.weight, p.bias)
            for part in PARTS for p in [layer.get_submodule(getattr(spec, part))]}


def head_logits(model, h: torch.Tensor) -> torch.Tensor:
    """Logits [B, C, V] from the last layer's output ``h`` [B, C, d]: final norm, LM head, soft-capping
    (Gemma)."""
    logits = model.get_output_embeddings()(model.get_decoder().norm(h))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _student_logits(model, data: _Windows, rows: torch.Tensor, weights: dict[int, dict[str, Projection]]):
    """POP's logits [B, C, V] of the windows ``rows`` (a [B] index) with ``weights`` on the deep layers."""
    layers, g = model.get_decoder().layers, data.geometry
    cache, h_cut = DynamicCache(), data.h_cut[rows]
    for index in g.layer_kwargs:
        parts = weights.get(index) or _own_projections(model, index)
        cache.update(*_prefix_kv(model, index, h_cut, parts, g.prefix_rope[index]), index)
    h = data.h_in[rows]  # [B, C, d]
    for index, kwargs in g.layer_kwargs.items():
        kwargs = {k: cache if isinstance(v, Cache) else v for k, v in kwargs.items()}
        h = layers[index](h, **kwargs)
    return head_logits(model, h)


def _kl(model, data: _Windows, rows: torch.Tensor, weights) -> torch.Tensor:
    """Mean over the windows' scored tokens of KL(full || POP), nats (a scalar with gradients)."""
    with torch.no_grad():
        teacher = torch.log_softmax(head_logits(model, data.teacher[rows]).float(), dim=-1)  # [B, C, V]
    student = torch.log_softmax(_student_logits(model, data, rows, weights).float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


@torch.no_grad()
def _mean_kl(model, data: _Windows, rows: torch.Tensor, weights) -> float:
    per_forward = max(1, min(8, EVAL_LOGITS // data.teacher.shape[1]
                             // model.get_output_embeddings().out_features))
    total = sum(float(_kl(model, data, chunk, weights)) * len(chunk) for chunk in rows.split(per_forward))
    return total / len(rows)


@contextlib.contextmanager
def _frozen(model: torch.nn.Module) -> Iterator[None]:
    """The model's own parameters take no gradients (restored after)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# --- training -----------------------------------------------------------------------------------

Weights = dict[int, dict[str, Projection]]


def _trainable(weights: Weights) -> Weights:
    """Leaf copies of ``weights`` that take gradients."""
    fresh = lambda t: None if t is None else t.detach().clone().requires_grad_(True)
    return {i: {part: Projection(fresh(p.weight), fresh(p.bias)) for part, p in parts.items()}
            for i, parts in weights.items()}


def _snapshot(weights: Weights) -> Weights:
    frozen = lambda t: None if t is None else t.detach().clone()
    return {i: {part: Projection(frozen(p.weight), frozen(p.bias)) for part, p in parts.items()}
            for i, parts in weights.items()}


def _tensors(weights: Weights) -> list[torch.Tensor]:
    return [t for parts in weights.values() for p in parts.values() for t in (p.weight, p.bias)
            if t is not None]


@dataclass(frozen=True)
class _Best:
    kl: float
    step: int
    weights: Weights


def _train(model, data: _Windows, weights: Weights, train: torch.Tensor, held: torch.Tensor,
           config: DistillConfig, report: Callable[[DistillProgress], None]) -> tuple[float, _Best, int]:
    """Adam on ``weights`` in place; (held-out KL of the init, the best by held-out KL, steps run)."""
    optimiser = torch.optim.Adam(_tensors(weights), lr=config.lr)
    shuffle = torch.Generator().manual_seed(config.seed + 1)
    initial = _mean_kl(model, data, held, weights)
    best, held_kl, stale, order, step = _Best(initial, 0, _snapshot(weights)), initial, 0, [], 0
    while step < config.steps and stale < config.patience:
        step += 1
        order = order or train[torch.randperm(len(train), generator=shuffle)].tolist()  # one epoch
        loss = _kl(model, data, torch.tensor([order.pop()]), weights)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        if step % config.eval_every == 0 or step == config.steps:
            held_kl = _mean_kl(model, data, held, weights)
            best, stale = ((_Best(held_kl, step, _snapshot(weights)), 0) if held_kl < best.kl
                           else (best, stale + 1))
        report(DistillProgress("train", step, config.steps, float(loss.detach()), held_kl))
    return initial, best, step


def check_cut(cut: int, num_layers: int) -> None:
    """ConfigError unless some layer past ``cut`` has K/V to fit or distil (layer ``cut`` keeps its own)."""
    if not 1 <= cut <= num_layers - 2:
        raise ConfigError(f"cut={cut} of {num_layers} layers leaves no K/V to fit (layer {cut} reads h_cut "
                          "in the full model too and keeps its own): use a cut in "
                          f"1..{num_layers - 2} (--cut)")


def _check_windows(windows: torch.Tensor, config: DistillConfig) -> None:
    if not (isinstance(windows, torch.Tensor) and windows.dim() == 2 and not windows.is_floating_point()):
        raise InputError(f"windows must be token ids [W, T], got {type(windows).__name__} "
                         f"{tuple(getattr(windows, 'shape', ()))}: stack equal-length windows")
    if windows.shape[1] < config.continuation + 2:
        raise InputError(f"windows of {windows.shape[1]} tokens leave no prompt before the "
                         f"{config.continuation} scored tokens: give windows of at least "
                         f"{config.continuation + 2} tokens (--seq-len)")


def _split(count: int, config: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, held-out) window indices, shuffled with the seed."""
    held = max(1, round(count * config.held_out))
    if count - held < 1:
        raise InputError(f"{count} window(s) are too few for a held-out split: give at least 2 "
                         "(more calibration text or a larger --max-tokens)")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed))
    return order[held:], order[:held]


@torch.no_grad()
def pop_continuation_logits(model, windows: torch.Tensor, cut: int, weights: Weights,
                            continuation: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """(full model's, POP's) teacher-forced logits [W, C, V] of the last C tokens of each window [W, T], by
    the precomputed path a distillation step takes (reference.continuation_logits computes the same)."""
    _check_windows(windows, DistillConfig(continuation=continuation))
    data = _precompute(model, windows, cut, continuation, lambda done: None)
    rows = torch.arange(windows.shape[0])
    return head_logits(model, data.teacher), _student_logits(model, data, rows, weights)


def continuation_kl(model, windows: torch.Tensor, cut: int, weights: Weights,
                    continuation: int = 48) -> float:
    """Mean KL(full || POP) over the last ``continuation`` tokens of each window [W, T], with ``weights``
    on the deep layers' K/V (the same value reference.continuation_logits gives, without running it)."""
    config = DistillConfig(continuation=continuation)
    _check_windows(windows, config)
    with torch.no_grad():
        data = _precompute(model, windows, cut, continuation, lambda done: None)
        return _mean_kl(model, data, torch.arange(windows.shape[0]), weights)


def distill_kv(model, windows: torch.Tensor, init: KVFit, config: DistillConfig = DistillConfig(),
               progress: Callable[[DistillProgress], None] | None = None) -> DistillResult:
    """Distil ``init``'s deep K/V projections (cut ``init.info.cut``) on windows of token ids [W, T]."""
    check_fit_shapes(init, model)
    check_cut(init.info.cut, init.info.num_layers)
    _check_windows(windows, config)
    split, report = _split(windows.shape[0], config), progress or (lambda event: None)
    data = _precompute(model, windows, init.info.cut, config.continuation, _teacher_report(report, windows))
    return _distilled(model, data, windows, init, split, config, report)


def ridge_then_distill(model, windows: torch.Tensor, cut: int, config: DistillConfig = DistillConfig(), *,
                       ridge: float = KVFitConfig.ridge, bias: bool = DEFAULT_FIT_BIAS["distill"],
                       progress: Callable[[DistillProgress], None] | None = None) -> DistillResult:
    """``distill_kv`` from the ridge fit (calibrate.fit_kv_cuts) on the same windows [W, T], both from one
    full-model pass: the ridge fit's statistics are taken from the forward the distillation precomputes
    (rows 0..T-2 of each window), which saves a full forward over the corpus. ``bias`` on by default: the
    configuration measured (docs/results.md, POP++), where training has a per-channel offset to move."""
    check_cut(cut, model.config.get_text_config().num_hidden_layers)
    _check_windows(windows, config)
    split, report = _split(windows.shape[0], config), progress or (lambda event: None)
    moments = CutMoments(model, [cut], ridge=ridge, bias=bias)
    data = _precompute(model, windows, cut, config.continuation, _teacher_report(report, windows), moments)
    return _distilled(model, data, windows, moments.fits()[cut], split, config, report)


def _teacher_report(report: Callable[[DistillProgress], None],
                    windows: torch.Tensor) -> Callable[[int], None]:
    return lambda done: report(DistillProgress("teacher", done, windows.shape[0]))


def _distilled(model, data: _Windows, windows: torch.Tensor, init: KVFit,
               split: tuple[torch.Tensor, torch.Tensor], config: DistillConfig,
               report: Callable[[DistillProgress], None]) -> DistillResult:
    """Train ``init``'s weights on the precomputed ``data`` of ``windows``, split (train, held out)."""
    train, held = split
    weights = _trainable(init.weights)
    with _frozen(model):
        initial, best, steps = _train(model, data, weights, train, held, config, report)
    digest = hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest()
    info = replace(init.info, tokens=windows.numel(), corpus_sha256=digest, method="distill")
    fit = check_finite(KVFit(info, best.weights), "the distilled fit")
    return DistillResult(fit, initial, best.kl, best.step, steps, tuple(held.tolist()), init)


def default_windows(tokenizer, *, seq_len: int = DEFAULT_SEQ_LEN,
                    max_tokens: int = KVFitConfig.max_tokens) -> torch.Tensor:
    """Token windows [W, seq_len] of the built-in calibration corpus (calibrate.default_batches: stdlib
    modules disjoint from the evaluation's; 116 windows of 560 tokens by default)."""
    batches = default_batches(tokenizer, seq_len=seq_len, max_tokens=max_tokens)
    if not batches:
        raise InputError(f"the built-in calibration corpus has no window of {seq_len} tokens for this "
                         "tokenizer: give a file from `popcompile calibrate --method distill` with your "
                         "own text")
    return torch.cat(batches)
