"""The one change POP makes to vLLM's model runner: a prompt chunk that does not end its prompt has no survivor.

vLLM computes logits at the last scheduled token of every request, also of a chunk in the middle of a
prompt (its sampled token is discarded: ``discard_request_mask``), and ``kv_sharing_fast_prefill`` hands
exactly those indices to the attention metadata. For POP that token must stop at the cut like the rest
of the prompt (popcompile/reference.py runs only the prompt's last token through the deep layers), or
the cache, and so the output, would depend on how the scheduler chunked the prompt.

    logits indices   [3, 7, 9]      requests A (decode), B (chunk mid-prompt), C (prompt ends)
    survivors        [3, 9, 9]      B dropped; padded by repeating the last index (all -1: none)

Installed once per process, by the POP model's constructor: only a process that serves a POP folder
runs the patched method. attention.survivor_index reads the list back.
"""
from __future__ import annotations

import torch

from .patching import wrap_once


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner subclasses it

    wrap_once(GPUModelRunner, "_prepare_kv_sharing_fast_prefill", _keeping_prompt_ends)


def _keeping_prompt_ends(original):
    def prepare_survivors(self, logits_indices: torch.Tensor) -> torch.Tensor:
        padded = original(self, logits_indices)  # [n_padded], one index per request (PopConfigHook: no drafts)
        ends = ~self.discard_request_mask.gpu[:logits_indices.shape[0]].bool()
        keep = logits_indices[ends]
        padded.fill_(-1)
        padded[:keep.shape[0]] = keep
        if keep.shape[0]:
            padded[keep.shape[0]:] = keep[-1]
        return padded

    return prepare_survivors
