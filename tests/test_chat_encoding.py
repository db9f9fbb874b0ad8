"""Chat prompts are encoded as transformers' apply_chat_template(tokenize=True) encodes them, for three
instruct families whose templates write {{ bos_token }} (tests/chat_families.py: no downloads), and
`eval ENGINE` encodes exactly as `run` does."""
from __future__ import annotations

import pytest
from chat_families import FAMILIES, write_family
from transformers import AutoTokenizer, GenerationConfig

from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval import humaneval
from popcompile.measure.eval.engine import EvalTokenizer
from popcompile.runtime.loop import encode_prompt
from popcompile.runtime.tokenizer import EngineTokenizer

PROMPTS = ["What is 2 + 2?", "  Leading and trailing spaces  ", "Unicode: naïve café, 東京, emoji 🎉 done",
           "Two\nlines\n\nand a tab\tend", "a </s> <s> <bos> <|eot_id|> b"]
CONVERSATION = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"}]
BOS = {"llama3": "<|begin_of_text|>", "mistral": "<s>", "gemma3": "<bos>"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(HF tokenizer, EngineTokenizer of the folder export would write, family name)."""
    root = tmp_path_factory.mktemp(request.param)
    source = write_family(root / "hub", request.param)
    hf = AutoTokenizer.from_pretrained(source)
    hf.save_pretrained(root / "engine")  # what export writes: tokenizer files, then the generation config
    GenerationConfig.from_pretrained(source).save_pretrained(root / "engine")
    return hf, EngineTokenizer.from_folder(root / "engine"), request.param


def hf_chat_ids(hf, messages, add_generation_prompt=True) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                       return_dict=False))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_prompt_ids_equal_transformers(family, prompt):
    hf, tok, name = family
    ids = encode_prompt(tok, prompt)  # chat=None: the template applies
    assert ids == hf_chat_ids(hf, [{"role": "user", "content": prompt}])
    bos = tok.token_to_id(BOS[name])
    assert ids[0] == bos and ids[1] != bos  # one BOS, written by the template


def test_template_places_the_bos_and_plain_text_gets_it_from_the_tokenizer(family):
    hf, tok, name = family
    bos = tok.token_to_id(BOS[name])
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).startswith(BOS[name])
    assert encode_prompt(tok, "Hello there", chat=False) == hf("Hello there").input_ids
    assert encode_prompt(tok, "Hello there", chat=False)[0] == bos


def test_multi_turn_and_no_generation_prompt_equal_transformers(family):
    hf, tok, _ = family
    for add in (True, False):
        assert tok.encode_chat(CONVERSATION, add_generation_prompt=add) == hf_chat_ids(hf, CONVERSATION, add)


def test_eval_encodes_chat_prompts_as_run_does(family):
    hf, tok, _ = family
    eval_tok = EvalTokenizer(tok)
    problem = {"prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"}
    for text in [*eval_data.CHAT_PROMPTS[:4], *PROMPTS]:
        run_ids = encode_prompt(tok, text)
        assert eval_data.chat_prompt_ids(eval_tok, text) == run_ids == eval_data.chat_prompt_ids(hf, text)
    chat_ids = humaneval.prompt_ids(eval_tok, problem, "chat")
    assert chat_ids == encode_prompt(tok, humaneval.CHAT_INSTRUCTION.format(prompt=problem["prompt"]))
    assert humaneval.prompt_ids(eval_tok, problem, "raw") == encode_prompt(tok, problem["prompt"], chat=False)


def test_generation_config_is_read_from_the_folder(family):
    _, tok, name = family
    expected = {"llama3": (True, 0.6, None, 0.9), "mistral": (None, None, None, None),
                "gemma3": (True, None, 64, 0.95)}[name]
    config = tok.generation_config
    assert tuple(config.get(k) for k in ("do_sample", "temperature", "top_k", "top_p")) == expected
    assert len(tok.eos_token_ids) == (1 if name == "mistral" else 2)
