"""A real engine folder from a tiny random decoder (tests/tiny.py), for tests that need exported graphs.

    from tiny_engine import tiny_engine
    folder = tiny_engine("llama", tmp_path / "engine")   # prefill.onnx, decode.onnx, popcompile.json, ...

No download: the tokenizer is a WordLevel vocabulary of the tiny model's 97 token ids built in memory.
"""
from __future__ import annotations

from pathlib import Path

import transformers
from tiny import tiny_model
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


def tiny_engine(model_type: str, out_dir: str | Path, **export_kwargs) -> Path:
    """Export ``tiny_model(model_type)`` as an engine folder at ``out_dir`` and return its path."""
    model = tiny_model(model_type)
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


def has_tensorrt_gpu() -> bool:
    """An NVIDIA GPU and the tensorrt package are here (engine.tensorrt.require_gpu passes)."""
    from popcompile.engine.tensorrt import TensorRTUnavailable, require_gpu

    try:
        require_gpu()
    except TensorRTUnavailable:
        return False
    return True
