"""``popcompile info``: describe an engine folder."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("info", help="describe an engine folder")
    p.add_argument("engine", type=Path, help="engine folder")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=cmd_info)


def cmd_info(args) -> None:
    from ..engine.manifest import EngineManifest

    manifest = EngineManifest.read(args.engine)
    print(manifest.to_json() if args.json else summary(args.engine, manifest))


def summary(folder: Path, manifest) -> str:
    size = sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
    layout = manifest.kv_layout
    return (f"{folder}: {manifest.model['name']} ({manifest.model['model_type']}), "
            f"{manifest.num_layers} layers, "
            f"cut {manifest.cut} (layers {manifest.cut}..{manifest.num_layers - 1} pruned in prefill), "
            f"boundary {manifest.boundary}\n"
            f"KV layout: {layout.num_layers} x "
            f"[batch, {layout.num_kv_heads}, {layout.max_seq}, {layout.head_dim}] "
            f"{layout.dtype}; folder {size / 2**20:.1f} MiB (weights shared by both graphs)\n"
            f"{quality_line(manifest.extra.get('cut_choice'))}"
            f"{_kv_fit(manifest.extra.get('kv_calibration'))}"
            f"{_weights(manifest)}"
            f"{_attention(manifest)}"
            f"{_vision(manifest)}"
            f"{_threshold(manifest)}")


def quality_line(choice: dict | None) -> str:
    """One line for a cut the quality floor chose (quality/floor.py): what it keeps, and the paper's third."""
    if not choice or choice.get("method") != "quality floor":
        return ""
    if choice.get("skipped"):
        return f"{choice['skipped']}\n"
    floor, shipped, third = choice["min_agreement"], choice.get("shipped"), choice.get("paper_third")
    if shipped is None:
        return (f"quality floor: no cut keeps the full model's first token on {floor:.0%} of "
                f"{choice['prompts']} held-out prompts; nothing pruned\n")
    line = (f"quality: cut {shipped['cut']} keeps the full model's first token on "
            f"{shipped['first_token']:.0%} of {shipped['prompts']} held-out prompts, matched prefix "
            f"{shipped['matched_prefix']:.1f}/{shipped['continuation']} ({shipped['fit']} fit; "
            f"floor {floor:.0%})")
    searched = "POP" if choice.get("search_fit") == "none" else "POP+"
    if third and third["cut"] != shipped["cut"]:
        line += (f"; 1/3 pruned (cut {third['cut']}) would give {third['first_token']:.0%} / "
                 f"{third['matched_prefix']:.1f} ({searched})")
    return line + "\n"


#: how info names each fit method (kvfit/calibrate.py's METHODS)
FIT_NAMES = {"ridge": "POP+ (ridge, closed form)", "distill": "POP++ (distill: ridge, then trained on the "
             "full model's greedy tokens)"}


def _kv_fit(record: dict | None) -> str:
    """The pruned layers' K/V projections: the model's own (the paper's POP) or the fit, what it saw."""
    if not record:
        return "K/V of the pruned layers: the model's own projections (the paper's POP, no fit)\n"
    method = FIT_NAMES.get(record.get("method"), record.get("method"))
    return f"K/V of the pruned layers: {method}, fitted on {record.get('tokens', 0):,} tokens\n"


def _vision(manifest) -> str:
    """One line for a vision-language engine: its vision graph and how images become tokens."""
    v = manifest.vision
    if not v:
        return ""
    p = v["processing"]
    side = p["patch_size"] * p["merge_size"]
    return (f"vision: {v['graph']['file']}, one image a call (run --image PATH), deepstack into layers "
            f"0..{v['deepstack'] - 1}; an image token per {side}x{side} pixels, {p['min_pixels']}.."
            f"{p['max_pixels']} pixels an image\n")


def _weights(manifest) -> str:
    """One line: float weights, or how they were quantised."""
    q = manifest.quantization
    if not q:
        return f"weights: {manifest.dtype}\n"
    return (f"weights: {q.get('format')} ({q.get('op')}, blocks of {q.get('block_size')}, accuracy level "
            f"{q.get('accuracy_level')}; embedding rows {manifest.dtype})\n")


def _attention(manifest) -> str:
    """One line: standard ONNX ops, or which layers run onnxruntime's fused attention."""
    layers = manifest.attention.get("layers")
    if not isinstance(layers, dict):
        return "attention: standard ONNX ops\n"
    forms = "; ".join(f"{graph}: "
                      + ", ".join(f"{count} {form}" for form, count in sorted(counts.items()) if count)
                      for graph, counts in sorted(layers.items()) if isinstance(counts, dict))
    shared = [graph for graph in ("prefill", "decode") if manifest.shares_kv(graph)]
    extra = f"; {' and '.join(shared)} on the shared KV buffer" if shared else ""
    return f"attention: onnxruntime fused ops (layers per graph, {forms}){extra}\n"


def _threshold(manifest) -> str:
    """One line: which prompts prefill with POP, and how that threshold was chosen."""
    record = manifest.extra.get("min_prompt_tokens")
    if not manifest.min_prompt_tokens:
        head = "POP prefill for every prompt (min_prompt_tokens 0)"
    else:
        head = f"POP prefill for prompts of {manifest.min_prompt_tokens}+ tokens, shorter ones in full"
    if not isinstance(record, dict):  # given as a number at export (or an older folder): nothing measured
        return head
    if not isinstance(record.get("table"), list):
        return f"{head} ({record.get('note', 'not measured')})"
    rows = ", ".join(f"{row.get('tokens')}: {row.get('speedup')}x (bound {row.get('flop_bound'):.3g}x)"
                     if isinstance(row.get("flop_bound"), (int, float)) else
                     f"{row.get('tokens')}: {row.get('speedup')}x"
                     for row in record["table"] if isinstance(row, dict))
    return (f"{head} (measured with {record.get('runtime')}, bar {record.get('min_speedup')}x or half the "
            f"FLOP bound's gain, threshold.py: {rows})")
