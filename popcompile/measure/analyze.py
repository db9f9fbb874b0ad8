"""``popcompile analyze``: stage-aware layer importance with virtual gates (Fisher approximation).

Every residual branch (attention, MLP) of every layer gets a gate g = 1 on the prefill positions and
another on the decode positions (``measure/gates.py``). A gate's importance is ``E[(dL/dg)^2]`` over
sequences: the Fisher approximation of the loss increase when the branch is removed there (g: 1 -> 0).
"layer" gates both branches with one g: gradient dL/dg_attn + dL/dg_mlp, importance its mean square.

Stages follow POP exactly. A sample is ``context_len + gen_len`` tokens of real text: a prompt
x_1..x_N (N = context_len) and y_1..y_G (G = gen_len). The model reads x_1..x_N y_1..y_{G-1}; the loss
is the mean next-token cross-entropy of y_1..y_G, predicted at the last G positions. POP prefills
x_1..x_{N-1}: those N - 1 positions carry the prefill gates; x_N (the boundary token, run by the full
model) and y_1..y_{G-1} are the decode positions. So a layer's prefill importance is what POP's
pruning of that layer puts at risk, and the last layer's is exactly 0 (POP at cut = L - 1 is exact).

A vision-language model (frontend/vision.py) is scored over its text decoder on image+text prompts
(``analyze_vision.py``): each window's prompt starts with a synthetic image in a chat turn, so its image
tokens are prefill positions like any prompt token; the decoder reads the model's own image features,
M-RoPE positions and deepstack features, and the recommended cut keeps the deepstack layers (cut >= k).

Gradients are per sequence (one gate tensor per row; loss = sum of the rows' losses), so scores do
not depend on the batch size. float32, one forward-backward per batch, parameters frozen (only
activations are kept: memory grows with batch x sequence length).
"""
from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import resolve_cut
from ..errors import ConfigError, ModelError
from ..frontend.arch import arch_spec, attention_windows, finish_logits
from ..frontend.capture import attention_for_capture, build_mask
from ..frontend.vision import deepstack_layers, vision_spec
from ..fsutil import atomic_path, atomic_write
from .analyze_samples import (  # noqa: F401 (the corpus moved there; its names stay importable here)
    ImagePrompts,
    Samples,
    default_sources,
    humaneval_prompts,
    stdlib_docstrings,
    token_windows,
)
from .analyze_vision import image_samples
from .gates import BRANCHES, STAGES, GateResult, gate_pass

#: Share of the total prefill importance that the recommended cut may prune (docs/analyze.md).
DEFAULT_BUDGET = 0.01
REPORT_JSON = "analyze.json"
REPORT_PNG = "analyze.png"


