"""A tokenizer file or chat template an engine folder cannot use is a one-line EngineError naming the file
(InputError when the template refuses the conversation); the sandbox holds. No downloads: the folder is
tests/chat_families.py's Mistral-style tokenizer."""
from __future__ import annotations

import json

import pytest
from chat_families import write_family

from popcompile.errors import ConfigError, EngineError, InputError
from popcompile.runtime.loop import encode_prompt
from popcompile.runtime.tokenizer import EngineTokenizer


@pytest.fixture
def folder(tmp_path):
    return write_family(tmp_path / "engine", "mistral")


def one_line_error(kind, call, *culprits: str) -> str:
    """Run ``call``; it must raise exactly ``kind`` (not a subclass of another family member) with a one-line
    message that names every culprit."""
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(c in message for c in culprits), message
    return message


def set_template(folder, template: str) -> None:
    (folder / "chat_template.jinja").write_text(template)


def chat(folder, content="hi"):
    return lambda: encode_prompt(EngineTokenizer.from_folder(folder), content, chat=True)


def test_the_fixture_folder_loads(folder):
    assert encode_prompt(EngineTokenizer.from_folder(folder), "hi", chat=True)[0] == 352  # <s>, once


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": ', '{"not": "a tokenizer"}', "[1, 2]", ""])
def test_corrupt_tokenizer_json(folder, content):
    (folder / "tokenizer.json").write_text(content)
    one_line_error(EngineError, lambda: EngineTokenizer.from_folder(folder), str(folder / "tokenizer.json"),
                   "re-export")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json",
                                  "generation_config.json", "chat_template.json"])
@pytest.mark.parametrize("content, says", [('{"bos_token": "<s>",', "not valid JSON (line 1"),
                                           ('["a list"]', "does not hold a JSON object")])
def test_corrupt_json_files(folder, name, content, says):
    (folder / name).write_text(content)
    if name == "chat_template.json":  # read only when tokenizer_config has no template
        config = json.loads((folder / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    one_line_error(EngineError, lambda: EngineTokenizer.from_folder(folder), str(folder / name), says)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja"])
def test_non_utf8_files(folder, name):
    path = folder / name
    path.write_bytes(b'{"bos_token": "caf\xe9"}')
    one_line_error(EngineError, lambda: EngineTokenizer.from_folder(folder), str(path), "not UTF-8",
                   "byte 18")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja"])
def test_a_tokenizer_file_that_links_out_of_the_folder_is_refused(folder, tmp_path, name):
    """The tokenizer files are not in the manifest's hashed list: a symlink out of the folder is refused by
    path, even when the file it leads to is a valid copy."""
    outside = tmp_path / f"outside-{name}"
    outside.write_bytes((folder / name).read_bytes() if (folder / name).exists()
                        else b"{% for m in messages %}{% endfor %}")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside)
    one_line_error(EngineError, lambda: EngineTokenizer.from_folder(folder), name,
                   "outside the engine folder")


def test_a_symlink_inside_the_folder_is_fine(folder):
    (folder / "real-tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("real-tokenizer.json")
    assert encode_prompt(EngineTokenizer.from_folder(folder), "hi", chat=True)[0] == 352


@pytest.mark.parametrize("value", ["x", 1.5, [2, "x"], 10**6, -1, True])
def test_bad_eos_token_id_in_generation_config(folder, value):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    one_line_error(EngineError, lambda: EngineTokenizer.from_folder(folder), "generation_config.json",
                   "eos_token_id must be a token id")


@pytest.mark.parametrize("value", [5, {"template": "x"}, [1, 2]])
def test_chat_template_of_the_wrong_type(folder, value):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": value}))
    one_line_error(EngineError, lambda: EngineTokenizer.from_folder(folder),
                   str(folder / "tokenizer_config.json"), "chat_template must be")


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}{{ m.content }}", "line 1"),  # no endfor
    ("{{ bos_token }}\n{% if %}x{% endif %}", "line 2"),
    ("{{ messages | no_such_filter }}", "no_such_filter"),
])
def test_template_syntax_error_is_one_line_and_plain_prompts_still_work(folder, template, says):
    set_template(folder, template)
    tok = EngineTokenizer.from_folder(folder)  # the folder still loads: plain prompts need no template
    assert encode_prompt(tok, "hi", chat=False)[0] == 352
    one_line_error(EngineError, chat(folder), str(folder / "chat_template.jinja"), "not valid Jinja", says,
                   "--no-chat")


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__.keys() }}",
    "{% set ns = namespace(_secret=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}",
    "{{ messages.append(1) }}",
    "{{ dict.__call__.__globals__ }}",
])
def test_sandbox_escapes_are_refused_in_one_line(folder, template):
    set_template(folder, template)
    message = one_line_error(EngineError, chat(folder), str(folder / "chat_template.jinja"), "--no-chat")
    assert "sandbox forbids" in message or "failed while rendering" in message


@pytest.mark.parametrize("template", ["{{ raise_exception.__globals__ }}", "{{ dict.__class__ }}"])
def test_unsafe_attributes_render_as_nothing(folder, template):
    """jinja's sandbox (and transformers') makes a bare unsafe attribute undefined: nothing leaks."""
    set_template(folder, "[" + template + "]")
    assert EngineTokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[]"


def test_template_runtime_failure_names_the_template(folder):
    set_template(folder, "{{ messages[0].content + 1 }}")
    one_line_error(EngineError, chat(folder), str(folder / "chat_template.jinja"), "failed while rendering",
                   "TypeError")


def test_template_refusing_the_conversation_is_an_input_error(folder):
    tok = EngineTokenizer.from_folder(folder)  # Mistral's template: user and assistant turns alternate
    message = one_line_error(InputError, lambda: tok.encode_chat([{"role": "assistant", "content": "x"}]),
                             str(folder / "tokenizer_config.json"), "Conversation roles must alternate")
    assert "refused the conversation" in message


@pytest.mark.parametrize("messages, says", [([], "empty conversation"), (["hi"], "must be dicts")])
def test_bad_messages_are_input_errors(folder, messages, says):
    one_line_error(InputError, lambda: EngineTokenizer.from_folder(folder).encode_chat(messages), says)


def test_chat_without_a_template_and_empty_prompts(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = EngineTokenizer.from_folder(folder)
    one_line_error(ConfigError, lambda: encode_prompt(tok, "hi", chat=True), "no chat template")
    one_line_error(InputError, lambda: encode_prompt(tok, ""), "non-empty text")
    # chat=None: plain without template
    assert encode_prompt(tok, "hi") == encode_prompt(tok, "hi", chat=False)
