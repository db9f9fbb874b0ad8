"""A vision-language model (tiny random Qwen3-VL) through export's defaults: POP+ fitted on image+text
windows (kvfit/images.py) and a measured min_prompt_tokens; the engine then answers about an image as the
reference with the same fit does; the fit lowers the pruned layers' K/V error on held-out image+text windows;
`popcompile calibrate` of the folder works, and its distill method is a one-line refusal."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from PIL import Image
from tiny import VL_IDS
from tiny_engine import tiny_vl_folder
from transformers.cache_utils import DynamicCache

from popcompile import reference
from popcompile.cli import main
from popcompile.config import KVFitConfig
from popcompile.engine.manifest import EngineManifest
from popcompile.errors import ConfigError
from popcompile.frontend.models import load_model
from popcompile.frontend.vision import ImageInputs
from popcompile.kvfit.calibrate import load_fit
from popcompile.kvfit.corpus import STDLIB_MODULES, encode, stdlib_texts
from popcompile.kvfit.fit import builtin_batches, resolve_fit
from popcompile.kvfit.images import CALIBRATION_SEED, ImageWindow, image_windows, layer_inputs
from popcompile.runtime import open_session
from popcompile.runtime.compare import TEXT_PROBES, engine_flop_bound, measure_speedups
from popcompile.runtime.vision import preprocess
from popcompile.threshold import choose_min_prompt_tokens

# one worker runs this file: the default-options export, made once per module (conftest.py)
pytestmark = pytest.mark.xdist_group("test_vlm_export_defaults")

CUT, LAYERS, NEW = 4, 6, 6  # export's default cut for 6 layers: the deep third pruned
IMAGE = VL_IDS["image_token_id"]
GREEDY = {"max_new_tokens": NEW, "greedy": True}
#: POP+ against plain POP, per refitted layer and K/V, as ||K_fit - K_true|| / ||K_pop - K_true|| on held-out
#: windows: measured 0.28 (K) and 0.22 (V) over all rows, 0.53 and 0.40 over the image rows
ALL_ROWS_RATIO, IMAGE_ROWS_RATIO = 0.5, 0.75
INPUT_ATOL = 1e-5  # fp32: the fit's forward (run_with_images) against transformers' own


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_vl_folder(tmp_path_factory.mktemp("qwen3-vl") / "model")


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model(str(folder))


@pytest.fixture(scope="module")
def engine(folder, tmp_path_factory):
    """`popcompile export FOLDER` with the defaults (--kv-calibration auto, --min-prompt-tokens auto); the
    buffer is short so the threshold probes only 16 and 32 tokens."""
    out = tmp_path_factory.mktemp("qwen3-vl-engine") / "engine"
    assert main(["export", str(folder), "--out", str(out), "--max-seq", "64"]) == 0
    return out


@pytest.fixture(scope="module")
def fit(loaded, folder):
    """The fit export makes (kvfit.fit.resolve_fit, auto: the built-in image+text windows)."""
    return resolve_fit(loaded.model, loaded.tokenizer, CUT, "auto", folder=folder)


def test_default_export_records_a_pop_plus_fit_and_a_measured_threshold(engine, fit):
    manifest = EngineManifest.read(engine)
    assert manifest.cut == CUT and manifest.vision["deepstack"] == 2
    recorded = manifest.extra["kv_calibration"]
    assert recorded["method"] == "ridge" and (recorded["cut"], recorded["num_layers"]) == (CUT, LAYERS)
    assert recorded["tokens"] == KVFitConfig().max_tokens  # 32 batches of 4 image+text windows of 512
    assert recorded["corpus_sha256"] == fit.info.corpus_sha256  # the fit the tests below rebuild
    threshold = manifest.extra["min_prompt_tokens"]
    assert threshold["method"] == "measured" and threshold["prompts"] == TEXT_PROBES
    lengths = {row["tokens"]: row["speedup"] for row in threshold["table"]}
    assert set(lengths) <= {16, 32} and all(row["flop_bound"] > 1.0 for row in threshold["table"])
    if "note" in threshold:  # tiny random models are noise-bound; either outcome must follow the rule
        assert manifest.min_prompt_tokens == 64
    else:
        assert manifest.min_prompt_tokens == choose_min_prompt_tokens(lengths)


def _image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_engine_answers_about_an_image_as_the_reference_with_the_fit(engine, loaded, fit):
    session = open_session(engine)
    image = _image(40, 24, 1)
    pop = session.generate("t5 t6 t7", GREEDY, images=[image], chat=False, min_prompt_tokens=0)[0]
    assert pop.prefill == "pop" and IMAGE in pop.prompt_token_ids
    pixels, grid = preprocess(image, session.images.processing)
    inputs = ImageInputs(torch.tensor(pixels), torch.tensor([[1, *grid]]))
    variant = reference.Variant(cut=CUT, kv_weights=fit.weights)
    ids = torch.tensor([pop.prompt_token_ids])
    assert pop.token_ids == reference.generate(loaded.model, ids, NEW, variant, images=inputs)
    # below the measured threshold the same prompt prefills in full
    short = session.generate("t5", GREEDY, images=[image], chat=False)[0]
    assert short.prefill == ("full" if len(short.prompt_token_ids) < session.min_prompt_tokens else "pop")


def _cache(model, window: ImageWindow, cut: int | None = None, weights=None) -> DynamicCache:
    """Every layer's K/V of ``window`` (transformers' forward through reference.VisionFeed): the full model,
    or POP's prefill at ``cut`` with ``weights`` on the pruned layers' projections."""
    feed, cache = reference.feed_for(model, window.ids, window.images), DynamicCache()
    pruned = reference.bypass_layers(model, cut) if cut else contextlib.nullcontext()
    with torch.no_grad(), pruned, reference.replaced_projections(model, weights or {}):
        feed.prompt(window.ids, 0, window.ids.shape[1], cache)
    return cache


def test_pop_plus_lowers_the_kv_error_on_held_out_image_windows(loaded, folder, fit):
    """Held out: eval's stdlib modules (corpus.STDLIB_MODULES) behind eval's images (seeds from 0); the fit
    saw the calibration modules behind images from CALIBRATION_SEED."""
    model, tok = loaded.model, loaded.tokenizer
    docs = (encode(tok, text, add_special_tokens=False) for _, text in stdlib_texts(STDLIB_MODULES))
    held_out = image_windows(model, tok, docs, seq_len=128, max_tokens=1024, batch=2, folder=folder, seed=0)
    assert set(fit.weights) == set(range(CUT + 1, LAYERS))
    errors: dict[tuple[int, str, str], list[float]] = {}
    for window in held_out:
        truth, plain, refit = _cache(model, window), _cache(model, window, CUT), _cache(model, window, CUT,
                                                                                           fit.weights)
        image_rows = window.ids == IMAGE  # [B, T]
        for layer in fit.weights:
            for kind in ("keys", "values"):
                for name, cache in (("plain", plain), ("refit", refit)):
                    # [B, H, T, D]
                    diff = getattr(cache.layers[layer], kind) - getattr(truth.layers[layer], kind)
                    sums = errors.setdefault((layer, kind, name), [0.0, 0.0])
                    sums[0] += float(diff.pow(2).sum())
                    sums[1] += float(diff.transpose(1, 2)[image_rows].pow(2).sum())
    assert all(int((w.ids == IMAGE).sum()) > 0 for w in held_out)
    for layer in fit.weights:
        for kind in ("keys", "values"):
            (plain_all, plain_img), (refit_all, refit_img) = (errors[layer, kind, "plain"],
                                                              errors[layer, kind, "refit"])
            assert (refit_all / plain_all) ** 0.5 < ALL_ROWS_RATIO, (layer, kind, refit_all, plain_all)
            assert (refit_img / plain_img) ** 0.5 < IMAGE_ROWS_RATIO, (layer, kind, refit_img, plain_img)


def test_the_fit_reads_the_decoder_inputs_transformers_computes(loaded, folder):
    """Each window's image features, deepstack additions and M-RoPE positions, rows batched: the inputs of
    every decoder layer in the fit's forward are those of transformers' own forward with the images."""
    model, tok = loaded.model, loaded.tokenizer
    window = builtin_batches(model, tok, KVFitConfig(seq_len=96, max_tokens=384), folder)[0]
    assert isinstance(window, ImageWindow) and window.ids.shape == (4, 96)  # one batch: 4 windows
    recorded: dict[int, torch.Tensor] = {}
    layers = model.model.language_model.layers
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs, i=i: recorded.__setitem__(
        i, args[0] if args else kwargs["hidden_states"]), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(input_ids=window.ids, pixel_values=window.images.pixel_values,
                  image_grid_thw=window.images.image_grid_thw, mm_token_type_ids=(window.ids == IMAGE).int())
    finally:
        for hook in hooks:
            hook.remove()
    for index, got in enumerate(layer_inputs(model, window)):
        torch.testing.assert_close(got, recorded[index], atol=INPUT_ATOL, rtol=0)


def test_calibration_windows_and_their_errors(loaded, folder):
    model, tok = loaded.model, loaded.tokenizer
    docs = [list(range(3, 140)) * 20]
    windows = image_windows(model, tok, docs, seq_len=48, max_tokens=384, folder=folder)
    assert len(windows) == 2 and windows[0].ids.shape == (4, 48)
    grids = torch.cat([w.images.image_grid_thw for w in windows])
    counts = [int((row == IMAGE).sum()) for w in windows for row in w.ids]
    assert counts == (grids.prod(-1) // 4).tolist() and max(counts) <= 24  # at most half of a window
    assert all(int(row[-1]) >= 3 for w in windows for row in w.ids)  # each image turn, then the text
    assert CALIBRATION_SEED > 100  # eval and analyze draw a few dozen images from 0
    with pytest.raises(ConfigError, match="--seq-len 8 leaves no text"):
        image_windows(model, tok, docs, seq_len=8, max_tokens=64, folder=folder)


def test_threshold_probes_are_text_on_a_vision_engine(engine):
    """The probes draw no image token (the runtime would refuse a placeholder without an image) and the
    FLOP bound is the text decoder's, read from config.json's text_config."""
    session = open_session(engine)

    class Recording:
        folder, manifest, layout, images = session.folder, session.manifest, session.layout, session.images
        prompts: list[list[int]] = []

        def generate(self, ids, sampling, **kwargs):
            self.prompts.extend(ids)
            return session.generate(ids, sampling, **kwargs)

    recording = Recording()
    table = measure_speedups(recording, (16, 32), repeats=1, min_speedup=0.0)
    drawn = {token for prompt in recording.prompts for token in prompt}
    assert [row["tokens"] for row in table] == [16, 32] and len(drawn) > 10
    assert not drawn & {IMAGE, VL_IDS["vision_start_token_id"], VL_IDS["vision_end_token_id"]}
    assert engine_flop_bound(engine, 32, CUT) == table[1]["flop_bound"] > 1.0


def test_calibrate_command_on_a_vision_folder(loaded, folder, tmp_path, capsys):
    out = tmp_path / "kv.safetensors"
    args = ["--max-tokens", "1024", "--seq-len", "128"]
    assert main(["calibrate", str(folder), "--out", str(out), *args]) == 0
    fit = load_fit(out)
    assert (fit.info.cut, fit.info.num_layers, fit.info.tokens) == (CUT, LAYERS, 1024)
    assert resolve_fit(loaded.model, loaded.tokenizer, CUT, out) is not None  # the shapes export checks
    capsys.readouterr()
    for args, message in ((["--method", "distill"], "distill (POP++) is not implemented for vision-language"),
                          (["--cut", "1"], "below qwen3_vl's deepstack layers")):
        assert main(["calibrate", str(folder), "--out", str(tmp_path / "x.safetensors"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
