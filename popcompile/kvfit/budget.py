"""What a K/V fit costs before it runs, where it runs, and what it does within its time budget.

    resolve_device(spec)                 KVFitConfig.device -> a torch.device (auto: cuda when torch sees a
                                         GPU, else cpu); EnvironmentUnavailable when the device is absent
    device_speed(device)                 a short benchmark on the device, cached per process: matmul FLOP/s
                                         and the latency of one small op
    fit_work(...)                        the fit's FLOPs and layer calls, counted from what really runs
    plan_fit(model, tokens, cut, config) the estimate, and the method that runs: distill falls back to ridge
                                         (POP+) when its estimate exceeds the budget, or when the model was
                                         built without its weights and they do not fit in memory (FitPlan)
    available_memory()                   bytes the fit may hold (psutil's available, less a margin)
    on_device(model, device)             the model moved there for the fit, and back after

The estimate is ``flops / flops_per_s + layer_calls * OPS_PER_LAYER_CALL * op_s``: matmul throughput for
the arithmetic, and per-op latency for what a small model spends in eager PyTorch's dispatch (a tiny model's
fit is all latency, an 8B one all FLOPs). FLOPs, with cost.Geometry's counting (multiply-add = 2)::

    ridge     per [B, T] batch: L * layer(0, T) through the decoder (no LM head), then the moments in
              float64 (counted twice): per token (d+1)^2 + (d+1) * 2 kv_width (L-1-cut), and each deep
              layer's k/v of its true input; the solves, 2 (L-1-cut) (d+1)^3 / 3 * 2
    distill   the teacher pass, per window of T tokens (P pruned rows, C scored rows): the prefix
              L * layer(0, P) + head, the greedy continuation (C-1 decode steps, greedy targets), the scored
              rows L * layer(P, C) + head, the ridge moments (as above, over P + C rows), the LM head on the
              C rows twice (top-k, then the S kept rows; S bounded by min(V, W C k)); then
              steps * 3 * student  (forward + backward) and (steps / eval_every + 1) * held * student,
              student = (L-cut) * (kv(P) + layer(P, C)) + C * 2 d S; every step counted (an upper
              bound: ``patience`` often ends training earlier)

Budget: ``plan_fit`` decides before anything runs; distill stops at its deadline inside training
(distill._train, keeping the best held-out weights), ridge after the batch that crosses it (fit on the
tokens seen). The record of both (``FitPlan.record``) is the manifest's ``extra.kv_fit``.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator

import torch

from ..config import KVFitConfig
from ..cost import Geometry
from ..errors import EnvironmentUnavailable

#: eager PyTorch ops (dispatches) per decoder-layer call (norms, projections, RoPE, attention, MLP, residuals)
#: and per call of the whole model (Hugging Face's masks, RoPE tables, cache, embedding, hooks), calibrated
#: on tiny models, whose fits are all latency (tests/test_budget.py: the estimate within 5x of the time)
LAYER_OPS = 60
MODEL_OPS = 250
#: float64 (the ridge moments) against float32 matmul throughput
FLOAT64_COST = 2.0
#: a distillation step's backward against its forward (activation gradients + the trained K/V weights)
BACKWARD_COST = 2.0
METHOD_NAMES = {"ridge": "POP+", "distill": "POP++"}


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` (KVFitConfig.device: auto | cpu | cuda | cuda:N | mps) names on this machine;
    EnvironmentUnavailable, naming --device, when it is not there."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EnvironmentUnavailable(f"--device {spec}: torch sees no CUDA GPU on this machine "
                                         "(torch.cuda.is_available() is False): give --device cpu or auto")
        index = int(spec.split(":")[1]) if ":" in spec else 0
        if index >= torch.cuda.device_count():
            raise EnvironmentUnavailable(f"--device {spec}: this machine has {torch.cuda.device_count()} "
                                         f"CUDA GPU(s): give cuda:0..cuda:{torch.cuda.device_count() - 1}")
    if spec == "mps" and not torch.backends.mps.is_available():
        raise EnvironmentUnavailable("--device mps: torch sees no Apple GPU (torch.backends.mps."
                                     "is_available() is False): give --device cpu or auto")
    return torch.device(spec)


@dataclass(frozen=True)
class DeviceSpeed:
    flops_per_s: float  # float32 matmul throughput
    op_s: float         # seconds per small eager op (dispatch latency, measured on an add)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@lru_cache(maxsize=None)
def device_speed(device: torch.device) -> DeviceSpeed:
    """Measured on ``device``, once per process (a fraction of a second): float32 matmul FLOP/s (the best of
    a few [n, n] products, n 1024 on a CPU, 4096 on a GPU) and the time of one small op (an add)."""
    n = 1024 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(4):  # the first is a warm-up
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    # dispatch latency: an add on 512 values, below every intra-op threading grain (a tiny matmul may be
    # threaded, and on busy cores waits for its second thread for milliseconds: not what a fit's ops see)
    x = torch.randn(8, 64, device=device)
    op = float("inf")
    for _ in range(6):  # the best of a few runs: another process on the cores makes some much slower
        _sync(device)
        start = time.perf_counter()
        for _ in range(40):
            x + 1.0
        _sync(device)
        op = min(op, (time.perf_counter() - start) / 40)
    return DeviceSpeed(2 * n ** 3 / max(best, 1e-9), op)


@dataclass(frozen=True)
class Work:
    """What a fit does: ``flops`` of arithmetic in ``ops`` eager op dispatches."""

    flops: float
    ops: float = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.ops + other.ops)

    def __mul__(self, factor: float) -> Work:
        return Work(self.flops * factor, self.ops * factor)

    def seconds(self, speed: DeviceSpeed) -> float:
        return self.flops / speed.flops_per_s + self.ops * speed.op_s


def _model_call(g: Geometry, past: int, tokens: int, head: bool = True) -> Work:
    """The whole model on ``tokens`` rows after ``past`` cached ones (the LM head on the last row)."""
    layers = g.num_hidden_layers
    return Work(layers * g.layer(past, tokens) + head * g.head, MODEL_OPS + layers * LAYER_OPS)


def _moments(g: Geometry, cut: int, tokens: int) -> Work:
    """The ridge statistics of ``tokens`` rows at ``cut`` (calibrate.CutMoments.add), float64."""
    d, kv_width, deep = g.hidden_size + 1, g.num_key_value_heads * g.head_dim, g.num_hidden_layers - 1 - cut
    flops = 2 * tokens * d * d + 2 * tokens * d * 2 * kv_width * deep + deep * g.kv(tokens)
    return Work(FLOAT64_COST * flops, 0)


def _solves(g: Geometry, cut: int) -> Work:
    d = g.hidden_size + 1
    return Work(FLOAT64_COST * 2 * (g.num_hidden_layers - 1 - cut) * 2 * d ** 3 / 3, 0)


def ridge_work(g: Geometry, cut: int, batches: list[tuple[int, int]]) -> Work:
    """The ridge fit over ``batches`` [(B, T)] (calibrate.ridge_fits): the decoder, the moments, the
    solves."""
    work = Work(0)
    for rows, length in batches:
        work = work + _model_call(g, 0, length, head=False) * rows + _moments(g, cut, rows * length)
    return work + _solves(g, cut)


def floor_work(g: Geometry, cuts: list[int], prompts: int, length: int, continuation: int, batch: int,
               search: list[tuple[int, int]]) -> Work:
    """The quality floor's search (quality/floor.search): POP+ at every cut in ``cuts`` from one pass over
    the ``search`` batches [(B, T)] (empty: no fit), then per batch of ``batch`` prompts of ``length``
    tokens the teacher (the prompt, ``continuation`` - 1 greedy steps, the scored rows) and per cut the deep
    layers on the scored rows and the LM head on them; the chosen cut measured again (one more teacher)."""
    if not cuts:
        return Work(0)
    layers, c = g.num_hidden_layers, continuation
    work = Work(0)
    for rows, size in search:
        work = work + _model_call(g, 0, size, head=False) * rows
        work = work + sum((_moments(g, cut, rows * size) for cut in cuts), Work(0))
    if search:
        work = work + sum((_solves(g, cut) for cut in cuts), Work(0))
    p = length - 1
    teacher = _model_call(g, 0, p) * batch + _model_call(g, p, c) * batch
    for i in range(c - 1):  # a greedy step runs the batch together: FLOPs per row, dispatches once
        step = _model_call(g, p + i, 1)
        teacher = teacher + Work(step.flops * batch, step.ops)
    head = 2 * g.hidden_size * g.vocab_size * c * batch
    student = sum((Work((layers - cut) * (g.kv(p) + g.layer(p, c)) * batch + head,
                        MODEL_OPS + (layers - cut) * LAYER_OPS) for cut in cuts), Work(0))
    batches = -(-prompts // batch)
    return work + (teacher * 2 + student) * batches


def floor_seconds(model, cuts: list[int], prompts: int, length: int, continuation: int, batch: int,
                  search: list[tuple[int, int]]) -> float:
    """``floor_work`` over the measured speed of the model's device (quality/floor.estimate_s)."""
    g = Geometry.from_config(model.config.get_text_config())
    work = floor_work(g, cuts, prompts, length, continuation, batch, search)
    return work.seconds(device_speed(next(model.parameters()).device))


