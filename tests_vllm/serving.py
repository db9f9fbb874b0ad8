"""Shared by tests_vllm/: serving folders exported in the pytest process, and vLLM engine runs (conftest.py
holds the fixture of SmolLM2's folders).

Exports go through popcompile's library API (``popcompile.driver.compile`` with an already loaded model, the
``popcompile export --target vllm`` path without the CLI; the CLI itself is tested in tests/): SmolLM2 is
loaded once for its calibration and all its folders, instead of one ``popcompile`` process each. Each vLLM
engine still runs in its own process (greedy.py): ``engine`` runs one with a list of jobs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: SmolLM2's cut (of 30 layers) in the shared folders
CUT, LAYERS = 20, 30
#: the "threshold" folder's min_prompt_tokens: the 300-token prompt runs in full, in two chunks
THRESHOLD = 400


def load(model: str | Path):
    """popcompile's LoadedModel (frontend.models.load_model: a shipped name or a HF folder), float32."""
    from popcompile.frontend.models import load_model

    return load_model(str(model))


def export(loaded, out: Path, *, cut: int | None, kv_calibration: str | Path = "none",
           min_prompt_tokens: int = 0) -> Path:
    """``popcompile export MODEL --target vllm --out OUT --cut CUT --kv-calibration K --min-prompt-tokens N``
    of an already loaded model (cut None: the default cut; POP for every prompt by default)."""
    from popcompile.config import PopConfig
    from popcompile.driver import compile as pop_compile

    config = PopConfig(cut=cut, kv_calibration=str(kv_calibration), min_prompt_tokens=min_prompt_tokens)
    pop_compile(loaded, config, out=out, target="vllm")
    return out


def calibrate(loaded, out: Path, *, cut: int, max_tokens: int) -> Path:
    """``popcompile calibrate MODEL --cut CUT --max-tokens N --out OUT``: the ridge fit on the built-in corpus
    (kvfit.fit.resolve_fit, the path calibrate and export share), saved as a calibration file."""
    from popcompile.config import KVFitConfig
    from popcompile.kvfit.calibrate import save_fit
    from popcompile.kvfit.fit import resolve_fit

    fit = resolve_fit(loaded.model, loaded.tokenizer, cut, "ridge", config=KVFitConfig(max_tokens=max_tokens))
    save_fit(fit, out)
    return out


class Run:
    """What one engine process gave: ``run[i]`` is job i's result (greedy.py), or a failed assertion with the
    process's stderr when the process ended before job i finished (or failed after its last job)."""

    def __init__(self, done: subprocess.CompletedProcess, results: list, jobs: int):
        self.done, self.results, self.jobs = done, results, jobs

    def __getitem__(self, i: int):
        # a job that ran stands on its own; every job ran, then the process must also have ended well
        failed = i >= len(self.results) or (len(self.results) == self.jobs and self.done.returncode != 0)
        assert not failed, \
            f"job {i} of {self.jobs}: {len(self.results)} ran, exit {self.done.returncode}: " \
            f"{self.done.stderr[-4000:]}"
        return self.results[i]


#: engine processes run by ``start``: at most two at a time. On CPU a vLLM engine computes on one core (it
#: keeps the other for its front end) and spends most of its start importing vLLM and torch, one core too.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine")


def start(run, *args, **kwargs) -> Future:
    """``run(*args, **kwargs)`` (``engine``, or a function that runs several in turn) in the background, with
    at most one other: tests compute their references in the pytest process meanwhile, then wait for the
    future's result."""
    return _POOL.submit(run, *args, **kwargs)


#: environment and engine arguments of a one-process engine (``engine(..., one_process=True)``)
ONE_PROCESS = ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, {"distributed_executor_backend": "uni"})


def engine(tmp: Path, folder: Path, jobs: list[dict], new: int, *, one_process: bool = False,
           **engine_args) -> Run:
    """One vLLM engine on ``folder`` (greedy.py, its own process) through ``jobs``, ``new`` greedy tokens
    each. A job: {"prompts": [...], "sequential": bool} or {"probe": "prompt_logprobs", "prompt": text}.

    By default vLLM's own process layout (as `vllm serve` and ``LLM`` run it): the front end, the engine core
    and the CPU worker each in a process, each importing vLLM and torch (most of an engine start on CPU).
    ``one_process``: all three in greedy.py's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor),
    for engines whose tests compare tokens only with the reference or with other one-process engines; the
    process layout stays tested by the default engines (the offline prompt_logprobs refusal, the chunking
    and prefix-cache tests), the prefill/decode instances, the servers and the samples."""
    tmp.mkdir(parents=True, exist_ok=True)
    name = f"{folder.name}-{len(list(tmp.glob('jobs-*.json')))}"
    jobs_file, out = tmp / f"jobs-{name}.json", tmp / f"out-{name}.json"
    jobs_file.write_text(json.dumps(jobs))
    env, args = ONE_PROCESS if one_process else ({}, {})
    done = subprocess.run([sys.executable, str(HERE / "greedy.py"), str(folder), str(jobs_file), str(out),
                           json.dumps({**args, **engine_args}), str(new)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, **env})
    return Run(done, json.loads(out.read_text()) if out.exists() else [], len(jobs))
