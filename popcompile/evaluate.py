"""``popcompile eval``: POP's quality against the full model and the paper's ablations, on real data.

Every variant runs through ``reference.py`` (the eager specification) on the same data:

    full             Variant(cut=L)                  nothing pruned
    pop              Variant(cut)                    POP as in the paper
    pop-no-boundary  Variant(cut, boundary=False)    x_N pruned too
    pop-no-kv        Variant(cut, kv_projection=False)  deep layers leave no cache for the prompt
    shortgpt         Variant(cut, shortgpt=True)     deep layers removed in prefill and decode

Tasks (data: ``eval_data.py``): ``continuation`` (teacher-forced NLL / perplexity of a continuation
after a prefilled prefix, and top-1 agreement with the full model), ``generation`` (greedy chat
generations: exact match and matched prefix vs full), ``humaneval`` (greedy code completion, pass@1;
runs model-written code, so only with ``allow_code_exec``). ``sweep`` runs the continuation task for
``pop`` at every cut from L down to ceil(L/2) next to the FLOP bound of that cut; ``auto_cut`` picks
the deepest cut that keeps a given agreement.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from . import eval_data, reference
from .reference import Variant

@dataclass(frozen=True)
class VariantContext:
    """What a variant factory may use: the cut, the depth, and (lazily) a POP+ K/V fit for that cut."""

    cut: int
    num_layers: int
    kv_fit: Callable[[int], Any] | None = None  # cut -> {layer: {"k_proj"|"v_proj": Projection}}

    def fitted_kv(self) -> Any:
        if self.kv_fit is None:
            raise ValueError("variant pop-kvfit needs a model to calibrate on (give kv_fit)")
        return self.kv_fit(self.cut) if self.cut < self.num_layers - 1 else None


#: name -> factory(VariantContext) -> Variant. Register new variants here.
VARIANTS: dict[str, Callable[[VariantContext], Variant]] = {
    "full": lambda c: Variant(cut=c.num_layers),
    "pop": lambda c: Variant(c.cut),
    "pop-kvfit": lambda c: Variant(c.cut, kv_weights=c.fitted_kv()),
    "pop-no-boundary": lambda c: Variant(c.cut, boundary=False),
    "pop-no-kv": lambda c: Variant(c.cut, kv_projection=False),
    "shortgpt": lambda c: Variant(c.cut, shortgpt=True),
}
TASKS = ("continuation", "generation", "humaneval")
DEFAULT_TASKS = ("continuation", "generation")
BASELINE = "full"
CODE_EXEC_REFUSAL = ("the humaneval task runs model-written code on this machine; pass --allow-code-exec "
                     "to allow it (ideally inside a sandbox or container)")


def register_variant(name: str, factory: Callable[[VariantContext], Variant]) -> None:
    """Add a variant: ``factory(VariantContext) -> Variant``."""
    if name in VARIANTS:
        raise ValueError(f"variant {name!r} is already registered")
    VARIANTS[name] = factory


def make_variants(names: Iterable[str], cut: int, num_layers: int,
                  kv_fit: Callable[[int], Any] | None = None) -> dict[str, Variant]:
    """``{name: Variant}`` for the named registry entries, the baseline ``full`` always first."""
    names = list(dict.fromkeys([BASELINE, *names]))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    context = VariantContext(cut, num_layers, kv_fit)
    return {name: VARIANTS[name](context) for name in names}


def describe(variant: Variant) -> dict:
    """A variant as JSON-able fields (the POP+ weights as a flag)."""
    return {"cut": variant.cut, "boundary": variant.boundary, "kv_projection": variant.kv_projection,
            "shortgpt": variant.shortgpt, "kv_refit": bool(variant.kv_weights)}


def default_kv_fit(loaded) -> Callable[[int], Any]:
    """POP+ weights fitted on the built-in calibration corpus (held out from the evaluation data)."""
    from .calibrate import default_batches, fit_kv

    def fit(cut: int):
        with torch.no_grad():
            return fit_kv(loaded.model, default_batches(loaded.tokenizer), cut).weights
    return fit


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=None, leave=False)


def _num_layers(model) -> int:
    return len(reference.decoder_layers(model))


# --- continuation ------------------------------------------------------------------------------

def default_batch_size(model, prefix_len: int) -> int:
    """The reference computes logits at every prefix position: keep them near 1 GiB per forward."""
    vocab = model.get_output_embeddings().weight.shape[0]
    return max(1, min(8, 2**28 // (prefix_len * vocab)))


@torch.no_grad()
def continuation_eval(model, docs: list[eval_data.Document], variants: dict[str, Variant],
                      batch_size: int | None = None, desc: str = "continuation") -> dict[str, dict]:
    """Teacher-forced scores of each variant. ``variants`` must hold the baseline ``full``.

    Per variant: ``nll`` (mean over all continuation tokens), ``perplexity`` = exp(nll), ``agreement``
    (argmax == the full model's argmax), ``accuracy`` (argmax == the true token), ``kl_to_full``
    (mean KL(full || variant), nats), and per-document ``doc_nll`` / ``doc_agreement``.
    """
    if BASELINE not in variants:
        raise ValueError(f"continuation_eval needs the {BASELINE!r} variant as its baseline")
    if not docs:
        raise ValueError("continuation_eval needs at least one document")
    lengths = {(len(d.prefix), len(d.continuation)) for d in docs}
    if len(lengths) != 1:
        raise ValueError(f"documents must share one prefix and continuation length, got {sorted(lengths)}")
    batch_size = batch_size or default_batch_size(model, len(docs[0].prefix))
    stats = {name: {"nll": [], "agree": [], "correct": [], "kl": []} for name in variants}
    batches = [docs[i:i + batch_size] for i in range(0, len(docs), batch_size)]
    with _bar(len(batches) * len(variants), desc) as bar:
        for batch in batches:
            prefix = torch.tensor([d.prefix for d in batch])
            target = torch.tensor([d.continuation for d in batch])
            base = None
            for name, variant in variants.items():  # the baseline comes first
                logp = torch.log_softmax(
                    reference.continuation_logits(model, prefix, target, variant).float(), dim=-1)
                if base is None:
                    base = logp
                s = stats[name]
                s["nll"].append(-logp.gather(-1, target[..., None])[..., 0])
                s["agree"].append(logp.argmax(-1) == base.argmax(-1))
                s["correct"].append(logp.argmax(-1) == target)
                s["kl"].append((base.exp() * (base - logp)).sum(-1))
                bar.update(1)
    results = {}
    for name, s in stats.items():
        nll, agree = torch.cat(s["nll"]), torch.cat(s["agree"]).float()
        mean_nll = float(nll.mean())
        results[name] = {
            "nll": mean_nll, "perplexity": math.exp(mean_nll), "agreement": float(agree.mean()),
            "accuracy": float(torch.cat(s["correct"]).float().mean()),
            "kl_to_full": float(torch.cat(s["kl"]).mean().clamp_min(0)),
            "doc_nll": [float(x) for x in nll.mean(1)], "doc_agreement": [float(x) for x in agree.mean(1)],
        }
    return results


# --- generation --------------------------------------------------------------------------------

def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.no_grad()
def generation_eval(model, prompts: list[list[int]], variants: dict[str, Variant], max_new_tokens: int = 64,
                    eos_token_id: int | None = None, decode: Callable[[list[int]], str] | None = None) -> dict:
    """Greedy generations with ``reference.generate``: ``exact_match`` (identical token sequence to
    full's) and ``matched_prefix`` (mean leading tokens equal to full's) per variant."""
    out = {name: [] for name in variants}
    with _bar(len(prompts) * len(variants), "generation") as bar:
        for ids in prompts:
            prompt = torch.tensor([ids])
            for name, variant in variants.items():
                out[name].append(reference.generate(model, prompt, max_new_tokens, variant, eos_token_id))
                bar.update(1)
    results = {}
    for name, gens in out.items():
        prefixes = [matched_prefix(g, f) for g, f in zip(gens, out[BASELINE])]
        results[name] = {
            "exact_match": sum(g == f for g, f in zip(gens, out[BASELINE])) / len(gens),
            "matched_prefix": sum(prefixes) / len(prefixes),
            "mean_length": sum(map(len, gens)) / len(gens),
            "tokens": gens,
            **({"texts": [decode(g) for g in gens]} if decode else {}),
        }
    return results


# --- humaneval ---------------------------------------------------------------------------------

@torch.no_grad()
def generate_until(model, prompt: torch.Tensor, variant: Variant, max_new_tokens: int,
                   eos_token_id: int | None = None, stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """``reference.generate`` with an early stop: ends after the token for which ``stop(tokens)`` holds.
    With ``stop=None`` it returns exactly what ``reference.generate`` returns."""
    with reference.attention_for(model, variant):
        run = reference.PopRun(model, variant, prompt.shape[1])
        logits, tokens, pos = run.prefill(prompt), [], prompt.shape[1]
        for _ in range(max_new_tokens):
            token = int(logits[0].argmax())
            tokens.append(token)
            if token == eos_token_id or (stop is not None and stop(tokens)):
                break
            logits = run.step(torch.tensor([[token]]), pos)[:, -1]
            pos += 1
    return tokens


def completion_text(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text the new tokens add to the prompt (decoded together, so no leading space is lost)."""
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new_ids, skip_special_tokens=True)


