"""Terminal tables and PNG plots of a ``popcompile eval`` results dict, and writing results.json with them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...fsutil import atomic_path, atomic_write
from .config import check_output_folder

# bar colours follow the order of scoring.VARIANTS; curves of the sweep by variant
_VARIANT_ORDER = ("full", "pop", "pop-carried", "pop-kvfit", "pop-kvfit-carried", "pop-distill",
                  "pop-distill-carried",
                  "pop-no-boundary", "pop-no-kv", "shortgpt",
                  "wanda", "slicegpt")
_CURVE_COLORS = {"pop": "tab:blue", "pop-kvfit": "tab:orange", "pop-distill": "tab:green"}


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _task_tables(t: dict, results: dict) -> list[str]:
    parts = []
    if "continuation" in t:
        c = t["continuation"]
        own = results.get("continuation_text")
        source = f" of {', '.join(own)}" if own else ""
        parts.append(f"\ncontinuation: {c['documents']} documents{source}, prefix {results['prefix_len']}, "
                     f"continuation {results['cont_len']} tokens")
        parts.append(format_table(["variant", "NLL", "PPL", "agree", "acc", "KL"], [
            [n, v["nll"], v["perplexity"], v["agreement"], v["accuracy"], v["kl_to_full"]]
            for n, v in c["variants"].items()]))
    if "generation" in t:
        g = t["generation"]
        parts.append(f"\ngeneration: {g['prompts']} prompts, greedy {g['max_new_tokens']} tokens")
        parts.append(format_table(["variant", "exact", "prefix", "length"], [
            [n, v["exact_match"], v["matched_prefix"], v["mean_length"]] for n, v in g["variants"].items()]))
    if "greedy" in t:
        parts += _greedy_table(t["greedy"])
    if "chat" in t:
        c = t["chat"]
        parts.append(f"\nchat: {c['conversations']} conversations, turn {c['turns']}'s reply, greedy "
                     f"{c['max_new_tokens']} tokens (-carried: the cache carried across turns)")
        parts.append(format_table(["variant", "exact", "prefix", "length"], [
            [n, v["exact_match"], v["matched_prefix"], v["mean_length"]] for n, v in c["variants"].items()]))
    if "humaneval" in t:
        h = t["humaneval"]
        parts.append(f"\nhumaneval: {h['problems']} problems (prompt: {h.get('prompt_format', 'raw')}, "
                     f"runner: {h['runner']})")
        parts.append(format_table(["variant", "pass@1", "same as full"], [
            [n, v["pass@1"], v["identical_to_full"]] for n, v in h["variants"].items()]))
    return parts


def _greedy_table(g: dict) -> list[str]:
    span = lambda s: f"{s['mean']:.3g} [{s['ci95'][0]:.3g}, {s['ci95'][1]:.3g}]"
    base = g["compared_with"]
    diff = lambda v, key: span(v[f"vs_{base}"][key]) if f"vs_{base}" in v else ""
    kinds = ", ".join(f"{n} {k}" for k, n in g["kinds"].items())
    return [f"\ngreedy: {g['prompts']} prompts ({kinds}), the full model's {g['max_new_tokens']} greedy "
            f"tokens; mean [95% interval]; vs {base}: paired difference",
            format_table(["variant", "first token", "matched prefix", "agree", f"first vs {base}",
                          f"prefix vs {base}"], [
                [n, span(v["first_token"]), span(v["matched_prefix"]), v["agreement"], diff(v, "first_token"),
                 diff(v, "matched_prefix")] for n, v in g["variants"].items()])]


def _sweep_table(s: dict) -> list[str]:
    names = list(dict.fromkeys(r.get("variant", "pop") for r in s["rows"]))
    by_cut: dict[int, dict] = {}
    for r in s["rows"]:
        by_cut.setdefault(r["cut"], {"cut": r["cut"], "pruned": r["pruned_layers"],
                                     "bound": r["speedup_bound"]})
        by_cut[r["cut"]][r.get("variant", "pop")] = r
    headers = ["cut", "pruned", "bound"] + [f"{n} {k}" for n in names for k in ("agree", "NLL")]
    rows = [[v["cut"], v["pruned"], v["bound"], *(v[n][k] for n in names for k in ("agreement", "nll"))]
            for v in by_cut.values()]
    picks = s["auto_cut"]
    if picks and not isinstance(next(iter(picks.values())), dict):  # results of an older version: pop only
        picks = {"pop": picks}
    lines = [f"auto cut ({n}): " + ", ".join(f"agreement >= {k}: {v}" for k, v in p.items())
             for n, p in picks.items()]
    return [f"\nsweep ({', '.join(names)}): {s['documents']} documents", format_table(headers, rows), *lines]


def report(results: dict) -> str:
    """The terminal summary of a results dict."""
    engine = (f" (engine {results['engine']}, onnxruntime {results.get('provider', 'cpu')})"
              if "engine" in results else "")
    parts = [f"{results['model']}{engine}: {results['num_layers']} layers, cut {results['cut']} "
             f"(FLOP bound {results['speedup_bound']:.2f}x at {results['prefix_len']} tokens)"]
    parts += _task_tables(results["tasks"], results)
    if "sweep" in results:
        parts += _sweep_table(results["sweep"])
    return "\n".join(parts)


def _panels(results: dict) -> list[tuple[str, dict[str, float], bool]]:
    t, panels = results["tasks"], []
    if "continuation" in t:
        v = t["continuation"]["variants"]
        panels += [("continuation: top-1 agreement with full", {n: x["agreement"] for n, x in v.items()},
                    False),
                   ("continuation: perplexity", {n: x["perplexity"] for n, x in v.items()}, True)]
    if "generation" in t:
        v = t["generation"]["variants"]
        panels += [("generation: exact match with full", {n: x["exact_match"] for n, x in v.items()}, False),
                   ("generation: matched prefix (tokens)", {n: x["matched_prefix"] for n, x in v.items()},
                    False)]
    if "chat" in t:
        v = t["chat"]["variants"]
        panels += [("chat, turn 3: matched prefix (tokens)", {n: x["matched_prefix"] for n, x in v.items()},
                    False)]
    if "humaneval" in t:
        v = t["humaneval"]["variants"]
        panels += [("humaneval: pass@1", {n: x["pass@1"] for n, x in v.items()}, False)]
    if "images" in t:
        v = t["images"]["variants"]
        panels += [("images: first token equal to full", {n: x["first_token"] for n, x in v.items()}, False),
                   ("images: matched prefix (tokens)", {n: x["matched_prefix"] for n, x in v.items()}, False)]
    return panels


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_quality(results: dict, path: Path) -> None:
    """One bar panel per task metric, one bar per variant."""
    plt, panels = _pyplot(), _panels(results)
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (title, values, log_if_wide) in zip(axes[0], panels):
        names = list(values)
        bars = ax.bar(range(len(names)), [values[n] for n in names], color=[
            colors[_VARIANT_ORDER.index(n) % 10] if n in _VARIANT_ORDER else "grey" for n in names])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(title, fontsize=10)
        positive = [x for x in values.values() if x > 0]
        if log_if_wide and positive and max(positive) / min(positive) > 20:
            ax.set_yscale("log")
    fig.suptitle(f"{results['model']}: cut {results['cut']}/{results['num_layers']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(results: dict, path: Path) -> None:
    """Agreement (left, solid) and NLL (right, dashed) against the FLOP-bound speedup, one curve per
    variant."""
    plt, rows = _pyplot(), results["sweep"]["rows"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    right = ax.twinx()
    for name in dict.fromkeys(r.get("variant", "pop") for r in rows):
        mine = [r for r in rows if r.get("variant", "pop") == name]
        x, color = [r["speedup_bound"] for r in mine], _CURVE_COLORS.get(name, "tab:grey")
        ax.plot(x, [r["agreement"] for r in mine], "o-", color=color, label=f"{name}: agreement")
        right.plot(x, [r["nll"] for r in mine], "s--", color=color, alpha=0.6, label=f"{name}: NLL")
        if name == "pop":
            for r, xi in zip(mine, x):
                ax.annotate(str(r["cut"]), (xi, r["agreement"]), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=7)
    ax.set_xlabel(f"FLOP-bound prefill speedup at {results['prefix_len']} tokens")
    ax.set_ylabel("top-1 agreement with full (solid)")
    right.set_ylabel("continuation NLL, nats/token (dashed)")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="center left")
    ax.grid(alpha=0.3)
    ax.set_title(f"{results['model']}: cut sweep (labels: cut of {results['num_layers']} layers)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(results: dict, out: Path, force: bool = False) -> None:
    """results.json and the plots, each through a temporary file and one rename (never half-written)."""
    out = Path(out)
    check_output_folder(out, force)  # again: another run may have written there meanwhile
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.json", json.dumps(results, indent=1))
    if _panels(results):  # a task without a plotted metric writes no quality.png
        with atomic_path(out / "quality.png") as tmp:
            plot_quality(results, tmp)
    if "sweep" in results:
        with atomic_path(out / "sweep.png") as tmp:
            plot_sweep(results, tmp)
