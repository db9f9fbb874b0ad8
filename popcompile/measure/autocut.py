"""``export --cut auto --budget B``: the cut analyze recommends for a loaded model, and its record.

    budget=B   stage-aware importance (analyze.recommended_cut): the deepest cut whose pruned layers hold at
               most B of prefill importance (default analyze.DEFAULT_BUDGET)

The CLI calls ``choose_cut`` before the driver and hands its cut and record to ``PopConfig`` (``cut``,
``cut_choice``). ``--cut auto`` alone is the quality floor, a step of the driver (quality/floor.py).
"""
from __future__ import annotations

from typing import Any


def choose_cut(loaded: Any, *, budget: float | None = None) -> tuple[int, dict]:
    """``(cut, record)`` for ``loaded`` (a models.LoadedModel) by stage-aware importance."""
    from .analyze import DEFAULT_BUDGET, recommended_cut

    budget = DEFAULT_BUDGET if budget is None else budget
    folder = getattr(loaded.source, "path", None)  # a VLM's preprocessor_config.json is there
    cut = recommended_cut(loaded.model, loaded.tokenizer, budget=budget, folder=folder)
    return cut, {"method": "analyze", "budget": budget, "cut": cut}


def describe(*, budget: float | None = None) -> str:
    """What ``choose_cut`` will do, and about how long it takes (for a CLI note)."""
    from .analyze import DEFAULT_BUDGET

    return ("choosing the cut: stage-aware importance, prefill budget "
            f"{DEFAULT_BUDGET if budget is None else budget:.0%} "
            "(2-3 min on a 2-core CPU; `popcompile analyze` shows the table)")
