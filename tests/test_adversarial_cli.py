"""Hostile and careless CLI use: every bad input exits 2 with one line naming the culprit, no traceback,
and nothing that must survive is changed (checksums of every file around the destination); what this
machine lacks (a GPU, TensorRT, an extra) exits 3 instead.

The CLI runs in-process (popcompile.cli.main); only the SIGTERM and concurrency cases start a process.
Models are tiny random decoders saved as Hugging Face folders (tests/tiny.py): loading one takes ~1 s.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_lines import error_lines
from safetensors.torch import save_file
from tiny import tiny_model
from tiny_engine import tiny_tokenizer

from popcompile import fsutil
from popcompile.cli import main
from popcompile.engine.manifest import FORMAT, MANIFEST, EngineManifest
from popcompile.errors import InputError, OutputError
from popcompile.kvfit.calibrate import CalibrationInfo, KVFit, check_finite, load_fit, save_fit
from popcompile.passes.pop import Projection

LAYERS, HIDDEN, KV_WIDTH = 4, 64, 32  # tiny_model defaults: 4 heads x 16, 2 kv heads x 16
REPO = Path(__file__).resolve().parents[1]


# --- fixtures and helpers --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A tiny llama as a Hugging Face folder: a cheap MODEL argument."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model("llama", layers=LAYERS, max_position_embeddings=512)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """GGUF hashes and conversions of the damaged files go to a throwaway cache, not the user's."""
    monkeypatch.setenv("POPCOMPILE_CACHE", str(tmp_path.with_name(tmp_path.name + "-cache")))


def tree(path: Path) -> dict[str, str]:
    """relative name -> sha256 of every file (hidden ones too) under ``path``; a file maps to itself."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(path.rglob("*"))}


def fails(capsys, argv: list, culprit: str, *, within_s: float | None = None) -> str:
    """Run the CLI: exit 2, exactly one stderr line containing ``culprit`` besides progress, no traceback;
    return the line."""
    start = time.perf_counter()
    code = main([str(a) for a in argv])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = error_lines(err)  # in a log the steps that ran are said first (progress.py)
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert culprit in lines[0], lines[0]
    assert lines[0].startswith(f"popcompile {argv[0]}: error: ")
    if within_s is not None:
        assert seconds < within_s, f"{seconds:.2f} s: {lines[0]}"
    return lines[0]


def fake_engine(folder: Path) -> Path:
    """A folder that --force may replace: its manifest parses and names the popcompile format."""
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "format_version": 2}))
    (folder / "weights.bin").write_bytes(b"old engine")
    return folder


def fit_file(path: Path, *, cut: int = 2, shape=(KV_WIDTH, HIDDEN), value: float = 0.01,
             layers=range(3, LAYERS)) -> Path:
    """A calibration file shaped like `calibrate`'s, with the given geometry and values."""
    weights = {i: {part: Projection(torch.full(shape, value)) for part in ("k_proj", "v_proj")}
               for i in layers}
    save_fit(KVFit(CalibrationInfo(cut, LAYERS, 1e-3, 64, "0" * 64), weights), path)
    return path


# --- export: what --force may replace, and the destination ----------------------------------------

def test_version_prints_the_package_version_and_exits_0(capsys):
    import popcompile

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"popcompile {popcompile.__version__}\n"


