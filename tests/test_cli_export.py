"""`popcompile export` choices that need no real model: --cut auto, its options, bad values."""
from __future__ import annotations

import argparse
import re

import pytest
from tiny import tiny_model
from tiny_engine import tiny_tokenizer

from popcompile.cli import main
from popcompile.commands.info import summary
from popcompile.engine.manifest import EngineManifest
from popcompile.kvfit.calibrate import load_fit


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny llama saved as a Hugging Face folder (what `export FOLDER` loads)."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model("llama", layers=6, max_position_embeddings=512)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_cut_auto_with_a_budget_takes_analyze_recommendation_and_records_it(tiny_folder, tmp_path, capsys):
    """--cut auto alone is the quality floor (test_floor.py); --budget asks analyze. In a log (stderr not a
    terminal) the fit shows its estimate and a line per 10% inside the calibrate step."""
    out = tmp_path / "engine"
    assert main(["export", str(tiny_folder), "--out", str(out), "--cut", "auto", "--budget", "0.3",
                 "--max-seq", "64", "--kv-calibration", "ridge"]) == 0  # auto's distillation: test_driver.py
    err = capsys.readouterr().err.splitlines()
    manifest = EngineManifest.read(out)
    choice = manifest.extra["cut_choice"]
    assert choice["method"] == "analyze" and choice["cut"] == manifest.cut and choice["budget"] == 0.3
    assert 1 <= manifest.cut <= 6
    if manifest.cut < 6:  # fitted for the chosen cut, and recorded
        assert manifest.extra["kv_calibration"]["cut"] == manifest.cut
        begun = [i for i, line in enumerate(err) if line.startswith("export ")]  # a line as each step begins
        step = next(i for i in begun if re.fullmatch(r"export \d+/\d+: calibrate, \d+ s", err[i]))
        inside = err[step + 1:min(i for i in begun if i > step)]
        assert inside[0].startswith("fitting POP+ K/V weights on cpu: ~") and len(inside) > 2, inside
        assert all(re.fullmatch(r"calibrate \(POP\+, ridge\): \d+/\d+ tok \(\d+%\), \d+ s", line)
                   for line in inside[1:]) and inside[-1].split(" tok ")[1].startswith("(100%)"), inside


def test_kv_calibration_none_is_the_papers_pop(tiny_folder, tmp_path):
    out = tmp_path / "engine"
    assert main(["export", str(tiny_folder), "--out", str(out), "--cut", "3", "--max-seq", "64",
                 "--kv-calibration", "none"]) == 0
    assert EngineManifest.read(out).extra["kv_calibration"] is None


@pytest.mark.parametrize("args, message", [
    (["--prune-ratio", "1/3", "--min-agreement", "0.9"], "drop --cut N / --prune-ratio"),
    (["--cut", "4", "--budget", "0.1"], "drop --cut N / --prune-ratio"),
    (["--cut", "auto", "--min-agreement", "0.9", "--budget", "0.1"], "give one"),
])
def test_cut_choice_options_are_checked_before_any_work(tiny_folder, tmp_path, capsys, args, message):
    out = tmp_path / "engine"
    assert main(["export", str(tiny_folder), "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_cut_must_be_a_number_or_auto(tiny_folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tiny_folder), "--out", str(tmp_path / "e"), "--cut", "deep"])
    assert exit_info.value.code == 2 and "'auto'" in capsys.readouterr().err


def test_calibrate_on_the_users_jsonl_then_export_with_it(tiny_folder, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    words = " ".join(f"t{i % 90}" for i in range(200))
    corpus.write_text("\n".join(f'{{"body": "{words}"}}' for _ in range(4)))
    fit = tmp_path / "kv.safetensors"
    assert main(["calibrate", str(tiny_folder), "--out", str(fit), "--cut", "2", "--seq-len", "32",
                 "--jsonl", str(corpus), "--jsonl-field", "body", "--method", "ridge"]) == 0
    # each line gives 6 whole windows of 32 tokens (the rest is dropped): 24 windows -> 768 tokens
    assert load_fit(fit).info.tokens == 768 and load_fit(fit).info.cut == 2
    out = tmp_path / "engine"
    assert main(["export", str(tiny_folder), "--out", str(out), "--max-seq", "64",
                 "--kv-calibration", str(fit)]) == 0  # no --cut: the file's own (the floor and the third: 3)
    manifest = EngineManifest.read(out)
    assert manifest.extra["kv_calibration"]["tokens"] == 768 and manifest.cut == 2
    line = "K/V of the pruned layers: POP+ (ridge, closed form), fitted on 768 tokens\n"
    assert line in summary(out, manifest)  # `popcompile info` and the export summary


def test_calibrate_names_a_bad_jsonl_before_loading_the_model(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 3}\n')
    assert main(["calibrate", "not-a-model", "--out", str(tmp_path / "kv.safetensors"),
                 "--jsonl", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--jsonl {bad}: JSONL line 1" in err and "not-a-model" not in err


def test_prune_ratio_takes_a_fraction_exactly():
    """--prune-ratio 1/3 is the paper's third exactly (0.3333 would leave 30 layers at cut 21, not 20)."""
    from popcompile.commands.common import _ratio
    from popcompile.config import resolve_cut

    assert resolve_cut(30, prune_ratio=_ratio("1/3")) == 20 and resolve_cut(30, prune_ratio=0.3333) == 21
    assert _ratio("0.25") == 0.25 and _ratio(" 2/5 ") == 0.4
    with pytest.raises(argparse.ArgumentTypeError, match="a number or a fraction such as 1/3, got 'a/b'"):
        _ratio("a/b")


def test_export_in_a_log_prints_each_step_with_the_seconds_so_far(tiny_folder, tmp_path, capsys):
    """stderr not a terminal (capsys; CI, nohup, a notebook): a line as each step begins and one at the end;
    the default export printed nothing there before (tqdm(disable=None)). The fit's lines inside its step:
    test_cut_auto_with_a_budget_takes_analyze_recommendation_and_records_it."""
    from popcompile.config import PopConfig
    from popcompile.driver import steps
    from popcompile.exporters.targets import TARGETS

    assert main(["export", str(tiny_folder), "--out", str(tmp_path / "engine"), "--cut", "3",
                 "--max-seq", "64", "--kv-calibration", "none", "--min-prompt-tokens", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    names = steps(PopConfig(cut=3, kv_calibration="none", min_prompt_tokens=0), TARGETS["onnx"]())
    begun = [line for line in err if re.fullmatch(r"export \d+/\d+: .+, \d+ s", line)]
    assert [line.rsplit(", ", 1)[0] for line in begun] == [f"export {i}/{len(names)}: {name}"
                                                          for i, name in enumerate(names, 1)]
    assert re.fullmatch(rf"export: done, {len(names)} steps in \d+ s", err[-1]), err
