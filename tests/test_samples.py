"""samples/ run as users run them (a subprocess each, on a tiny random model), and the docs quote them.

A ```python block of README.md or docs/*.md must be, character for character, a ``# [readme:NAME]`` region of a sample, and
every region must be in the README: the snippets cannot drift from code that CI runs.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny import tiny_model
from tiny_engine import tiny_tokenizer

from popcompile import reference
from popcompile.engine.tensorrt import TensorRTUnavailable, require_gpu

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
TESTED = {"export_and_run.py", "chat.py", "torch_compile.py", "tensorrt_deploy.py"}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
REGION = re.compile(r"^# \[readme:(\w+)\]\n(.*?)^# \[/readme\]\n", re.S | re.M)


def run_sample(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SAMPLES / name), *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny llama as a Hugging Face folder, its tokenizer with a chat template."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model("llama", layers=6, max_position_embeddings=256)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    model.generation_config.eos_token_id = None  # random weights: no early stop, every run the same length
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(tiny_folder, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("engines") / "tiny"
    done = run_sample("export_and_run.py", "--model", tiny_folder, "--out", out, "--kv-calibration", "none",
                      "--min-prompt-tokens", "0", "--max-seq", "64", "--prompt", "t1 t2 t3 t4 t5 t6 t7 t8")
    return out, done


def test_samples_are_all_tested():
    assert {p.name for p in SAMPLES.glob("*.py")} == TESTED


def test_export_and_run_compiles_and_generates_with_pop_and_full(engine):
    out, done = engine
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("pop (cut 4/6, pop prefill): first token after ")
    assert lines[1].startswith("full (cut 4/6, full prefill): first token after ")
    assert (out / "popcompile.json").is_file() and (out / "prefill.onnx").is_file()


def test_chat_streams_two_turns_over_the_whole_conversation(engine):
    out, _ = engine
    done = run_sample("chat.py", out, "--turn", "t1 t2 t3", "--turn", "t4 t5", "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
    stats = re.findall(r"\[(\d+) prompt tokens, pop prefill, [\d.]+ s to the first token\]", done.stdout)
    assert done.stdout.count("> ") == 2 and len(stats) == 2
    assert int(stats[1]) > int(stats[0]) + 2  # the second turn's prompt holds the first turn and its reply


def test_torch_compile_gives_the_pop_reference_tokens(tiny_folder):
    prompt = " ".join(f"t{i % 90}" for i in range(3, 40))
    done = run_sample("torch_compile.py", "--model", tiny_folder, "--inner", "eager", "--min-prompt-tokens", "0",
                      "--max-new-tokens", "6", "--prompt", prompt)
    assert done.returncode == 0, done.stderr
    got = ast.literal_eval(re.search(r"^pop:  (\[.*\])$", done.stdout, re.M).group(1))
    from popcompile.models import load_model

    loaded = load_model(str(tiny_folder))
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = reference.generate(loaded.model, ids, 6, reference.Variant(4))
    assert got == want


def _has_gpu() -> bool:
    try:
        require_gpu()
    except TensorRTUnavailable:
        return False
    return True


def test_tensorrt_deploy(tiny_folder, tmp_path):
    out = tmp_path / "trt"
    done = run_sample("tensorrt_deploy.py", "--model", tiny_folder, "--out", out)
    if _has_gpu():
        assert done.returncode == 0, done.stderr
        assert "prefill, first token after" in done.stdout
    else:  # stops at once, one line naming what is missing, nothing written
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
        assert "NVIDIA GPU" in done.stderr and not out.exists()


def regions() -> dict[str, str]:
    found = {}
    for path in sorted(SAMPLES.glob("*.py")):
        for name, body in REGION.findall(path.read_text()):
            found[name] = textwrap.dedent(body).strip("\n")
    return found


def readme_snippets() -> list[str]:
    """The ```python blocks of README.md and docs/*.md."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [block.strip("\n") for doc in docs
            for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)]


def test_readme_python_snippets_are_sample_regions():
    found, snippets = regions(), readme_snippets()
    assert set(found) == {"export_and_run", "chat", "torch_compile", "tensorrt_deploy"}
    assert [s for s in snippets if s not in found.values()] == []
    assert [name for name, body in found.items() if body not in snippets] == []
