"""Engine-folder loading is total: any folder gives a working OrtSession or an EngineError naming the culprit.

Every damaging test works on its own copy of one tiny engine (tests/tiny_engine.py) and checks that the
failed load changed nothing in the folder. Hashes are remembered in a per-test cache folder, never in
the user's ~/.cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from popcompile.engine.manifest import MANIFEST, EngineManifest
from popcompile.engine.tensorrt import TrtSection
from popcompile.engine.verify import HashCache, UnverifiedWeightsWarning
from popcompile.errors import ConfigError, EngineError, InputError, PopcompileError
from popcompile.runtime.ort import OrtSession
from popcompile.runtime.sampling import SamplingConfig
from popcompile.runtime.trt import TrtSession, verify_plans

PROMPT = [[5, 9, 12, 40, 41]]


@pytest.fixture(scope="module")
def engine(engines) -> Path:
    return engines.tiny("llama", cut=3, max_seq=64)


@pytest.fixture
def folder(engine, tmp_path) -> Path:
    """A private copy of the engine that a test may damage."""
    return Path(shutil.copytree(engine, tmp_path / "engine"))


@pytest.fixture
def cache(tmp_path) -> HashCache:
    return HashCache(tmp_path / "verified")


def load(folder: Path, cache: HashCache | None = None) -> OrtSession:
    return OrtSession(folder, hash_cache=cache or HashCache(None))


def checksums(folder: Path) -> dict[str, str]:
    """Every entry of the folder: a symlink's target, a file's sha256, a folder's name."""
    def one(path: Path) -> str:
        if path.is_symlink():
            return "-> " + os.readlink(path)
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return {p.name: one(p) for p in sorted(folder.iterdir())}


def refused(folder: Path, *culprits: str, cache: HashCache | None = None) -> str:
    """Loading raises EngineError with a one-line message naming every culprit, and changes nothing."""
    before = checksums(folder)
    with pytest.raises(EngineError) as error:
        load(folder, cache)
    message = str(error.value)
    assert "\n" not in message and all(c in message for c in culprits), message
    assert checksums(folder) == before
    return message


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def write_manifest(folder: Path, data: object) -> None:
    (folder / MANIFEST).write_text(json.dumps(data))


def edit(folder: Path, change: Callable[[dict], None]) -> None:
    data = manifest(folder)
    change(data)
    write_manifest(folder, data)


def put(path: str, value: object) -> Callable[[dict], None]:
    """A manifest edit setting the dotted key ``path`` (e.g. "kv_layout.max_seq") to ``value``."""
    *parents, last = path.split(".")

    def change(data: dict) -> None:
        for key in parents:
            data = data[key]
        data[last] = value
    return change


def drop(path: str) -> Callable[[dict], None]:
    *parents, last = path.split(".")

    def change(data: dict) -> None:
        for key in parents:
            data = data[key]
        del data[last]
    return change


def rehash(folder: Path, graph: str) -> None:
    """Record graph file's current size and sha256 in the manifest (what a careful attacker would do)."""
    path = folder / f"{graph}.onnx"
    edit(folder, put(f"graphs.{graph}.bytes", path.stat().st_size))
    edit(folder, put(f"graphs.{graph}.sha256", hashlib.sha256(path.read_bytes()).hexdigest()))


def flip(path: Path, offset: int, count: int = 1) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------- the manifest