def distill_work(g: Geometry, cut: int, windows: int, length: int, config: KVFitConfig) -> Work:
    """ridge_then_distill over ``windows`` windows of ``length`` tokens (module docstring)."""
    d, layers, dc = g.hidden_size, g.num_hidden_layers, config.distill
    c = dc.continuation
    greedy = dc.targets == "greedy"
    p = length - 1 if greedy else length - c - 1
    teacher = _model_call(g, 0, p) + _model_call(g, p, c)
    if greedy:  # the full model's greedy tokens, one decode step each
        for i in range(c - 1):
            teacher = teacher + _model_call(g, p + i, 1)
    scored = min(g.vocab_size, windows * c * dc.vocab_top_k) if dc.vocab_top_k else g.vocab_size
    teacher = teacher + _moments(g, cut, p + c) + Work(c * 2 * d * (g.vocab_size + scored))
    deep = layers - cut
    student = Work(deep * (g.kv(p) + g.layer(p, c)) + c * 2 * d * scored, MODEL_OPS + deep * LAYER_OPS)
    held = max(1, round(windows * dc.held_out))
    scores = dc.steps // dc.eval_every + 1 + (dc.steps % dc.eval_every > 0)
    return (teacher * windows + _solves(g, cut) + student * (dc.steps * (1 + BACKWARD_COST))
            + student * (scores * held))


