"""A vision-language ONNX engine (a tiny random Qwen3-VL, exported here): the full engine is transformers'
``generate`` token for token and the POP engine is the eager reference token for token, with one image and
with two (PIL images and files); a text-only prompt works; chat keeps an image's rows while the
conversation holds the same image; bad input is a one-line error with exit 2."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cli_lines import error_lines
from PIL import Image
from tiny import tiny_vlm
from tiny_engine import tiny_vl_engine, tiny_vl_folder

from popcompile import reference
from popcompile.cli import main
from popcompile.engine.manifest import EngineManifest
from popcompile.errors import ConfigError, InputError
from popcompile.frontend.vision import ImageInputs
from popcompile.runtime import open_session
from popcompile.runtime.vision import preprocess

CUT, NEW = 4, 8
GREEDY = {"max_new_tokens": NEW, "greedy": True}


@pytest.fixture(scope="module")
def model():
    return tiny_vlm()


@pytest.fixture(scope="module")
def engine(engines):
    return engines.tiny_vl(cut=CUT, max_seq=160)  # the weights of ``model``: tiny_vlm() is seeded


@pytest.fixture(scope="module")
def session(engine):
    return open_session(engine)


def _image(width, height, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _inputs(session, images):
    """The processed images as the reference and transformers take them (the runtime's own preprocessing,
    which tests/test_vlm_runtime.py holds to transformers' processor)."""
    done = [preprocess(image, session.images.processing) for image in images]
    return ImageInputs(torch.tensor(np.concatenate([d[0] for d in done])),
                       torch.tensor([[1, *d[1]] for d in done]))


IMAGES = {"one image": [(40, 24, 1)], "two images": [(40, 24, 1), (16, 32, 2)]}


@pytest.mark.parametrize("case", list(IMAGES))
def test_pop_engine_is_the_reference_and_full_engine_is_transformers(model, session, case):
    images = [_image(*spec) for spec in IMAGES[case]]
    pop = session.generate("t5 t6 t7", GREEDY, images=images, chat=False)[0]
    full = session.generate("t5 t6 t7", GREEDY, images=images, chat=False, mode="full")[0]
    ids, inputs = torch.tensor([pop.prompt_token_ids]), _inputs(session, images)
    assert pop.prompt_token_ids == full.prompt_token_ids and pop.prefill == "pop"
    assert (ids == 150).sum() == int(inputs.image_grid_thw.prod(-1).sum()) // 4  # placeholders expanded
    expected_pop = reference.generate(model, ids, NEW, reference.Variant(cut=CUT), images=inputs)
    hf = model.generate(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                        mm_token_type_ids=(ids == 150).int(), max_new_tokens=NEW, do_sample=False)
    assert len(set(hf[0, ids.shape[1]:].tolist())) > 1
    assert pop.token_ids == expected_pop
    assert full.token_ids == hf[0, ids.shape[1]:].tolist()


def test_images_from_files_where_the_prompt_writes_them(model, session, tmp_path):
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path, spec in zip(paths, IMAGES["two images"]):
        _image(*spec).save(path)
    marker = session.images.placeholder_text(1)
    prompt = f"t5 {marker} t6 {marker} t7"
    result = session.generate(prompt, GREEDY, images=[str(p) for p in paths], chat=False)[0]
    ids = result.prompt_token_ids
    first_image = ids.index(150)
    assert ids[first_image - 2:first_image] == [8, 152]  # t5, vision_start, then the first image's tokens
    expected = reference.generate(model, torch.tensor([ids]), NEW, reference.Variant(cut=CUT),
                                  images=_inputs(session, [Image.open(p) for p in paths]))
    assert result.token_ids == expected


def test_text_only_prompts_and_the_manifest(model, engine, session):
    from popcompile.commands.info import summary

    manifest = EngineManifest.read(engine)
    assert manifest.format_version == 4 and manifest.vision["deepstack"] == 2
    assert manifest.vision["processing"]["max_pixels"] == 48 * 48  # read from preprocessor_config.json
    assert "vision: vision.onnx, one image a call" in summary(engine, manifest)
    result = session.generate("t5 t6 t7 t8 t9", GREEDY, chat=False)[0]
    ids = torch.tensor([result.prompt_token_ids])
    assert result.token_ids == reference.generate(model, ids, NEW, reference.Variant(cut=CUT))


def test_chat_keeps_an_images_rows_while_it_is_the_same_image(session):
    image = _image(40, 24, 1)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "t9"}]}]
    first = session.chat(messages, GREEDY)
    assert first.cached_tokens == 0 and 150 in first.prompt_token_ids
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "t11 t12"}]
    second = session.chat(messages, GREEDY)
    start = second.prompt_token_ids.index(150)
    assert second.cached_tokens > start + first.prompt_token_ids.count(150)  # the image's rows were kept
    messages[0] = {"role": "user", "content": [{"type": "image", "image": _image(40, 24, 7)},
                                               {"type": "text", "text": "t9"}]}
    third = session.chat(messages, GREEDY)
    assert third.cached_tokens <= start  # another image, same size: its rows are not reused


