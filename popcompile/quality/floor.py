"""The quality floor: how often POP at each cut keeps the full model's answer, and the cut that holds it.

    measure_cuts(model, prompts, fits)   {cut: CutQuality} on the floor's prompts (prompts.py)
    choose_cut(qualities, floor)         the deepest cut meeting the floor, every shallower one meeting it too
    search(model, tokenizer, floor)      POP+ at every candidate cut, measured, one chosen (FloorSearch)
    check_shipped(model, found, weights) the chosen cut with the weights that ship
    estimate_s(model, floor)             the search's time, before it runs (kvfit/budget.floor_work)

One full-model pass per prompt serves every cut (kvfit/student.teacher_run: the input of every layer from
the deepest candidate on, the full model's C greedy tokens), then per cut a pass of layers cut..L-1 over
those C rows only, under a cache of the K/V projections of h_cut (student_logits). Teacher-forced on the
full model's greedy tokens, POP's argmax agrees with them exactly as long as POP's own greedy tokens do:

    first_token      POP's first generated token equals the full model's (row 0: x_N's prediction)
    matched_prefix   the leading run of equal tokens, 0..C: what free-running greedy POP would match

Cost (SmolLM2-135M, 64 prompts of 256 tokens in batches of 8, C = 32, 15 cuts): the ridge pass over the
search tokens and the full-model passes dominate; each cut adds its deep layers and the LM head on C rows.
SmolLM2 on two CPU cores: 104 s measured, 96 s estimated (docs/results.md, "The quality floor").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from ..config import QualityFloor
from ..kvfit.student import Weights, Windows, head_logits, student_logits, teacher_run
from .prompts import LENGTH, FloorPrompt, floor_prompts

#: prompts per full-model pass (the teacher's greedy steps run them together)
BATCH = 8


@dataclass(frozen=True)
class CutQuality:
    cut: int
    first_token: float       # share of prompts whose first generated token is the full model's
    matched_prefix: float    # mean leading greedy tokens equal to the full model's, of ``continuation``
    prompts: int
    continuation: int

    def line(self) -> str:
        """``cut 24: first token equal on 96% of 64 held-out prompts, matched prefix 17.2/32``."""
        return (f"cut {self.cut}: first token equal on {self.first_token:.0%} of {self.prompts} held-out "
                f"prompts, matched prefix {self.matched_prefix:.1f}/{self.continuation}")

    def to_dict(self) -> dict:
        return {"cut": self.cut, "first_token": round(self.first_token, 4),
                "matched_prefix": round(self.matched_prefix, 2), "prompts": self.prompts,
                "continuation": self.continuation}


@torch.no_grad()
def measure_cuts(model: torch.nn.Module, prompts: Iterable[FloorPrompt], fits: Mapping[int, Weights | None],
                 continuation: int = QualityFloor.continuation, batch: int = BATCH,
                 progress: Callable[[int], None] | None = None) -> dict[int, CutQuality]:
    """``{cut: CutQuality}`` of POP at each cut of ``fits`` (cut -> the deep layers' K/V weights; None or
    {}: the layers' own, the paper's POP) against the full model, on ``prompts`` (each at least 2 tokens; runs
    of equal length go through the model ``batch`` at a time), over ``continuation`` greedy tokens.
    ``progress(done)`` after each batch, with the prompts done."""
    if not fits:
        return {}
    first, device = min(fits), next(model.parameters()).device
    equal: dict[int, list[torch.Tensor]] = {cut: [] for cut in fits}
    done = 0
    for group in _batches(list(prompts), batch):
        ids = torch.tensor([p.ids for p in group], device=device)  # [B, N]
        run = teacher_run(model, ids, first, continuation)
        targets = head_logits(model, run.teacher).argmax(-1)  # [B, C]: the full model's greedy tokens
        rows = torch.arange(len(group))
        for cut, weights in fits.items():
            h_cut, h_in, geometry = run.at(cut)
            data = Windows(h_cut, h_in, torch.empty(0), targets, None, geometry)
            logits = student_logits(model, data, rows, weights or {})  # [B, C, V]
            equal[cut].append((logits.argmax(-1) == targets).long().cpu())  # [B, C]
        done += len(group)
        if progress is not None:
            progress(done)
    return {cut: _quality(cut, torch.cat(rows), continuation) for cut, rows in equal.items() if rows}


def _batches(prompts: list[FloorPrompt], size: int) -> list[list[FloorPrompt]]:
    """Consecutive prompts of one length, ``size`` at most per batch."""
    groups: list[list[FloorPrompt]] = []
    for prompt in prompts:
        if groups and len(groups[-1]) < size and len(groups[-1][0].ids) == len(prompt.ids):
            groups[-1].append(prompt)
        else:
            groups.append([prompt])
    return groups


def _quality(cut: int, equal: torch.Tensor, continuation: int) -> CutQuality:
    # equal: [prompts, C] 1 where POP's argmax is the full model's greedy token
    return CutQuality(cut, float(equal[:, 0].double().mean()), float(equal.cumprod(1).sum(1).double().mean()),
                      equal.shape[0], continuation)


def choose_cut(qualities: Mapping[int, CutQuality], floor: QualityFloor, num_layers: int) -> int:
    """The deepest (smallest) cut whose first-token agreement is at least ``floor.min_agreement``, every
    shallower candidate meeting it too (one that does not would make a deeper pass an accident of the
    prompts); ``num_layers`` (no pruning) when even the shallowest misses it."""
    chosen = num_layers
    for cut in sorted(qualities, reverse=True):
        if qualities[cut].first_token < floor.min_agreement:
            break
        chosen = cut
    return chosen


@dataclass(frozen=True)
class Note:
    """A line for whoever draws the compile's progress (commands/fitprogress.py prints ``line()``)."""

    text: str
    fallback: str | None = None

    def line(self) -> str:
        return self.text


