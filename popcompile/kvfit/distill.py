"""POP++: distil the pruned layers' K/V projections on the output (zero inference overhead).

POP+ (calibrate.py) fits each deep layer's K/V to the full model's K/V. What a user sees is the output,
so here the same weights W'_K, W'_V (and biases where the projection has one) of layers ``cut+1..L-1``
start from a fit (the ridge one) and are trained to minimise, over windows of text,

    sum over t = 0..C-1 of  w_t KL_t(full || POP) / sum_t w_t,     w_0 = boundary_weight, w_t = 1 after

where row 0 is the boundary token x_N (its prediction is the first generated token, made by the full model
over POP's deep K/V) and rows 1..C-1 the scored continuation, teacher-forced: ``x_1..x_{N-1}`` are prefilled
under POP, x_N and the continuation run through the full model (reference.continuation_logits, prefix N, C
tokens). ``DistillConfig.targets`` picks the continuation:

    greedy    windows [W, N] are prompts; the continuation is the full model's own greedy output y_1..y_{C-1}
              (what a user's first generated tokens are; matched prefix = leading argmax agreement on it)
    document  windows [W, N + C]: the last C tokens of the text (x_N is the window's N-th token)

Why a step is cheap: layers ``0..cut-1`` and ``h_cut`` never depend on the trained weights (the shallow
layers are exact in POP), so one full-model forward per window, without gradients, gives everything a
step needs (P = N-1 pruned rows, C scored rows, d hidden width, S scored vocabulary rows)::

    h_cut    [1, P, d]   input of layer cut at the pruned rows (every deep layer's K/V source in POP)
    h_in     [1, C, d]   input of layer cut at the boundary and continuation rows (exact in POP too)
    teacher  [1, C, S]   the full model's logits at those rows, on the S vocabulary rows kept: the union of
                         every row's top ``vocab_top_k`` (all V with 0), computed once
    targets  [1, C]      the full model's argmax at those rows (greedy: y_1..y_C)

and, from the first window (every window has the same length), each deep layer's call arguments for
the C rows (mask, RoPE tables, positions) and its RoPE tables (cos, sin) [1, P, D] of the pruned rows.
A step then runs only layers ``cut..L-1``, with gradients, on the C rows, and the LM head on the S rows; the
cache holds

    k_l = RoPE_l(k_norm_l(input_norm_l(h_cut) W'_K^T + b'_K)),   v_l = input_norm_l(h_cut) W'_V^T + b'_V

(arch.pruned_kv: no input norm in a post-norm layer, OLMo 2; k and v clamped where the family clips them,
OLMoE) (layer ``cut`` keeps its own weights: it reads ``h_cut`` in the full model too). Adam on one window
per step; a held-out share of the windows is scored every ``eval_every`` steps (KL, first-token agreement
and matched prefix against ``targets``); the best weights by ``select`` are kept, and training stops after
``patience`` scores without improvement.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from ..config import DEFAULT_FIT_BIAS, DistillConfig, KVFitConfig
from ..errors import ConfigError, InputError
from ..passes.pop import Projection
from .calibrate import (
    CutMoments,
    KVFit,
    check_finite,
    check_fit_shapes,
    default_batches,
)
from .distill_windows import prompt_windows
from .student import Weights, Windows, precompute, student_logits

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
class Score:
    """Held-out windows with one set of weights: mean KL over every scored row (unweighted, nats, on the
    scored vocabulary), the share whose first scored token's argmax is the target, the mean matched prefix."""

    kl: float
    first_token: float
    matched_prefix: float

    def better_than(self, other: "Score", select: str) -> bool:
        if select == "kl":
            return self.kl < other.kl
        return (self.matched_prefix, -self.kl) > (other.matched_prefix, -other.kl)


@dataclass(frozen=True)
class DistillResult:
    fit: KVFit            # the best weights by ``select`` (the init's if training never improved on it)
    initial: Score        # held-out scores of the init weights
    best: Score           # held-out scores of ``fit``
    best_step: int        # the step ``fit`` was taken at (0: the init)
    steps_run: int        # steps done before the end or the early stop
    held_out: tuple[int, ...]  # the windows (rows of ``windows``) scored for early stopping, never trained on
    init: KVFit           # the fit training started from (ridge_then_distill's ridge fit)
    #: why training ended before ``config.steps``: "patience" (no improvement), "budget" (``stop()`` said
    #: so: the time budget, kvfit/budget.py), None (every step ran)
    stopped: str | None = None

    @property
    def initial_kl(self) -> float:
        """Held-out KL(full || POP) with the init weights."""
        return self.initial.kl

    @property
    def best_kl(self) -> float:
        """Held-out KL of ``fit``."""
        return self.best.kl



