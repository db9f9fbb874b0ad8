"""EngineTokenizer (tokenizers + jinja2 only) against transformers on the two shipped models."""
from __future__ import annotations

import inspect
import json
import json.decoder
import subprocess
import sys
import textwrap

import pytest

from popcompile.runtime.loop import encode_prompt
from popcompile.runtime.tokenizer import EngineTokenizer, StreamDecoder

TEXTS = [
    inspect.getsource(json.decoder),  # real code nobody here wrote
    "The quick brown fox jumps over the lazy dog.  Twice!\n\n\tIndented line.",
    "Unicode: naïve café, Größe, 東京タワー, 你好世界, Привет, مرحبا, emoji 🎉🚀👩‍💻 done",
    " leading space and trailing space ",
    "",
]
CJK_EMOJI = "流式解码测试：🎉🚀👩‍💻 日本語のテキスト、한국어 텍스트 🇯🇵 ok"
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 🎨?"},
    ],
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request, tmp_path_factory, real_model):
    """(HF tokenizer, EngineTokenizer loaded from its save_pretrained folder, model name)."""
    loaded = real_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    loaded.tokenizer.save_pretrained(folder)
    loaded.model.generation_config.save_pretrained(folder)
    return loaded.tokenizer, EngineTokenizer.from_folder(folder), request.param


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_encode_equals_hf(pair, index):
    hf, tok, _ = pair
    assert tok.encode(TEXTS[index]) == hf(TEXTS[index]).input_ids


def test_special_token_behaviour(pair):
    """Gemma's tokenizer prepends <bos>; SmolLM2's adds nothing."""
    hf, tok, name = pair
    ids = tok.encode("Hello")
    if name == "gemma3-270m":
        assert ids[0] == tok.token_to_id("<bos>") == 2
    else:
        assert tok.token_to_id(tok.bos_token) not in ids
    assert tok.encode("Hello", add_special_tokens=False) == hf("Hello", add_special_tokens=False).input_ids


def test_special_token_text_is_parsed_like_hf(pair):
    hf, tok, _ = pair
    text = f"a {tok.eos_token} b {tok.bos_token}c"
    assert tok.encode(text) == hf(text).input_ids


@pytest.mark.parametrize("skip", [True, False])
def test_decode_round_trip(pair, skip):
    hf, tok, _ = pair
    for text in TEXTS + [CJK_EMOJI]:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(CJK_EMOJI)) == CJK_EMOJI
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]


def test_special_tokens_and_ids(pair):
    hf, tok, _ = pair
    assert tok.bos_token == hf.bos_token
    assert tok.eos_token == hf.eos_token
    assert tok.pad_token_id == hf.pad_token_id
    assert tok.eos_token_ids == (hf.eos_token_id,)  # both generation_configs hold one int
    assert tok.vocab_size == len(hf)


def test_chat_template(pair):
    hf, tok, name = pair
    if name == "gemma3-270m":  # its GGUF carries no chat template
        assert not tok.has_chat_template
        with pytest.raises(ValueError, match="no chat template"):
            tok.apply_chat_template(MESSAGES[0])
        return
    assert tok.has_chat_template
    for messages in MESSAGES:
        for prompt in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == expected


def test_prompt_ids_equal_hf(pair):
    """encode_prompt (what run and eval send) equals apply_chat_template(tokenize=True), or
    tokenizer(text)."""
    hf, tok, name = pair
    for text in TEXTS[1:4]:
        if name == "gemma3-270m":  # no template: plain text with <bos>
            assert encode_prompt(tok, text) == hf(text).input_ids
            continue
        expected = hf.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
        assert encode_prompt(tok, text) == list(expected)
    for messages in MESSAGES[1:] if name != "gemma3-270m" else []:
        assert tok.encode_chat(messages) == list(hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("text", [TEXTS[0][:2000], TEXTS[2], CJK_EMOJI])
def test_stream_decoder_concatenates_to_full_decode(pair, text):
    _, tok, _ = pair
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_stream_decoder_holds_back_partial_bytes(pair):
    """A character split across byte tokens appears only once it is complete."""
    _, tok, _ = pair
    char = next(c for c in "🎉𓀀𠀋🝖" if len(tok.encode(c, add_special_tokens=False)) > 1)
    ids = tok.encode(char, add_special_tokens=False)  # byte pieces of one character
    stream = tok.stream_decoder()
    assert [stream.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1]) == char
    assert stream.flush() == ""


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="incomplete") as info:
        EngineTokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_template_sandbox_and_helpers(tmp_path, pair):
    """raise_exception, strftime_now, tojson and {% generation %} work; the sandbox holds."""
    _, tok, _ = pair
    folder = tmp_path / "engine"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x", "bos_token": "y"}))
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0].role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{% generation %}G{% endgeneration %}"
        "{{ strftime_now('%Y') | length }}{% for m in messages %}{% if loop.first %}{% continue %}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    custom = EngineTokenizer.from_folder(folder)
    out = custom.apply_chat_template([{"role": "user", "content": "<é>"}])
    assert out == 'y[{"role": "user", "content": "<é>"}]G4'
    with pytest.raises(Exception, match="bad role"):
        custom.apply_chat_template([{"role": "bad", "content": ""}])
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely"):
        EngineTokenizer.from_folder(folder).apply_chat_template([{"role": "u", "content": ""}])


def test_runtime_imports_no_torch():
    code = textwrap.dedent(
        """
        import sys, popcompile.runtime.tokenizer, popcompile.runtime.sampling
        bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]
        bad += [m for m in sys.modules if m.startswith('popcompile.') and not (
            m.startswith(('popcompile.runtime', 'popcompile.engine'))
            or m in ('popcompile.errors', 'popcompile.fsutil'))]
        assert not bad, bad
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
