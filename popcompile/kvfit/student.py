"""The full model as POP's teacher, and POP's deep layers as the student, from one forward per window.

Shared by POP++'s training (distill.py) and the quality floor (floor.py). For a window of token ids, one
full-model forward without gradients (``teacher_run``) gives everything POP's output needs at every cut
from ``first_cut`` on (P pruned rows, C scored rows: x_N and the continuation, d hidden width)::

    pruned[l]   [1, P, d]   input of layer l at the pruned rows (POP at cut l: every deep layer's K/V source)
    scored[l]   [1, C, d]   input of layer l at the scored rows (exact in POP at cut l: shallow layers)
    teacher     [1, C, d]   the last layer's output at the scored rows (the full model's logits, via the head)

and each deep layer's call arguments for the C rows (mask, RoPE tables, positions) and its RoPE tables of
the P pruned rows. ``student_logits`` then runs only layers ``cut..L-1`` on the C rows, over a cache of
the K/V projections of ``pruned[cut]`` (``weights`` for layers past the cut, layer ``cut``'s own).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..config import DistillConfig
from ..errors import UnsupportedModelError
from ..frontend.arch import arch_spec, finish_logits, kv_projections, pruned_kv
from ..frontend.capture import cache_keyword
from ..passes.pop import Projection
from .calibrate import PARTS, CutMoments

Weights = dict[int, dict[str, Projection]]


@dataclass(frozen=True)
class Geometry:
    """What every window shares: each deep layer's call arguments for the C scored rows (its cache
    argument replaced per step) and its RoPE tables (cos, sin) [1, P, D] of the P pruned rows."""

    layer_kwargs: dict[int, dict[str, Any]]
    prefix_rope: dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Windows:
    h_cut: torch.Tensor      # [W, P, d]
    h_in: torch.Tensor       # [W, C, d]
    teacher: torch.Tensor    # [W, C, S] float32 logits on the vocabulary rows ``vocab``
    targets: torch.Tensor    # [W, C] the teacher's argmax over the whole vocabulary
    vocab: torch.Tensor | None  # [S] vocabulary rows scored (None: all)
    geometry: Geometry


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
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
          **{cache_keyword(model): cache})


def _greedy(model, last: torch.Tensor, cache: DynamicCache, start: int, steps: int) -> torch.Tensor:
    """The full model's greedy tokens [B, steps] after ``last`` [B, 1] at position ``start`` (``cache`` is
    copied, not extended)."""
    cache, tokens = copy.deepcopy(cache), [last]
    for i in range(steps):
        position = torch.full_like(last, start + i)  # [B, 1]
        out = model(input_ids=tokens[-1], position_ids=position,
                    use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
        tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens[1:], dim=1) if steps else last[:, :0]


@dataclass(frozen=True)
class TeacherRun:
    """One window through the full model (module docstring): every layer from ``first_cut`` on."""

    pruned: dict[int, torch.Tensor]   # l -> [1, P, d] input of layer l at the pruned rows
    scored: dict[int, torch.Tensor]   # l -> [1, C, d] input of layer l at the scored rows
    teacher: torch.Tensor             # [1, C, d] the last layer's output at the scored rows
    scored_ids: torch.Tensor          # [1, C] x_N and the continuation
    geometry: Geometry                # layers first_cut..L-1

    def at(self, cut: int) -> tuple[torch.Tensor, torch.Tensor, Geometry]:
        """(h_cut [1, P, d], h_in [1, C, d], the geometry of layers cut..L-1) of POP at ``cut``."""
        g = self.geometry
        return self.pruned[cut], self.scored[cut], Geometry(
            {i: kw for i, kw in g.layer_kwargs.items() if i >= cut},
            {i: rope for i, rope in g.prefix_rope.items() if i >= cut})


@torch.no_grad()
def teacher_run(model, ids: torch.Tensor, first_cut: int, continuation: int, targets: str = "greedy",
                moments: CutMoments | None = None) -> TeacherRun:
    """The full model over one window ``ids`` [1, T] in two forwards: the pruned rows, then the C scored
    rows (the window's last C tokens, or x_N and the full model's C-1 greedy tokens after it), recording the
    input of every layer from ``first_cut`` on. With ``moments``, those inputs over every row run also go
    into the ridge fit's statistics: its forward is this one."""
    layers, norm = model.get_decoder().layers, model.get_decoder().norm
    deep = {i: layers[i] for i in range(first_cut, len(layers))}
    greedy = targets == "greedy"
    rows, cache = ids.shape[1] - (1 if greedy else continuation + 1), DynamicCache()
    with _recorded_calls(deep) as calls:
        _forward(model, ids[:, :rows], cache, 0)
    pruned = {i: _hidden(call) for i, call in calls.items()}  # [1, P, d] per deep layer
    prefix_rope = {i: tuple(kwargs["position_embeddings"]) for i, (_, kwargs) in calls.items()}
    scored = (torch.cat([ids[:, rows:], _greedy(model, ids[:, rows:], cache, rows, continuation - 1)], dim=1)
              if greedy else ids[:, rows:-1])
    with _recorded_calls({**deep, -1: norm}) as calls:
        _forward(model, scored, cache, rows)
    teacher = _hidden(calls.pop(-1))
    if moments is not None:
        moments.add({i: torch.cat([pruned[i], _hidden(call)], dim=1)[0] for i, call in calls.items()},
                    torch.cat([ids[:, :rows], scored], dim=1))
    layer_kwargs = {i: kwargs for i, (_, kwargs) in calls.items()}
    return TeacherRun(pruned, {i: _hidden(call) for i, call in calls.items()}, teacher, scored,
                      Geometry(layer_kwargs, prefix_rope))