@dataclass(frozen=True)
class FloorSearch:
    """The cut ``choose_cut`` took from ``curve`` (each candidate's quality with the search's weights:
    POP+ fitted on ``search_tokens`` tokens, or the layers' own with ``fitted`` False), on ``prompts``."""

    floor: QualityFloor
    curve: dict[int, CutQuality]
    cut: int
    num_layers: int
    fitted: bool
    prompts: tuple[FloorPrompt, ...]

    def summary(self) -> str:
        """``quality floor 95%: cut 26 (first token 97%, matched prefix 14.1/32 with POP+); cut 25: 92%``."""
        fit = "POP+" if self.fitted else "POP"
        if self.cut >= self.num_layers:
            shallowest = self.curve[max(self.curve)]
            return (f"quality floor {self.floor.min_agreement:.0%}: no cut holds it (the shallowest, "
                    f"{shallowest.line()} with {fit}); nothing pruned")
        chosen, deeper = self.curve[self.cut], self.curve.get(self.cut - 1)
        miss = "" if deeper is None else f"; cut {deeper.cut}: {deeper.first_token:.0%}"
        return (f"quality floor {self.floor.min_agreement:.0%}: {chosen.line()} with {fit}{miss}")

    def record(self, shipped: CutQuality | None, method: str | None, third: int) -> dict:
        """The manifest's ``extra.cut_choice``: the floor, the prompts' provenance, the curve, the chosen
        cut's quality with the fit that ships (``method``), the paper's third (cut ``third``) beside it."""
        return {"method": "quality floor", "min_agreement": self.floor.min_agreement, "cut": self.cut,
                "prompts": len(self.prompts), "continuation": self.floor.continuation,
                "provenance": PROVENANCE,
                "search_fit": f"ridge (POP+) on {self.floor.search_tokens} tokens" if self.fitted else "none",
                "curve": [q.to_dict() for q in self.curve.values()],
                "shipped": None if shipped is None else {**shipped.to_dict(), "fit": method},
                "paper_third": self.curve[third].to_dict() if third in self.curve else None}


#: where the floor's prompts come from (prompts.py), as the manifest records it
PROVENANCE = ("quality/prompts.py: code, docstring and licence prose of standard-library modules "
              "held out of calibration and evaluation, raw and under the chat template")


def estimate_s(model: torch.nn.Module, floor: QualityFloor, *, fitted: bool, seq_len: int,
               length: int = LENGTH) -> float:
    """Seconds ``search`` and ``check_shipped`` should take on the model's device (kvfit/budget.py: the
    FLOPs and dispatches of ``floor_work`` over the device's measured speed)."""
    from ..kvfit.budget import floor_seconds, in_batches

    cuts = floor.candidates(model.config.get_text_config().num_hidden_layers)
    search = in_batches([(floor.search_tokens // seq_len, seq_len)]) if fitted else []
    return floor_seconds(model, cuts, floor.prompts, length, floor.continuation, BATCH, search)


def search(model: torch.nn.Module, tokenizer, floor: QualityFloor, *, fitted: bool, ridge: float, bias: bool,
           seq_len: int, progress: Callable | None = None) -> FloorSearch:
    """Measure every candidate cut (``floor.candidates``) and choose one. ``fitted``: with POP+ weights
    fitted at every candidate in one pass over ``floor.search_tokens`` tokens of the built-in corpus
    (``ridge``, ``bias``, windows of ``seq_len``), else the layers' own (kv_calibration none).
    ``progress(DistillProgress)``: phases "floor ridge" (tokens), "floor search" (prompts)."""
    from ..kvfit.calibrate import default_batches, ridge_fits
    from ..kvfit.distill import DistillProgress

    report = progress or (lambda event: None)
    layers = model.config.get_text_config().num_hidden_layers
    cuts = floor.candidates(layers)
    prompts = tuple(floor_prompts(tokenizer, floor.prompts))
    fits: dict[int, Weights | None] = dict.fromkeys(cuts)
    if fitted:
        batches = default_batches(tokenizer, seq_len=seq_len, max_tokens=floor.search_tokens)
        total, done = sum(b.numel() for b in batches), [0]

        def counted(count: int) -> None:
            done[0] += count
            report(DistillProgress("floor ridge", done[0], total))
        fits.update({c: f.weights for c, f in ridge_fits(model, batches, [c for c in cuts if c < layers - 1],
                                                          ridge=ridge, bias=bias, progress=counted).items()})
    curve = measure_cuts(model, prompts, fits, floor.continuation,
                         progress=lambda n: report(DistillProgress("floor search", n, len(prompts))))
    return FloorSearch(floor, curve, choose_cut(curve, floor, layers), layers, fitted, prompts)


def check_shipped(model: torch.nn.Module, found: FloorSearch, weights: Weights | None,
                  progress: Callable | None = None) -> CutQuality | None:
    """The chosen cut's quality with the weights that ship (None when the cut prunes nothing)."""
    from ..kvfit.distill import DistillProgress

    if found.cut >= found.num_layers:
        return None
    report, total = progress or (lambda event: None), len(found.prompts)
    return measure_cuts(model, found.prompts, {found.cut: weights}, found.floor.continuation,
                        progress=lambda n: report(DistillProgress("floor check", n, total)))[found.cut]
