"""The layering in packaging: a machine that only runs engine folders installs the core and an
onnxruntime (``pip install 'popcompile[cpu]'``): no torch, transformers or onnx. An engine folder exported
here runs there with the same greedy tokens, and a compile command there names the extra it needs.

The venv is built once per run from this checkout (pip resolves numpy, tokenizers, jinja2 and onnxruntime
from the package index, ~30 s; the wheel cache makes later runs quicker).
"""
from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from tiny_engine import tiny_engine

from popcompile.runtime import open_session

# one worker runs this file: the runtime-only venv, built once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_runtime_install")

REPO = Path(__file__).resolve().parents[1]
COMPILER_MODULES = ("torch", "transformers", "onnx", "onnxscript", "safetensors", "gguf")


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Path:
    """A fresh venv holding ``popcompile[cpu]`` (not editable: the installed package, as a deployment has
    it)."""
    root = tmp_path_factory.mktemp("runtime-venv")
    venv.EnvBuilder(with_pip=True).create(root)
    done = subprocess.run([root / "bin" / "python", "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", f"{REPO}[cpu]"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_the_runtime_install_holds_no_compiler(runtime_venv):
    code = ("import importlib.util, json; "
            f"print(json.dumps([m for m in {COMPILER_MODULES!r} if importlib.util.find_spec(m)]))")
    found = subprocess.run([runtime_venv / "bin" / "python", "-c", code], capture_output=True, text=True,
                           check=True)
    assert json.loads(found.stdout) == []


def test_an_engine_folder_runs_from_the_runtime_install(runtime_venv, tmp_path):
    engine = tiny_engine("llama", tmp_path / "engine")
    prompt = " ".join(f"t{i}" for i in range(5, 40))
    here = open_session(engine).generate(prompt, {"max_new_tokens": 8, "greedy": True})[0]
    done = subprocess.run([runtime_venv / "bin" / "popcompile", "run", str(engine), "--prompt", prompt,
                           "--max-new-tokens", "8", "--greedy", "--no-warmup", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout)
    assert there["token_ids"] == list(here.token_ids), (there, here)


@pytest.mark.parametrize("command, extra", [
    (["export", "smollm2-135m", "--out", "engines/x"], "compile"),
    (["calibrate", "smollm2-135m", "--out", "kv.safetensors"], "compile"),
    (["eval", "smollm2-135m", "--out", "out"], "eval"),
])
def test_a_compile_command_names_the_extra_it_needs(runtime_venv, tmp_path, command, extra):
    done = subprocess.run([runtime_venv / "bin" / "popcompile", *command], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"pip install 'popcompile[{extra}]'" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-n", "0"]))
