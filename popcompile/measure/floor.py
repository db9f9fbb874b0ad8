"""The quality floor: how often POP at each cut keeps the full model's answer, and the cut that holds it.

    measure_cuts(model, prompts, fits)   {cut: CutQuality} on the floor's prompts (floor_prompts.py)
    choose_cut(qualities, floor)         the deepest cut whose first-token agreement meets the floor

One full-model pass per prompt serves every cut (kvfit/student.teacher_run: the input of every layer from
the deepest candidate on, the full model's C greedy tokens), then per cut a pass of layers cut..L-1 over
those C rows only, under a cache of the K/V projections of h_cut (student_logits). Teacher-forced on the
full model's greedy tokens, POP's argmax agrees with them exactly as long as POP's own greedy tokens do:

    first_token      POP's first generated token equals the full model's (row 0: x_N's prediction)
    matched_prefix   the leading run of equal tokens, 0..C: what free-running greedy POP would match

Cost (SmolLM2-135M, 64 prompts of ~300 tokens, C = 32, 15 cuts, two CPU cores): the full-model passes
and C-1 greedy steps per prompt dominate; each cut adds its deep layers on C rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from ..config import QualityFloor
from ..kvfit.student import Weights, Windows, head_logits, student_logits, teacher_run
from .floor_prompts import FloorPrompt


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
                 continuation: int = QualityFloor.continuation,
                 progress: Callable[[int], None] | None = None) -> dict[int, CutQuality]:
    """``{cut: CutQuality}`` of POP at each cut of ``fits`` (cut -> the deep layers' K/V weights; None or
    {}: the layers' own, the paper's POP) against the full model, on ``prompts`` (each at least 2 tokens),
    over ``continuation`` greedy tokens. ``progress(done)`` after each prompt."""
    if not fits:
        return {}
    first, device = min(fits), next(model.parameters()).device
    equal: dict[int, list[torch.Tensor]] = {cut: [] for cut in fits}
    count = 0
    for count, prompt in enumerate(prompts, 1):
        ids = torch.tensor([prompt.ids], device=device)
        run = teacher_run(model, ids, first, continuation)
        targets = head_logits(model, run.teacher).argmax(-1)  # [1, C]: the full model's greedy tokens
        for cut, weights in fits.items():
            h_cut, h_in, geometry = run.at(cut)
            data = Windows(h_cut, h_in, torch.empty(0), targets, None, geometry)
            logits = student_logits(model, data, torch.tensor([0]), weights or {})  # [1, C, V]
            equal[cut].append((logits.argmax(-1) == targets)[0].long().cpu())  # [C]
        if progress is not None:
            progress(count)
    return {cut: _quality(cut, torch.stack(rows), continuation) for cut, rows in equal.items() if rows}


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
