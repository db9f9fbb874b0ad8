"""The trade-off curve: POP's quality at every cut against the FLOP bound, and the cut choice from it.

``sweep`` runs the continuation task (``evaluate.continuation_eval``) for ``pop``, ``pop-kvfit`` and/or
``pop-distill`` (one distillation per cut: minutes each) at every cut from L down to ceil(L/2); each row
carries the prefill FLOP-bound speedup of its cut at
the prefix length. ``auto_cut`` picks the deepest-pruning cut that keeps a given top-1 agreement (eval's
report); ``export --cut auto`` chooses with the quality floor (quality/floor.py) instead.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

from ...errors import ConfigError
from ...reference import Variant
from . import data as eval_data

SWEEP_VARIANTS = ("pop", "pop-kvfit", "pop-distill")
#: the curves ``--sweep`` draws when no variants are named: pop-distill (a distillation per cut) only on
#: request
DEFAULT_SWEEP = ("pop", "pop-kvfit")
METRICS = ("nll", "perplexity", "agreement", "accuracy", "kl_to_full")
DATA_NAME = "continuation: stdlib sources + HumanEval solutions (eval_data.continuation_documents)"


def sweep_cuts(num_layers: int) -> list[int]:
    """L, L-1, ..., ceil(L/2)."""
    return list(range(num_layers, math.ceil(num_layers / 2) - 1, -1))


def _sweep_variants(names: Iterable[str], cuts: list[int], layers: int,
                    fits: dict[str, Callable[[int], Any] | None],
                    ) -> tuple[dict[str, Variant], dict[tuple[str, int], str]]:
    """Unique variants to score and (name, cut) -> key of its scores. ``fits``: refitted variant -> cut -> its
    K/V weights (scoring.REFITS). A refit at cut >= L-1 has nothing to change (layer L-1 reads h_{L-1}
    anyway), so it reuses pop's row of that cut."""
    from .scoring import REFITS

    variants, keys = {"full": Variant(cut=layers)}, {}
    for name in names:
        if name not in SWEEP_VARIANTS:
            raise ConfigError(f"the sweep runs {', '.join(SWEEP_VARIANTS)}, not {name!r}")
        if name in REFITS and fits.get(name) is None:
            raise ConfigError(f"a {name} sweep needs {REFITS[name]} (cut -> its K/V weights)")
        for cut in cuts:
            refit = name in REFITS and cut < layers - 1
            key = f"{name}@{cut}" if refit else f"pop@{cut}"
            if key not in variants:
                variants[key] = Variant(cut, kv_weights=fits[name](cut)) if refit else Variant(cut)
            keys[(name, cut)] = key
    return variants, keys


def sweep(model, docs: list[eval_data.Document], cuts: list[int] | None = None, batch_size: int | None = None,
          variants: Iterable[str] = ("pop",), kv_fit: Callable[[int], Any] | None = None,
          distill_fit: Callable[[int], Any] | None = None) -> list[dict]:
    """One row per (variant, cut): the continuation scores and ``speedup_bound`` (FLOP bound at the
    prefix length), in the order of ``variants`` then ``cuts`` (default L..ceil(L/2))."""
    from ...cost import speedup_bound
    from ...reference import decoder_layers
    from .scoring import continuation_eval

    layers = len(decoder_layers(model))
    cuts = sweep_cuts(layers) if cuts is None else list(cuts)
    names = list(dict.fromkeys(variants))
    to_score, keys = _sweep_variants(names, cuts, layers, {"pop-kvfit": kv_fit, "pop-distill": distill_fit})
    scores = continuation_eval(model, docs, to_score, batch_size, desc="sweep")
    n = len(docs[0].prefix)
    return [{"variant": name, "cut": c, "pruned_layers": layers - c,
             "speedup_bound": speedup_bound(model.config.get_text_config(), n, c),
             **{k: scores[keys[(name, c)]][k] for k in METRICS}} for name in names for c in cuts]


def auto_cut(rows: list[dict], min_agreement: float, variant: str | None = None) -> int:
    """The deepest-pruning (smallest) cut among ``rows`` (of ``variant``, if given) whose
    ``agreement >= min_agreement``."""
    if not 0.0 <= min_agreement <= 1.0:
        raise ConfigError(f"min_agreement={min_agreement} is out of range: use 0..1")
    rows = [r for r in rows if variant is None or r.get("variant", "pop") == variant]
    ok = [row["cut"] for row in rows if row["agreement"] >= min_agreement]
    if not ok:
        best = max(rows, key=lambda r: r["agreement"], default=None)
        found = f"best is {best['agreement']:.3f} at cut {best['cut']}" if best else "no rows"
        raise ConfigError(f"no cut reaches agreement {min_agreement} ({found}): lower --min-agreement")
    return min(ok)


def auto_cuts(rows: list[dict], thresholds: Iterable[float]) -> dict[str, dict[str, int | None]]:
    """``{variant: {threshold: cut or None}}`` for the variants present in ``rows``."""
    picks: dict[str, dict[str, int | None]] = {}
    for name in dict.fromkeys(r.get("variant", "pop") for r in rows):
        picks[name] = {}
        for threshold in sorted(set(thresholds)):
            try:
                picks[name][str(threshold)] = auto_cut(rows, threshold, name)
            except ValueError:
                picks[name][str(threshold)] = None
    return picks


def sweep_variant_names(variant_names: Iterable[str] | None) -> list[str]:
    """The curves of ``--sweep``: the SWEEP_VARIANTS among the chosen variants (DEFAULT_SWEEP when none are
    named; pop when none of them is chosen)."""
    chosen = [n for n in SWEEP_VARIANTS if n in (DEFAULT_SWEEP if variant_names is None else variant_names)]
    return chosen or ["pop"]
