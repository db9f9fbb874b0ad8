"""popcompile eval ENGINE_FOLDER: the engine's scores equal the eager reference's on the same tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny import tiny_model

from popcompile.cli import main
from popcompile.measure.eval import data as eval_data
from popcompile.measure.eval import engine as eval_engine
from popcompile.measure.eval import greedy, humaneval, prompts, run, scoring
from popcompile.reference import Variant
from popcompile.runtime.ort import OrtSession

# tiny_model's depth, the engine's cut, the word tokenizer's </s>. Cut 2, not 3: at cut L-1 the one pruned
# layer's K/V come from h_{L-1} in POP too, so POP equals full there and the comparison would prove less.
LAYERS, CUT, EOS = 4, 2, 2
NLL_TOL = 1e-4  # float32 onnxruntime against float32 eager torch: per-token NLLs differ by ~1e-6


@pytest.fixture(scope="module")
def folder(engines):
    return engines.tiny("llama", cut=CUT)  # tiny_model's default depth (LAYERS) and max length (128)


@pytest.fixture(scope="module")
def session(folder):
    return OrtSession(folder, threads=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=LAYERS)  # the weights the engine was exported from (same seed)


@pytest.fixture(scope="module")
def docs(session):
    """5 documents of 20 + 8 random words, tokenized by the engine's own tokenizer (one id per word)."""
    rng = np.random.default_rng(0)
    texts = [(f"doc{i}", " ".join(f"t{w}" for w in rng.integers(0, 94, 28))) for i in range(5)]
    found, _ = eval_data.make_documents({"random": texts}, eval_engine.EvalTokenizer(session.tokenizer),
                                        20, 8)
    assert len(found) == 5 and all(3 <= t < 97 for d in found for t in d.prefix + d.continuation)
    return found


def test_continuation_scores_equal_the_reference(session, model, docs):
    run = eval_engine.EngineRun(session)
    logits = lambda name, prefix, target: torch.from_numpy(eval_engine.continuation_logits(
        run, prefix.numpy(), target.numpy(), eval_engine.ENGINE_VARIANTS[name]))
    engine = scoring.score_continuations(docs, ["full", "pop"], logits, batch_size=2)  # batches of 2, 2, 1
    ref = scoring.continuation_eval(model, docs, {"full": Variant(LAYERS), "pop": Variant(CUT)}, batch_size=3)
    for name in ("full", "pop"):
        e, r = engine[name], ref[name]
        assert e["nll"] == pytest.approx(r["nll"], abs=NLL_TOL)
        assert e["doc_nll"] == pytest.approx(r["doc_nll"], abs=NLL_TOL)
        assert e["kl_to_full"] == pytest.approx(r["kl_to_full"], abs=NLL_TOL)
        assert (e["agreement"], e["accuracy"], e["doc_agreement"]) == (r["agreement"], r["accuracy"],
                                                                       r["doc_agreement"])
    # the cut is real
    assert engine["pop"]["kl_to_full"] > 0 and engine["pop"]["nll"] != engine["full"]["nll"]


def test_full_against_itself_agrees_everywhere(session, docs):
    run = eval_engine.EngineRun(session)
    logits = lambda name, prefix, target: torch.from_numpy(
        eval_engine.continuation_logits(run, prefix.numpy(), target.numpy(), "full"))
    scores = scoring.score_continuations(docs, ["full", "again"], logits, batch_size=4)
    assert scores["again"]["agreement"] == 1.0 and scores["again"]["nll"] == scores["full"]["nll"]
    assert scores["again"]["kl_to_full"] == 0.0


def test_generation_equals_the_reference(session, model):
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 97, n)] for n in (6, 11, 2)]
    engine = scoring.compare_generations(prompts, ["full", "pop"], eval_engine.session_generate(session, 10))
    ref = scoring.generation_eval(model, prompts, {"full": Variant(LAYERS), "pop": Variant(CUT)}, 10, EOS)
    assert engine == ref
    run = eval_engine.EngineRun(session)  # the humaneval path: greedy steps with a stop rule
    stop = lambda tokens: len(tokens) == 4
    assert eval_engine.greedy(run, prompts[0], "pop", 10, (EOS,)) == ref["pop"]["tokens"][0]
    assert eval_engine.greedy(run, prompts[1], "pop", 10, (EOS,), stop) == humaneval.generate_until(
        model, torch.tensor([prompts[1]]), Variant(CUT), 10, EOS, stop)


def test_greedy_task_equals_the_reference(folder, session, model, tmp_path):
    rng = np.random.default_rng(2)
    found = [prompts.Prompt(f"p{i}", "code", tuple(int(t) for t in rng.integers(3, 97, n)))
             for i, n in enumerate((7, 19, 12, 30))]
    run = eval_engine.EngineRun(session)
    engine = greedy.greedy_scores(found, ["pop"], *eval_engine.greedy_functions(run, 10))
    variants = {"full": Variant(LAYERS), "pop": Variant(CUT)}
    ref = greedy.greedy_scores(found, ["pop"], *greedy.reference_functions(model, variants, 10, EOS))
    assert engine["full_lengths"] == ref["full_lengths"]
    for name in ("full", "pop"):
        assert engine["variants"][name]["per_prompt"] == ref["variants"][name]["per_prompt"]
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--tasks", "greedy", "--limit", "2", "--greedy-tokens", "3",
                 "--threads", "1", "--out", str(out)]) == 0
    g = json.loads((out / "results.json").read_text())["tasks"]["greedy"]
    assert g["prompts"] == 2 and g["skipped"]  # the rest do not fit max_seq 128


