"""The K/V fit's estimate, device and time budget (kvfit/budget.py): the arithmetic, the device choice, the
estimate against the measured time, the fallback to POP+ and the early stop, their one line and their
manifest record, the progress lines."""
from __future__ import annotations

import io
import json
import math
import time
import warnings

import pytest
import torch
from tiny import tiny_model
from tiny_engine import tiny_hf_folder

from popcompile.cli import main
from popcompile.commands.fitprogress import FitProgress
from popcompile.config import DEFAULT_CALIBRATION_BUDGET_S, DistillConfig, KVFitConfig, PopConfig
from popcompile.cost import Geometry
from popcompile.errors import ConfigError, EnvironmentUnavailable
from popcompile.kvfit import budget
from popcompile.kvfit.budget import (
    LAYER_OPS,
    MODEL_OPS,
    DeviceSpeed,
    FitPlan,
    Work,
    device_speed,
    distill_work,
    fit_work,
    plan_fit,
    resolve_device,
    ridge_work,
)
from popcompile.kvfit.distill import DistillProgress, ridge_then_distill
from popcompile.kvfit.fit import fit_on_tokens

LAYERS, CUT = 4, 2
SHORT = DistillConfig(steps=12, continuation=4, eval_every=3, patience=100, windows=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=LAYERS)


def windows(count: int = 8, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (count, length), generator=torch.Generator().manual_seed(seed))


# --- the device -----------------------------------------------------------------------------------

def test_auto_is_cuda_when_present_else_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(EnvironmentUnavailable, match="--device cuda:2: this machine has 2 CUDA GPU"):
        resolve_device("cuda:2")


def test_an_absent_device_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(EnvironmentUnavailable, match=f"--device {spec}: torch sees no CUDA GPU"):
            resolve_device(spec)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(EnvironmentUnavailable, match="--device mps"):
        resolve_device("mps")


@pytest.mark.parametrize("field, value, flag", [
    ("device", "gpu", "--device 'gpu'"), ("device", "cuda:x", "--device 'cuda:x'"),
    ("device", 0, "--device 0"),
    ("budget_s", 0, "--calibration-budget 0"), ("budget_s", -5.0, "--calibration-budget -5.0"),
    ("budget_s", math.nan, "--calibration-budget nan"), ("budget_s", True, "--calibration-budget True"),
    ("budget_s", "10", "--calibration-budget '10'"),
])
def test_bad_device_and_budget_name_the_flag(field, value, flag):
    with pytest.raises(ConfigError, match=flag.replace("(", r"\(").replace(".", r"\.")):
        KVFitConfig(**{field: value})
    assert KVFitConfig(budget_s=None).budget_s is None and KVFitConfig(device="cuda:3").device == "cuda:3"
    assert KVFitConfig().budget_s == DEFAULT_CALIBRATION_BUDGET_S and KVFitConfig().device == "auto"


def test_cli_device_without_a_gpu_is_one_line_exit_3(tmp_path, capsys, monkeypatch):
    """Before the model loads: the model path need not even exist. 3: the machine lacks it (bad values: 2)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["export", str(tmp_path / "m"), "--out", str(tmp_path / "e"), "--device", "cuda"],
                 ["calibrate", str(tmp_path / "m"), "--out", str(tmp_path / "k.safetensors"), "--device",
                  "cuda:1"]):
        assert main(argv) == 3
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and "torch sees no CUDA GPU" in lines[0] and "--device cuda" in lines[0], lines
    assert main(["export", str(tmp_path / "m"), "--out", str(tmp_path / "e"),
                 "--calibration-budget", "-1"]) == 2
    assert "--calibration-budget -1.0" in capsys.readouterr().err


# --- the arithmetic -------------------------------------------------------------------------------

def test_ridge_work_counts_the_decoder_the_moments_and_the_solves():
    g = Geometry(64, 4, 2, 16, 128, 97, LAYERS)
    work = ridge_work(g, CUT, [(4, 24), (4, 24)])
    d, kv, deep = 65, 2 * 16, LAYERS - 1 - CUT
    decoder = 2 * 4 * LAYERS * g.layer(0, 24)
    moments = 2 * 2 * (2 * 96 * d * d + 2 * 96 * d * 2 * kv * deep + deep * g.kv(96))
    solves = 2 * 2 * deep * 2 * d ** 3 / 3
    assert work.flops == pytest.approx(decoder + moments + solves)
    assert work.ops == 2 * 4 * (MODEL_OPS + LAYER_OPS * LAYERS)


def test_distill_work_grows_with_steps_and_windows_as_counted():
    g = Geometry(64, 4, 2, 16, 128, 97, LAYERS)
    config = KVFitConfig(method="distill", distill=SHORT)
    base = distill_work(g, CUT, 8, 24, config)
    more_steps = distill_work(g, CUT, 8, 24, KVFitConfig(method="distill", distill=DistillConfig(
        steps=24, continuation=4, eval_every=3, patience=100)))
    p, c, deep = 23, 4, LAYERS - CUT
    student = deep * (g.kv(p) + g.layer(p, c)) + c * 2 * 64 * 97  # S = the whole tiny vocabulary
    held = 2  # round(8 * 0.25)
    # 12 more steps: 3x a student forward each (forward + backward), and 4 more held-out scores
    assert more_steps.flops - base.flops == pytest.approx(12 * 3 * student + 4 * held * student)
    teacher = LAYERS * (g.layer(0, p) + g.layer(p, c) + sum(g.layer(p + i, 1) for i in range(c - 1))) \
        + (2 + c - 1) * g.head
    assert distill_work(g, CUT, 16, 24, config).flops - base.flops > 8 * teacher  # + moments, the head


def test_135m_estimates_are_the_documented_size():
    """SmolLM2-135M's geometry, the defaults: POP++ is tens of TFLOP (minutes on two cores at ~100 GFLOP/s),
    POP+ on the same windows (the teacher pass's forward, about) a third of it."""
    smol = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "intermediate_size": 1536, "vocab_size": 49152, "num_hidden_layers": 30}
    config = KVFitConfig(method="distill")
    distill = fit_work(smol, 20, config, [(64, 512)]).flops
    ridge = fit_work(smol, 20, KVFitConfig(), budget.in_batches([(64, 512)])).flops
    assert 1e13 < distill < 5e13 and 3e12 < ridge < 1.5e13 and ridge < distill / 2, (distill, ridge)


def test_the_plan_line_and_record():
    plan = FitPlan("distill", "distill", "cpu", 2.1e12, 9e9, 240.0, 600.0)
    assert plan.line() == ("fitting POP++ K/V weights on cpu: ~4 min estimated (2.1 TFLOP at 9.0 GFLOP/s "
                           "measured; budget 10 min)")
    record = plan.record(250.04, None)
    assert record["requested"] == record["method"] == "distill" and record["elapsed_s"] == 250.0
    assert record["fallback"] is None and record["stopped"] is None and record["budget_s"] == 600.0
    assert "stops at the budget" in FitPlan("ridge", "ridge", "cpu", 1e15, 1e10, 1e5, 600.0).line()


def test_device_speed_is_measured_once_in_a_fraction_of_a_second():
    device_speed.cache_clear()
    start = time.perf_counter()
    speed = device_speed(torch.device("cpu"))
    assert time.perf_counter() - start < 1.5 and speed.flops_per_s > 1e8 and 0 < speed.op_s < 1e-3
    assert device_speed(torch.device("cpu")) is speed


# --- the estimate against the time ----------------------------------------------------------------

#: the estimate and the measured time of a tiny fit agree within this factor (either way)
TOLERANCE = 5.0


@pytest.fixture
def one_thread():
    """One intra-op thread, the speed measured again under it: on cores another process keeps busy, a small
    matmul threaded over two waits milliseconds for its second thread, at random (an oversubscribed
    machine's stalls, which no estimate predicts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device_speed.cache_clear()
    yield
    torch.set_num_threads(threads)
    device_speed.cache_clear()


@pytest.mark.parametrize("method", ["ridge", "distill"])
def test_the_estimate_is_within_5x_of_a_tiny_fit(model, method, one_thread):
    config = KVFitConfig(method=method, distill=SHORT, seq_len=24, budget_s=None)
    ids = windows()
    tokens = ids if method == "distill" else list(ids.split(4))
    fit_on_tokens(model, tokens, CUT, config, progress=lambda event: None)  # warm-up
    took = math.inf
    for _ in range(3):  # the best of three: a busy machine stalls a fit of a fraction of a second for seconds
        events: list = []
        start = time.perf_counter()
        fit, _ = fit_on_tokens(model, tokens, CUT, config, progress=events.append)
        took = min(took, time.perf_counter() - start)
    plan = events[0]
    assert isinstance(plan, FitPlan) and plan.method == method and fit.record["method"] == method
    assert 1 / TOLERANCE < plan.estimate_s / took < TOLERANCE, (plan.estimate_s, took, plan.line())


# --- the budget -----------------------------------------------------------------------------------

def test_distill_over_the_budget_falls_back_to_ridge_in_one_line(model):
    """A budget the distillation cannot fit: POP+ on the same windows instead, said once (a warning where
    nothing draws progress), recorded; here ridge cannot fit either and stops after its first batch."""
    config = KVFitConfig(method="distill", distill=SHORT, seq_len=24, budget_s=1e-6)
    events: list = []
    fit, result = fit_on_tokens(model, windows(), CUT, config, progress=events.append)
    plan = events[0]
    assert result is None and fit.info.method == "ridge" and plan.method == "ridge"
    assert plan.fallback.startswith("POP++ (distill) is estimated at ~") and "\n" not in plan.fallback
    assert "over --calibration-budget 0 s on cpu: fitting POP+ (ridge" in plan.fallback
    assert [e.phase for e in events[1:]] == ["ridge"]  # one batch of 4 windows, then the budget
    record = fit.record
    assert record["requested"] == "distill" and record["method"] == "ridge"
    assert record["fallback"] == plan.fallback
    assert record["stopped"] == f"stopped after {4 * 24} of {8 * 24} tokens: budget"
    assert fit.info.bias is False  # POP+'s own default, not distill's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_on_tokens(model, windows(), CUT, config)
    assert [str(w.message) for w in caught] == [plan.fallback]


class TrainingDeadline(budget.Deadline):
    """The budget counted from the first question (the first training step), so that a slow teacher pass on a
    busy machine leaves the training its time."""

    def passed(self) -> bool:
        if not hasattr(self, "asked"):
            self.asked = time.monotonic()
        return time.monotonic() - self.asked >= self.seconds


def test_distill_stops_at_the_budget_with_the_best_weights(model, monkeypatch):
    """An estimate inside the budget, a training that is not: it stops once the budget is spent, scores
    the last weights and keeps the best held-out ones."""
    monkeypatch.setattr(budget, "device_speed", lambda device: DeviceSpeed(1e18, 1e-12))  # estimate ~0
    monkeypatch.setattr("popcompile.kvfit.fit.Deadline", TrainingDeadline)
    endless = DistillConfig(steps=100_000, continuation=4, eval_every=7, patience=100_000)
    config = KVFitConfig(method="distill", distill=endless, seq_len=24, budget_s=1.5)
    start = time.perf_counter()
    fit, result = fit_on_tokens(model, windows(), CUT, config, progress=lambda event: None)
    took = time.perf_counter() - start
    assert result.stopped == "budget" and 0 < result.steps_run < 100_000 and took < 1.5 + 15, took
    assert fit.record["stopped"] == f"stopped at step {result.steps_run} of 100000: budget"
    assert fit.record["fallback"] is None and fit.info.method == "distill"
    assert result.best.kl <= result.initial.kl and result.best_step <= result.steps_run


def test_stop_scores_the_last_weights(model):
    """stop() before step 5 of a run scored every 7 steps: the weights of step 4 are scored, and kept when
    better than the init's (lr large enough to move them)."""
    asked = iter(range(100))
    result = ridge_then_distill(model, windows(), CUT, DistillConfig(steps=50, continuation=4, eval_every=7,
                                                                      lr=1e-2, select="kl"),
                                stop=lambda: next(asked) >= 4)
    assert result.stopped == "budget" and result.steps_run == 4
    assert result.best_step in (0, 4) and (result.best_step == 4) == (result.best.kl < result.initial.kl)


def test_patience_and_the_full_run_are_told_apart(model):
    full = ridge_then_distill(model, windows(), CUT, DistillConfig(steps=3, continuation=4, eval_every=1))
    assert full.stopped is None and full.steps_run == 3
    patient = ridge_then_distill(model, windows(), CUT, DistillConfig(steps=500, continuation=4, eval_every=1,
                                                                       patience=1, lr=10.0))
    assert patient.stopped == "patience" and patient.steps_run < 500


def test_the_plan_is_ridge_when_distill_fits_in_no_budget(model):
    plan = plan_fit(model, [(8, 24)], CUT, KVFitConfig(method="distill", distill=SHORT, budget_s=None),
                    torch.device("cpu"))
    assert plan.method == "distill" and plan.fallback is None and plan.budget_s is None
    assert isinstance(Work(1.0) + Work(2.0, 3), Work)


# --- export: the manifest and the lines -----------------------------------------------------------

def test_export_records_the_fallback_in_the_manifest(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path / "hf", layers=LAYERS, max_position_embeddings=256)
    out = tmp_path / "engine"
    assert main(["export", str(folder), "--out", str(out), "--cut", str(CUT), "--max-seq", "64",
                 "--min-prompt-tokens", "0", "--calibration-budget", "0.000001", "--json"]) == 0
    captured = capsys.readouterr()
    extra = json.loads(captured.out)["extra"]
    assert extra["kv_fit"]["requested"] == "distill" and extra["kv_fit"]["method"] == "ridge"
    assert extra["kv_calibration"]["method"] == "ridge" and extra["kv_fit"]["stopped"].endswith(": budget")
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert sum(line.startswith("POP++ (distill) is estimated at") for line in err) == 1, err
    assert any(line.startswith("fitting POP+ K/V weights on cpu: ~") for line in err), err


def test_an_export_without_a_fit_records_none(tmp_path):
    from popcompile.driver import compile

    folder = tiny_hf_folder(tmp_path / "hf", layers=LAYERS, max_position_embeddings=256)
    config = PopConfig(cut=CUT, max_seq=64, min_prompt_tokens=0, kv_calibration="none")
    manifest = compile(str(folder), config, out=tmp_path / "engine")
    assert "kv_fit" not in manifest.extra and manifest.extra["kv_calibration"] is None


# --- the progress lines ---------------------------------------------------------------------------

def test_progress_off_a_terminal_is_a_line_per_tenth():
    stream = io.StringIO()
    with FitProgress(stream) as progress:
        progress(FitPlan("distill", "ridge", "cpu", 1e12, 1e10, 100.0, 10.0,
                         fallback="POP++ (distill) is ..."))
        for done in range(1, 9):
            progress(DistillProgress("teacher", done, 8))
        for done in range(1, 101):
            progress(DistillProgress("train", done, 100, loss=0.5, held_out=0.25))
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("fitting POP+ K/V weights on cpu: ~") and lines[1] == "POP++ (distill) is ..."
    teacher = [line for line in lines if line.startswith("full model")]
    train = [line for line in lines if line.startswith("distill (POP++): ")]
    assert len(teacher) == 8 and len(train) == 10, lines  # 8 windows: each crosses a tenth
    assert train[0].startswith("distill (POP++): 10/100 step (10%), ") and " s, KL 0.5000" in train[0]
    assert train[-1].startswith("distill (POP++): 100/100 step (100%), ")