def fit_work(model_config, cut: int, config: KVFitConfig, shapes: list[tuple[int, int]]) -> Work:
    """The work of ``config.method``'s fit at ``cut`` on token ids of ``shapes`` [(rows, length)]: distill's
    windows (one shape), or ridge's batches (a distill's windows in batches of 4 rows when ridge replaces
    it). A vision-language model's vision tower is not counted (its text decoder is)."""
    g = Geometry.from_config(model_config.get_text_config() if hasattr(model_config, "get_text_config")
                             else model_config)
    if config.method == "distill":
        (rows, length), = shapes
        return distill_work(g, cut, rows, length, config)
    return ridge_work(g, cut, shapes)


def in_batches(shapes: list[tuple[int, int]], rows: int = 4) -> list[tuple[int, int]]:
    """``shapes`` cut into batches of ``rows`` rows (how the ridge fit takes a distillation's windows)."""
    return [(min(rows, count - start), length) for count, length in shapes for start in range(0, count, rows)]


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


@dataclass(frozen=True)
class FitPlan:
    """What a fit will do, decided before it starts: ``requested`` method, the ``method`` that runs (ridge
    when distill's estimate exceeds the budget: ``fallback`` says why), on ``device``, its estimate."""

    requested: str
    method: str
    device: str
    flops: float
    flops_per_s: float
    estimate_s: float
    budget_s: float | None
    fallback: str | None = None
    fallback_cause: str | None = None  # the fallback in a few words, for a summary line

    def line(self) -> str:
        """``fitting POP++ K/V weights on cpu: ~4 min estimated (2.1 TFLOP at 9.0 GFLOP/s measured)``."""
        budget = "" if self.budget_s is None else f"; budget {_duration(self.budget_s)}"
        over = self.budget_s is not None and self.estimate_s > self.budget_s
        tail = ": stops at the budget with the best weights so far" if over else ""
        return (f"fitting {METHOD_NAMES[self.method]} K/V weights on {self.device}: "
                f"~{_duration(self.estimate_s)} estimated ({_si(self.flops, 'FLOP')} at "
                f"{_si(self.flops_per_s, 'FLOP/s')} measured{budget}){tail}")

    def record(self, elapsed_s: float, stopped: str | None) -> dict:
        """The manifest's ``extra.kv_fit``: the plan, the time the fit took, and why it stopped early."""
        return {"requested": self.requested, "method": self.method, "device": self.device,
                "estimate_s": round(self.estimate_s, 1), "flops": self.flops,
                "flops_per_s": round(self.flops_per_s), "budget_s": self.budget_s, "fallback": self.fallback,
                "fallback_cause": self.fallback_cause,
                "elapsed_s": round(elapsed_s, 1), "stopped": stopped}


