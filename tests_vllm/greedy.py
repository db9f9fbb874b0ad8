"""One vLLM engine in its own process: greedy completions of token-id prompts, as JSON (tests and benchmarks).

    python tests_vllm/greedy.py FOLDER JOBS.json OUT.json [ENGINE_ARGS_JSON] [MAX_TOKENS]

JOBS.json is a list of jobs, run one after the other through the one engine (tests that need the same folder
and engine arguments share a start). A job is either

    {"prompts": [[token ids], ...], "sequential": false}  greedy completions: one batch (one ``generate``
                                                           call), or with "sequential" one call per prompt
                                                           (so prefix caching can reuse an earlier prompt)
    {"probe": "prompt_logprobs", "prompt": "text"}         a request with prompt_logprobs=1, then a plain
                                                           4-token request: does the engine refuse the first
                                                           and serve the second?
    {"probe": "rows", "prompts": [...], "modules": [...]}  greedy completions of the prompts in one batch,
                                                           counting the rows each decoder layer's named
                                                           submodules ("mlp", "mlp.gate", ...) are called on
                                                           (one-process engines, enforce_eager: hooks)
    {"probe": "start"}                                     does an engine start on the job's folder?

A job may name another "folder", and "engine_args" that override ENGINE_ARGS (one-process engines only,
``ENGINE_ARGS`` with "distributed_executor_backend": "uni" and VLLM_ENABLE_V1_MULTIPROCESSING=0): the engine
in hand is shut down and one started on that folder with those arguments, in this process, so that vLLM and
torch are imported once for several folders (most of an engine start on CPU: ~2 s per further tiny folder
against ~20 s per process). A job without them runs on the previous job's folder (the first: FOLDER) and
ENGINE_ARGS.

Before every job but the first on an engine the prefix cache is emptied (``LLM.reset_prefix_cache``): each job
sees the cache a fresh engine would. JOBS.json may also be a plain list of token-id lists: one job, sequential
when ENGINE_ARGS has "sequential": true (the old form).

OUT.json: one entry per job finished, written after each. Greedy jobs: [{"tokens": [...], "cached":
num_cached_tokens, "logprobs": [of each sampled token]}, ...]; prompt_logprobs probes: {"first": "REFUSED
<exception type> <message>" | "ACCEPTED", "after": tokens of the second request}; rows probes: {"tokens":
[[...], ...], "rows": {module: [rows of layer 0, 1, ...]}}; start probes: {"start": "REFUSED <exception type>
<message>" | "STARTED"}. float32, enforce_eager unless ENGINE_ARGS says otherwise, 1 GiB KV cache,
max_model_len 4096.
"""
from __future__ import annotations

import json
import os
import sys


def main(folder: str, jobs_file: str, out_file: str, engine_args: str = "{}",
         max_tokens: str = "16") -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams

    args = json.loads(engine_args)
    sequential = args.pop("sequential", False)
    jobs = json.load(open(jobs_file))
    old_form = not jobs or not isinstance(jobs[0], dict)
    if old_form:
        jobs = [{"prompts": jobs, "sequential": sequential}]
    if "kv_transfer_config" in args:  # one instance of a prefill/decode pair (PopConnector)
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True, logprobs=0)
    engines, results = Engines(args), []
    for job in jobs:
        folder = job.get("folder", folder)
        overrides = job.get("engine_args", {})
        if job.get("probe") == "start":
            results.append({"start": engines.try_start(folder, overrides)})
        else:  # no reference to the engine outlives the job: Engines.close must be able to free it
            results.append(JOBS[job.get("probe")](engines.on(folder, overrides), job, params))
        if not old_form:  # after every job: a job that kills the engine leaves the earlier ones' results
            json.dump(results, open(out_file, "w"))
    if old_form:
        json.dump(results[0], open(out_file, "w"))


class Engines:
    """The engine in hand, on one folder at a time (the module docstring: jobs that name another folder)."""

    def __init__(self, args: dict):
        self.args, self.key, self.llm, self.jobs = args, None, None, 0

    def on(self, folder: str, overrides: dict):
        """The engine on ``folder`` with ENGINE_ARGS and ``overrides``, started if the one in hand is another;
        its prefix cache emptied if it served a job before."""
        key = (folder, json.dumps(overrides, sort_keys=True))
        if self.llm is None or key != self.key:
            self.close()
            self.llm, self.key, self.jobs = self._start(folder, {**self.args, **overrides}), key, 0
        elif self.jobs:
            assert self.llm.reset_prefix_cache(), "the prefix cache could not be emptied between jobs"
        self.jobs += 1
        return self.llm

    def try_start(self, folder: str, overrides: dict) -> str:
        try:
            self.on(folder, overrides)
        except Exception as err:  # what vLLM (or the plugin, inside vLLM's config build) raised
            self.llm = None
            return f"REFUSED {type(err).__name__} {err}"
        return "STARTED"

    @staticmethod
    def _start(folder: str, args: dict):
        from vllm import LLM

        return LLM(model=folder,
                   **{"enforce_eager": True, "dtype": "float32", "max_model_len": 4096, "seed": 0, **args})

    def close(self) -> None:
        if self.llm is None:
            return
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" \
            and self.args.get("distributed_executor_backend") == "uni", \
            "jobs on several engines: give a one-process engine (serving.engine(..., one_process=True))"
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm = None  # the last reference: the engine shuts down now, or in the cleanup's gc.collect
        cleanup_dist_env_and_memory()  # vLLM's own, between engines in one process (its tests' too)


def run(llm, job: dict, params) -> list[dict]:
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    batches = [[p] for p in prompts] if job.get("sequential") else [prompts]
    outputs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
             "logprobs": [step[token].logprob
                          for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outputs]


def rows(llm, job: dict, params) -> dict:
    """The prompts' greedy tokens (one batch) and the rows each decoder layer's ``modules`` were called on."""
    counts = {name: {} for name in job["modules"]}

    def hook(name, index):
        def count(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            counts[name][index] = counts[name].get(index, 0) + hidden.shape[0]
        return count

    def attach(model):
        layers = model.model.layers
        return [layers[i].get_submodule(name).register_forward_pre_hook(hook(name, i), with_kwargs=True)
                for name in job["modules"] for i in range(len(layers))]

    handles = [h for worker in llm.apply_model(attach) for h in worker]
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
    layers = len(handles) // len(job["modules"])
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "rows": {name: [counts[name].get(i, 0) for i in range(layers)] for name in job["modules"]}}


def probe(llm, job: dict, params=None) -> dict:
    from vllm import SamplingParams

    assert job["probe"] == "prompt_logprobs", job
    try:
        llm.generate(job["prompt"], SamplingParams(max_tokens=4, prompt_logprobs=1), use_tqdm=False)
        first = "ACCEPTED"
    except Exception as err:  # vllm.exceptions.VLLMValidationError, as for vLLM's own parameter checks
        first = f"REFUSED {type(err).__name__} {err}"
    again = llm.generate(job["prompt"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    return {"first": first, "after": len(again[0].outputs[0].token_ids)}


JOBS = {None: run, "rows": rows, "prompt_logprobs": probe}


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run on import
    main(*sys.argv[1:])
