"""gguf_tokenizer: a converted tokenizer follows its GGUF's add_bos/add_eos flags, whichever transformers
converted it (5.19 drops them: Gemma 3 lost its <bos>). Tiny GGUF files with metadata only."""
from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from popcompile.frontend.gguf_tokenizer import apply_special_tokens, gguf_special_tokens
from popcompile.frontend.models import _SOURCE_RECORD, _upgrade_conversion

VOCAB = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "a": 3, "b": 4}


def write_gguf(path, **flags) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind, token in (("bos", 1), ("eos", 2)):
        if f"add_{kind}" in flags:
            writer.add_bool(f"tokenizer.ggml.add_{kind}_token", flags[f"add_{kind}"])
            writer.add_uint32(f"tokenizer.ggml.{kind}_token_id", token)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tokenizer(path) -> None:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<bos>", "<eos>"])
    tokenizer.save(str(path))


@pytest.mark.parametrize("flags, expected", [
    ({"add_bos": True}, [1, 3, 4]),
    ({"add_bos": True, "add_eos": True}, [1, 3, 4, 2]),
    ({"add_bos": False}, [3, 4]),
    ({}, [3, 4]),
])
def test_the_tokenizer_follows_the_gguf_flags(tmp_path, flags, expected):
    write_gguf(tmp_path / "m.gguf", **flags)
    write_tokenizer(tmp_path / "tokenizer.json")
    wanted = gguf_special_tokens(tmp_path / "m.gguf")
    assert apply_special_tokens(tmp_path / "tokenizer.json", wanted) == (expected != [3, 4])
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("a b").ids == expected
    assert tokenizer.decode(tokenizer.encode("a b").ids) == "a b"  # the added tokens are special: skipped
    assert not apply_special_tokens(tmp_path / "tokenizer.json", wanted)  # already follows: untouched


def test_a_cache_converted_before_the_fix_is_repaired_in_place(tmp_path):
    write_gguf(tmp_path / "m.gguf", add_bos=True)
    folder = tmp_path / "converted"
    folder.mkdir()
    write_tokenizer(folder / "tokenizer.json")
    (folder / _SOURCE_RECORD).write_text(json.dumps({"gguf": "m.gguf", "sha256": "0" * 64}))  # conversion 1
    _upgrade_conversion(folder, tmp_path / "m.gguf")
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode("a").ids == [1, 3]
    assert json.loads((folder / _SOURCE_RECORD).read_text())["conversion"] == 2
