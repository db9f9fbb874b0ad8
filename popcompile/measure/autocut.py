"""``export --cut auto``: the cut chosen for a loaded model, and the figures the manifest records.

    min_agreement=X   the eval sweep (eval/sweep.choose_cut): the deepest-pruning cut whose top-1
                      agreement with the full model on the built-in continuation data is >= X (minutes)
    budget=B          stage-aware importance (analyze.recommended_cut): the deepest cut whose pruned
                      layers hold at most B of prefill importance (default analyze.DEFAULT_BUDGET)

The CLI calls ``choose_cut`` before the driver and hands its cut and record to ``PopConfig``
(``cut``, ``cut_choice``): choosing is a measurement, compiling is not.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def choose_cut(loaded: Any, *, min_agreement: float | None = None, budget: float | None = None,
               kv_calibration: Any = "auto") -> tuple[int, dict]:
    """``(cut, record)`` for ``loaded`` (a models.LoadedModel); one of ``min_agreement`` / ``budget``."""
    if min_agreement is not None and budget is not None:
        raise ConfigError("--min-agreement (eval sweep) and --budget (analyze) are two ways to choose: "
                          "give one")
    if min_agreement is not None:
        from .eval.sweep import choose_cut as sweep_cut

        return sweep_cut(loaded, min_agreement, kv_calibration=kv_calibration)
    from .analyze import DEFAULT_BUDGET, recommended_cut

    budget = DEFAULT_BUDGET if budget is None else budget
    folder = getattr(loaded.source, "path", None)  # a VLM's preprocessor_config.json is there
    cut = recommended_cut(loaded.model, loaded.tokenizer, budget=budget, folder=folder)
    return cut, {"method": "analyze", "budget": budget, "cut": cut}


def describe(*, min_agreement: float | None = None, budget: float | None = None) -> str:
    """What ``choose_cut`` with these arguments will do, and about how long it takes (for a CLI note)."""
    if min_agreement is not None:
        return (f"choosing the cut: continuation sweep for agreement >= {min_agreement} "
                "(every cut from L to L/2; 10-20 min on a 2-core CPU)")
    from .analyze import DEFAULT_BUDGET

    return ("choosing the cut: stage-aware importance, prefill budget "
            f"{DEFAULT_BUDGET if budget is None else budget:.0%} "
            "(2-3 min on a 2-core CPU; `popcompile analyze` shows the table)")
