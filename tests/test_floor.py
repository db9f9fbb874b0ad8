"""The quality floor (quality/floor.py, floor_prompts.py): its teacher-forced measure equals free-running
greedy POP's (reference.generate) prompt by prompt, the cut it chooses, and its prompts' provenance."""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import pytest
import torch
from test_distill import sharp_model
from tiny_engine import tiny_hf_folder, tiny_tokenizer

from popcompile import reference
from popcompile.commands.info import quality_line
from popcompile.config import KVFitConfig, PopConfig, QualityFloor
from popcompile.driver import compile
from popcompile.engine.manifest import EngineManifest
from popcompile.errors import ConfigError
from popcompile.frontend.models import load_model
from popcompile.kvfit.calibrate import ridge_fits
from popcompile.kvfit.corpus import CALIBRATION_MODULES, STDLIB_MODULES
from popcompile.measure.eval.scoring import matched_prefix
from popcompile.quality.floor import CutQuality, FloorSearch, check_shipped, choose_cut, measure_cuts
from popcompile.quality.prompts import FLOOR_MODULES, KINDS, PER_KIND, FloorPrompt, floor_prompts, texts
from popcompile.reference import Variant

CONT = 8


def ids(length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, 97, (length,), generator=generator).tolist()


def prompts(count: int = 4, same_length: bool = False) -> list[FloorPrompt]:
    """Of one length (the measure runs them as one batch) or each its own."""
    generator = torch.Generator().manual_seed(5)
    return [FloorPrompt(f"p{i}", "code", tuple(ids(20 if same_length else 12 + 3 * i, generator)))
            for i in range(count)]


@pytest.mark.parametrize("arch, same_length", [("llama", True), ("qwen3", False)])
def test_the_teacher_forced_measure_is_free_running_greedy_pops(arch, same_length):
    """Per cut, POP+ weights and the layers' own: the share of prompts whose first token is the full
    model's and the mean matched prefix equal what reference.generate's greedy tokens give."""
    model = sharp_model(arch)  # 4 layers
    layers = model.config.num_hidden_layers
    batches = [torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(9))]
    fits = {3: None, 2: ridge_fits(model, batches, [2])[2].weights, 1: None}
    got = measure_cuts(model, prompts(same_length=same_length), fits, continuation=CONT)
    for cut, weights in fits.items():
        first, matched = [], []
        for prompt in prompts(same_length=same_length):
            ids = torch.tensor([prompt.ids])
            full = reference.generate(model, ids, CONT, Variant(layers))
            pop = reference.generate(model, ids, CONT, Variant(cut, kv_weights=weights))
            first.append(full[0] == pop[0])
            matched.append(matched_prefix(full, pop))
        assert got[cut].first_token == pytest.approx(sum(first) / len(first), abs=1e-9), cut
        assert got[cut].matched_prefix == pytest.approx(sum(matched) / len(matched), abs=1e-9), cut
    assert {q.prompts for q in got.values()} == {4}
    assert min(q.matched_prefix for q in got.values()) < CONT  # some cut loses tokens: not all-equal


def quality(cut: int, first: float) -> CutQuality:
    return CutQuality(cut, first, 10.0 * first, 64, 32)


def test_the_choice_is_the_deepest_cut_meeting_the_floor_without_a_gap():
    floor = QualityFloor(min_agreement=0.95)
    curve = {29: quality(29, 1.0), 28: quality(28, 0.97), 27: quality(27, 0.95), 26: quality(26, 0.9),
             25: quality(25, 0.96)}
    assert choose_cut(curve, floor, 30) == 27  # 25 meets it again below a miss: not taken
    assert choose_cut({29: quality(29, 0.9)}, floor, 30) == 30  # no cut holds it: nothing pruned
    assert choose_cut(curve, QualityFloor(min_agreement=0.0), 30) == 25


def test_candidates_and_bad_values():
    assert QualityFloor().candidates(30) == list(range(29, 14, -1))
    assert QualityFloor(max_prune=0.2).candidates(10) == [9, 8]
    with pytest.raises(ConfigError, match=r"--min-agreement 1.5 must be a share within 0..1"):
        QualityFloor(min_agreement=1.5)
    with pytest.raises(ConfigError, match="prompts=0 must be an integer >= 1"):
        QualityFloor(prompts=0)


def test_the_prompts_are_held_out_of_calibration_and_evaluation():
    assert not set(FLOOR_MODULES) & (set(STDLIB_MODULES) | set(CALIBRATION_MODULES))
    got = texts()
    assert list(got) == list(KINDS) and all(len(group) >= PER_KIND for group in got.values())
    root = Path(sysconfig.get_paths()["stdlib"])
    for module in FLOOR_MODULES:  # present in this interpreter (3.10-3.13 all have them)
        assert ast.parse((root / f"{module}.py").read_text(encoding="utf-8"))
    tokenizer = tiny_tokenizer(97)
    made = floor_prompts(tokenizer, limit=8)
    assert [p.kind for p in made] == list(KINDS) * 2 and all(len(p.ids) >= 2 for p in made)


# --- through the driver and the CLI ---------------------------------------------------------------

FAST = KVFitConfig(seq_len=32, max_tokens=1024)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_hf_folder(tmp_path_factory.mktemp("floor-hf"), layers=6, max_position_embeddings=512)