def run_window(model, ids: torch.Tensor, cut: int, continuation: int, targets: str,
               moments: CutMoments | None = None):
    """``teacher_run`` at one cut: (h_cut, h_in, teacher hidden state [1, C, d], geometry)."""
    run = teacher_run(model, ids, cut, continuation, targets, moments)
    return run.pruned[cut], run.scored[cut], run.teacher, run.geometry


@torch.no_grad()
def _scored_vocab(model, teacher: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                     torch.Tensor | None]:
    """(the teacher's logits [W, C, S] on the kept vocabulary rows, its argmax [W, C] over all of them, the
    rows kept [S] or None for all) from its hidden states [W, C, d]: the union of every row's top ``top_k``
    tokens (0: the whole vocabulary). One window's [C, V] logits at a time."""
    whole = [head_logits(model, h[None]).float() for h in teacher] if top_k == 0 else None
    if whole is not None:
        return torch.cat(whole), torch.cat([x.argmax(-1) for x in whole]), None
    kept = torch.zeros(model.get_output_embeddings().out_features, dtype=torch.bool, device=teacher.device)
    argmax = []
    for h in teacher:
        top = head_logits(model, h[None]).topk(top_k, dim=-1).indices  # [1, C, k], sorted: argmax first
        kept[top.flatten()] = True
        argmax.append(top[..., 0])
    vocab = kept.nonzero()[:, 0]
    return torch.cat([head_logits(model, h[None], vocab).float() for h in teacher]), torch.cat(argmax), vocab


def precompute(model, windows: torch.Tensor, cut: int, config: DistillConfig,
                report: Callable[[int], None], moments: CutMoments | None = None) -> Windows:
    """``run_window`` over every window [W, T] (on the model's device, one at a time); the geometry is the
    first window's (all share one length)."""
    runs, geometry, device = [], None, next(model.parameters()).device
    for i in range(windows.shape[0]):
        *tensors, found = run_window(model, windows[i:i + 1].to(device), cut, config.continuation,
                                      config.targets, moments)
        runs.append(tensors)
        geometry = geometry or found
        report(i + 1)
    h_cut, h_in, hidden = (torch.cat(parts) for parts in zip(*runs))
    return Windows(h_cut, h_in, *_scored_vocab(model, hidden, config.vocab_top_k), geometry)


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


def own_projections(model, index: int) -> dict[str, Projection]:
    spec, layer = arch_spec(model.config), model.get_decoder().layers[index]
    return {part: Projection(p.weight, p.bias) for part, p in kv_projections(spec, layer).items()}


def head_logits(model, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, C, V] from the last layer's output ``h`` [B, C, d]: final norm, LM head, the
    model's scaling and soft-cap (arch.finish_logits); with ``vocab`` [S] its rows only: [B, C, S]."""
    head, x = model.get_output_embeddings(), model.get_decoder().norm(h)
    if vocab is None:
        logits = head(x)
    else:
        bias = None if head.bias is None else head.bias[vocab]
        logits = torch.nn.functional.linear(x, head.weight[vocab], bias)
    return finish_logits(model.config, logits)


def student_logits(model, data: Windows, rows: torch.Tensor, weights: dict[int, dict[str, Projection]]):
    """POP's logits [B, C, S] of the windows ``rows`` (a [B] index) with ``weights`` on the deep layers."""
    layers, g = model.get_decoder().layers, data.geometry
    cache, h_cut = DynamicCache(), data.h_cut[rows]
    for index in g.layer_kwargs:
        parts = weights.get(index) or own_projections(model, index)
        cache.update(*_prefix_kv(model, index, h_cut, parts, g.prefix_rope[index]), index)
    h = data.h_in[rows]  # [B, C, d]
    for index, kwargs in g.layer_kwargs.items():
        kwargs = {k: cache if isinstance(v, Cache) else v for k, v in kwargs.items()}
        h = layers[index](h, **kwargs)
    return head_logits(model, h, data.vocab)
