"""One vLLM engine in its own process: greedy completions of token-id prompts, as JSON (tests and benchmarks).

    python tests_vllm/greedy.py FOLDER PROMPTS.json OUT.json [ENGINE_ARGS_JSON] [MAX_TOKENS]

PROMPTS.json is a list of token-id lists, run in order, each a separate ``generate`` call when
ENGINE_ARGS has "sequential": true (so prefix caching can reuse an earlier prompt), else one batch.
OUT.json: [{"tokens": [...], "cached": num_cached_tokens, "logprobs": [of each sampled token]}, ...].
float32, enforce_eager unless ENGINE_ARGS says otherwise, 1 GiB KV cache.
"""
from __future__ import annotations

import json
import os
import sys


def main(folder: str, prompts_file: str, out_file: str, engine_args: str = "{}",
         max_tokens: str = "16") -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    args = json.loads(engine_args)
    sequential = args.pop("sequential", False)
    if "kv_transfer_config" in args:  # one instance of a prefill/decode pair (PopConnector)
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    llm = LLM(model=folder,
              **{"enforce_eager": True, "dtype": "float32", "max_model_len": 4096, "seed": 0, **args})
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": ids} for ids in json.load(open(prompts_file))]
    batches = [[p] for p in prompts] if sequential else [prompts]
    outputs = [out for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]
    json.dump([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                "logprobs": [step[token].logprob
                             for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
               for o in outputs], open(out_file, "w"))


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run on import
    main(*sys.argv[1:])
