"""The suite's shared setup: the helpers' import path, one engine cache and one real-model cache.

- ``engines`` (engine_cache.EngineCache): every engine folder a test only *uses* is built once per run and
  shared by both workers; tests of export itself still export. ``real_engines`` builds shipped models' too.
- ``real_model(name)``: a shipped model (SmolLM2, Gemma 3) loaded once per worker. Every test that reaches it,
  directly or through a fixture, is marked ``real_model``: ``pytest -m "not real_model"`` leaves them out.
- ``cli(*args)``: ``popcompile ARGS`` run in-process through ``popcompile.cli.main``, as a CompletedProcess
  (subprocesses only where the process boundary itself is tested: signals, the installed script, a venv).
- The worker count is chosen here (``pytest_xdist_auto_num_workers``; pyproject says ``-n auto``).
- No test reaches the real Hugging Face hub: ``HF_HUB_OFFLINE=1`` for the run and its subprocesses (a hub id
  resolves from the cache only); test_hub.py serves a hub of its own on 127.0.0.1 and goes online there.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is imported, which is after this
if "huggingface_hub.constants" in sys.modules:
    sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py, tiny_engine.py, engine_cache.py

from engine_cache import EngineCache  # noqa: E402

#: the fixtures that load a shipped model; a test whose fixture closure holds one is marked real_model
REAL_MODEL_FIXTURES = {"real_model"}


@pytest.fixture(scope="session")
def real_model():
    """``real_model(name) -> LoadedModel``, each shipped model loaded once per worker. Tests must not change
    the model they get (the driver never does: it compiles a copy for float16)."""
    from popcompile.frontend.models import load_model

    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(name)
        return loaded[name]
    return get


@pytest.fixture(scope="session")
def engines(tmp_path_factory, worker_id) -> EngineCache:
    """The run's engine folders: under the base temp folder every worker shares (xdist gives each worker
    ``<run>/popen-gwN``), new for each run."""
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / "shared-engines"
    cache = EngineCache(root)
    yield cache
    changed = cache.changed()
    assert not changed, f"tests changed shared engine folders (work on a copy): {changed}"


@pytest.fixture(scope="session")
def real_engines(engines, real_model) -> EngineCache:
    """``engines`` that also builds shipped models' folders (``real_engines.real(name, ...)``)."""
    return engines.using(real_model)


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*args, check=True, input=None) -> CompletedProcess``: the CLI in this process (its exit code,
    what it printed); ``check`` asserts exit 0, ``input`` is its stdin."""
    from popcompile.cli import main

    def run(*args, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        capsys.readouterr()
        if input is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(input))
        try:
            code = main(argv)
        except SystemExit as done:  # argparse's usage errors, `check`'s exit 1: what the process would exit
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
        out, err = capsys.readouterr()
        if check:
            assert code == 0, err[-2000:]
        return subprocess.CompletedProcess(["popcompile", *argv], code, out, err)
    return run


@pytest.hookimpl(trylast=True)  # after pytest's own ordering by fixture scope
def pytest_collection_modifyitems(config, items):
    """Mark what reaches a shipped model ``real_model``; then order the run longest-first, so that no long
    test starts last while the other worker idles: real-model tests, then files kept on one worker
    (xdist_group: one unit each), then the rest (a stable sort: each file's own order is kept)."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
    items.sort(key=lambda item: 0 if item.get_closest_marker("real_model") else
               1 if item.get_closest_marker("xdist_group") else 2)


def pytest_configure(config):
    """A worker's share of the cores for torch's threads (and its subprocesses' OpenMP): two workers of two
    threads each on two cores oversubscribe them, and OpenMP threads that spin while they wait then slow the
    ops of both. xdist sets PYTEST_XDIST_WORKER_COUNT in each worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_xdist_auto_num_workers(config) -> int:
    """Two workers (CI's two cores; more would multiply memory: a real-model export peaks at several GB), none
    when the run names test files or ids of one file only: a single file needs no workers' startup."""
    files = {str(arg).split("::")[0] for arg in config.args}
    if len(files) == 1 and next(iter(files)).endswith(".py"):
        return 0
    return 2