def _row_kl(model, data: Windows, rows: torch.Tensor, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(full || POP) [B, C] of each scored row, nats, with gradients; POP's logits [B, C, S])."""
    teacher = torch.log_softmax(data.teacher[rows], dim=-1)
    logits = student_logits(model, data, rows, weights)
    student = torch.log_softmax(logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1), logits


def _loss(model, data: Windows, rows: torch.Tensor, weights, config: DistillConfig) -> torch.Tensor:
    """The weighted mean KL of the module docstring (a scalar with gradients)."""
    kl = _row_kl(model, data, rows, weights)[0]
    w = torch.ones(kl.shape[1], device=kl.device)
    w[0] = config.boundary_weight
    return (kl * w).sum(-1).mean() / w.sum()


@torch.no_grad()
def _score(model, data: Windows, rows: torch.Tensor, weights) -> Score:
    """The held-out ``Score`` of the windows ``rows`` with ``weights``."""
    per_forward = max(1, min(8, EVAL_LOGITS // data.teacher.shape[1] // data.teacher.shape[2]))
    kl, agree = [], []
    for chunk in rows.split(per_forward):
        row_kl, logits = _row_kl(model, data, chunk, weights)
        kl.append(row_kl)
        picked = logits.argmax(-1)
        agree.append((picked if data.vocab is None else data.vocab[picked]) == data.targets[chunk])
    kl, agree = torch.cat(kl), torch.cat(agree).long()  # [B, C] each
    return Score(float(kl.mean()), float(agree[:, 0].float().mean()),
                 float(agree.cumprod(1).sum(1).float().mean()))


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
    score: Score
    step: int
    weights: Weights


def _train(model, data: Windows, weights: Weights, train: torch.Tensor, held: torch.Tensor,
           config: DistillConfig, report: Callable[[DistillProgress], None],
           stop: Callable[[], bool] = lambda: False) -> tuple[Score, _Best, int, str | None]:
    """Adam on ``weights`` in place; (held-out score of the init, the best by ``config.select``, steps
    run, why it stopped early: "patience", "budget" or None). ``stop()`` is asked before every step; when it
    says so, the weights of the last step are scored too (unless just scored), so the best so far is kept."""
    optimiser = torch.optim.Adam(_tensors(weights), lr=config.lr)
    shuffle = torch.Generator().manual_seed(config.seed + 1)
    initial = _score(model, data, held, weights)
    best, held_kl, stale, order, step = _Best(initial, 0, _snapshot(weights)), initial.kl, 0, [], 0
    scored = 0
    while step < config.steps and stale < config.patience:
        if stop():
            if scored != step:
                score = _score(model, data, held, weights)
                if score.better_than(best.score, config.select):
                    best = _Best(score, step, _snapshot(weights))
            return initial, best, step, "budget"
        step += 1
        order = order or train[torch.randperm(len(train), generator=shuffle)].tolist()  # one epoch
        loss = _loss(model, data, torch.tensor([order.pop()]), weights, config)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        if step % config.eval_every == 0 or step == config.steps:
            score, scored = _score(model, data, held, weights), step
            held_kl = score.kl
            improved = score.better_than(best.score, config.select)
            best, stale = (_Best(score, step, _snapshot(weights)), 0) if improved else (best, stale + 1)
        report(DistillProgress("train", step, config.steps, float(loss.detach()), held_kl))
    return initial, best, step, "patience" if step < config.steps else None


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
    if config.targets == "greedy" and windows.shape[1] < 2:
        raise InputError(f"windows of {windows.shape[1]} token(s) leave nothing to prune: give windows of at "
                         "least 2 tokens (--seq-len)")
    if config.targets == "document" and windows.shape[1] < config.continuation + 2:
        raise InputError(f"windows of {windows.shape[1]} tokens leave no prompt before the "
                         f"{config.continuation} scored tokens: give windows of at least "
                         f"{config.continuation + 2} tokens (--seq-len)")


def check_inputs(model, windows: torch.Tensor, cut: int, config: DistillConfig) -> None:
    """What ``ridge_then_distill`` refuses, checked before anything runs (or is estimated)."""
    check_cut(cut, model.config.get_text_config().num_hidden_layers)
    _check_windows(windows, config)
    _split(windows.shape[0], config)


def _split(count: int, config: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, held-out) window indices, shuffled with the seed."""
    held = max(1, round(count * config.held_out))
    if count - held < 1:
        raise InputError(f"{count} window(s) are too few for a held-out split: give at least 2 "
                         "(more calibration text or a larger --max-tokens)")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed))
    return order[held:], order[:held]


#: the evaluation helpers score the window's own last tokens over the whole vocabulary
_DOCUMENT = DistillConfig(targets="document", vocab_top_k=0)


@torch.no_grad()
def pop_continuation_logits(model, windows: torch.Tensor, cut: int, weights: Weights,
                            continuation: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """(full model's, POP's) teacher-forced logits [W, C, V] of the last C tokens of each window [W, T], by
    the precomputed path a distillation step takes (reference.continuation_logits computes the same)."""
    config = replace(_DOCUMENT, continuation=continuation)
    _check_windows(windows, config)
    data = precompute(model, windows, cut, config, lambda done: None)
    rows = torch.arange(windows.shape[0])
    return data.teacher, student_logits(model, data, rows, weights)


def continuation_kl(model, windows: torch.Tensor, cut: int, weights: Weights,
                    continuation: int = 48) -> float:
    """Mean KL(full || POP) over the last ``continuation`` tokens of each window [W, T], with ``weights``
    on the deep layers' K/V (the same value reference.continuation_logits gives, without running it)."""
    config = replace(_DOCUMENT, continuation=continuation)
    _check_windows(windows, config)
    with torch.no_grad():
        data = precompute(model, windows, cut, config, lambda done: None)
        return _score(model, data, torch.arange(windows.shape[0]), weights).kl


def distill_kv(model, windows: torch.Tensor, init: KVFit, config: DistillConfig = DistillConfig(),
               progress: Callable[[DistillProgress], None] | None = None) -> DistillResult:
    """Distil ``init``'s deep K/V projections (cut ``init.info.cut``) on windows of token ids [W, T]."""
    check_fit_shapes(init, model)
    check_cut(init.info.cut, init.info.num_layers)
    _check_windows(windows, config)
    split, report = _split(windows.shape[0], config), progress or (lambda event: None)
    data = precompute(model, windows, init.info.cut, config, _teacher_report(report, windows))
    return _distilled(model, data, windows, init, split, config, report)


def ridge_then_distill(model, windows: torch.Tensor, cut: int, config: DistillConfig = DistillConfig(), *,
                       ridge: float = KVFitConfig.ridge, bias: bool = DEFAULT_FIT_BIAS["distill"],
                       progress: Callable[[DistillProgress], None] | None = None,
                       stop: Callable[[], bool] = lambda: False) -> DistillResult:
    """``distill_kv`` from the ridge fit (calibrate.ridge_fits) on the same windows [W, T], both from one
    full-model pass: the ridge fit's statistics are taken from the forward the distillation precomputes
    (document targets: rows 0..T-2 of each window; greedy: the window and the greedy tokens but the last),
    which saves a full forward over the corpus. ``bias`` on by default: the
    configuration measured (docs/results.md, POP++), where training has a per-channel offset to move.
    ``stop()`` (the time budget) ends training early, keeping the best weights so far (``_train``)."""
    check_cut(cut, model.config.get_text_config().num_hidden_layers)
    _check_windows(windows, config)
    split, report = _split(windows.shape[0], config), progress or (lambda event: None)
    moments = CutMoments(model, [cut], ridge=ridge, bias=bias)
    data = precompute(model, windows, cut, config, _teacher_report(report, windows), moments)
    return _distilled(model, data, windows, moments.fits()[cut], split, config, report, stop)


def _teacher_report(report: Callable[[DistillProgress], None],
                    windows: torch.Tensor) -> Callable[[int], None]:
    return lambda done: report(DistillProgress("teacher", done, windows.shape[0]))


def _distilled(model, data: Windows, windows: torch.Tensor, init: KVFit,
               split: tuple[torch.Tensor, torch.Tensor], config: DistillConfig,
               report: Callable[[DistillProgress], None],
               stop: Callable[[], bool] = lambda: False) -> DistillResult:
    """Train ``init``'s weights on the precomputed ``data`` of ``windows``, split (train, held out)."""
    train, held = split
    weights = _trainable(init.weights)
    with _frozen(model):
        initial, best, steps, stopped = _train(model, data, weights, train, held, config, report, stop)
    digest = hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest()
    info = replace(init.info, tokens=windows.numel(), corpus_sha256=digest, method="distill")
    fit = check_finite(KVFit(info, best.weights), "the distilled fit")
    return DistillResult(fit, initial, best.score, best.step, steps, tuple(held.tolist()), init, stopped)


def default_windows(tokenizer, config: DistillConfig = DistillConfig(), *, seq_len: int = KVFitConfig.seq_len,
                    max_tokens: int | None = None) -> torch.Tensor:
    """Windows of the built-in calibration text for ``config.targets``: greedy, prompts [W, seq_len] of code,
    prose and chat turns (distill_windows.prompt_windows); document, [W, seq_len + continuation] of the
    stdlib corpus (calibrate.default_batches). Both from text disjoint from the evaluation's; ``max_tokens``
    prompt tokens in all (default ``config.windows`` windows)."""
    max_tokens = config.windows * seq_len if max_tokens is None else max_tokens
    if config.targets == "greedy":
        return prompt_windows(tokenizer, seq_len, max(2, max_tokens // seq_len))
    length = seq_len + config.continuation
    batches = default_batches(tokenizer, seq_len=length, max_tokens=max_tokens * length // seq_len)
    if not batches:
        raise InputError(f"the built-in calibration corpus has no window of {length} tokens for this "
                         "tokenizer: give a file from `popcompile calibrate --method distill` with your "
                         "own text")
    return torch.cat(batches)
