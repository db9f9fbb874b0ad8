"""What each load-time check of an engine folder costs (docs/reliability.md), stage by stage.

    python benchmarks/load_checks.py /work/cache/engines/smollm2-135m --reps 5

Works on a private copy of the folder (hard links where the file system allows, so no bytes are copied;
a manifest without a weights sha256 gets one in the copy) and a private hash cache, so the user's
~/.cache is never touched. Stages:
manifest read + validation, path resolution, sha256 of each file (no cache), the cache lookup that
replaces it, the external-data scan of each graph, onnxruntime's session creation, and whole
OrtSession loads without and with a warm hash cache. Medians of ``--reps`` runs; the page cache is warm
(the files were read just before), as on any second load.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from popcompile.engine.manifest import MANIFEST, EngineManifest, engine_file, sha256_file
from popcompile.engine.verify import HashCache
from popcompile.runtime.onnx_refs import external_refs
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.ort_load import load_graph


def median_ms(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def private_copy(folder: Path, into: Path) -> Path:
    """Hard links of every file, and a manifest of our own that records the weights' sha256."""
    copy = into / folder.name
    copy.mkdir()
    for item in folder.iterdir():
        if item.is_file() and item.name != MANIFEST:
            try:
                os.link(item, copy / item.name)
            except OSError:  # another file system
                shutil.copy2(item, copy / item.name)
    data = json.loads((folder / MANIFEST).read_text())
    data["weights"].setdefault("sha256", sha256_file(folder / data["weights"]["file"]))
    (copy / MANIFEST).write_text(json.dumps(data))
    return copy


def stages(folder: Path, reps: int, cache_dir: Path) -> list[tuple[str, float]]:
    import onnxruntime as ort

    manifest = EngineManifest.read(folder)
    files = ({name: entry.file for name, entry in manifest.graphs.items()}
             | {"weights": manifest.weights["file"]})
    rows = [("manifest read + validation", median_ms(lambda: EngineManifest.read(folder), reps)),
            ("resolve 3 paths inside the folder",
             median_ms(lambda: [engine_file(folder, f, k) for k, f in files.items()], reps))]
    for _name, file in files.items():
        size = (folder / file).stat().st_size / 2**20
        rows.append((f"sha256 {file} ({size:.1f} MiB)",
                     median_ms(lambda file=file: sha256_file(folder / file), reps)))
    cache = HashCache(cache_dir)
    OrtSession(folder, hash_cache=cache)  # fills the cache
    lookups = [(folder / f, (folder / f).stat()) for f in files.values()]
    rows.append(("cache lookup of the 3 verified hashes",
                 median_ms(lambda: [cache.lookup(p.resolve(), s) for p, s in lookups], reps)))
    for name in manifest.graphs:
        data = (folder / files[name]).read_bytes()
        rows.append((f"external-data scan of {files[name]}",
                     median_ms(lambda data=data: external_refs(data), reps)))
    rows.append(("onnxruntime sessions (both graphs)", median_ms(
        lambda: [load_graph(folder / files[n], ort.SessionOptions(), ["CPUExecutionProvider"])
                 for n in manifest.graphs], reps)))
    rows.append(("OrtSession, no hash cache",
                 median_ms(lambda: OrtSession(folder, hash_cache=HashCache(None)), reps)))
    rows.append(("OrtSession, warm hash cache",
                 median_ms(lambda: OrtSession(folder, hash_cache=cache), reps)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = private_copy(args.folder, Path(tmp))
        for label, ms in stages(folder, args.reps, Path(tmp) / "verified"):
            print(f"| {label:<45} | {ms:10.2f} |")


if __name__ == "__main__":
    main()
