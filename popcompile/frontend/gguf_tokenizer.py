"""The GGUF's own special-token rule on a converted tokenizer: ``tokenizer.ggml.add_bos_token`` /
``add_eos_token``.

transformers 5.19 (vLLM 0.32's pin) drops these flags when it reads a GGUF tokenizer, 5.25 keeps them:
Gemma 3's prompts then lose their ``<bos>`` depending on which environment converted the shared model
cache. After conversion the saved ``tokenizer.json`` is made to follow the flags:

    GGUF  add_bos_token=True, bos_token_id=2         tokenizer.json post_processor
    saved encode("Hello") = [9259]              ->   TemplateProcessing "<bos> $A", encode = [2, 9259]

A tokenizer that already follows them is left as it is (SmolLM2's GGUF asks for neither).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, processors

_PROBE = "a"


def gguf_special_tokens(gguf: Path) -> dict[str, int]:
    """{"bos": id, "eos": id} for the special tokens the GGUF says every encoding carries."""
    from gguf import GGUFReader  # popcompile's dependency; imported here as only conversion needs it

    fields = GGUFReader(str(gguf)).fields
    wanted = {}
    for kind in ("bos", "eos"):
        add, token = (fields.get(f"tokenizer.ggml.add_{kind}_token"),
                      fields.get(f"tokenizer.ggml.{kind}_token_id"))
        if add is not None and token is not None and bool(add.parts[add.data[0]][0]):
            wanted[kind] = int(token.parts[token.data[0]][0])
    return wanted


def apply_special_tokens(tokenizer_json: Path, wanted: dict[str, int]) -> bool:
    """Make ``tokenizer_json`` add ``wanted`` (gguf_special_tokens) around every encoding, as transformers'
    own GGUF conversion does when it keeps the flags; returns whether the file was rewritten."""
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    probe = tokenizer.encode(_PROBE).ids
    bos, eos = wanted.get("bos"), wanted.get("eos")
    if (bos is None or probe[:1] == [bos]) and (eos is None or probe[-1:] == [eos]):
        return False
    names = {kind: tokenizer.id_to_token(token) for kind, token in wanted.items()}
    around = lambda seq, type_id: ([f"{names['bos']}:{type_id}"] if bos is not None else []) + [
        f"${seq}:{type_id}"] + ([f"{names['eos']}:{type_id}"] if eos is not None else [])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=around("A", 0), pair=around("A", 0) + around("B", 1),
        special_tokens=[(names[kind], token) for kind, token in wanted.items()])
    tmp = tokenizer_json.with_name(f".{tokenizer_json.name}.tmp")
    tokenizer.save(str(tmp))
    tmp.replace(tokenizer_json)
    return True