def humaneval_eval(model, tokenizer, problems: list[dict], variants: dict[str, Variant], *,
                   allow_code_exec: bool, max_new_tokens: int = 256, timeout: float = 10.0,
                   runner: str = "auto") -> dict:
    """pass@1 (greedy) per variant and the fraction of completions identical to full's."""
    if not allow_code_exec:
        raise ValueError(CODE_EXEC_REFUSAL)
    runner_name, check = eval_data.checker(runner)
    eos = getattr(tokenizer, "eos_token_id", None)
    out = {name: [] for name in variants}
    with _bar(len(problems) * len(variants), "humaneval") as bar:
        for problem in problems:
            ids = eval_data.encode(tokenizer, problem["prompt"])
            def stop(new: list[int]) -> bool:
                return eval_data.completion_finished(completion_text(tokenizer, ids, new))
            for name, variant in variants.items():
                new = generate_until(model, torch.tensor([ids]), variant, max_new_tokens, eos, stop)
                completion = eval_data.truncate_completion(completion_text(tokenizer, ids, new))
                out[name].append({"task_id": problem["task_id"], "completion": completion,
                                  **check(problem, completion, timeout)})
                bar.update(1)
    results = {"runner": runner_name, "variants": {}}
    for name, rows in out.items():
        results["variants"][name] = {
            "pass@1": sum(r["passed"] for r in rows) / len(rows),
            "identical_to_full": sum(r["completion"] == f["completion"] for r, f in zip(rows, out[BASELINE]))
            / len(rows),
            "problems": rows,
        }
    return results


