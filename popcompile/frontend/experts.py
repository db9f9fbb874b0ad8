"""Mixture-of-experts layers under capture: transformers' experts as one op, ``popcompile::experts``.

transformers computes a sparse MoE block in two parts: the router (standard ops: a linear, softmax, top-k,
an optional renormalisation; each family its own) and the experts, a module decorated with
``use_experts_implementation`` whose forward takes ``(hidden [N, d], top_k_index [N, k], top_k_weights
[N, k])``. Its implementations do not capture: "eager" loops over the experts a batch hits (data-dependent),
"grouped_mm" is an opaque custom op on CPU, "batched_mm" gathers each token's expert weights ([N*k, 2I, d]:
gigabytes at prefill lengths). Capture runs the experts as ``popcompile::experts`` instead (registered as
the "popcompile" experts implementation), one node per layer that the exporters lower (exporters/moe.py):
onnxruntime's MoE operator, or standard ops at E/k times the active FLOPs.

    before: router -> top_k_index, top_k_weights -> <loop over experts hit: linear, act, linear, index_add>
    after:  router -> top_k_index, top_k_weights -> popcompile::experts(hidden, index, weights, gate_up, down)

The op's contract (what every lowering computes), with ``gate, up = (gate_up[e] @ x).chunk(2)``:

    y[n] = sum_j  weights[n, j] * down[e] @ (silu(gate) * up),   e = index[n, j]

Supported experts: gated (gate and up concatenated in one [E, 2I, d] parameter, transformers' layout), SiLU,
no biases, not transposed, no per-expert norm (Qwen2/3-MoE, Mixtral, OLMoE). Any other is refused by name
(``check_experts``) before capture rather than exported wrong.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from ..errors import ModelError

IMPLEMENTATION = "popcompile"
#: the experts module's flags (set by transformers' use_experts_implementation) the op computes
SUPPORTED_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                   "has_post_expert_norm": False}


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's experts modules (those transformers dispatches through its experts interface)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(experts_modules(model))


def check_experts(model: torch.nn.Module) -> None:
    """ModelError naming the first experts module the op does not compute."""
    for name, module in experts_modules(model):
        for flag, value in SUPPORTED_FLAGS.items():
            if getattr(module, flag, value) != value:
                raise ModelError(f"{name} ({type(module).__name__}) has {flag}={getattr(module, flag)}: "
                                 f"popcompile's experts op computes {flag}={value} only; this model's "
                                 "mixture of experts is not supported yet")
        act = type(getattr(module, "act_fn", None)).__name__
        if act not in ("SiLU", "SiLUActivation"):
            raise ModelError(f"{name} ({type(module).__name__}) uses the activation {act}: popcompile's "
                             "experts op computes SiLU-gated experts only; this model is not supported yet")


@functools.cache
def experts_op():
    """``torch.ops.popcompile.experts``, defined on first use (no registration on import)."""

    @torch.library.custom_op("popcompile::experts", mutates_args=())
    def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        # hidden [N, d]; top_k_index [N, k] int64; top_k_weights [N, k]; gate_up [E, 2I, d]; down [E, d, I]
        return _expert_sum(hidden, top_k_index, top_k_weights, gate_up, down)

    @experts.register_fake
    def _(hidden, top_k_index, top_k_weights, gate_up, down):
        return torch.empty_like(hidden)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        """Gradients for the hidden states and the routing weights (analyze's gates reach the loss through
        both), by autograd over the eager sum; none for the expert weights, which nothing here trains."""
        hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
        with torch.enable_grad():
            x, w = hidden.detach().requires_grad_(), top_k_weights.detach().requires_grad_()
            out = _expert_sum(x, top_k_index, w, gate_up.detach(), down.detach())
            dx, dw = torch.autograd.grad(out, (x, w), grad)
        return dx, None, dw, None, None

    experts.register_autograd(backward, setup_context=setup_context)
    return experts


def _expert_sum(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The op's eager value (the module docstring's sum), over the experts ``top_k_index`` hits."""
    out = torch.zeros_like(hidden)
    for expert in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == expert)
        gate, up = torch.nn.functional.linear(hidden[token], gate_up[expert]).chunk(2, dim=-1)
        rows = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[expert])
        out = out.index_add(0, token, rows * top_k_weights[token, slot, None].to(rows.dtype))
    return out


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "popcompile" experts implementation: the op (defined by ``_register``, before any trace: dynamo
    does not trace an op's definition) on the module's [E, 2I, d] and [E, d, I] weights."""
    return torch.ops.popcompile.experts.default(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                                                self.down_proj)


def use_pop_experts(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model``'s experts as ``popcompile::experts`` from now on (``popcompile.use_pop_experts``): what
    ``torch.compile(model, backend="pop")`` needs of a mixture of experts, whose other implementations
    flatten and sort the tokens by expert (no last position for the deep layers to take). Returns
    ``model``; ModelError for experts the op does not compute."""
    check_experts(model)
    _register()
    for config in {id(m.config): m.config for _, m in experts_modules(model)}.values():
        config._experts_implementation = IMPLEMENTATION
    return model


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts_op()
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


@contextlib.contextmanager
def experts_for_capture(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s experts as ``popcompile::experts`` (nothing for a dense model), restoring the
    user's implementation after."""
    if not is_moe(model):
        yield
        return
    check_experts(model)
    _register()
    configs = {id(m.config): m.config for _, m in experts_modules(model)}
    previous = {key: config._experts_implementation for key, config in configs.items()}
    for config in configs.values():
        config._experts_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = previous[key]