MANIFEST_CASES = {
    # id: (edit of the parsed manifest, words the message must hold)
    "missing-key": (drop("cut"), ["lacks", "cut"]),
    "unknown-key": (put("surprise", 1), ["unknown keys", "surprise"]),
    "format": (put("format", "onnx"), ["not a popcompile engine", "onnx"]),
    "version-99": (put("format_version", 99), ["format version 99"]),
    "version-string": (put("format_version", "2"), ["format version '2'"]),
    "version-bool": (put("format_version", True), ["format version True"]),
    "num-layers-type": (put("num_layers", "4"), ["num_layers='4'"]),
    "cut-range": (put("cut", 9), ["cut=9", "out of range"]),
    "cut-float": (put("cut", 2.5), ["cut=2.5"]),
    "kv-layout-list": (put("kv_layout", [4, 2, 16, 64]), ["kv_layout", "KVLayout"]),
    "kv-layout-missing-field": (drop("kv_layout.head_dim"), ["kv_layout", "head_dim"]),
    "max-seq-1e12": (put("kv_layout.max_seq", 1e12), ["kv_layout", "max_seq", "1000000000000.0"]),
    "max-seq-huge-int": (put("kv_layout.max_seq", 10**12), ["kv_layout", "max_seq", "1000000000000"]),
    "max-seq-zero": (put("kv_layout.max_seq", 0), ["max_seq", "got 0"]),
    "kv-dtype-unknown": (put("kv_layout.dtype", "float8"), ["kv_layout", "dtype", "float8"]),
    "dtype-unknown": (put("dtype", "float33"), ["dtype='float33'"]),
    "dtype-disagrees": (put("dtype", "bfloat16"), ["disagrees", "dtype=bfloat16"]),
    "layers-disagree": (put("kv_layout.num_layers", 3), ["disagrees", "num_layers=4"]),
    "graphs-list": (put("graphs", ["prefill.onnx"]), ["graphs must be", "['prefill.onnx']"]),
    "graphs-one": (drop("graphs.decode"), ["graphs must be", "prefill and decode, found ['prefill']"]),
    "graph-entry-string": (put("graphs.prefill", "prefill.onnx"), ["graphs.prefill=", "must be an object"]),
    "graph-bytes-string": (put("graphs.prefill.bytes", "571161"), ["graphs.prefill.bytes="]),
    "graph-sha-short": (put("graphs.decode.sha256", "abc"), ["graphs.decode.sha256="]),
    "graph-inputs-string": (put("graphs.prefill.inputs", "input_ids"), ["graphs.prefill.inputs="]),
    "graph-inputs-renamed": (put("graphs.decode.inputs", ["tokens"]), ["graphs.decode", "inputs/outputs"]),
    "graph-absolute": (put("graphs.prefill.file", "/etc/passwd"), ["graphs.prefill.file='/etc/passwd'"]),
    "graph-dotdot": (put("graphs.decode.file", "../engine/decode.onnx"), ["graphs.decode.file='../engine"]),
    "weights-absolute": (put("weights.file", "/dev/zero"), ["weights.file='/dev/zero'"]),
    "weights-dotdot": (put("weights.file", ".."), ["weights.file='..'"]),
    "weights-bytes-negative": (put("weights.bytes", -1), ["weights.bytes=-1"]),
    "weights-sha-upper": (put("weights.sha256", "A" * 64), ["weights.sha256='AAAA"]),
    "weights-unknown-key": (put("weights.offset", 0), ["weights has unknown keys ['offset']"]),
    "weights-not-object": (put("weights", "weights.bin"), ["weights='weights.bin'"]),
    "eos-negative": (put("eos_token_ids", [-1]), ["eos_token_ids=(-1,)"]),
    "eos-strings": (put("eos_token_ids", ["</s>"]), ["eos_token_ids="]),
    "boundary": (put("boundary", "sideways"), ["boundary='sideways'"]),
    "tensorrt-list": (put("tensorrt", []), ["tensorrt=[]"]),
    "model-null": (put("model", None), ["model=None"]),
    "min-prompt-tokens": (put("min_prompt_tokens", -3), ["min_prompt_tokens=-3"]),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_bad_manifest_values_are_refused_by_name(folder, case):
    change, words = MANIFEST_CASES[case]
    edit(folder, change)
    message = refused(folder, *words)
    assert str(folder) in message


@pytest.mark.parametrize("content, words", [
    (b"", ["corrupt"]),
    (b"[1, 2, 3]", ["JSON list, not an object"]),
    (b'"popcompile"', ["JSON str, not an object"]),
    (b"null", ["JSON NoneType, not an object"]),
    (b"\xff\xfe{}", ["not UTF-8"]),
    (b"[" * 100_000 + b"]" * 100_000, ["corrupt"]),
    (b'{"cut": ' + b"9" * 5000 + b"}", ["corrupt"]),
    (b" " * ((1 << 20) + 1), ["larger than"]),
], ids=["empty", "list", "string", "null", "not-utf8", "deep", "long-int", "huge"])
def test_manifests_that_are_not_objects(folder, content, words):
    (folder / MANIFEST).write_bytes(content)
    refused(folder, MANIFEST, *words)


def test_truncated_manifest(folder):
    raw = (folder / MANIFEST).read_bytes()
    (folder / MANIFEST).write_bytes(raw[: len(raw) // 2])
    refused(folder, MANIFEST, "corrupt")


def test_folder_argument_of_the_wrong_type():
    with pytest.raises(ConfigError, match="an engine folder is a path"):
        OrtSession(42)


def test_manifest_that_is_a_folder_or_a_symlink_out(folder, engine):
    (folder / MANIFEST).unlink()
    (folder / MANIFEST).symlink_to(engine / MANIFEST)  # a manifest outside the folder
    refused(folder, MANIFEST, "outside the engine folder")
    (folder / MANIFEST).unlink()
    (folder / MANIFEST).mkdir()
    refused(folder, "not a popcompile engine folder")


# ------------------------------------------------------------------------------------------- the files

def test_graph_symlink_out_of_the_folder_is_refused_even_with_the_right_hash(folder, tmp_path):
    outside = tmp_path / "elsewhere.onnx"
    (folder / "prefill.onnx").rename(outside)
    (folder / "prefill.onnx").symlink_to(outside)
    refused(folder, "prefill.onnx", "outside the engine folder")


def test_weights_symlink_out_of_the_folder_is_refused(folder, tmp_path):
    outside = tmp_path / "weights.bin"
    (folder / "weights.bin").rename(outside)
    (folder / "weights.bin").symlink_to(outside)
    refused(folder, "weights.bin", "outside the engine folder")


def test_symlink_inside_the_folder_is_fine(folder):
    (folder / "weights.bin").rename(folder / "real-weights.bin")
    (folder / "weights.bin").symlink_to("real-weights.bin")
    assert load(folder).generate(PROMPT, SamplingConfig(max_new_tokens=2))[0].token_ids


def test_symlink_loop(folder):
    (folder / "weights.bin").unlink()
    (folder / "weights.bin").symlink_to("weights.bin")
    refused(folder, "weights.bin")


def test_graph_that_is_a_folder(folder):
    (folder / "decode.onnx").unlink()
    (folder / "decode.onnx").mkdir()
    refused(folder, "decode.onnx", "not a regular file")


def test_missing_weights(folder):
    (folder / "weights.bin").unlink()
    refused(folder, "weights.bin is missing")


def test_truncated_weights(folder):
    with open(folder / "weights.bin", "r+b") as file:
        file.truncate(1000)
    refused(folder, "weights.bin has 1000 bytes")


@pytest.mark.parametrize("offset, count", [(12345, 1), (4096, 16384)], ids=["one-byte", "16KiB-block"])
def test_changed_weights_are_caught_by_their_hash(folder, engine, offset, count):
    assert EngineManifest.read(engine).weights_sha256() is not None  # export records it
    flip(folder / "weights.bin", offset, count)
    refused(folder, "weights.bin", "sha256")


def test_flipped_graph_byte(folder):
    flip(folder / "decode.onnx", 2000)
    refused(folder, "decode.onnx", "sha256")


def test_hash_cache_remembers_and_still_catches_a_change(folder, cache):
    load(folder, cache)
    entries = sorted(cache.folder.iterdir())
    assert len(entries) == 3  # prefill.onnx, decode.onnx, weights.bin
    assert {json.loads(e.read_text())["sha256"] for e in entries} == {
        hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("prefill.onnx", "decode.onnx", "weights.bin")}
    stat = (folder / "weights.bin").stat()
    flip(folder / "weights.bin", 777)
    os.utime(folder / "weights.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    refused(folder, "weights.bin", "sha256", cache=cache)


def test_a_wrong_cache_entry_cannot_fail_a_good_file(folder, cache):
    load(folder, cache)
    for entry in cache.folder.iterdir():
        data = json.loads(entry.read_text())
        entry.write_text(json.dumps({**data, "sha256": "0" * 64}))
    load(folder, cache)  # hashed again, good
    (cache.folder / "junk.json").write_text("{")
    load(folder, cache)


def test_unwritable_cache_only_costs_time(folder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    load(folder, HashCache(blocker / "verified"))


def test_manifest_without_weights_hash_warns_and_checks_size(folder):
    edit(folder, drop("weights.sha256"))
    with pytest.warns(UnverifiedWeightsWarning, match="size only"):
        load(folder)
    with open(folder / "weights.bin", "r+b") as file:
        file.truncate(100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedWeightsWarning)
        refused(folder, "weights.bin has 100 bytes")


# ------------------------------------------------------------------------------------------- the graphs

def rewrite_graph(folder: Path, graph: str, change: Callable[[onnx.ModelProto], None]) -> None:
    proto = onnx.load(str(folder / f"{graph}.onnx"), load_external_data=False)
    change(proto)
    onnx.save(proto, str(folder / f"{graph}.onnx"))
    rehash(folder, graph)


def set_location(value: str) -> Callable[[onnx.ModelProto], None]:
    def change(proto: onnx.ModelProto) -> None:
        tensor = next(t for t in proto.graph.initializer if t.external_data)
        next(e for e in tensor.external_data if e.key == "location").value = value
    return change


@pytest.mark.parametrize("location", ["tokenizer.json", "../engine/weights.bin", "/etc/passwd"])
def test_graph_external_data_must_be_the_weights_file(folder, location):
    rewrite_graph(folder, "prefill", set_location(location))
    refused(folder, "prefill.onnx", repr(location), "weights.bin")


def test_graph_external_data_past_the_end_of_the_weights(folder):
    def change(proto: onnx.ModelProto) -> None:
        tensor = next(t for t in proto.graph.initializer if t.external_data)
        next(e for e in tensor.external_data if e.key == "offset").value = str(10**9)
    rewrite_graph(folder, "decode", change)
    refused(folder, "decode.onnx", "1000000000")


@pytest.mark.parametrize("keep", [5000, -100])
def test_truncated_graph_with_a_matching_manifest(folder, keep):
    """Cut before any external tensor, onnxruntime refuses it; cut after some, the external-data scan does."""
    path = folder / "prefill.onnx"
    path.write_bytes(path.read_bytes()[:keep])
    rehash(folder, "prefill")
    message = refused(folder, "prefill.onnx")
    assert "not a readable ONNX file" in message or "onnxruntime cannot load" in message


@pytest.mark.parametrize("damage, words", [
    ("truncate", ["prefill.onnx is not a readable ONNX graph"]),
    ("symlink-out", ["outside the engine folder"])])
def test_tensorrt_check_reads_only_verified_graphs(folder, tmp_path, damage, words):
    from popcompile.exporters.tensorrt_compat import check_engine

    path = folder / "prefill.onnx"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:5000])
        rehash(folder, "prefill")
    else:
        path.rename(tmp_path / "prefill.onnx")
        path.symlink_to(tmp_path / "prefill.onnx")
    with pytest.raises(EngineError) as error:
        check_engine(folder)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_graph_onnxruntime_refuses(folder):
    rewrite_graph(folder, "decode", lambda proto: setattr(proto.graph.node[0], "op_type", "NoSuchOp"))
    refused(folder, "onnxruntime cannot load", "decode.onnx")


@pytest.mark.parametrize("key, value, word", [
    ("num_kv_heads", 4, "past_key_values.0.key"), ("head_dim", 8, "past_key_values.0.key")])
def test_kv_layout_that_disagrees_with_the_graphs(folder, key, value, word):
    edit(folder, put(f"kv_layout.{key}", value))
    refused(folder, ".onnx declares", word, "kv_layout")


def test_kv_dtype_that_disagrees_with_the_graphs(folder):
    edit(folder, lambda data: (put("kv_layout.dtype", "bfloat16")(data), put("dtype", "bfloat16")(data)))
    refused(folder, ".onnx declares", "tensor(bfloat16)", "tensor(float)")


def test_swapped_graph_files(folder):
    (folder / "prefill.onnx").rename(folder / "tmp.onnx")
    (folder / "decode.onnx").rename(folder / "prefill.onnx")
    (folder / "tmp.onnx").rename(folder / "decode.onnx")
    refused(folder, ".onnx has", "bytes where the manifest says")


# ------------------------------------------------------------------------------------------- TensorRT plans

def trt_section(plans: dict) -> TrtSection:
    return TrtSection(tensorrt_version="x", gpu="x", compute_capability="x", precision="fp32",
                      workspace_gb=1.0, max_batch=1, sentinel_rows=1, decode_kv="static", plans=plans,
                      profiles={"prefill": [], "decode": []}, onnx_sha256={}, timing_cache="",
                      build_seconds={})


def test_tensorrt_plans_are_verified_and_stay_inside_the_folder(folder, tmp_path, cache):
    data = b"plan bytes"
    (folder / "prefill.plan").write_bytes(data)
    (tmp_path / "decode.plan").write_bytes(data)
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    good = {"file": "prefill.plan", **entry}
    paths = verify_plans(folder, trt_section({"prefill": good, "decode": good}), cache)
    assert paths["decode"].name == "prefill.plan"
    for plan, words in [({"file": "../decode.plan", **entry}, ["tensorrt.plans.decode", "build-trt"]),
                        ({"file": "/etc/passwd", **entry}, ["tensorrt.plans.decode"]),
                        ({"file": "prefill.plan", "bytes": "10"}, ["tensorrt.plans.decode"]),
                        ({**good, "sha256": "0" * 64}, ["prefill.plan", "sha256", "build-trt"])]:
        with pytest.raises(EngineError) as error:
            verify_plans(folder, trt_section({"prefill": good, "decode": plan}), cache)
        assert all(w in str(error.value) for w in words), str(error.value)
    (folder / "decode.plan").symlink_to(tmp_path / "decode.plan")
    with pytest.raises(EngineError, match="outside the engine folder"):
        plans = {"prefill": good, "decode": {"file": "decode.plan", **entry}}
        verify_plans(folder, trt_section(plans), cache)


def good_section() -> dict:
    digest = {"file": "prefill.plan", "bytes": 1, "sha256": "0" * 64}
    profile = {"name": "prefill", "shapes": {"input_ids": {"min": [1, 1], "opt": [1, 8], "max": [1, 64]}}}
    return {**trt_section({"prefill": digest, "decode": {**digest, "file": "decode.plan"}}).__dict__,
            "profiles": {"prefill": [profile], "decode": [{**profile, "name": "step"}]}}


@pytest.mark.parametrize("key, value, words", [
    ("plans", ["prefill", "decode"], "tensorrt.plans="), ("max_batch", "1", "tensorrt.max_batch='1'"),
    ("sentinel_rows", 0, "tensorrt.sentinel_rows=0"),
    ("profiles", {"prefill": [{}], "decode": []}, "profiles"),
    ("profiles", {"prefill": 5, "decode": []}, "tensorrt.profiles="),
    ("workspace_gb", float("nan"), "workspace_gb"),
])
def test_malformed_tensorrt_sections(folder, key, value, words):
    edit(folder, put("tensorrt", {**good_section(), key: value}))
    with pytest.raises(EngineError) as error:
        TrtSession(folder, hash_cache=HashCache(None))
    assert words in str(error.value) and "build-trt" in str(error.value)


# ------------------------------------------------------------------------------------------- the session

def test_good_engine_loads_and_checks_token_ids(engine, cache):
    before = checksums(engine)
    session = load(engine, cache)
    assert session.vocab == 97
    greedy = session.generate(PROMPT, SamplingConfig(max_new_tokens=3))[0].token_ids
    zero = session.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0, "greedy": False})[0]
    assert zero.token_ids == greedy
    for prompts, words in [([[1, -5, 3]], "token 1 is int -5"), ([[1, 2.0]], "float 2.0"), ([[97]], "int 97"),
                           ([[1, True]], "bool True"), ([1, 2], "[[id, id, ...]]"), ([], "non-empty"),
                           ([[]], "no tokens"), ([[1] * 64], "max length 64"), (7, "int 7")]:
        with pytest.raises(InputError) as error:
            session.generate(prompts, SamplingConfig(max_new_tokens=2))
        assert words in str(error.value)
    with pytest.raises(ConfigError, match="unknown sampling options"):
        session.generate(PROMPT, {"max_tokens": 2})
    with pytest.raises(ConfigError, match="mode"):
        session.generate(PROMPT, mode="fast")
    assert checksums(engine) == before


# ------------------------------------------------------------------------------------------- fuzzing

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
_KEYS = ["model", "num_layers", "cut", "kv_layout", "kv_layout.num_layers", "kv_layout.num_kv_heads",
         "kv_layout.head_dim", "kv_layout.max_seq", "kv_layout.dtype", "graphs", "graphs.prefill",
         "graphs.prefill.file", "graphs.prefill.inputs", "graphs.prefill.bytes", "graphs.decode.sha256",
         "graphs.decode.outputs", "weights", "weights.file", "weights.bytes", "weights.sha256", "dtype",
         "versions", "eos_token_ids", "target", "format", "format_version", "extra", "tensorrt", "boundary",
         "min_prompt_tokens"]
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _loads_or_engine_error(folder: Path, cache: HashCache) -> None:
    """A session or an EngineError; either way no file but the manifest differs from the engine's."""
    before = {name: digest for name, digest in checksums(folder).items() if name != MANIFEST}
    try:
        with warnings.catch_warnings():
            # a fuzzed manifest may drop weights.sha256
            warnings.simplefilter("ignore", UnverifiedWeightsWarning)
            load(folder, cache)
    except EngineError as error:
        assert "\n" not in str(error)
    assert {name: digest for name, digest in checksums(folder).items() if name != MANIFEST} == before


@_FUZZ
@given(key=st.sampled_from(_KEYS), value=_JSON, delete=st.booleans())
def test_fuzz_any_value_in_any_key(folder, cache, key, value, delete):
    original = (folder / MANIFEST).read_text()
    try:
        edit(folder, drop(key) if delete else put(key, value))
        _loads_or_engine_error(folder, cache)
    finally:
        (folder / MANIFEST).write_text(original)


@_FUZZ
@given(key=st.sampled_from(sorted(good_section())), value=_JSON)
def test_fuzz_tensorrt_section(folder, key, value):
    """No GPU here: a fuzzed section ends in EngineError, or EnvironmentUnavailable once it looks runnable."""
    original = (folder / MANIFEST).read_text()
    try:
        edit(folder, put("tensorrt", {**good_section(), key: value}))
        with pytest.raises(PopcompileError):
            TrtSession(folder, hash_cache=HashCache(None))
    finally:
        (folder / MANIFEST).write_text(original)


@_FUZZ
@given(data=st.data())
def test_fuzz_truncated_and_bit_flipped_manifests(folder, cache, data):
    original = (folder / MANIFEST).read_bytes()
    raw = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        (folder / MANIFEST).write_bytes(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))
        _loads_or_engine_error(folder, cache)
    finally:
        (folder / MANIFEST).write_bytes(original)