#: what the fit leaves free of the available memory (activations, the moments, the rest of the process)
MEMORY_MARGIN = 0.8


def available_memory() -> int:
    """Bytes a fit may hold on this machine: ``MEMORY_MARGIN`` of what psutil says is available."""
    import psutil

    return int(psutil.virtual_memory().available * MEMORY_MARGIN)


def plan_fit(model, shapes: list[tuple[int, int]], cut: int, config: KVFitConfig, device: torch.device, *,
             unread_bytes: int = 0, memory: int | None = None) -> FitPlan:
    """The plan for ``config.method`` at ``cut`` on tokens of ``shapes`` (fit_work) on ``device``. Distill
    becomes ridge on the same windows, with a ``fallback`` line, when its estimate exceeds
    ``config.budget_s``, or when ``unread_bytes`` (the weights of a model built without them,
    frontend.lazy) exceed ``memory`` (default ``available_memory()``): distill trains through the whole
    model, ridge reads one layer at a time. A ridge fit over the budget still runs, stopping at it
    (FitPlan.line says so)."""
    speed = device_speed(device)
    work = fit_work(model.config, cut, config, shapes)
    estimate = work.seconds(speed)
    plan = FitPlan(config.method, config.method, str(device), work.flops, speed.flops_per_s, estimate,
                   config.budget_s)
    if config.method != "distill":
        return plan
    ridge = fit_work(model.config, cut, replace(config, method="ridge"), in_batches(shapes))
    instead = f"fitting POP+ (ridge, ~{_duration(ridge.seconds(speed))}) instead"
    if unread_bytes and unread_bytes > (memory := available_memory() if memory is None else memory):
        cause = "its float32 weights exceed the memory available"
        reason = (f"POP++ (distill) trains through the whole model: its float32 weights "
                  f"({unread_bytes / 2**30:.1f} GiB) exceed the memory available for the fit "
                  f"({memory / 2**30:.1f} GiB); {instead}, reading one layer's weights at a time; a machine "
                  "with more memory (or a GPU, --device cuda) fits POP++")
    elif config.budget_s is not None and estimate > config.budget_s:
        cause = "over the calibration budget"
        reason = (f"POP++ (distill) is estimated at ~{_duration(estimate)}, over --calibration-budget "
                  f"{_duration(config.budget_s)} on {device}: {instead}; give a larger --calibration-budget "
                  "or a GPU (--device cuda) for POP++")
    else:
        return plan
    return replace(plan, method="ridge", flops=ridge.flops, estimate_s=ridge.seconds(speed), fallback=reason,
                   fallback_cause=cause)


@contextlib.contextmanager
def on_device(model: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """``model`` on ``device`` while the context is open, back on its own device after (a no-op when it is
    there already)."""
    home = next(model.parameters()).device
    if home == device:
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to(home)


class Deadline:
    """A budget running from its creation: ``passed()`` once ``seconds`` have gone (never with None)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def passed(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds
