"""POP++ (distill.py): the precomputed fast path is POP, distillation lowers held-out KL, is deterministic,
covers every architecture, refuses bad values; ``popcompile calibrate --method distill``."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import TINY, tiny_model
from tiny_engine import tiny_tokenizer

from popcompile import reference
from popcompile.cli import main
from popcompile.config import DistillConfig
from popcompile.errors import ConfigError, InputError
from popcompile.frontend.arch import DECODER_TYPES
from popcompile.kvfit.calibrate import KVFit, load_fit, ridge_fit, ridge_fits, save_fit
from popcompile.kvfit.distill import (
    continuation_kl,
    distill_kv,
    pop_continuation_logits,
    ridge_then_distill,
)
from popcompile.kvfit.student import own_projections
from popcompile.reference import Variant

ARCHS = sorted(DECODER_TYPES)
CUT, LAYERS, CONT = 2, 4, 8
# float32: the fast path runs the boundary and continuation in one forward, the reference in two
LOGITS_ATOL = 1e-4
KL_ATOL = 1e-4      # the brief's bound on the step-0 loss against the eager reference


def sharp_model(arch: str) -> torch.nn.Module:
    """A tiny model whose final norm is scaled up: peaked distributions, so KLs are O(0.1), not O(1e-5)
    (on the plain random model a wrong cache would still pass a 1e-4 KL bound). Gemma 3 with both
    soft-caps (Gemma 2 with its own: tiny.py's small ones would flatten the distributions)."""
    gemma = arch in ("gemma3_text", "gemma2")
    extra = {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0} if gemma else {}
    model = tiny_model(arch, layers=LAYERS, **extra)
    with torch.no_grad():
        norm = model.get_decoder().norm.weight
        # Gemma's norm scales by 1 + w
        norm.copy_(20 * (1 + norm) - 1 if gemma else 20 * norm)
    return model


def windows(count: int = 6, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (count, length), generator=torch.Generator().manual_seed(seed))


def plain_pop(model, fit: KVFit) -> KVFit:
    """The deep layers' own k/v weights as a fit: POP as in the paper, a poor start to distil from."""
    return KVFit(fit.info, {i: own_projections(model, i) for i in fit.weights})


def reference_logits(model, ids: torch.Tensor, variant: Variant) -> torch.Tensor:
    n = ids.shape[1] - CONT
    return reference.continuation_logits(model, ids[:, :n], ids[:, n:], variant)


def reference_kl(model, ids: torch.Tensor, weights) -> float:
    full = torch.log_softmax(reference_logits(model, ids, Variant(LAYERS)), -1)
    pop = torch.log_softmax(reference_logits(model, ids, Variant(CUT, kv_weights=weights)), -1)
    return float((full.exp() * (full - pop)).sum(-1).mean())


def test_every_architecture_has_a_tiny_model():
    assert set(DECODER_TYPES) == set(TINY)


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_path_is_pop(arch):
    """(a) the precomputed path's logits and step-0 KL equal the eager reference's, for ridge and plain POP
    weights (which differ by far more than the tolerance: the check can tell them apart)."""
    model, ids = sharp_model(arch), windows()
    ridge = ridge_fit(model, [ids], CUT)
    full, pop = pop_continuation_logits(model, ids, CUT, ridge.weights, CONT)
    assert (full - reference_logits(model, ids, Variant(LAYERS))).abs().max() <= LOGITS_ATOL
    assert ((pop - reference_logits(model, ids, Variant(CUT, kv_weights=ridge.weights))).abs().max()
            <= LOGITS_ATOL)
    kls = {}
    for name, fit in (("ridge", ridge), ("pop", plain_pop(model, ridge))):
        kls[name] = continuation_kl(model, ids, CUT, fit.weights, CONT)
        assert abs(kls[name] - reference_kl(model, ids, fit.weights)) <= KL_ATOL, (name, kls[name])
    assert abs(kls["pop"] - kls["ridge"]) > 100 * KL_ATOL, kls


@pytest.mark.parametrize("arch", ARCHS)
def test_distillation_lowers_held_out_kl(arch, tmp_path):
    """(b) from plain POP weights, 100 steps lower the held-out KL by a fifth or more; the returned fit is the
    best one (its KL on the held-out windows, recomputed, is best_kl) and the model is left as it was."""
    model, ids = sharp_model(arch), windows(32, 48)
    before = {name: p.clone() for name, p in model.named_parameters()}
    init = plain_pop(model, ridge_fit(model, [ids], CUT))
    config = DistillConfig(steps=100, lr=1e-3, continuation=16, held_out=0.25, eval_every=10,
                           targets="document", vocab_top_k=0, select="kl", boundary_weight=1.0)
    result = distill_kv(model, ids, init, config)
    assert result.best_kl <= 0.8 * result.initial_kl, (result.initial_kl, result.best_kl)
    held = ids[list(result.held_out)]
    assert len(result.held_out) == 8
    assert result.initial_kl == pytest.approx(continuation_kl(model, held, CUT, init.weights, 16), abs=1e-6)
    assert result.best_kl == pytest.approx(continuation_kl(model, held, CUT, result.fit.weights, 16),
                                           abs=1e-6)
    assert all(torch.equal(p, before[name]) and p.requires_grad and p.grad is None
               for name, p in model.named_parameters())
    save_fit(result.fit, tmp_path / "kv.safetensors")
    assert load_fit(tmp_path / "kv.safetensors").info == result.fit.info
    assert result.fit.info.method == "distill" and result.fit.info.tokens == ids.numel()


def test_same_seed_same_weights():
    """(c) a seed fixes the split, the order and so every weight; another seed changes them."""
    model, ids = sharp_model("qwen2"), windows(8, 32)  # qwen2: biases are trained too
    init = plain_pop(model, ridge_fit(model, [ids], CUT))
    runs = [distill_kv(model, ids, init, DistillConfig(steps=12, lr=1e-3, continuation=CONT, seed=seed,
                                                         eval_every=4))
            for seed in (0, 0, 1)]
    flat = [torch.cat([t.flatten() for parts in r.fit.weights.values() for p in parts.values()
                       for t in (p.weight, p.bias)]) for r in runs]
    assert runs[0].best_step > 0
    assert torch.equal(flat[0], flat[1]) and runs[0].held_out == runs[1].held_out
    assert not torch.equal(flat[0], flat[2])


@pytest.mark.parametrize("arch", ARCHS)
def test_ridge_then_distill_is_the_ridge_fit_then_distill_kv_in_one_pass(arch):
    """The ridge statistics taken from the distillation's precompute give ridge_fits's fit of rows 0..T-2 of
    each window (the precompute never runs the last token), and training from it is distill_kv's."""
    model, ids = sharp_model(arch), windows(8, 32)
    config = DistillConfig(steps=6, lr=1e-3, continuation=CONT, eval_every=3, targets="document")
    one_pass = ridge_then_distill(model, ids, CUT, config)
    ridge = ridge_fits(model, [ids[:, :-1]], [CUT], bias=True)[CUT]  # distill fits a bias by default
    assert one_pass.init.info == ridge.info and one_pass.init.info.bias
    for i, parts in ridge.weights.items():
        for part, p in parts.items():
            got = one_pass.init.weights[i][part]
            # float64 moments of the same rows, summed window by window instead of in one batch
            torch.testing.assert_close(got.weight, p.weight, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got.bias, p.bias, atol=1e-5, rtol=1e-4)
    two_pass = distill_kv(model, ids, one_pass.init, config)
    assert one_pass.best_step == two_pass.best_step and one_pass.held_out == two_pass.held_out
    for i, parts in two_pass.fit.weights.items():
        for part, p in parts.items():
            assert torch.equal(one_pass.fit.weights[i][part].weight, p.weight)


def test_early_stop_keeps_the_best_weights():
    """A learning rate far too large: held-out KL never improves, training stops after `patience` scores
    and the init weights come back unchanged."""
    model, ids = sharp_model("llama"), windows(8, 32)
    init = ridge_fit(model, [ids], CUT)
    result = distill_kv(model, ids, init, DistillConfig(steps=500, lr=1.0, continuation=CONT, eval_every=2,
                                                        patience=3))
    assert result.best_step == 0 and result.steps_run == 6 and result.best_kl == result.initial_kl
    assert all(torch.equal(p.weight, init.weights[i][part].weight)
               for i, parts in result.fit.weights.items() for part, p in parts.items())


@pytest.mark.parametrize("kwargs, culprit", [
    ({"steps": 0}, "--steps 0"), ({"lr": 0.0}, "--lr 0.0"), ({"lr": float("nan")}, "--lr nan"),
    ({"seed": -1}, "--seed -1"), ({"held_out": 1.0}, "held_out=1.0"), ({"continuation": 0}, "continuation=0"),
    ({"targets": "text"}, "targets='text'"), ({"select": "loss"}, "select='loss'"),
    ({"boundary_weight": 0}, "boundary_weight=0"), ({"vocab_top_k": -1}, "vocab_top_k=-1"),
    ({"windows": 1}, "windows=1"),
])
def test_bad_config_values_are_named(kwargs, culprit):
    with pytest.raises(ConfigError, match=culprit.replace("(", r"\(")):
        DistillConfig(**kwargs)


@pytest.mark.parametrize("ids, culprit", [
    (windows(1, 32), "too few for a held-out split"),
    (windows(4, 9), "at least 10 tokens"),
    (windows(4, 1), "at least 2 tokens"),
    (torch.rand(4, 32), "token ids"),
])
def test_bad_windows_are_refused(ids, culprit):
    model = tiny_model("llama", layers=LAYERS)
    init = ridge_fit(model, [windows(2, 16)], CUT)
    targets = "greedy" if ids.shape[1] == 1 else "document"
    with pytest.raises(InputError, match=culprit):
        distill_kv(model, ids, init, DistillConfig(steps=1, continuation=CONT, targets=targets))


def test_files_without_a_method_read_as_ridge(tmp_path):
    """Files written before CalibrationInfo.method existed stay readable (they are ridge fits)."""
    model = tiny_model("llama", layers=LAYERS)
    save_fit(ridge_fit(model, [windows(2, 16)], CUT), tmp_path / "new.safetensors")
    meta = json.loads(_metadata(tmp_path / "new.safetensors"))
    assert meta.pop("method") == "ridge"
    save_file(load_file(tmp_path / "new.safetensors"), str(tmp_path / "old.safetensors"),
              metadata={"popcompile_kv_fit": json.dumps(meta)})
    assert load_fit(tmp_path / "old.safetensors").info.method == "ridge"
    meta["method"] = "magic"
    save_file(load_file(tmp_path / "new.safetensors"), str(tmp_path / "bad.safetensors"),
              metadata={"popcompile_kv_fit": json.dumps(meta)})
    with pytest.raises(InputError, match="'magic' is not one of ridge, distill"):
        load_fit(tmp_path / "bad.safetensors")


def _metadata(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata()["popcompile_kv_fit"]


# --- CLI ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model("llama", layers=LAYERS, max_position_embeddings=512)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(f"t{i * 7 % 90}" for i in range(1200)))
    return path


def fails(capsys, argv: list, culprit: str, within_s: float = 1.0) -> str:
    """exit 2, one stderr line naming ``culprit``, no traceback, within ``within_s``."""
    start = time.perf_counter()
    code = main([str(a) for a in argv])
    seconds = time.perf_counter() - start
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    assert culprit in lines[0] and lines[0].startswith("popcompile calibrate: error: "), lines[0]
    assert seconds < within_s, f"{seconds:.2f} s: {lines[0]}"
    return lines[0]


@pytest.mark.parametrize("args, culprit", [
    (["--method", "distill", "--steps", "0"], "--steps 0"),
    (["--method", "distill", "--lr", "0"], "--lr 0.0"),
    (["--method", "distill", "--lr", "nan"], "--lr nan"),
    (["--method", "distill", "--seed", "-2"], "--seed -2"),
    (["--method", "distill", "--seq-len", "1"], "--seq-len 1"),
    (["--method", "ridge", "--steps", "10", "--lr", "1e-3"], "--steps, --lr apply to --method distill only"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_distill_options_fail_before_the_model_loads(hf, tmp_path, capsys, args, culprit):
    fails(capsys, ["calibrate", hf, "--out", tmp_path / "kv.safetensors", *args], culprit)
    assert list(tmp_path.iterdir()) == []


def test_too_little_text_for_a_held_out_split_is_one_line(hf, tmp_path, capsys, corpus):
    out, short = tmp_path / "kv.safetensors", tmp_path / "short.txt"
    short.write_text(" ".join(f"t{i}" for i in range(100)))  # one token a word: one window of 64
    fails(capsys, ["calibrate", hf, "--out", out, "--method", "distill", "--text", short, "--cut", "2",
                   "--seq-len", "64"], "1 window(s) are too few for a held-out split", within_s=30)
    fails(capsys, ["calibrate", hf, "--out", out, "--method", "distill", "--text", corpus, "--cut", "3",
                   "--seq-len", "64"], "cut=3 of 4 layers leaves no K/V to fit", within_s=30)
    # the ridge fit too: at cut L-1 it used to write a fit with no layer in it
    fails(capsys, ["calibrate", hf, "--out", out, "--method", "ridge", "--text", corpus, "--cut", "3"],
          "cut=3 of 4 layers leaves no K/V to fit", within_s=30)
    assert not out.exists()
    assert not out.exists()


def test_calibrate_distill_writes_a_distilled_fit(hf, tmp_path, capsys, corpus):
    """On a text model the default (auto, export's) distils: the user's own text gets POP++ as export's
    built-in text does; --method ridge is POP+."""
    out = tmp_path / "kv.safetensors"
    assert main(["calibrate", str(hf), "--out", str(out), "--cut", "2", "--seq-len", "64",
                 "--text", str(corpus), "--steps", "6", "--lr", "1e-3", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    fit = load_fit(out)
    assert fit.info.method == "distill" and fit.info.cut == 2 and set(fit.weights) == {3}
    assert printed.startswith(f"{out}: POP++ K/V projections") and "distilled 6 steps, held-out" in printed
    ridge = tmp_path / "ridge.safetensors"
    assert main(["calibrate", str(hf), "--out", str(ridge), "--cut", "2", "--seq-len", "64",
                 "--text", str(corpus), "--method", "ridge", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)  # --json: the file's metadata and how the fit ran
    assert printed["out"] == str(ridge) and printed["method"] == "ridge" and printed["layers"] == [3]
    assert printed["cut"] == 2 and printed["distill"] is None and printed["fit"]["device"] == "cpu"
    assert (load_fit(ridge).info.method == "ridge"
            and load_fit(ridge).info.corpus_sha256 == fit.info.corpus_sha256)
