"""The one change POP makes to vLLM's model runner: which tokens of a step survive into the deep layers.

vLLM computes logits at the last scheduled token of every request, also of a chunk in the middle of a
prompt (its sampled token is discarded: ``discard_request_mask``), and ``kv_sharing_fast_prefill`` hands
exactly those indices to the attention metadata. For POP that token must stop at the cut like the rest
of the prompt (popcompile/reference.py runs only the prompt's last token through the deep layers), or
the cache, and so the output, would depend on how the scheduler chunked the prompt. A prompt shorter than
the folder's ``min_prompt_tokens`` (settings.py) runs the full model: every token it has in the step survives.

    logits indices   [3, 7, 9]        requests A (decode), B (chunk mid-prompt), C (prompt ends)
    survivors        [3, 9, 9]        B dropped; padded by repeating the last index (all -1: none)
    + D, short       [3, 9, 10..14]   D's whole prompt (tokens 10..14) survives

Installed once per process, by the POP model's constructor: only a process that serves a POP folder
runs the patched method. attention.survivor_index reads the list back.
"""
from __future__ import annotations

import numpy as np
import torch

from ..threshold import uses_pop
from .patching import wrap_once
from .settings import PopSettings


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner subclasses it

    wrap_once(GPUModelRunner, "_prepare_kv_sharing_fast_prefill", _keeping_prompt_ends)


def _keeping_prompt_ends(original):
    def prepare_survivors(self, logits_indices: torch.Tensor) -> torch.Tensor:
        # [n_padded], one index per request (PopConfigHook: no drafts)
        padded = original(self, logits_indices)
        requests = logits_indices.shape[0]
        ends = ~self.discard_request_mask.gpu[:requests].bool()
        keep = logits_indices[ends]
        short = short_prompt_tokens(self, requests)
        if short.size:
            # sorted, as the steps' tokens
            keep = torch.unique(torch.cat([keep, torch.from_numpy(short).to(keep)]))
        # the runner's buffer holds max_num_tokens indices: room for every token of the step
        out = self.kv_sharing_fast_prefill_logits_indices[:max(padded.shape[0], keep.shape[0])]
        out.fill_(-1)
        out[:keep.shape[0]] = keep
        if keep.shape[0]:
            out[keep.shape[0]:] = keep[-1]
        return out

    return prepare_survivors


def short_prompt_tokens(runner, requests: int) -> np.ndarray:
    """Step token indices [K] of the requests still in a prompt shorter than the folder's
    min_prompt_tokens."""
    threshold = PopSettings.of(runner.model_config.hf_config).min_prompt_tokens
    prompt = runner.input_batch.num_prompt_tokens[:requests]
    computed = runner.input_batch.num_computed_tokens_cpu[:requests]  # before this step's tokens
    short = np.flatnonzero(~uses_pop(prompt, threshold) & (computed < prompt))
    if not short.size:
        return short
    starts = runner.query_start_loc.np[:requests + 1]  # request i's tokens: starts[i]..starts[i+1]-1
    return np.concatenate([np.arange(starts[i], starts[i + 1]) for i in short])