# --- sweep -------------------------------------------------------------------------------------

def sweep_cuts(num_layers: int) -> list[int]:
    """L, L-1, ..., ceil(L/2)."""
    return list(range(num_layers, math.ceil(num_layers / 2) - 1, -1))


def sweep(model, docs: list[eval_data.Document], cuts: list[int] | None = None,
          batch_size: int | None = None) -> list[dict]:
    """The continuation task for ``pop`` at each cut; one row per cut with the FLOP bound at the
    prefix length (``speedup_bound``)."""
    from .cost import speedup_bound

    layers = _num_layers(model)
    cuts = sweep_cuts(layers) if cuts is None else cuts
    variants = {BASELINE: Variant(cut=layers), **{f"cut{c}": Variant(c) for c in cuts}}
    scores = continuation_eval(model, docs, variants, batch_size, desc="sweep")
    n = len(docs[0].prefix)
    return [{"cut": c, "pruned_layers": layers - c, "speedup_bound": speedup_bound(model.config, n, c),
             **{k: scores[f"cut{c}"][k] for k in ("nll", "perplexity", "agreement", "accuracy", "kl_to_full")}}
            for c in cuts]


def auto_cut(rows: list[dict], min_agreement: float) -> int:
    """The deepest-pruning (smallest) cut among ``rows`` whose ``agreement >= min_agreement``."""
    if not 0.0 <= min_agreement <= 1.0:
        raise ValueError(f"min_agreement={min_agreement} is out of range: use 0..1")
    ok = [row["cut"] for row in rows if row["agreement"] >= min_agreement]
    if not ok:
        best = max(rows, key=lambda r: r["agreement"], default=None)
        found = f"best is {best['agreement']:.3f} at cut {best['cut']}" if best else "no rows"
        raise ValueError(f"no cut reaches agreement {min_agreement} ({found}): lower --min-agreement")
    return min(ok)