def test_cli_scores_an_engine_folder(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--tasks", "continuation,generation", "--limit", "2",
                 "--prefix-len", "24", "--cont-len", "6", "--gen-tokens", "4", "--threads", "1",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["engine"] == str(folder) and results["cut"] == CUT and results["num_layers"] == LAYERS
    assert results["kv_calibration"] is None and results["variants"]["pop"]["mode"] == "pop"
    cont, gen = results["tasks"]["continuation"], results["tasks"]["generation"]
    assert cont["documents"] == 2 and list(cont["variants"]) == ["full", "pop"]
    assert cont["variants"]["full"]["agreement"] == 1.0 and gen["variants"]["full"]["exact_match"] == 1.0
    assert (out / "quality.png").is_file() and f"(engine {folder}" in capsys.readouterr().out


def test_cli_scores_the_users_own_text(folder, session, tmp_path, capsys):
    """eval --text FILE on an engine folder: windows of the file's text are the continuation documents."""
    words = " ".join(f"t{w}" for w in np.random.default_rng(5).integers(0, 94, 70))
    (tmp_path / "mine.txt").write_text(words)
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--text", str(tmp_path / "mine.txt"), "--prefix-len", "20",
                 "--cont-len", "8", "--threads", "1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    cont = results["tasks"]["continuation"]
    assert list(results["tasks"]) == ["continuation"] and results["continuation_text"] == [str(tmp_path /
                                                                                              "mine.txt")]
    assert cont["names"] == [f"{tmp_path / 'mine.txt'}@{start}" for start in (0, 28)]  # 70 words: 2 windows
    docs, _ = eval_data.text_documents(((str(tmp_path / "mine.txt"), (words,)),),
                                       eval_engine.EvalTokenizer(session.tokenizer), 20, 8)
    names = ["full", "pop"]
    logits = lambda name, prefix, target: torch.from_numpy(eval_engine.continuation_logits(
        eval_engine.EngineRun(session), prefix.numpy(), target.numpy(), eval_engine.ENGINE_VARIANTS[name]))
    expected = scoring.score_continuations(docs, names, logits, 8)
    for name in names:
        for key, value in expected[name].items():
            assert cont["variants"][name][key] == pytest.approx(value, abs=NLL_TOL), (name, key)
    assert f"2 documents of {tmp_path / 'mine.txt'}" in capsys.readouterr().out


def test_humaneval_runs_on_an_engine(folder, tmp_path):
    results = run.run_eval(str(folder), tmp_path, tasks=["humaneval"], limit=1, code_tokens=4,
                                allow_code_exec=True, timeout=5.0, threads=1)
    h = results["tasks"]["humaneval"]
    assert (h["problems"] == 1 and h["prompt_format"] == "raw"
            and h["variants"]["full"]["identical_to_full"] == 1.0)
    assert h["variants"]["pop"]["pass@1"] == 0.0  # random weights write no working code


@pytest.mark.parametrize("flags, says", [
    (["--variants", "pop,pop-no-boundary"], "pop-no-boundary need the model"),
    (["--variants", "shortgpt"], "shortgpt need the model"),
    (["--variants", "nope"], "unknown variant"),
    (["--sweep"], "--sweep needs the model"),
    (["--cut", "2"], "--cut needs the model"),
])
def test_what_needs_the_model_is_a_one_line_error(folder, tmp_path, capsys, flags, says):
    assert main(["eval", str(folder), *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert says in err and ("unknown" in says or "give the model's name or path" in err)
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_engine_options_need_an_engine_folder(tmp_path, capsys):
    assert main(["eval", "no-such-model", "--threads", "1", "--out", str(tmp_path)]) == 2
    assert "are for an engine folder" in capsys.readouterr().err


def test_pop_variant_prunes_whatever_the_engines_min_prompt_tokens(folder, model):
    """`run` prefills prompts shorter than min_prompt_tokens in full; eval's pop variant scores POP itself."""
    session = OrtSession(folder, threads=1, min_prompt_tokens=1000)
    # POP != full here
    prompts = [[int(t) for t in np.random.default_rng(3).integers(3, 97, n)] for n in (7, 12)]
    assert session.generate([prompts[0]], eval_engine.SamplingConfig(max_new_tokens=1))[0].prefill == "full"
    engine = scoring.compare_generations(prompts, ["full", "pop"], eval_engine.session_generate(session, 8))
    assert engine == scoring.generation_eval(model, prompts, {"full": Variant(LAYERS), "pop": Variant(CUT)},
                                             8, EOS)
    assert engine["pop"]["tokens"] != engine["full"]["tokens"]  # POP ran: the cut changes these generations
