"""Short prompts prefill in full: ``min_prompt_tokens`` in the manifest, the session and each call."""
from __future__ import annotations

import json

import numpy as np
import pytest

from popcompile.errors import ConfigError, EngineError
from popcompile.exporters.manifest import MANIFEST, EngineManifest
from popcompile.runtime.compare import compare, measure_speedups
from popcompile.runtime.generate import SamplingConfig
from popcompile.runtime.loop import prefill_path
from popcompile.runtime.ort import PopSession
from tiny_engine import tiny_engine

SHORT, LONG = [5, 9, 12], [5, 9, 12, 40, 41, 7, 3, 88, 19, 23, 61]
GREEDY = SamplingConfig(max_new_tokens=8)
# Seeded sampling from the tiny random model's near-uniform distribution: any change of logits shows up
SAMPLED = SamplingConfig(greedy=False, seed=3, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine("llama", tmp_path_factory.mktemp("thr") / "llama", cut=3, max_seq=64)


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
    forced = PopSession(engine, min_prompt_tokens=0)
    full_short = _first(forced, SHORT, mode="full")
    pop_short = _first(forced, SHORT)
    pop_long = _first(forced, LONG)
    assert pop_short[2] == pop_long[2] == "pop"
    assert not np.array_equal(full_short[0], pop_short[0])  # the two paths differ, so the checks below can fail
    session = PopSession(engine, min_prompt_tokens=len(LONG))
    short = _first(session, SHORT)
    assert short[2] == "full" and np.array_equal(short[0], full_short[0]) and short[1] == full_short[1]
    long = _first(session, LONG)
    assert long[2] == "pop" and np.array_equal(long[0], pop_long[0]) and long[1] == pop_long[1]
    assert _first(session, LONG, min_prompt_tokens=len(LONG) + 1)[2] == "full"  # per-call override


def test_manifest_threshold_is_the_session_default(engine, tmp_path):
    assert EngineManifest.read(engine).min_prompt_tokens == 0  # tests export with 0: POP always
    folder = tmp_path / "e"
    folder.mkdir()
    for f in engine.iterdir():
        (folder / f.name).hardlink_to(f) if f.name != MANIFEST else None  # symlinks out are refused
    data = json.loads((engine / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**data, "min_prompt_tokens": 7}))
    assert PopSession(folder).min_prompt_tokens == 7
    (folder / MANIFEST).write_text(json.dumps({**data, "min_prompt_tokens": -1}))
    with pytest.raises(EngineError, match="min_prompt_tokens"):
        EngineManifest.read(folder)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_override_is_a_config_error(engine, bad):
    with pytest.raises(ConfigError, match="min_prompt_tokens"):
        PopSession(engine, min_prompt_tokens=bad)


def test_compare_forces_pop_and_reports_both(engine):
    session = PopSession(engine, min_prompt_tokens=100)
    result = compare(session, [LONG], GREEDY, repeats=2)
    assert result.pop.prefill == "pop" and result.full.prefill == "full"
    assert not result.pop_by_default
    assert result.flop_bound is not None and result.flop_bound > 1.0
    assert result.matched_prefix <= len(result.full.token_ids)
    assert result.same_text == (result.full.token_ids == result.pop.token_ids)
    assert json.dumps(result.to_dict())


def test_measure_speedups_table(engine):
    table = measure_speedups(PopSession(engine), (4, 8, 16), repeats=1, min_speedup=0.0)
    assert [row["tokens"] for row in table] == [4, 8]  # stops after two lengths that pass
    assert all(row["speedup"] > 0 and row["flop_bound"] > 1.0 for row in table)
