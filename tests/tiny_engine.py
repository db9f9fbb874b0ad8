"""A real engine folder from a tiny random decoder (tests/tiny.py), for tests that need exported graphs.

    from tiny_engine import tiny_engine
    folder = tiny_engine("llama", tmp_path / "engine")   # prefill.onnx, decode.onnx, popcompile.json, ...

No download: the tokenizer is a WordLevel vocabulary of the tiny model's 97 token ids built in memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import transformers
from tiny import VL_IDS, tiny_model, tiny_vlm
from tokenizers import Tokenizer, models, pre_tokenizers

from popcompile.driver import export
from popcompile.frontend.models import LoadedModel, ModelSource


def tiny_tokenizer(vocab_size: int = 97) -> transformers.PreTrainedTokenizerFast:
    """Whitespace words ``t0 .. t{n-4}`` plus <unk>, <s>, </s>: one id per token of the tiny model."""
    special = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(special + [f"t{i}" for i in range(vocab_size - len(special))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_engine(model_type: str, out_dir: str | Path, *, model_kwargs: dict | None = None,
                **export_kwargs) -> Path:
    """Export ``tiny_model(model_type, **model_kwargs)`` as an engine folder at ``out_dir``; return its path.
    Tests that only need *an* engine take it from the ``engines`` fixture (engine_cache.py) instead."""
    model = tiny_model(model_type, **(model_kwargs or {}))
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    source = ModelSource(name="tiny", kind="folder", path="tiny", sha256=None)
    export_kwargs.setdefault("kv_calibration", "none")  # the paper's POP, what the tests compare against
    # POP for every prompt: the tests choose the path themselves
    export_kwargs.setdefault("min_prompt_tokens", 0)
    export(LoadedModel(model, tokenizer, source), out_dir, **export_kwargs)
    return Path(out_dir)


def tiny_hf_folder(folder: str | Path, model_type: str = "llama", *, chat_template: str | None = None,
                   eos: bool = True, **model_kwargs) -> Path:
    """Save ``tiny_model(model_type, **model_kwargs)`` and its tokenizer as a Hugging Face folder (a MODEL
    argument that loads in a second); ``eos=False`` leaves the model no eos, so generations run to length."""
    model = tiny_model(model_type, **model_kwargs)
    tokenizer = tiny_tokenizer(model.config.vocab_size)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model.generation_config.eos_token_id = tokenizer.eos_token_id if eos else None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


#: Qwen3-VL's image tokens as the tiny vision-language tokenizer writes them (ids: tiny.VL_IDS)
VL_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
#: Qwen-VL's chat layout, shortened: each image of a message is vision_start, image_pad, vision_end
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %} </s> {% endfor %}"
    "{% if add_generation_prompt %}t1 {% endif %}")


def tiny_vl_tokenizer(vocab_size: int = 160) -> transformers.PreTrainedTokenizerFast:
    """tiny_tokenizer's words for ids below 150, Qwen3-VL's image tokens at tiny.VL_IDS, a chat template
    that renders images as Qwen-VL does."""
    special = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(special + [f"t{i}" for i in range(150 - len(special))])}
    vocab.update({text: VL_IDS[key] for key, text in VL_TOKENS.items()})
    vocab.update({f"x{i}": i for i in range(len(vocab), vocab_size) if i not in vocab.values()})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=list(VL_TOKENS.values()))
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


#: the tiny engine's image processing (its source folder's preprocessor_config.json): images of 16x16 to
#: 48x48 pixels, 4 to 36 tokens
VL_PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
                   "size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
                   "image_mean": [0.48, 0.46, 0.41], "image_std": [0.27, 0.26, 0.28]}


def tiny_vl_folder(folder: str | Path, **model_kwargs) -> Path:
    """A tiny random Qwen3-VL saved as a Hugging Face folder (weights, tokenizer, preprocessor_config.json):
    a MODEL argument for export, eval and the samples."""
    folder = Path(folder)
    tiny_vlm(**model_kwargs).save_pretrained(folder)
    tiny_vl_tokenizer().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR))
    return folder


def tiny_vl_engine(out_dir: str | Path, model=None, **export_kwargs) -> Path:
    """Export a tiny random Qwen3-VL (tiny.tiny_vlm) as an engine folder at ``out_dir``; its source folder
    (beside it) holds the preprocessor_config.json the export reads."""
    model = model or tiny_vlm()
    tokenizer = tiny_vl_tokenizer(model.config.text_config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    folder = Path(str(out_dir) + "-source")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR))
    source = ModelSource(name="tiny-vl", kind="folder", path=str(folder), sha256=None)
    export_kwargs.setdefault("kv_calibration", "none")
    export_kwargs.setdefault("min_prompt_tokens", 0)
    export(LoadedModel(model, tokenizer, source), out_dir, **export_kwargs)
    return Path(out_dir)


def has_tensorrt_gpu() -> bool:
    """An NVIDIA GPU and the tensorrt package are here (engine.tensorrt.require_gpu passes)."""
    from popcompile.engine.tensorrt import TensorRTUnavailable, require_gpu

    try:
        require_gpu()
    except TensorRTUnavailable:
        return False
    return True