# --- reports -----------------------------------------------------------------------------------

def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def report(results: dict) -> str:
    """The terminal summary of a results dict (as written to results.json)."""
    t, parts = results["tasks"], [
        f"{results['model']}: {results['num_layers']} layers, cut {results['cut']} "
        f"(FLOP bound {results['speedup_bound']:.2f}x at {results['prefix_len']} tokens)"]
    if "continuation" in t:
        c = t["continuation"]
        parts.append(f"\ncontinuation: {c['documents']} documents, prefix {results['prefix_len']}, "
                     f"continuation {results['cont_len']} tokens")
        parts.append(format_table(["variant", "NLL", "PPL", "agree", "acc", "KL"], [
            [n, v["nll"], v["perplexity"], v["agreement"], v["accuracy"], v["kl_to_full"]]
            for n, v in c["variants"].items()]))
    if "generation" in t:
        g = t["generation"]
        parts.append(f"\ngeneration: {g['prompts']} prompts, greedy {g['max_new_tokens']} tokens")
        parts.append(format_table(["variant", "exact", "prefix", "length"], [
            [n, v["exact_match"], v["matched_prefix"], v["mean_length"]] for n, v in g["variants"].items()]))
    if "humaneval" in t:
        h = t["humaneval"]
        parts.append(f"\nhumaneval: {h['problems']} problems (runner: {h['runner']})")
        parts.append(format_table(["variant", "pass@1", "same as full"], [
            [n, v["pass@1"], v["identical_to_full"]] for n, v in h["variants"].items()]))
    if "sweep" in results:
        s = results["sweep"]
        parts.append(f"\nsweep (pop): {s['documents']} documents")
        parts.append(format_table(["cut", "pruned", "bound", "NLL", "PPL", "agree"], [
            [r["cut"], r["pruned_layers"], r["speedup_bound"], r["nll"], r["perplexity"], r["agreement"]]
            for r in s["rows"]]))
        parts.append("auto cut: " + ", ".join(f"agreement >= {k}: {v}" for k, v in s["auto_cut"].items()))
    return "\n".join(parts)


def _panels(results: dict) -> list[tuple[str, dict[str, float], bool]]:
    t, panels = results["tasks"], []
    if "continuation" in t:
        v = t["continuation"]["variants"]
        panels += [("continuation: top-1 agreement with full", {n: x["agreement"] for n, x in v.items()}, False),
                   ("continuation: perplexity", {n: x["perplexity"] for n, x in v.items()}, True)]
    if "generation" in t:
        v = t["generation"]["variants"]
        panels += [("generation: exact match with full", {n: x["exact_match"] for n, x in v.items()}, False),
                   ("generation: matched prefix (tokens)", {n: x["matched_prefix"] for n, x in v.items()}, False)]
    if "humaneval" in t:
        v = t["humaneval"]["variants"]
        panels += [("humaneval: pass@1", {n: x["pass@1"] for n, x in v.items()}, False)]
    return panels


