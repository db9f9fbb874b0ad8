"""Short prompts prefill in full: ``min_prompt_tokens`` in the manifest, the session and each call."""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
from tiny_engine import tiny_engine

from popcompile.cli import main
from popcompile.commands.info import summary
from popcompile.engine.manifest import MANIFEST, EngineManifest
from popcompile.errors import ConfigError, EngineError
from popcompile.runtime.compare import compare, measure_speedups, measured_min_prompt_tokens
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig
from popcompile.threshold import choose_min_prompt_tokens

SHORT, LONG = [5, 9, 12], [5, 9, 12, 40, 41, 7, 3, 88, 19, 23, 61]
GREEDY = SamplingConfig(max_new_tokens=8)
# Seeded sampling from the tiny random model's near-uniform distribution: any change of logits shows up
SAMPLED = SamplingConfig(greedy=False, seed=3, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(engines):
    return engines.tiny("llama", cut=3, max_seq=64)


def _first(session, prompt, **kw):
    """(first-token logits, generated ids, prefill path) of one greedy run, checking which graphs ran."""
    calls, run = [], session.backend.run

    def spy(graph, *args):
        logits, present = run(graph, *args)
        calls.append((graph, None if logits is None else logits.copy()))
        return logits, present

    session.backend.run = spy
    try:
        result = session.generate([prompt], GREEDY, **kw)[0]
    finally:
        del session.backend.run
    assert (calls[0][0] == "prefill") == (result.prefill == "pop")  # the result says which graph ran
    first = next(logits for _, logits in calls if logits is not None)
    return first, result.token_ids, result.prefill


def test_below_threshold_equals_full_and_at_or_above_equals_pop(engine):
    forced = OrtSession(engine, min_prompt_tokens=0)
    full_short = _first(forced, SHORT, mode="full")
    pop_short = _first(forced, SHORT)
    pop_long = _first(forced, LONG)
    assert pop_short[2] == pop_long[2] == "pop"
    # the two paths differ, so the checks below can fail
    assert not np.array_equal(full_short[0], pop_short[0])
    session = OrtSession(engine, min_prompt_tokens=len(LONG))
    short = _first(session, SHORT)
    assert short[2] == "full" and np.array_equal(short[0], full_short[0]) and short[1] == full_short[1]
    long = _first(session, LONG)
    assert long[2] == "pop" and np.array_equal(long[0], pop_long[0]) and long[1] == pop_long[1]
    assert _first(session, LONG, min_prompt_tokens=len(LONG) + 1)[2] == "full"  # per-call override


def test_manifest_threshold_is_the_session_default(engine, tmp_path):
    # tests export with min_prompt_tokens=0: POP always, nothing measured
    manifest = EngineManifest.read(engine)
    assert manifest.min_prompt_tokens == 0 and manifest.extra["min_prompt_tokens"] is None
    folder = tmp_path / "e"
    folder.mkdir()
    for f in engine.iterdir():
        (folder / f.name).hardlink_to(f) if f.name != MANIFEST else None  # symlinks out are refused
    data = json.loads((engine / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**data, "min_prompt_tokens": 7}))
    assert OrtSession(folder).min_prompt_tokens == 7
    (folder / MANIFEST).write_text(json.dumps({**data, "min_prompt_tokens": -1}))
    with pytest.raises(EngineError, match="min_prompt_tokens"):
        EngineManifest.read(folder)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_override_is_a_config_error(engine, bad):
    with pytest.raises(ConfigError, match="min_prompt_tokens"):
        OrtSession(engine, min_prompt_tokens=bad)


def test_compare_forces_pop_and_reports_both(engine):
    session = OrtSession(engine, min_prompt_tokens=100)
    result = compare(session, [LONG], GREEDY, repeats=2)
    assert result.pop.prefill == "pop" and result.full.prefill == "full"
    assert not result.pop_by_default
    assert result.flop_bound is not None and result.flop_bound > 1.0
    assert result.matched_prefix <= len(result.full.token_ids)
    assert result.same_text == (result.full.token_ids == result.pop.token_ids)
    assert json.dumps(result.to_dict())


def test_measure_speedups_table(engine):
    table = measure_speedups(OrtSession(engine), (4, 8, 16), repeats=1, min_speedup=0.0)
    assert [row["tokens"] for row in table] == [4, 8]  # stops after two lengths that pass
    assert all(row["speedup"] > 0 and row["flop_bound"] > 1.0 for row in table)


class _Timed:
    """A session whose TTFTs follow ``speedup(n)`` (full = n ms, POP = n / speedup(n) ms): the rule's
    input."""

    def __init__(self, session, speedup):
        self.session, self.speedup = session, speedup
        self.folder, self.manifest, self.layout = session.folder, session.manifest, session.layout

    def generate(self, ids, sampling, *, mode, min_prompt_tokens):
        assert min_prompt_tokens == 0  # the probe must time POP's graph at every length
        n = len(ids[0])
        return [types.SimpleNamespace(ttft_s=n / 1000 / (self.speedup(n) if mode == "pop" else 1.0))]