@dataclass(frozen=True)
class AnalyzeConfig:
    samples: int = 32  # sequences scored (fewer when the text runs out)
    context_len: int = 512  # prompt tokens N; POP prefills N - 1 of them
    gen_len: int = 32  # tokens predicted after the prompt (the decode stage)
    batch_size: int = 2  # sequences per forward-backward (memory grows linearly with it)
    budget: float = DEFAULT_BUDGET  # share of prefill importance the recommended cut may prune

    def __post_init__(self) -> None:
        for name, low in (("samples", 1), ("context_len", 2), ("gen_len", 1), ("batch_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"AnalyzeConfig.{name} must be an int >= {low}, got {value!r}")
        if not (isinstance(self.budget, (int, float)) and math.isfinite(self.budget)
                and 0.0 <= self.budget < 1.0):
            raise ConfigError(f"AnalyzeConfig.budget={self.budget} is out of range: use 0 <= budget < 1")

    @property
    def window(self) -> int:
        return self.context_len + self.gen_len


#: A quick configuration for ``recommended_cut`` (export --cut auto): 2-3 minutes on a shared 2-core CPU.
AUTO_CONFIG = AnalyzeConfig(samples=16, context_len=256, gen_len=32)


@dataclass(frozen=True)
class StageScores:
    """One number per branch of one layer in one stage."""

    attn: float
    mlp: float
    layer: float  # both branches under one gate


@dataclass(frozen=True)
class LayerScore:
    index: int
    prefill: StageScores  # importance E[(dL/dg)^2]
    decode: StageScores
    prefill_grad: StageScores  # first-order term E[dL/dg] (removing the branch changes L by about -this)
    decode_grad: StageScores
    prefill_stderr: StageScores  # standard error of the importance over sequences
    decode_stderr: StageScores


@dataclass(frozen=True)
class DeepSummary:
    """The paper's question for the default cut: is the deep third's prefill importance lower?"""

    cut: int  # default cut (L - floor(L/3)); deep layers are cut..L-1
    prefill: float  # summed layer importance of the deep layers
    decode: float
    prefill_share: float  # of the total over all layers
    decode_share: float
    layers_prefill_lower: int  # deep layers whose prefill importance is below their decode importance


@dataclass(frozen=True)
class AnalyzeReport:
    model: str
    model_type: str
    num_layers: int
    config: AnalyzeConfig
    corpus: Mapping[str, int]  # source -> sequences taken from it
    samples: int
    loss: float  # mean next-token cross-entropy of the scored tokens (nats)
    layers: tuple[LayerScore, ...]
    deep: DeepSummary
    recommended_cut: int
    seconds: float
    peak_rss_mb: float  # peak resident memory of the whole process (model included)
    images: ImagePrompts | None = None  # a vision-language model's image+text prompts; None: text only

    def to_json(self) -> str:
        """The report as JSON; a text model's has no ``images`` key (its report is as it always was)."""
        data = asdict(self)
        if data["images"] is None:
            del data["images"]
        return json.dumps(data, indent=2)


# --- the gated graph -----------------------------------------------------------------------------

class Scorer(torch.nn.Module):
    """input_ids [B, S] -> logits [B, G, V] of the last G positions (a full causal forward).

    The same masks and attention function as ``capture.py``; the LM head runs on the last G positions
    only (Gemma 3's 262k vocabulary over every position would dominate time and memory).
    """

    def __init__(self, model: torch.nn.Module, gen_len: int):
        super().__init__()
        self.model = model
        self.gen_len = gen_len
        self.mask_mapping = arch_spec(model.config).mask_mapping
        self.windows = attention_windows(model.config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        positions = torch.arange(seq).expand(batch, seq)  # [B, S] no padding
        masks = {kind: build_mask(torch.ones_like(input_ids), seq, w) for kind, w in self.windows.items()}
        mask = masks if self.mask_mapping else next(iter(masks.values()))
        out = self.model.model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                               use_cache=False)
        return finish_logits(self.model.config, self.model.lm_head(out.last_hidden_state[:, -self.gen_len:]))


def capture_scorer(model: torch.nn.Module, batch: int, seq_len: int, gen_len: int) -> GateResult:
    """torch.export the Scorer at static [batch, seq_len] and run the gates pass on it."""
    if not 1 <= gen_len <= seq_len:
        raise ValueError(f"gen_len={gen_len} must be in 1..seq_len={seq_len}")
    example = torch.zeros(batch, seq_len, dtype=torch.long)
    with attention_for_capture(model):
        program = torch.export.export(Scorer(model, gen_len).eval(), (example,), strict=False)
    return gate_pass(program.module())


@contextlib.contextmanager
def frozen_parameters(module: torch.nn.Module) -> Iterator[None]:
    """No parameter requires grad inside (the backward keeps no weight-gradient inputs); restored after."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def stage_mask(batch: int, context_len: int, gen_len: int) -> torch.Tensor:
    """[B, S] float: 0 on POP's prefill positions 0..N-2, 1 on the decode positions N-1..N+G-2."""
    stage = torch.zeros(batch, context_len + gen_len - 1)
    stage[:, context_len - 1:] = 1.0
    return stage


def sequence_losses(gm: torch.nn.Module, windows: torch.Tensor, gates: torch.Tensor, stage: torch.Tensor,
                    context_len: int, inputs: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy [B] of each window's tokens after ``context_len`` (y_1..y_G),
    the gated graph reading ``inputs`` (default: windows[:, :-1]; a VLM's graph: Samples.inputs) with the
    given ``gates`` [B, L, 2, 2] and ``stage`` [B, S]."""
    (logits,) = gm(*(inputs or (windows[:, :-1],)), gates, stage)  # [B, G, V]
    targets = windows[:, context_len:]  # [B, G]
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape[:2])} do not match targets {tuple(targets.shape)}: "
                         "the graph was captured for another context/generation length")
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return nll.view(targets.shape).mean(dim=1)


def gate_gradients(gated: GateResult, windows: torch.Tensor, context_len: int, gen_len: int,
                   progress: Callable[[int], None] | None = None,
                   inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence dL/dgates [N, L, 2, 2] (float64) and losses [N], one forward-backward per batch;
    ``inputs(rows)``: the graph's inputs for row indices [B] (default: the windows' ids, ``Samples.inputs``).

    A last, short batch is filled with copies of its first row that enter no loss.
    """
    gm, batch = gated.graph_module, gated.batch
    stage = stage_mask(batch, context_len, gen_len)
    grads, losses = [], []
    with frozen_parameters(gm), torch.enable_grad():
        for start in range(0, len(windows), batch):
            real = min(batch, len(windows) - start)
            index = torch.tensor([*range(start, start + real), *[start] * (batch - real)])  # [B]
            feed = None if inputs is None else inputs(index)
            gates = torch.ones(batch, gated.num_layers, 2, 2, requires_grad=True)
            loss = sequence_losses(gm, windows[index], gates, stage, context_len, feed)[:real]  # [real]
            (grad,) = torch.autograd.grad(loss.sum(), gates)
            grads.append(grad[:real].double())
            losses.append(loss.detach().double())
            if progress is not None:
                progress(real)
    return torch.cat(grads), torch.cat(losses)


# --- scores and the recommended cut ----------------------------------------------------------------

def layer_scores(grads: torch.Tensor) -> tuple[LayerScore, ...]:
    """Per-layer importance, first-order term and standard error from per-sequence grads [N, L, 2, 2]."""
    if grads.dim() != 4 or grads.shape[2:] != (len(BRANCHES), len(STAGES)):
        raise ValueError(f"expected grads [N, L, 2, 2], got {tuple(grads.shape)}")
    full = torch.cat([grads, grads.sum(dim=2, keepdim=True)], dim=2)  # [N, L, 3, 2]: attn, mlp, layer
    squares = full ** 2
    fisher, mean = squares.mean(dim=0), full.mean(dim=0)  # [L, 3, 2]
    stderr = squares.std(dim=0) / math.sqrt(len(grads)) if len(grads) > 1 else torch.zeros_like(fisher)

    def stage(table: torch.Tensor, layer: int, s: int) -> StageScores:
        return StageScores(*(float(v) for v in table[layer, :, s]))

    return tuple(
        LayerScore(l, stage(fisher, l, 0), stage(fisher, l, 1), stage(mean, l, 0), stage(mean, l, 1),
                   stage(stderr, l, 0), stage(stderr, l, 1))
        for l in range(grads.shape[1]))


def cut_from_scores(prefill: Sequence[float], budget: float, keep: int = 1) -> int:
    """The first layer of the deepest contiguous block (layers cut..L-1) whose share of the total
    prefill importance is at most ``budget``; L (nothing pruned) when even the last layer is over.
    Never below ``keep`` (at least 1: layer 0 always runs; a VLM keeps its deepstack layers 0..k-1)."""
    if not (math.isfinite(budget) and 0.0 <= budget < 1.0):
        raise ConfigError(f"budget={budget} is out of range: use 0 <= budget < 1")
    if len(prefill) == 1:
        return 1  # one layer: it is the last, its prefill importance is 0, and layer 0 always runs
    total = float(sum(prefill))
    if not math.isfinite(total) or total <= 0 or min(prefill) < 0:
        raise ModelError(f"prefill importances must be finite, >= 0 and not all 0, got total {total}: "
                         "the model's weights or gradients overflow; check the model in float32")
    cut, tail = len(prefill), 0.0
    for layer in range(len(prefill) - 1, max(keep, 1) - 1, -1):
        tail += prefill[layer]
        if tail / total > budget:
            break
        cut = layer
    return cut


def recommend_cut(report: AnalyzeReport, budget: float) -> int:
    """``cut_from_scores`` on the report's prefill layer importance (a VLM's: at or above its deepstack)."""
    keep = report.images.deepstack if report.images is not None else 1
    return cut_from_scores([layer.prefill.layer for layer in report.layers], budget, keep)


def deep_summary(layers: Sequence[LayerScore]) -> DeepSummary:
    """Prefill against decode importance of the layers the default cut prunes (the last third)."""
    cut = resolve_cut(len(layers))
    prefill, decode = ([getattr(layer, stage).layer for layer in layers] for stage in STAGES)
    deep_p, deep_d = sum(prefill[cut:]), sum(decode[cut:])
    lower = sum(p < d for p, d in zip(prefill[cut:], decode[cut:]))
    return DeepSummary(cut, deep_p, deep_d, deep_p / (sum(prefill) or 1.0), deep_d / (sum(decode) or 1.0),
                       lower)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_analyze(model: torch.nn.Module, tokenizer: Any, config: AnalyzeConfig = AnalyzeConfig(), *,
                sources: Mapping[str, Iterable[str]] | None = None, name: str | None = None,
                folder: str | Path | None = None,
                progress: Callable[[int, int], None] | None = None) -> AnalyzeReport:
    """Score every layer's branches in both stages on real text (the built-in corpus by default); a
    vision-language model on image+text prompts (``folder``: the model folder, whose
    preprocessor_config.json says how images become tokens).

    ``progress(done, total)`` is called after every batch with the sequences it scored.
    """
    start = time.perf_counter()
    _check_model(model, config)
    samples = analysis_samples(model, tokenizer, config, sources, folder)
    if progress is not None:
        progress(0, len(samples))  # the total is known before the capture (which takes a while)
    gated = samples.capture(model, min(config.batch_size, len(samples)), config.window - 1, config.gen_len)
    report_progress = None if progress is None else (lambda done: progress(done, len(samples)))
    grads, losses = gate_gradients(gated, samples.windows, config.context_len, config.gen_len,
                                   report_progress, samples.inputs)
    layers = layer_scores(grads)
    cut = cut_from_scores([layer.prefill.layer for layer in layers], config.budget,
                          deepstack_layers(model.config))
    return AnalyzeReport(
        model=name or str(getattr(model.config, "_name_or_path", "")), model_type=model.config.model_type,
        num_layers=len(layers), config=config, corpus={k: v for k, v in samples.corpus.items() if v},
        samples=len(samples), loss=float(losses.mean()), layers=layers, deep=deep_summary(layers),
        recommended_cut=cut, seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb(),
        images=samples.images)


def analysis_samples(model: torch.nn.Module, tokenizer: Any, config: AnalyzeConfig,
                     sources: Mapping[str, Iterable[str]] | None, folder: str | Path | None) -> Samples:
    """The corpus's token windows, read by ``capture_scorer``'s graph; a vision-language model's behind
    synthetic image prompts (``analyze_vision.image_samples``)."""
    windows, taken = token_windows(default_sources() if sources is None else sources, tokenizer,
                                   config.window, config.samples)
    if vision_spec(model.config) is not None:
        return image_samples(model, tokenizer, windows, taken, config.context_len, folder)
    return Samples(windows, taken, capture_scorer, lambda rows: (windows[rows, :-1],))


def _check_model(model: torch.nn.Module, config: AnalyzeConfig) -> None:
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ConfigError(f"analyze runs in float32, the model is {dtype}: "
                          "load it in float32 (model.float())")
    text = model.config.get_text_config()  # a VLM's text decoder; a text model's own config
    if config.window > (limit := getattr(text, "max_position_embeddings", None) or math.inf):
        raise ConfigError(f"--context-len + --gen-len = {config.window} exceeds the model's "
                         f"max_position_embeddings={limit}: use shorter lengths")


def recommended_cut(model: torch.nn.Module, tokenizer: Any, *, budget: float = DEFAULT_BUDGET,
                    config: AnalyzeConfig = AUTO_CONFIG, sources: Mapping[str, Iterable[str]] | None = None,
                    folder: str | Path | None = None,
                    progress: Callable[[int, int], None] | None = None) -> int:
    """The cut for ``export --cut auto``: a quick analysis (``AUTO_CONFIG``) and ``recommend_cut``."""
    report = run_analyze(model, tokenizer, replace(config, budget=budget), sources=sources, folder=folder,
                         progress=progress)
    return report.recommended_cut


# --- outputs -----------------------------------------------------------------------------------------

def write_outputs(report: AnalyzeReport, out_dir: Path) -> tuple[Path, Path]:
    """``analyze.json`` and ``analyze.png`` in ``out_dir`` (created if missing), each through a temporary
    file and one rename: a reader never sees half a file, an interrupted run leaves the old ones."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    json_path, png_path = Path(out_dir) / REPORT_JSON, Path(out_dir) / REPORT_PNG
    atomic_write(json_path, report.to_json() + "\n")
    with atomic_path(png_path) as tmp:
        plot_report(report, tmp)
    return json_path, png_path


def format_table(report: AnalyzeReport) -> str:
    """The terminal table: per layer, prefill and decode importance of attention, MLP and both."""
    prefill = [layer.prefill.layer for layer in report.layers]
    total = sum(prefill) or 1.0
    cfg, deep = report.config, report.deep
    lines = [f"{report.model} ({report.model_type}, {report.num_layers} layers): {report.samples} sequences, "
             f"context {cfg.context_len} + {cfg.gen_len} generated, loss {report.loss:.3f} nats",
             "importance E[(dL/dg)^2]; 'share' = prefill importance of this layer and all deeper ones",
             f"{'layer':>5} | {'prefill attn':>12} {'mlp':>9} {'layer':>9} | {'decode attn':>11} {'mlp':>9} "
             f"{'layer':>9} | {'share':>6}"]
    if report.images is not None:
        lines.insert(1, image_line(report.images, cfg.context_len))
    for layer in report.layers:
        p, d = layer.prefill, layer.decode
        share = sum(prefill[layer.index:]) / total
        mark = ("  <- recommended cut" if layer.index == report.recommended_cut else "") + \
               ("  <- default cut" if layer.index == deep.cut else "")
        lines.append(f"{layer.index:>5} | {p.attn:>12.2e} {p.mlp:>9.2e} {p.layer:>9.2e} | {d.attn:>11.2e} "
                     f"{d.mlp:>9.2e} {d.layer:>9.2e} | {share:>6.1%}{mark}")
    lines += [f"deep layers {deep.cut}..{report.num_layers - 1} (default cut): prefill {deep.prefill:.3g} "
              f"({deep.prefill_share:.1%} of all prefill) vs decode {deep.decode:.3g} "
              f"({deep.decode_share:.1%} of all decode); prefill below decode in "
              f"{deep.layers_prefill_lower} of {report.num_layers - deep.cut}",
              f"recommended cut (budget {cfg.budget:.1%} of prefill importance): {report.recommended_cut} "
              f"(prunes {report.num_layers - report.recommended_cut} layers; default cut {deep.cut})",
              f"{report.seconds:.0f} s, peak memory {report.peak_rss_mb:.0f} MB"]
    return "\n".join(lines)


def image_line(images: ImagePrompts, context_len: int) -> str:
    """How a vision-language model's sequences were built, in one line of the table."""
    tokens, turns, k = images.image_tokens, images.prompt_tokens, images.deepstack
    return (f"image+text prompts: one synthetic image per sequence, before the text: "
            f"{min(tokens)}-{max(tokens)} image tokens in a {min(turns)}-{max(turns)}-token image turn, "
            f"of {context_len} prompt tokens"
            + (f"; deepstack into layers 0..{k - 1}: the cut stays >= {k}" if k else ""))


def plot_report(report: AnalyzeReport, path: Path) -> None:
    """Prefill vs decode importance over depth (log scale, +-1 standard error shaded; exact zeros,
    i.e. the last layer's prefill, are gaps) and the prefill share each cut would prune."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    _plot_layers(axes[0], report)
    _plot_branches(axes[1], report)
    _plot_share(axes[2], report)
    for ax, offset in zip(axes, (0.5, 0.5, 0.0)):  # layer axes: the cut lies before its layer
        ax.set_yscale("log")
        ax.axvline(report.deep.cut - offset, color="gray", ls=":", label=f"default cut {report.deep.cut}")
        ax.axvline(report.recommended_cut - offset, color="green", ls="--",
                   label=f"recommended cut {report.recommended_cut}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    kind = "image+text " if report.images is not None else ""
    fig.suptitle(f"{report.model}: virtual-gate importance, {report.samples} {kind}sequences, context "
                 f"{report.config.context_len} + {report.config.gen_len} generated", fontsize=11)
    fig.savefig(path, dpi=110)


def _plot_layers(ax, report: AnalyzeReport) -> None:
    x = [layer.index for layer in report.layers]
    for stage, color in (("prefill", "tab:blue"), ("decode", "tab:red")):
        value = [getattr(layer, stage).layer for layer in report.layers]
        err = [getattr(layer, f"{stage}_stderr").layer for layer in report.layers]
        ax.plot(x, _positive(value), "o-", color=color, label=stage)
        low, high = ([v + sign * e for v, e in zip(value, err)] for sign in (-1, 1))
        ax.fill_between(x, _positive(low), _positive(high), color=color, alpha=0.15, lw=0)
    ax.set(title="layer (attention + MLP, one gate)", xlabel="layer", ylabel="importance E[(dL/dg)²]")
    ax.annotate("last layer's prefill: exactly 0", (1.0, 0.02), xycoords="axes fraction", ha="right",
                fontsize=7)


def _plot_branches(ax, report: AnalyzeReport) -> None:
    x = [layer.index for layer in report.layers]
    for stage, color in (("prefill", "tab:blue"), ("decode", "tab:red")):
        for branch, style, label in (("attn", "o-", "attention"), ("mlp", "s--", "MLP")):
            values = [getattr(getattr(layer, stage), branch) for layer in report.layers]
            ax.plot(x, _positive(values), style, color=color, label=f"{stage} {label}", ms=4)
    ax.set(title="per branch", xlabel="layer")


def _plot_share(ax, report: AnalyzeReport) -> None:
    prefill = [layer.prefill.layer for layer in report.layers]
    cuts = list(range(1, len(prefill)))
    shares = [sum(prefill[c:]) / (sum(prefill) or 1.0) for c in cuts]
    ax.plot(cuts, _positive(shares), "o-", color="tab:blue", label="prefill importance pruned")
    ax.axhline(report.config.budget, color="black", lw=1, label=f"budget {report.config.budget:.1%}")
    if report.images is not None and report.images.deepstack > 1:  # cuts 1..k-1 would prune deepstack layers
        ax.axvspan(0.5, report.images.deepstack - 0.5, color="gray", alpha=0.15, lw=0,
                   label=f"refused: below deepstack k={report.images.deepstack}")
    ax.set(title="share of prefill importance in layers cut..L-1", xlabel="cut (first pruned layer)",
           ylabel="share")


def _positive(values: Sequence[float]) -> list[float]:
    """Log axes cannot show 0: exact zeros (the last layer's prefill) become gaps."""
    return [v if v > 0 else math.nan for v in values]
