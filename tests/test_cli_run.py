"""`popcompile run --prompts FILE`: several prompts as batches, one result a prompt; on a tiny engine
(engines fixture: tiny llama, cut 3 of 4, POP for every prompt) through the in-process ``cli``."""
from __future__ import annotations

import json

import pytest

from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig

PROMPTS = ["t5 t6 t7", "t10 t11 t12 t13 t14 t15 t16 t17 t18", "t20 t21", "t30 t31 t32 t33 t34"]
FLAGS = ("--greedy", "--max-new-tokens", "5", "--no-chat", "--no-warmup")


@pytest.fixture(scope="module")
def engine(engines):
    return engines.tiny("llama", cut=3, max_seq=64)


def test_prompts_file_gives_one_result_a_prompt_as_the_api_batch_gives(engine, cli, tmp_path):
    """One JSON object a line, in order, each with its index and prompt; the tokens are those of the Python
    API's batch generate (runtime/session.generate takes a list) and of a single run of each prompt."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:2]) + "\n\n" + "\n".join(PROMPTS[2:]) + "\n")  # a blank line: skipped
    done = cli("run", engine, "--prompts", path, "--batch-size", "3", "--json", *FLAGS)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(row["index"], row["prompt"]) for row in rows] == list(enumerate(PROMPTS, 1))
    session = OrtSession(engine)
    sampling = SamplingConfig(max_new_tokens=5)
    batches = (session.generate(PROMPTS[:3], sampling, chat=False)
               + session.generate(PROMPTS[3:], sampling, chat=False))
    assert [row["token_ids"] for row in rows] == [result.token_ids for result in batches]
    single = json.loads(cli("run", engine, "--prompt", PROMPTS[1], "--json", *FLAGS).stdout)
    assert rows[1]["token_ids"] == single["token_ids"] and rows[1]["sampling"] == single["sampling"]


def test_a_jsonl_file_prints_each_result_under_its_prompt(engine, cli, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "text": p}) for i, p in enumerate(PROMPTS[:3])))
    done = cli("run", engine, "--prompts", path, "--prompts-field", "text", *FLAGS)
    heads = [line for line in done.stdout.splitlines() if line.startswith("--- ")]
    assert heads == [f"--- {i}/3: {p}" for i, p in enumerate(PROMPTS[:3], 1)]
    stats = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in stats] == ["[1/3", "[2/3", "[3/3"] and "TTFT" in stats[0]


@pytest.mark.parametrize("content, flags, culprit", [
    ("t1\n", ["--prompt", "t2"], "--prompt is for one prompt"),
    ("t1\n", ["--compare", "--image", "a.png"], "--image, --compare are for one prompt"),
    ("\n\n", [], "holds no prompt"),
    ('{"prompt": 3}\n', [], "JSONL line 1: expected a string"),
], ids=["with-prompt", "with-compare", "empty", "bad-jsonl"])
def test_prompts_refusals_come_before_the_engine_loads(cli, tmp_path, content, flags, culprit):
    path = tmp_path / ("p.jsonl" if "{" in content else "p.txt")
    path.write_text(content)
    done = cli("run", tmp_path / "no-engine", "--prompts", path, *flags, check=False)
    assert done.returncode == 2 and culprit in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    done = cli("run", tmp_path / "no-engine", "--prompt", "t1", "--batch-size", "2", check=False)
    assert done.returncode == 2 and "--batch-size goes with --prompts FILE" in done.stderr


def test_prompts_field_is_for_a_jsonl_file(cli, tmp_path):
    (tmp_path / "p.txt").write_text("t1\n")
    done = cli("run", tmp_path / "e", "--prompts", tmp_path / "p.txt", "--prompts-field", "q", check=False)
    assert done.returncode == 2 and "is read as one prompt a line" in done.stderr