def test_bad_image_input_is_a_one_line_error(engine, session, engines, tmp_path, capsys):
    text_engine = engines.tiny("llama", cut=3, max_seq=64)
    with pytest.raises(InputError, match="is a text engine .* takes no images"):
        open_session(text_engine).generate("t5 t6", GREEDY, images=[_image(16, 16, 0)])
    with pytest.raises(InputError, match="1 image placeholder\\(s\\) .* for 2 image"):
        session.generate(f"t5 {session.images.placeholder_text(1)}", GREEDY, images=[_image(16, 16, 0)] * 2,
                         chat=False)
    (tmp_path / "note.png").write_text("not an image")
    _image(16, 16, 0).save(tmp_path / "ok.png")
    cases = [([str(engine), "--prompt", "t5", "--image", str(tmp_path / "missing.png")], "does not exist"),
             ([str(engine), "--prompt", "t5", "--image", str(tmp_path / "note.png")], "is not an image"),
             ([str(text_engine), "--prompt", "t5", "--image", str(tmp_path / "ok.png")], "takes no images")]
    for args, message in cases:
        assert main(["run", *args, "--max-new-tokens", "2", "--no-warmup"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_cli_run_with_an_image(engine, tmp_path, capsys):
    _image(40, 24, 1).save(tmp_path / "a.png")
    assert main(["run", str(engine), "--prompt", "t5 t6", "--image", str(tmp_path / "a.png"), "--no-chat",
                 "--greedy", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"].count(150) == 15 and len(out["token_ids"]) == 4  # 40x24 -> 40x24 px


def test_a_cut_below_the_deepstack_layers_is_refused_at_export(tmp_path, capsys):
    with pytest.raises(ConfigError, match="below qwen3_vl.s deepstack layers"):
        tiny_vl_engine(tmp_path / "low", cut=1)
    assert not (tmp_path / "low").exists()


def test_cli_exports_a_vision_language_model_folder_and_refuses_a_low_cut(tmp_path, capsys):
    """``popcompile export FOLDER`` of a saved Qwen3-VL: the deepstack rule is one line, exit 2; a good cut
    writes an engine with its vision graph."""
    folder = tiny_vl_folder(tmp_path / "qwen3-vl", layers=3)
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["export", str(folder), "--out", str(tmp_path / "low"), "--cut", "1",
                 "--kv-calibration", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert "below qwen3_vl's deepstack layers" in err and "--cut 2" in err and len(error_lines(err)) == 1
    assert not (tmp_path / "low").exists()
    assert main(["export", str(folder), "--out", str(tmp_path / "engine"), "--cut", "2", "--kv-calibration",
                 "none", "--max-seq", "96", "--min-prompt-tokens", "0", "--json"]) == 0
    manifest = EngineManifest.read(tmp_path / "engine")
    assert manifest.cut == 2 and manifest.vision["graph"]["file"] == "vision.onnx"


def test_the_three_graphs_pass_the_tensorrt_check(engines):
    """Exported with standard ops (what TensorRT takes), the vision graph and both text graphs pass
    ``popcompile check --target tensorrt``."""
    from popcompile.exporters.targets import OnnxTarget
    from popcompile.exporters.tensorrt_compat import check_engine

    folder = engines.tiny_vl(cut=CUT, max_seq=160, target=OnnxTarget(attention="standard"))
    report = check_engine(folder)
    assert report.ok, report.failures
    graphs = {finding.graph for finding in report.findings}
    assert {"vision", "prefill", "decode"} <= graphs


def test_eval_scores_pop_on_synthetic_image_prompts(tmp_path, capsys):
    """``popcompile eval`` of a Qwen3-VL folder runs the images task (its default) through the reference:
    full agrees with itself, every variant is scored against it; a text-only variant is refused."""
    folder = tiny_vl_folder(tmp_path / "qwen3-vl")
    capsys.readouterr()
    assert main(["eval", str(folder), "--variants", "full,pop,pop-no-boundary", "--limit", "3",
                 "--gen-tokens", "4", "--out", str(tmp_path / "eval")]) == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    task = results["tasks"]["images"]
    assert list(results["tasks"]) == ["images"] and task["prompts"] == 3 and min(task["image_tokens"]) > 0
    assert task["variants"]["full"]["exact_match"] == 1.0 and task["variants"]["full"]["first_token"] == 1.0
    assert set(task["variants"]) == {"full", "pop", "pop-no-boundary"}
    assert main(["eval", str(folder), "--variants", "full,wanda", "--out", str(tmp_path / "bad")]) == 2
    assert "wanda is not run on a vision-language model" in capsys.readouterr().err
