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

Before every job but the first the prefix cache is emptied (``LLM.reset_prefix_cache``): each job sees the
cache a fresh engine would. JOBS.json may also be a plain list of token-id lists: one job, sequential when
ENGINE_ARGS has "sequential": true (the old form).

OUT.json: one entry per job finished, written after each. Greedy jobs: [{"tokens": [...], "cached":
num_cached_tokens, "logprobs": [of each sampled token]}, ...]; probes: {"first": "REFUSED <exception type>
<message>" | "ACCEPTED", "after": tokens of the second request}. float32, enforce_eager unless ENGINE_ARGS
says otherwise, 1 GiB KV cache, max_model_len 4096.
"""
from __future__ import annotations

import json
import os
import sys


def main(folder: str, jobs_file: str, out_file: str, engine_args: str = "{}",
         max_tokens: str = "16") -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    args = json.loads(engine_args)
    sequential = args.pop("sequential", False)
    jobs = json.load(open(jobs_file))
    old_form = not jobs or not isinstance(jobs[0], dict)
    if old_form:
        jobs = [{"prompts": jobs, "sequential": sequential}]
    if "kv_transfer_config" in args:  # one instance of a prefill/decode pair (PopConnector)
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    llm = LLM(model=folder,
              **{"enforce_eager": True, "dtype": "float32", "max_model_len": 4096, "seed": 0, **args})
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True, logprobs=0)
    results = []
    for i, job in enumerate(jobs):
        if i:
            assert llm.reset_prefix_cache(), "the prefix cache could not be emptied between jobs"
        results.append(probe(llm, job) if "probe" in job else run(llm, job, params))
        if not old_form:  # after every job: a job that kills the engine leaves the earlier ones' results
            json.dump(results, open(out_file, "w"))
    if old_form:
        json.dump(results[0], open(out_file, "w"))


def run(llm, job: dict, params) -> list[dict]:
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    batches = [[p] for p in prompts] if job.get("sequential") else [prompts]
    outputs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
             "logprobs": [step[token].logprob
                          for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outputs]


def probe(llm, job: dict) -> dict:
    from vllm import SamplingParams

    assert job["probe"] == "prompt_logprobs", job
    try:
        llm.generate(job["prompt"], SamplingParams(max_tokens=4, prompt_logprobs=1), use_tqdm=False)
        first = "ACCEPTED"
    except Exception as err:  # vllm.exceptions.VLLMValidationError, as for vLLM's own parameter checks
        first = f"REFUSED {type(err).__name__} {err}"
    again = llm.generate(job["prompt"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    return {"first": first, "after": len(again[0].outputs[0].token_ids)}


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run on import
    main(*sys.argv[1:])