def plot_quality(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(results)
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (title, values, log_if_wide) in zip(axes[0], panels):
        names = list(values)
        bars = ax.bar(range(len(names)), [values[n] for n in names],
                      color=[colors[list(VARIANTS).index(n) % 10] if n in VARIANTS else "grey" for n in names])
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["sweep"]["rows"]
    x = [r["speedup_bound"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    ax.plot(x, [r["agreement"] for r in rows], "o-", color="tab:blue", label="top-1 agreement")
    ax.set_xlabel(f"FLOP-bound prefill speedup at {results['prefix_len']} tokens")
    ax.set_ylabel("top-1 agreement with full", color="tab:blue")
    for r, xi in zip(rows, x):
        ax.annotate(str(r["cut"]), (xi, r["agreement"]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7)
    right = ax.twinx()
    right.plot(x, [r["nll"] for r in rows], "s--", color="tab:red", label="NLL")
    right.set_ylabel("continuation NLL (nats/token)", color="tab:red")
    ax.set_title(f"{results['model']}: POP cut sweep (labels: cut of {results['num_layers']} layers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- driver ------------------------------------------------------------------------------------

def parse_tasks(text: str | None, sweep_only: bool) -> list[str]:
    if text is None:
        return [] if sweep_only else list(DEFAULT_TASKS)
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"unknown task(s) {', '.join(bad) or '(none)'}: use a comma list of {', '.join(TASKS)}")
    return list(dict.fromkeys(tasks))


def run_eval(model_name: str, out: Path, *, tasks: list[str], variant_names: Iterable[str] | None = None,
             cut: int | None = None, prune_ratio: float | None = None, limit: int | None = None,
             prefix_len: int = 512, cont_len: int = 48, gen_tokens: int = 64, code_tokens: int = 256,
             batch_size: int | None = None, do_sweep: bool = False, min_agreement: float = 0.95,
             allow_code_exec: bool = False, timeout: float = 10.0) -> dict:
    """Run the tasks (and the sweep), write ``out/results.json`` and the plots; return the results."""
    if "humaneval" in tasks and not allow_code_exec:
        raise ValueError(CODE_EXEC_REFUSAL)  # before any model is loaded
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if not (tasks or do_sweep):
        raise ValueError("nothing to do: give --tasks or --sweep")
    for flag, value in (("--gen-tokens", gen_tokens), ("--code-tokens", code_tokens), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0.0 <= min_agreement <= 1.0:
        raise ValueError(f"--min-agreement must be within 0..1, got {min_agreement}")
    from .cost import speedup_bound
    from .models import load_model
    from .passes.pop import resolve_cut

    loaded = load_model(model_name)
    model, tok = loaded.model, loaded.tokenizer
    layers = _num_layers(model)
    cut = resolve_cut(layers, cut, prune_ratio)
    variants = make_variants(VARIANTS if variant_names is None else variant_names, cut, layers,
                             kv_fit=default_kv_fit(loaded))
    results: dict[str, Any] = {
        "model": model_name, "model_type": model.config.model_type, "num_layers": layers, "cut": cut,
        "prefix_len": prefix_len, "cont_len": cont_len, "speedup_bound": speedup_bound(model.config, prefix_len, cut),
        "variants": {n: describe(v) for n, v in variants.items()}, "limit": limit, "tasks": {},
    }
    docs = None
    if "continuation" in tasks or do_sweep:
        docs, skipped = eval_data.continuation_documents(tok, prefix_len, cont_len, limit)
    if "continuation" in tasks:
        start = time.perf_counter()
        scores = continuation_eval(model, docs, variants, batch_size)
        results["tasks"]["continuation"] = {
            "documents": len(docs), "names": [d.name for d in docs], "skipped_too_short": len(skipped),
            "seconds": time.perf_counter() - start, "variants": scores}
    if "generation" in tasks:
        start = time.perf_counter()
        texts = eval_data.CHAT_PROMPTS[:limit]
        prompts = [eval_data.chat_prompt_ids(tok, p) for p in texts]
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        scores = generation_eval(model, prompts, variants, gen_tokens, tok.eos_token_id, decode)
        results["tasks"]["generation"] = {
            "prompts": len(prompts), "prompt_texts": list(texts), "chat_template": bool(tok.chat_template),
            "max_new_tokens": gen_tokens, "seconds": time.perf_counter() - start, "variants": scores}
    if "humaneval" in tasks:
        start = time.perf_counter()
        problems = eval_data.humaneval_problems()[:limit]
        scores = humaneval_eval(model, tok, problems, variants, allow_code_exec=allow_code_exec,
                                max_new_tokens=code_tokens, timeout=timeout)
        results["tasks"]["humaneval"] = {"problems": len(problems), "max_new_tokens": code_tokens,
                                         "seconds": time.perf_counter() - start, **scores}
    if do_sweep:
        start = time.perf_counter()
        rows = sweep(model, docs, batch_size=batch_size)
        picks = {}
        for threshold in sorted({min_agreement, 0.9, 0.95, 0.99}):
            try:
                picks[str(threshold)] = auto_cut(rows, threshold)
            except ValueError:
                picks[str(threshold)] = None
        results["sweep"] = {"documents": len(docs), "rows": rows, "auto_cut": picks,
                            "seconds": time.perf_counter() - start}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if results["tasks"]:
        plot_quality(results, out / "quality.png")
    if do_sweep:
        plot_sweep(results, out / "sweep.png")
    return results