def test_a_missing_environment_exits_3_and_a_mistake_2_as_help_says(monkeypatch, tmp_path, capsys):
    """A script can tell a skip (this machine lacks a GPU, TensorRT, an extra: 3) from a mistake (2)."""
    from popcompile import commands
    from popcompile.cli import EXIT_UNAVAILABLE, EXIT_USER_ERROR

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    epilog = capsys.readouterr().out.split("exit codes:\n")[1]
    assert exited.value.code == 0 and re.search(r"^  2 +a mistake to fix", epilog, re.M)
    assert re.search(r"^  3 +this machine lacks what the request needs: an NVIDIA GPU", epilog, re.M)
    assert (EXIT_USER_ERROR, EXIT_UNAVAILABLE) == (2, 3)
    monkeypatch.setitem(commands.EXTRA_MODULES, "compile", ("popcompile_no_such_module",))
    argv = ["export", "smollm2-135m", "--out", str(tmp_path / "e")]
    assert main(argv) == 3
    line = capsys.readouterr().err.strip()
    assert line.startswith("popcompile export: error: ") and "pip install 'popcompile[compile]'" in line
    assert main(["run", str(tmp_path / "e"), "--max-new-tokens", "0", "--prompt", "hi"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_every_command_prints_its_result_as_json_on_request():
    import argparse

    from popcompile.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert [name for name, parser in commands.items() if "--json" not in parser._option_string_actions] == []


def test_a_reader_that_left_ends_the_command_quietly(monkeypatch, engines):
    """``popcompile info E | head -1``: stdout's reader is gone when the command writes: no traceback, the
    exit code of SIGPIPE, and later writes go nowhere."""
    import io

    read, write = os.pipe()
    os.close(read)  # every write to ``write`` fails with EPIPE
    stdout = io.TextIOWrapper(os.fdopen(write, "wb", buffering=0), write_through=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["info", str(engines.tiny("llama", cut=3, max_seq=64))]) == 128 + signal.SIGPIPE
    print("after", file=stdout)  # the descriptor now points at /dev/null
    stdout.close()


def test_force_refuses_a_folder_that_is_not_an_engine(hf, tmp_path, capsys):
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("\\chapter{Four years of work}\n")
    before = tree(tmp_path)
    fails(capsys, ["export", hf, "--out", thesis, "--force"], "not a popcompile engine folder", within_s=1.0)
    assert tree(tmp_path) == before


def test_force_refuses_a_folder_whose_manifest_is_corrupt(hf, tmp_path, capsys):
    folder = tmp_path / "engine"
    folder.mkdir()
    (folder / MANIFEST).write_bytes(b"\x00\xffnot json")
    (folder / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    fails(capsys, ["export", hf, "--out", folder, "--force"], "not a popcompile engine folder")
    assert tree(tmp_path) == before


def test_existing_engine_needs_force(hf, tmp_path, capsys):
    fake_engine(tmp_path / "engine")
    before = tree(tmp_path)
    fails(capsys, ["export", hf, "--out", tmp_path / "engine"], "pass --force", within_s=1.0)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("make, out, culprit", [
    (lambda d: (d / "file").write_text("x"), "file", "exists and is not a folder"),
    (lambda d: (d / "file").write_text("x"), "file/engine", "is a file, not a folder"),
    (lambda d: (d / "file").write_text("x"), "file/a/b/engine", "is a file, not a folder"),
], ids=["out-is-a-file", "out-under-a-file", "out-deep-under-a-file"])
def test_out_that_cannot_be_a_folder_fails_at_once(hf, tmp_path, capsys, make, out, culprit):
    make(tmp_path)
    before = tree(tmp_path)
    fails(capsys, ["export", hf, "--out", tmp_path / out], culprit, within_s=1.0)
    assert tree(tmp_path) == before


def test_out_that_is_a_symlink_is_refused(hf, tmp_path, capsys):
    target = fake_engine(tmp_path / "real")
    (tmp_path / "link").symlink_to(target)
    before = tree(target)
    fails(capsys, ["export", hf, "--out", tmp_path / "link", "--force"], "not a folder")
    assert tree(target) == before


# --- export: option values, before the model loads -------------------------------------------------

@pytest.mark.parametrize("args, culprit", [
    (["--max-seq", "0"], "--max-seq 0"),
    (["--max-seq", "-5"], "--max-seq -5"),
    (["--max-seq", "4"], "--max-seq 4"),
    (["--cut", "0"], "--cut 0"),
    (["--cut", "-2"], "--cut -2"),
    (["--prune-ratio", "nan"], "--prune-ratio nan"),
    (["--prune-ratio", "1.5"], "--prune-ratio 1.5"),
    (["--prune-ratio", "-0.1"], "--prune-ratio -0.1"),
    (["--cut", "auto", "--budget", "inf"], "--budget"),
    (["--cut", "auto", "--budget", "nan"], "--budget"),
    (["--cut", "auto", "--min-agreement", "nan"], "--min-agreement"),
    (["--cut", "auto", "--min-agreement", "1.5"], "--min-agreement"),
    (["--min-prompt-tokens", "-3"], "--min-prompt-tokens"),
    (["--kv-calibration", "distil"], "give auto, none, ridge, distill, or a file"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_export_options_fail_in_a_second(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["export", hf, "--out", tmp_path / "engine", *args], culprit, within_s=1.0)
    assert list(tmp_path.iterdir()) == []


def test_export_help_names_the_distill_calibration_and_its_cost(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "{auto,ridge,distill,none,FILE}" in text and "distill (POP++" in text and "4-5 min at 135M" in text
    assert "auto (default: distill for a text model, ridge for a vision-language model)" in text


@pytest.mark.parametrize("args, culprit", [
    (["--max-seq", "100000"], "max_position_embeddings=512"),
    (["--cut", "99"], "cut=99 is out of range"),
], ids=["max-seq-over-model-limit", "cut-over-layers"])
def test_options_beyond_the_model_fail_before_capture(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["export", hf, "--out", tmp_path / "engine", "--kv-calibration", "none", *args], culprit,
          within_s=15.0)
    assert list(tmp_path.iterdir()) == []


# --- export: calibration files --------------------------------------------------------------------

@pytest.mark.parametrize("make, culprit", [
    (lambda p: p.write_bytes(os.urandom(300)), "not a readable KV calibration file"),
    (lambda p: p.write_bytes(b""), "not a readable KV calibration file"),
    (lambda p: save_file({"x": torch.ones(2)}, str(p)), "no metadata"),
    (lambda p: fit_file(p, shape=(7, 5)), "do not match the model"),
    (lambda p: fit_file(p, layers=range(2, LAYERS)), "the model needs [3]"),
    (lambda p: fit_file(p, value=math.nan), "non-finite values"),
    (lambda p: fit_file(p, value=math.inf), "non-finite values"),
    (lambda p: fit_file(p, cut=1, layers=range(2, LAYERS)), "fitted for cut 1"),
], ids=["random-bytes", "empty", "foreign-safetensors", "wrong-shape", "wrong-layers", "nan", "inf",
        "other-cut"])
def test_bad_calibration_file_is_named(hf, tmp_path, capsys, make, culprit):
    fit = tmp_path / "kv.safetensors"
    make(fit)
    line = fails(capsys, ["export", hf, "--out", tmp_path / "engine", "--cut", "2", "--max-seq", "64",
                          "--kv-calibration", fit], culprit, within_s=15.0)
    assert "kv.safetensors" in line or "KV calibration" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.safetensors"]


def test_missing_calibration_file_is_named(hf, tmp_path, capsys):
    fails(capsys, ["export", hf, "--out", tmp_path / "engine", "--kv-calibration",
                   tmp_path / "nope.safetensors"],
          "nope.safetensors does not exist")


# --- export: damaged model folders and files -------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("damage, culprit", [
    (lambda d: (d / "config.json").write_text('{"model_type": "llama", '), "config.json cannot be read"),
    (lambda d: (d / "config.json").write_text('[1, 2]'), "config.json is not a JSON object"),
    (lambda d: (d / "model.safetensors").unlink(), "has no weights"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
     "weights in"),
    (lambda d: (d / "tokenizer.json").write_text("{ not json"), "tokenizer"),
], ids=["corrupt-config", "config-not-object", "no-weights", "truncated-weights", "corrupt-tokenizer"])
def test_damaged_model_folder_is_a_model_error(hf, tmp_path, capsys, damage, culprit):
    model = _copy(hf, tmp_path / "model")
    damage(model)
    before = tree(tmp_path)
    line = fails(capsys, ["export", model, "--out", tmp_path / "engine", "--kv-calibration", "none"], culprit)
    assert str(model) in line or "model" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("content, culprit", [
    (b"GGUF\x03\x00\x00\x00garbage", "GGUF file"),
    (b"PK\x03\x04 a zip, not a model", "is not a GGUF file"),
], ids=["corrupt-gguf", "not-gguf"])
def test_damaged_gguf_is_a_model_error(tmp_path, capsys, content, culprit):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(content)
    fails(capsys, ["export", gguf, "--out", tmp_path / "engine", "--kv-calibration", "none"], culprit)
    assert not (tmp_path / "engine").exists()


# --- export: the one successful export, and what it leaves -----------------------------------------

def test_force_replaces_an_engine_folder_and_cleans_stale_partials(hf, tmp_path, capsys):
    out = fake_engine(tmp_path / "engine")
    stale = tmp_path / ".engine.999999999.partial"  # a killed export's: pid 999999999 does not exist
    stale.mkdir()
    (stale / "weights.bin").write_bytes(b"half")
    assert main(["export", str(hf), "--out", str(out), "--force", "--cut", "3", "--max-seq", "16",
                 "--kv-calibration", "none"]) == 0
    manifest = EngineManifest.read(out)
    assert (manifest.cut, manifest.kv_layout.max_seq) == (3, 16)
    assert (out / "weights.bin").read_bytes() != b"old engine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # no partial, no lock, no old folder


# --- export: signals and concurrency (a real process) ----------------------------------------------

def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_second_export_fails_at_once_and_sigterm_leaves_nothing(hf, tmp_path, capsys):
    out = tmp_path / "engine"
    proc = subprocess.Popen([sys.executable, "-m", "popcompile.cli", "export", str(hf), "--out", str(out),
                             "--max-seq", "64", "--kv-calibration", "none"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    try:
        assert _wait_for(lambda: (tmp_path / ".engine.lock").exists(), 120), proc.stderr.read()
        fails(capsys, ["export", hf, "--out", out, "--kv-calibration", "none"], f"pid {proc.pid}",
              within_s=1.0)
        partial = tmp_path / f".engine.{proc.pid}.partial"
        assert _wait_for(partial.exists, 240), "the export never reached its staging folder"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # no engine, no partial, no lock


_SIGNAL_IN_IMPORT = """
import signal, sys, time
# as in a foreground interpreter: a suite started in the background (`cmd &`) hands its children SIGINT
# ignored, which _signals_raise rightly leaves alone
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[1])
from popcompile.cli import Terminated, _signals_raise
start = time.monotonic()
try:
    with _signals_raise():
        import signals_itself  # sends SIGTERM from inside its own import, then takes 0.3 s to finish
        time.sleep(10)
except Terminated:
    print(sys.modules["signals_itself"].FINISHED, round(time.monotonic() - start, 1))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_an_import_is_raised_after_it(tmp_path, signum):
    """An exception inside an extension module's init crashed the interpreter (SIGSEGV in ``import onnx``)."""
    (tmp_path / "signals_itself.py").write_text(
        f"import os, time\nos.kill(os.getpid(), {int(signum)})\ntime.sleep(0.3)\nFINISHED = True\n")
    if signum == signal.SIGINT:
        code = _SIGNAL_IN_IMPORT.replace("except Terminated", "except KeyboardInterrupt")
    else:
        code = _SIGNAL_IN_IMPORT
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    printed = done.stdout.split()  # [FINISHED, seconds] once Terminated/KeyboardInterrupt was caught
    assert printed[:1] == ["True"] and float(printed[1]) < 2.0, done.stdout + done.stderr


def test_lock_held_by_another_process_names_it(hf, tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / '.engine.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        fails(capsys, ["export", hf, "--out", tmp_path / "engine"], "being written by another popcompile",
              within_s=1.0)
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "engine").exists()


# --- calibrate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, culprit", [
    (["--ridge", "nan"], "--ridge"),
    (["--ridge", "-1"], "--ridge"),
    (["--ridge", "inf"], "--ridge"),
    (["--seq-len", "0"], "--seq-len"),
    (["--max-tokens", "-3"], "--max-tokens"),
    (["--prune-ratio", "nan"], "--prune-ratio"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_calibrate_options_fail_in_a_second(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["calibrate", hf, "--out", tmp_path / "kv.safetensors", *args], culprit, within_s=1.0)
    assert list(tmp_path.iterdir()) == []


def test_calibrate_refuses_an_existing_out_and_a_folder(hf, tmp_path, capsys):
    (tmp_path / "kv.safetensors").write_bytes(b"precious")
    before = tree(tmp_path)
    fails(capsys, ["calibrate", hf, "--out", tmp_path / "kv.safetensors"], "pass --force", within_s=1.0)
    fails(capsys, ["calibrate", hf, "--out", tmp_path], "is a folder", within_s=1.0)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", ["kv.safetensors", "kv.json", "config"])
def test_calibrate_writes_only_its_out_file(hf, tmp_path, name):
    """No side file: a user's kv.json / config.json beside --out survive, and --out kv.json is the fit
    itself."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"t{i % 90}" for i in range(400)))
    for neighbour in ("kv.json", "config.json"):
        if neighbour != name:
            (tmp_path / neighbour).write_text('{"mine": true}')
    before = tree(tmp_path)
    assert main(["calibrate", str(hf), "--out", str(tmp_path / name), "--cut", "2", "--seq-len", "16",
                 "--text", str(corpus), "--method", "ridge"]) == 0
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k != name} == before
    fit = load_fit(tmp_path / name)
    assert fit.info.cut == 2 and set(fit.weights) == {3}


@pytest.mark.parametrize("flag, content, culprit", [
    ("--text", b"caf\xe9 \xff\xfe", "not UTF-8"),
    ("--jsonl", b'{"text": "ok"}\n{"text": 3}\n', "JSONL line 2"),
    ("--jsonl", b"\xff\xff\n", "not UTF-8"),
], ids=["text-latin1", "jsonl-bad-field", "jsonl-latin1"])
def test_calibration_text_files_are_named(hf, tmp_path, capsys, flag, content, culprit):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    line = fails(capsys, ["calibrate", hf, "--out", tmp_path / "kv.safetensors", flag, data], culprit,
                 within_s=1.0)
    assert str(data) in line
    assert not (tmp_path / "kv.safetensors").exists()


def test_missing_text_file_is_named(hf, tmp_path, capsys):
    fails(capsys, ["calibrate", hf, "--out", tmp_path / "kv.safetensors", "--text", tmp_path / "nope.txt"],
          "nope.txt", within_s=1.0)


def test_non_finite_fits_are_refused():
    nan = Projection(torch.tensor([[math.nan]]))
    with pytest.raises(InputError, match="layer 3 k_proj.weight"):
        check_finite(KVFit(CalibrationInfo(2, 4, 1e-3, 8, ""), {3: {"k_proj": nan}}), "the fit")


# --- eval -----------------------------------------------------------------------------------------

def test_eval_refuses_to_replace_results_without_force(hf, tmp_path, capsys):
    (tmp_path / "results.json").write_text('{"weeks": "of runs"}')
    before = tree(tmp_path)
    fails(capsys, ["eval", hf, "--out", tmp_path], "results.json exists", within_s=1.0)
    assert tree(tmp_path) == before


def test_eval_force_replaces_results(hf, tmp_path):
    (tmp_path / "results.json").write_text('{"old": true}')
    assert main(["eval", str(hf), "--out", str(tmp_path), "--force", "--tasks", "continuation", "--variants",
                 "full,pop", "--limit", "1", "--prefix-len", "16", "--cont-len", "4", "--cut", "3"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cut"] == 3 and "continuation" in results["tasks"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


@pytest.mark.parametrize("args, culprit", [
    (["--threads", "-1"], "--threads"),
    (["--limit", "0"], "--limit"),
    (["--min-agreement", "nan"], "--min-agreement"),
    (["--timeout", "inf"], "--timeout"),
    (["--prune-ratio", "nan"], "--prune-ratio"),
    (["--tasks", "poetry"], "poetry"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_eval_options_fail_in_a_second(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["eval", hf, "--out", tmp_path / "out", *args], culprit, within_s=1.0)
    assert not (tmp_path / "out").exists()


def test_eval_out_that_is_a_file(hf, tmp_path, capsys):
    (tmp_path / "out").write_text("x")
    fails(capsys, ["eval", hf, "--out", tmp_path / "out"], "is a file", within_s=1.0)
    assert (tmp_path / "out").read_text() == "x"


# --- analyze and run ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, culprit", [
    (["--budget", "nan"], "budget"),
    (["--samples", "0"], "samples"),
], ids=["budget-nan", "samples-0"])
def test_bad_analyze_options(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["analyze", hf, "--out", tmp_path / "out", *args], culprit)
    assert not (tmp_path / "out").exists()


def test_analyze_refuses_its_old_report_and_non_utf8_text(hf, tmp_path, capsys):
    (tmp_path / "analyze.json").write_text("{}")
    fails(capsys, ["analyze", hf, "--out", tmp_path], "analyze.json exists", within_s=1.0)
    bad = tmp_path / "t.txt"
    bad.write_bytes(b"\xff\xfe\x00")
    fails(capsys, ["analyze", hf, "--out", tmp_path / "new", "--text", bad], "not UTF-8")


@pytest.mark.parametrize("args, culprit", [
    (["--prompt", "hi", "--threads", "-1"], "--threads"),
    (["--prompt", "hi", "--threads", "0"], "--threads"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "hi", "--min-prompt-tokens", "-1"], "--min-prompt-tokens"),
    (["--prompt", "hi", "--compare", "--repeat", "0"], "--repeat"),
    (["--prompt", "hi", "--repeat", "3"], "use it with --compare"),
    (["--max-new-tokens", "4"], "no prompt"),
], ids=["threads-negative", "threads-zero", "max-new-tokens-0", "min-prompt-tokens-negative", "repeat-0",
        "repeat-without-compare", "no-prompt"])
def test_bad_run_options_fail_before_the_engine_loads(tmp_path, capsys, args, culprit):
    fails(capsys, ["run", tmp_path / "no-engine", *args], culprit, within_s=1.0)


def test_run_refuses_another_runtimes_flags(tmp_path, capsys):
    """Each flag goes to one runtime (run.RUNTIME_FLAGS): given with the other, it would be ignored."""
    fails(capsys, ["run", tmp_path / "e", "--prompt", "hi", "--cuda-graph"],
          "--cuda-graph: --runtime tensorrt's", within_s=1.0)
    fails(capsys, ["run", tmp_path / "e", "--prompt", "hi", "--runtime", "tensorrt", "--provider", "cuda",
                   "--threads", "2"], "--provider, --threads: --runtime onnxruntime's", within_s=1.0)


def usage_error(cli, *args) -> str:
    """argparse's refusal: exit 2, usage, then one error line; that line."""
    done = cli(*args, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_tensorrt_is_one_switch_and_provider_has_choices(cli, tmp_path):
    from popcompile.commands.common import PROVIDERS
    from popcompile.runtime.ort import PROVIDERS as ORT_PROVIDERS

    assert set(ORT_PROVIDERS) - set(PROVIDERS) == {"tensorrt"}  # onnxruntime's devices, TensorRT elsewhere
    for command in (["run", tmp_path / "e", "--prompt", "hi"], ["eval", tmp_path / "e", "--out", tmp_path]):
        line = usage_error(cli, *command, "--provider", "tensorrt")
        assert "popcompile run --runtime tensorrt" in line and "cpu or cuda" in line, line
        assert "invalid choice: 'tpu'" in usage_error(cli, *command, "--provider", "tpu")
    assert "--runtime {onnxruntime,tensorrt}" in cli("run", "--help").stdout


def test_precision_flags_share_one_vocabulary_and_take_the_short_spellings(cli, tmp_path):
    """export --dtype and --precision (build-trt, export --target tensorrt): float32/float16/bfloat16, with
    fp32/fp16/bf16 as aliases; build-trt hands TrtBuildConfig its own spelling."""
    from popcompile.cli import build_parser
    from popcompile.commands.build_trt import build_config
    from popcompile.exporters.tensorrt import PRECISIONS, TrtBuildConfig

    parse = build_parser().parse_args
    export = ["export", "m", "--out", "o"]
    assert parse([*export, "--dtype", "fp16"]).dtype == parse([*export, "--dtype", "float16"]).dtype
    assert parse([*export, "--dtype", "fp16"]).dtype == "float16"
    assert parse(export).dtype == "float32" and parse([*export, "--precision", "FP32"]).precision == "float32"
    for given, trt in (("bf16", "bf16"), ("bfloat16", "bf16"), ("float16", "fp16"), ("fp32", "fp32")):
        assert build_config(parse(["build-trt", "e", "--precision", given])).precision == trt
    assert build_config(parse(["build-trt", "e"])) == TrtBuildConfig()  # the same default
    assert sorted(build_config(parse(["build-trt", "e", "--precision", p])).precision
                  for p in ("float32", "float16", "bfloat16")) == sorted(PRECISIONS)
    assert "invalid choice: 'bfloat16'" in usage_error(cli, *export, "--dtype", "bf16")  # no bfloat16 ONNX
    assert "invalid choice: 'fp8'" in usage_error(cli, "build-trt", tmp_path, "--precision", "fp8")
    for command in (export, ["build-trt", "e"]):
        assert "{float32,float16" in " ".join(cli(*command[:1], "--help").stdout.split())


def test_run_prompt_file_that_is_not_utf8(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"\x80\x81 bonjour")
    fails(capsys, ["run", tmp_path / "no-engine", "--prompt-file", prompt], "prompt.txt is not UTF-8")


# --- the write primitives -------------------------------------------------------------------------

def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), fsutil.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]
    with pytest.raises(OutputError, match="No space left on device"), fsutil.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))  # what a full disk raises
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_staged_folder_swaps_only_when_complete_and_lock_is_exclusive(tmp_path):
    out = fake_engine(tmp_path / "engine")
    with pytest.raises(RuntimeError), fsutil.staged_folder(out, replace=True) as tmp:
        (tmp / "weights.bin").write_bytes(b"new")
        raise RuntimeError("interrupted")
    assert (out / "weights.bin").read_bytes() == b"old engine"
    with fsutil.staged_folder(out, replace=True) as tmp:
        (tmp / "weights.bin").write_bytes(b"new")
    assert (out / "weights.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    with fsutil.destination_lock(out):
        fd = os.open(tmp_path / ".engine.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    assert not (tmp_path / ".engine.lock").exists()
    with pytest.raises(OutputError, match="appeared"), fsutil.staged_folder(out) as tmp:
        pass
