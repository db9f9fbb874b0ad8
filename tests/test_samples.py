"""samples/ run as users run them (a subprocess each, on a tiny random model), and the docs quote them.

Every samples/*.py is run by some test here (a ``run_sample`` call naming it). A ```python block of
README.md or docs/*.md must be, character for character, a ``# [readme:NAME]`` ... ``# [/readme]`` region
of a sample (dedented), and every region must be in the README: the snippets cannot drift from code that CI
runs.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_engine import has_tensorrt_gpu, tiny_hf_folder

from popcompile import reference

# one worker runs this file: the samples' model folder and engine, made once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_samples")

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
REGION = re.compile(r"^[ \t]*# \[readme:(\w+)\]\n(.*?)^[ \t]*# \[/readme\]\n", re.S | re.M)
MARKER = re.compile(r"^[ \t]*# \[/?readme\b", re.M)
FAST = ("--kv-calibration", "none", "--min-prompt-tokens", "0", "--max-seq", "64", "--max-new-tokens", "4")


def run_sample(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SAMPLES / name), *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny llama as a Hugging Face folder, its tokenizer with a chat template; no eos (no early stop: every
    run the same length). Two pruned layers (cut 4/6; with one, POP's K/V would be the full model's own) and
    weights large enough that POP's greedy tokens differ from the full model's on the prompts below."""
    return tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), layers=6, initializer_range=0.1,
                          max_position_embeddings=256, chat_template=CHAT_TEMPLATE, eos=False)