def floor(**kwargs) -> QualityFloor:
    return QualityFloor(**{"prompts": 8, "continuation": 8, "search_tokens": 512, **kwargs})


def test_compile_chooses_the_cut_and_records_the_curve_and_the_shipped_fit(folder, tmp_path):
    config = PopConfig(quality_floor=floor(min_agreement=0.0), kv_calibration="ridge", kv_fit=FAST,
                       max_seq=64, min_prompt_tokens=0)
    manifest = compile(str(folder), config, out=tmp_path / "e", fit_progress=lambda event: None)
    choice = manifest.extra["cut_choice"]
    assert manifest.cut == choice["cut"] == 3  # floor 0: the deepest candidate, L - floor(L / 2)
    assert [row["cut"] for row in choice["curve"]] == [5, 4, 3]
    assert choice["shipped"]["cut"] == 3 and choice["shipped"]["fit"] == "ridge"
    assert choice["shipped"]["prompts"] == 8 and 0 <= choice["shipped"]["first_token"] <= 1
    assert choice["paper_third"]["cut"] == 4 and choice["search_fit"] == "ridge (POP+) on 512 tokens"
    assert manifest.extra["kv_calibration"]["cut"] == 3


def test_a_floor_no_cut_holds_prunes_nothing_and_says_so():
    curve = {5: quality(5, 0.5), 4: quality(4, 0.4)}
    cut = choose_cut(curve, QualityFloor(), 6)
    found = FloorSearch(QualityFloor(), curve, cut, 6, True, tuple(prompts(2)))
    assert found.cut == 6 and check_shipped(None, found, None) is None  # nothing pruned: nothing to measure
    assert found.summary() == ("quality floor 95%: no cut holds it (the shallowest, cut 5: first token "
                               "equal on 50% of 64 held-out prompts, matched prefix 5.0/32 with POP+); "
                               "nothing pruned")
    record = found.record(None, "none", third=4)
    assert record["shipped"] is None and record["paper_third"]["cut"] == 4
    assert quality_line(record) == ("quality floor: no cut keeps the full model's first token on 95% of 2 "
                                    "held-out prompts; nothing pruned\n")
    chosen = FloorSearch(QualityFloor(), {5: quality(5, 0.97), 4: quality(4, 0.4)}, 5, 6, False, ())
    assert chosen.summary() == ("quality floor 95%: cut 5: first token equal on 97% of 64 held-out prompts, "
                                "matched prefix 9.7/32 with POP; cut 4: 40%")
    shipped = quality(5, 0.97)
    line = quality_line(FloorSearch(QualityFloor(), curve, 5, 6, True, ()).record(shipped, "distill", 4))
    assert line == ("quality: cut 5 keeps the full model's first token on 97% of 64 held-out prompts, "
                    "matched prefix 9.7/32 (distill fit; floor 95%); 1/3 pruned (cut 4) would give 40% / 4.0 "
                    "(POP+)\n")


def test_the_floor_and_a_fixed_cut_are_refused_together():
    with pytest.raises(ConfigError, match="quality_floor chooses the cut"):
        PopConfig(cut=4, quality_floor=QualityFloor())


def test_cli_export_defaults_to_the_quality_floor_and_prints_it(folder, tmp_path, cli):
    done = cli("export", folder, "--out", tmp_path / "floor", "--min-agreement", "0.5",
               "--kv-calibration", "none", "--max-seq", "64", "--min-prompt-tokens", "0")
    assert "keeps the full model's first token on" in done.stdout and "floor 50%" in done.stdout
    assert EngineManifest.read(tmp_path / "floor").extra["cut_choice"]["min_agreement"] == 0.5
    compared = cli("run", tmp_path / "floor", "--prompt", "t1 t2 t3 t4 t5", "--compare",
                   "--max-new-tokens", 2, "--min-prompt-tokens", 0)
    choice = EngineManifest.read(tmp_path / "floor").extra["cut_choice"]
    assert compared.stdout.splitlines()[-1] == quality_line(choice).strip() != ""


def test_a_floor_over_the_budget_is_skipped_for_the_papers_third_in_one_line(folder, tmp_path):
    config = PopConfig(quality_floor=floor(), kv_calibration="none", max_seq=64, min_prompt_tokens=0,
                       kv_fit=KVFitConfig(budget_s=1e-6))
    events = []
    manifest = compile(str(folder), config, out=tmp_path / "e", fit_progress=events.append)
    skipped = manifest.extra["cut_choice"]["skipped"]
    assert manifest.cut == 4 and skipped.startswith("quality floor skipped: its estimate (~")
    assert "exceeds --calibration-budget 0 s; cut at the paper's third" in skipped
    assert [event.line() for event in events] == [skipped] and quality_line(manifest.extra["cut_choice"])


def test_the_estimate_grows_with_the_work(folder):
    from popcompile.quality.floor import estimate_s

    model = load_model(str(folder)).model
    small = estimate_s(model, floor(prompts=8), fitted=False, seq_len=32)
    assert 0 < small < estimate_s(model, floor(prompts=64), fitted=False, seq_len=32)
    assert small < estimate_s(model, floor(prompts=8), fitted=True, seq_len=32)