@pytest.mark.parametrize("curve, expected, noted", [
    ({16: 0.9, 32: 1.25}, 32, False),
    ({16: 1.3, 32: 1.0}, 0, True),          # max_seq 64: only 16 and 32 are probed; 32 fails -> never POP
    ({16: 1.3, 32: 1.3}, 16, False),
])
def test_auto_threshold_follows_the_measured_curve(engine, curve, expected, noted):
    session = _Timed(OrtSession(engine), lambda n: curve[n])
    value, record = measured_min_prompt_tokens(session, "fake")
    assert [row["tokens"] for row in record["table"]] == sorted(curve)
    assert [row["speedup"] for row in record["table"]] == [curve[n] for n in sorted(curve)]
    assert value == (session.layout.max_seq if noted else expected)
    assert ("note" in record) == noted and record["min_speedup"] == 1.2 and record["runtime"] == "fake"


def test_export_auto_records_the_measured_threshold(tmp_path, monkeypatch):
    """The threshold is measured on the staged folder before its manifest exists: the manifest is written
    once, with the threshold in it."""
    writes, write = [], EngineManifest.write

    def counted(self, folder):
        writes.append((self.min_prompt_tokens, (Path(folder) / MANIFEST).exists()))
        write(self, folder)

    monkeypatch.setattr(EngineManifest, "write", counted)
    auto = tiny_engine("llama", tmp_path / "auto", cut=3, max_seq=64, min_prompt_tokens="auto")
    manifest = EngineManifest.read(auto)
    assert writes == [(manifest.min_prompt_tokens, False)]
    record = manifest.extra["min_prompt_tokens"]
    assert record["method"] == "measured" and record["runtime"] == "onnxruntime-cpu"
    assert "measured with onnxruntime-cpu, bar 1.2x" in summary(auto, manifest)  # popcompile info says how
    lengths = {row["tokens"]: row["speedup"] for row in record["table"]}
    assert set(lengths) <= {16, 32}  # the probes below max_seq=64
    if "note" in record:  # tiny random models are noise-bound; either outcome must follow the rule
        assert manifest.min_prompt_tokens == 64
    else:
        assert manifest.min_prompt_tokens == choose_min_prompt_tokens(lengths)
    for bad in (-1, "often", 2.5):
        with pytest.raises(ConfigError, match="--min-prompt-tokens"):
            tiny_engine("llama", tmp_path / "bad", min_prompt_tokens=bad)
        assert not (tmp_path / "bad").exists()


def _run_json(capsys, *args) -> dict:
    assert main(["run", *map(str, args), "--no-chat", "--max-new-tokens", "6", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_run_threshold_override_and_compare(engine, tmp_path, capsys):
    session = OrtSession(engine)
    text = " ".join(f"t{i}" for i in range(20))
    ids = session.encode(text, chat=False)
    greedy = SamplingConfig(max_new_tokens=6)
    pop = session.generate([ids], greedy, min_prompt_tokens=0)[0].token_ids
    full = session.generate([ids], greedy, mode="full")[0].token_ids
    above = _run_json(capsys, engine, "--prompt", text, "--min-prompt-tokens", len(ids) + 1)
    assert above["prefill"] == "full" and above["token_ids"] == full
    at = _run_json(capsys, engine, "--prompt", text, "--min-prompt-tokens", len(ids))
    assert at["prefill"] == "pop" and at["token_ids"] == pop
    both = _run_json(capsys, engine, "--prompt", text, "--compare", "--repeat", 2, "--min-prompt-tokens", 99)
    assert (both["pop"]["token_ids"], both["full"]["token_ids"]) == (pop, full)  # POP forced despite 99
    assert both["repeats"] == 2 and both["pop_by_default"] is False and both["flop_bound"] > 1.0
    assert both["same_text"] == (pop == full) and both["prompt_tokens"] == len(ids)


def test_cli_run_prompt_file_then_instruction(engine, tmp_path, capsys):
    attached = tmp_path / "doc.txt"
    attached.write_text("t1 t2 t3 t4")
    out = _run_json(capsys, engine, "--prompt-file", attached, "--prompt", "t9 t8")
    assert out["prompt_token_ids"] == OrtSession(engine).encode("t1 t2 t3 t4\n\nt9 t8", chat=False)


def test_flop_bound_reads_config_json_only_inside_the_folder(tmp_path):
    """config.json is not in the manifest's hashed list: read for the FLOP bound only from inside the
    folder."""
    from popcompile.runtime.compare import engine_flop_bound

    folder = tmp_path / "engine"
    folder.mkdir()
    assert engine_flop_bound(folder, 512, 20) is None  # no config: no bound, not an error
    config = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
              "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (folder / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(EngineError, match="outside the engine folder"):
        engine_flop_bound(folder, 512, 20)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    assert 1.3 < engine_flop_bound(folder, 512, 20) < 1.5  # 1/3 of 30 layers pruned
