"""Small in-memory tokenizers with the special tokens, tokenizer_config.json and chat template of three
instruct families whose templates write ``{{ bos_token }}`` themselves (no downloads).

``write_family(folder, name)`` writes tokenizer.json, tokenizer_config.json and generation_config.json
as the model's hub folder has them; loading that folder with ``AutoTokenizer`` and saving it again is
what ``popcompile export`` does with a real model. The vocabularies are tiny (bytes and letters), the
post-processors, normalizers and configs follow the real files:

    llama3   byte-level BPE, post-processor "<|begin_of_text|> $A", no add_bos_token key
    mistral  sentencepiece-style BPE (metaspace, byte fallback), add_bos_token true, <s> ... </s>
    gemma3   sentencepiece-style BPE (spaces -> "▁", byte fallback), add_bos_token true, <bos> ... <eos>
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

_TEXT_CHARS = string.ascii_letters + string.digits + string.punctuation


def _byte_level() -> Tokenizer:
    """Llama 3: byte-level BPE over the 256 byte symbols, no merges."""
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(prepend: bool) -> Tokenizer:
    """Mistral (prepend "▁") and Gemma 3 (spaces only): BPE with byte fallback, no merges."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *_TEXT_CHARS]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prepend else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prepend else []))
    return tok


def _with_specials(tok: Tokenizer, specials: list[str], bos: str) -> Tokenizer:
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _llama3() -> tuple[Tokenizer, dict, dict]:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    tok = _with_specials(_byte_level(), specials, "<|begin_of_text|>")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
              "model_max_length": 131072, "chat_template": LLAMA3_TEMPLATE}
    eos = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    generation = {"bos_token_id": tok.token_to_id("<|begin_of_text|>"), "eos_token_id": eos,
                  "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    return tok, config, generation


def _mistral() -> tuple[Tokenizer, dict, dict]:
    tok = _sentencepiece(prepend=True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False,
              "clean_up_tokenization_spaces": False, "chat_template": MISTRAL_TEMPLATE}
    generation = {"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>")}
    return tok, config, generation


def _gemma3() -> tuple[Tokenizer, dict, dict]:
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    tok = _with_specials(_sentencepiece(prepend=False), specials, "<bos>")
    tok.add_tokens([AddedToken("\n", special=False, normalized=False)])
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "clean_up_tokenization_spaces": False, "chat_template": GEMMA3_TEMPLATE}
    generation = {"bos_token_id": tok.token_to_id("<bos>"), "pad_token_id": tok.token_to_id("<pad>"),
                  "eos_token_id": [tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>")],
                  "do_sample": True, "top_k": 64, "top_p": 0.95}
    return tok, config, generation


FAMILIES = {"llama3": _llama3, "mistral": _mistral, "gemma3": _gemma3}


def write_family(folder: Path, name: str) -> Path:
    """Write family ``name``'s hub-style tokenizer files into ``folder``; return ``folder``."""
    tok, config, generation = FAMILIES[name]()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder
