"""``popcompile info``: describe an engine folder."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("info", help="describe an engine folder")
    p.add_argument("engine", type=Path, help="engine folder")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=cmd_info)


def cmd_info(args) -> None:
    from ..exporters.manifest import EngineManifest

    manifest = EngineManifest.read(args.engine)
    print(manifest.to_json() if args.json else summary(args.engine, manifest))


def summary(folder: Path, manifest) -> str:
    size = sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
    layout = manifest.kv_layout
    return (f"{folder}: {manifest.model['name']} ({manifest.model['model_type']}), {manifest.num_layers} layers, "
            f"cut {manifest.cut} (layers {manifest.cut}..{manifest.num_layers - 1} pruned in prefill), "
            f"boundary {manifest.boundary}\n"
            f"KV layout: {layout.num_layers} x [batch, {layout.num_kv_heads}, {layout.max_seq}, {layout.head_dim}] "
            f"{layout.dtype}; folder {size / 2**20:.1f} MiB (weights shared by both graphs)")