@pytest.fixture(scope="module")
def engine(tiny_folder, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("engines") / "tiny"
    done = run_sample("export_and_run.py", "--model", tiny_folder, "--out", out, *FAST,
                      "--prompt", "t1 t2 t3 t4 t5 t6 t7 t8")
    return out, done


def test_every_sample_is_run_by_a_test():
    """Here, or in tests_vllm/ for the samples that need vLLM (run in .venv-vllm)."""
    vllm_tests = (ROOT / "tests_vllm").glob("test_*.py")
    sources = Path(__file__).read_text() + "".join(path.read_text() for path in vllm_tests)
    run_here = set(re.findall(r'(?:run_sample|sample_process)\("(\w+\.py)"', sources))
    assert sorted(p.name for p in SAMPLES.glob("*.py")) == sorted(run_here)


def test_export_and_run_compiles_and_generates_with_pop_and_full(engine):
    out, done = engine
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    texts = []
    # each mode ran its own prefill and printed its 4 tokens' text
    for line, mode in zip(lines, ("pop", "full")):
        head, text = re.fullmatch(r"(\w+ \(cut 4/6, \w+ prefill\)): first token after [\d.]+ s: "
                                  r"('.*'|\".*\")", line).groups()
        assert head == f"{mode} (cut 4/6, {mode} prefill)"
        texts.append(ast.literal_eval(text))
    assert texts[0].strip() and texts[1].strip() and texts[0] != texts[1]  # on this model POP's tokens differ
    assert (out / "popcompile.json").is_file() and (out / "prefill.onnx").is_file()


def test_chat_streams_two_turns_and_keeps_the_first_in_the_cache(engine):
    out, _ = engine
    done = run_sample("chat.py", "--out", out, "--turn", "t1 t2 t3", "--turn", "t4 t5",
                      "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr  # the engine in --out is used as it is
    stats = re.findall(r"\[(\d+) new prompt tokens, (\d+) cached, \w+ prefill, [\d.]+ s to the first token\]",
                       done.stdout)
    assert done.stdout.count("> ") == 2 and len(stats) == 2
    (new1, cached1), (new2, cached2) = [(int(a), int(b)) for a, b in stats]
    assert cached1 == 0 and cached2 >= new1  # the second turn reuses at least the first one's prompt rows


def test_chat_compiles_the_model_when_out_holds_no_engine(tmp_path):
    out = tmp_path / "new"
    done = run_sample("chat.py", "--out", out, "--model", tmp_path / "missing", "--kv-calibration", "none")
    assert done.returncode == 2 and done.stderr.startswith(
        f"compiling {tmp_path / 'missing'} into {out}\nchat: ")
    assert len(done.stderr.splitlines()) == 2 and not out.exists()


def test_torch_compile_gives_the_pop_reference_tokens(tiny_folder):
    prompt = " ".join(f"t{i % 90}" for i in range(3, 40))
    done = run_sample("torch_compile.py", "--model", tiny_folder, "--inner", "eager",
                      "--min-prompt-tokens", "0", "--max-new-tokens", "6", "--prompt", prompt)
    assert done.returncode == 0, done.stderr
    printed = {name: ast.literal_eval(tokens)
               for name, tokens in re.findall(r"^(pop|full): +(\[.*\])$", done.stdout, re.M)}
    from popcompile.frontend.models import load_model

    loaded = load_model(str(tiny_folder))
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        pop = reference.generate(loaded.model, ids, 6, reference.Variant(4))  # eager POP, cut 4 of 6
        full = loaded.model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert printed == {"pop": pop, "full": full} and pop != full


def test_tensorrt_deploy(tiny_folder, tmp_path):
    out = tmp_path / "trt"
    done = run_sample("tensorrt_deploy.py", "--model", tiny_folder, "--out", out, "--precision", "fp32",
                      *FAST)
    if has_tensorrt_gpu():
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(r"pop prefill, first token after [\d.]+ ms: ('.*'|\".*\")\n",
                            done.stdout), done.stdout
    else:  # stops at once, one line naming what is missing, nothing written; 3: a skip, not a mistake
        assert done.returncode == 3 and len(done.stderr.strip().splitlines()) == 1
        assert "NVIDIA GPU" in done.stderr and not out.exists()


def regions() -> dict[str, str]:
    """NAME -> the dedented text of each ``# [readme:NAME]`` region of samples/*.py (names unique, markers
    paired)."""
    found = {}
    for path in sorted(SAMPLES.glob("*.py")):
        text = path.read_text()
        pairs = REGION.findall(text)
        assert 2 * len(pairs) == len(MARKER.findall(text)), (
            f"{path.name}: an unpaired or nested readme marker")
        for name, body in pairs:
            assert name not in found, f"two regions named {name}"
            found[name] = textwrap.dedent(body).strip("\n")
    return found


def python_blocks(doc: Path) -> list[str]:
    return [block.strip("\n") for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)]


def test_readme_python_snippets_are_sample_regions():
    found = regions()
    readme = python_blocks(ROOT / "README.md")
    docs = [block for doc in sorted((ROOT / "docs").glob("*.md")) for block in python_blocks(doc)]
    assert set(found) == {"export_and_run", "chat", "torch_compile", "tensorrt_deploy", "vllm", "vlm"}
    assert [block for block in readme + docs if block not in found.values()] == []  # no snippet of its own
    assert [name for name, body in found.items() if body not in readme] == []  # every region in the README


def test_vlm_compiles_a_qwen3_vl_folder_and_answers_about_images(tmp_path):
    """samples/vlm.py on a tiny random Qwen3-VL folder: compiled into --out, then POP and full on two
    images (tests/test_vlm_engine.py holds their tokens to the reference)."""
    import numpy as np
    from PIL import Image
    from tiny_engine import tiny_vl_folder

    folder, out = tiny_vl_folder(tmp_path / "qwen3-vl"), tmp_path / "engine"
    rng = np.random.default_rng(0)
    for name, size in (("a.png", (24, 40)), ("b.png", (32, 16))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp_path / name)
    done = run_sample("vlm.py", "--model", folder, "--out", out, "--image", tmp_path / "a.png", "--image",
                      tmp_path / "b.png", "--question", "t5 t6 t7", "--max-new-tokens", "4")  # POP+ on images
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["pop", "full"], done.stdout
    pattern = r"\w+: \d+ prompt tokens, first token after [\d.]+ s \([\d.]+ s in the vision tower\)"
    assert all(re.match(pattern, line) for line in lines)
    assert (out / "vision.onnx").is_file()
    missing = run_sample("vlm.py", "--out", tmp_path / "none", "--image", tmp_path / "a.png")
    assert missing.returncode == 2 and "holds no engine: give --model" in missing.stderr


# --- the samples' --help against the code's defaults ----------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def sample_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser samples/NAME's main() builds, stopped at parse_args: nothing else of main runs."""
    spec = importlib.util.spec_from_file_location(f"sample_{name.removesuffix('.py')}", SAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def stop(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Parsed) as parsed:
        module.main([])
    monkeypatch.undo()
    return parsed.value.parser


def library_defaults(sample: str) -> dict[str, object]:
    """dest -> the default of the library call the sample's option feeds (the sample must not differ)."""
    from popcompile import PopConfig, TrtBuildConfig, dynamo

    if sample == "torch_compile.py":
        return {"min_prompt_tokens": dynamo.MIN_PROMPT_TOKENS}
    config = PopConfig()
    return {"kv_calibration": str(config.kv_calibration), "min_prompt_tokens": config.min_prompt_tokens,
            "max_seq": config.max_seq, "precision": TrtBuildConfig().precision}


@pytest.fixture(scope="module")
def auto_fit_names() -> dict[str, str]:
    """"text" / "vision-language" -> the fit kv_calibration auto gives such a model (kvfit.fit.fit_method),
    named as `popcompile info` names it (POP+, POP++)."""
    from tiny import tiny_model, tiny_vlm

    from popcompile.kvfit.fit import fit_method

    return {kind: FIT_NAME[fit_method(model, "auto")]
            for kind, model in (("text", tiny_model("llama")), ("vision-language", tiny_vlm()))}


def _fit_names() -> dict[str, str]:
    from popcompile.commands.info import FIT_NAMES

    return {"none": "POP", **{method: name.split()[0] for method, name in FIT_NAMES.items()}}


FIT_NAME = _fit_names()


def stale_help(parser: argparse.ArgumentParser, defaults: dict, auto_fits: dict[str, str]) -> list[str]:
    """What ``parser``'s options say that the code does not do: an option feeding a library call whose
    default differs from that call's (``defaults``); "X (default" where X, one of the option's values (its
    choices; kv_calibration's modes), is not the default;
    min(N, model limit) where N is not engine.kv.DEFAULT_MAX_SEQ; a kv_calibration mode named with another
    fit than it gives (auto: per kind of model, ``auto_fits``)."""
    from popcompile.config import KV_MODES
    from popcompile.engine.kv import DEFAULT_MAX_SEQ

    problems = []
    for action in parser._actions:
        text, flag = " ".join((action.help or "").split()), "/".join(action.option_strings)
        if action.dest in defaults and action.default != defaults[action.dest]:
            problems.append(f"{flag} defaults to {action.default!r}, the code to {defaults[action.dest]!r}")
        modes = KV_MODES if action.dest == "kv_calibration" else ()
        values = {str(v) for v in action.choices or ()} | set(modes)
        problems += [f"{flag}: help says the default is {named}, it is {action.default}"
                     for named in re.findall(r"([\w.+-]+) \(default\b", text)
                     if named in values and named != str(action.default)]
        problems += [f"{flag}: help says min({cap}, model limit), the code min({DEFAULT_MAX_SEQ}, ...)"
                     for cap in re.findall(r"min\((\d+), model limit\)", text) if int(cap) != DEFAULT_MAX_SEQ]
        if action.dest != "kv_calibration":
            continue
        modes = dict(re.findall(r"\b(auto|ridge|distill|none) \(([^)]*)\)", text))
        per_kind = re.findall(r"(POP\+*) on an? (text|vision-language) model", modes.pop("auto", ""))
        if not per_kind:
            problems.append(f"{flag}: help does not say which fit auto gives (POP... on a text model)")
        problems += [f"{flag}: help says auto gives {name} on a {kind} model, the code {auto_fits[kind]}"
                     for name, kind in per_kind if name != auto_fits[kind]]
        problems += [f"{flag}: help names {mode} {inside!r}, the code gives {FIT_NAME[mode]}"
                     for mode, inside in modes.items() if re.findall(r"POP\+*", inside) != [FIT_NAME[mode]]]
    return problems


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.glob("*.py")))
def test_sample_help_names_the_defaults_the_code_has(sample, monkeypatch, auto_fit_names):
    parser = sample_parser(sample, monkeypatch)
    assert stale_help(parser, library_defaults(sample), auto_fit_names) == []


def test_stale_help_catches_what_the_samples_once_said(auto_fit_names):
    """auto called POP+ (the text default is POP++), a default the option does not have, another cap."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-calibration", default="auto", help="auto (POP+), none (the paper's POP)")
    parser.add_argument("--mode", default="full", choices=["pop", "full"], help="pop (default) or full")
    parser.add_argument("--max-seq", type=int, help="KV buffer length (default: min(2048, model limit))")
    old = argparse.ArgumentParser()
    old.add_argument("--kv-calibration", default="auto", help="auto (default: POP+ on a text model)")
    problems = stale_help(parser, {"kv_calibration": "auto"}, auto_fit_names)
    assert len(problems) == 3 and "which fit auto gives" in problems[0], problems
    assert stale_help(old, {}, auto_fit_names) == [
        "--kv-calibration: help says auto gives POP+ on a text model, the code POP++"]
