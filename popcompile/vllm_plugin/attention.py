"""Attention metadata for POP's deep layers: only the tokens that survive the cut (vLLM 0.32).

A step's tokens: decode tokens and prompt chunks of several requests. With ``kv_sharing_fast_prefill``
on (settings.PopConfigHook) the model runner puts the logits indices — every decode token and the last
token of each prompt that ends in this step — into the common attention metadata. The deep layers'
backend (``survivor_backend``) builds its metadata for those tokens only, with vLLM's own reduction
(``make_kv_sharing_fast_prefill_common_attn_metadata``, the one Gemma 3n's cross-decoder uses):

    tokens        [d0 | p0 p1 p2 p3 | q0 q1]    d: decode, p: a prompt that ends here,
                                                q: a chunk that does not
    survivors     [d0 |          p3 |      ]    metadata.pop_survivors = [0, 4] (None: every token survives)

A prompt shorter than the folder's ``min_prompt_tokens`` survives whole (runner.py): its request then has
several survivors, and the reduced metadata's max_query_len is the most any request has.

The stock deep layers then run on the survivors; their K/V writes go to the survivors' own cache slots
(``survivor_slots``). Every other token's deep K/V is POP's projection, written by ``write_kv`` first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.v1.attention.backend import subclass_attention_backend
from vllm.v1.attention.backends.utils import make_kv_sharing_fast_prefill_common_attn_metadata


@functools.cache
def survivor_backend(underlying: type) -> type:
    """``underlying`` (the backend vLLM chose for the layer) whose metadata covers the survivors only."""
    base_builder = underlying.get_builder_cls()

    class PopSurvivorBuilder(base_builder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            index = survivor_index(common_attn_metadata)
            reduced = common_attn_metadata
            if index is not None:
                reduced = make_kv_sharing_fast_prefill_common_attn_metadata(dataclasses.replace(
                    common_attn_metadata, logits_indices_padded=index, num_logits_indices=index.numel(),
                    max_logits_per_req=most_per_request(index, common_attn_metadata)))
            metadata = super().build(common_prefix_len, reduced, fast_build)
            metadata.pop_survivors = index if reduced is not common_attn_metadata else None
            return metadata

    return subclass_attention_backend("PopSurvivor", underlying, PopSurvivorBuilder)


def survivor_index(common_attn_metadata) -> torch.Tensor | None:
    """The step's survivor token indices [S] (S may be 0), or None when every token survives.

    runner.py leaves the survivors (sorted; one per request, or every token of a short prompt) in the
    runner's logits index list, padded by repeating the last one (vLLM's own padding), all -1 when no
    token survives; the list may be longer than ``num_logits_indices`` (one per request).
    """
    padded, count = common_attn_metadata.logits_indices_padded, common_attn_metadata.num_logits_indices
    if padded is None or count is None:  # not armed: profiling, warm-up
        return None
    if common_attn_metadata.max_query_len == 1:  # decode only: every token survives, no work per step
        return None
    index = torch.unique_consecutive(padded)
    index = index[index >= 0]
    return None if index.numel() == common_attn_metadata.num_actual_tokens else index


def most_per_request(index: torch.Tensor, common_attn_metadata) -> int:
    """The largest number of survivors [S] that one request has in the step (the reduced max_query_len)."""
    if not index.numel():
        return 1
    starts = common_attn_metadata.query_start_loc_cpu[1:]  # request i's tokens end before starts[i]
    requests = torch.bucketize(index.cpu(), starts, right=True)
    return int(torch.bincount(requests).max())


def survivors(layer_name: str) -> torch.Tensor | None:
    """The step's survivor token indices [S] as the deep layer ``layer_name`` sees them; None: all tokens.

    None also when there is no metadata (vLLM's profiling and warm-up runs): the full model runs then.
    """
    metadata = get_forward_context().attn_metadata
    metadata = metadata.get(layer_name) if isinstance(metadata, dict) else None
    return getattr(metadata, "pop_survivors", None)


def warming_up() -> bool:
    """True in vLLM's profiling and warm-up runs (no attention metadata): every unit runs once, to compile."""
    return get_forward_context().attn_metadata is None


@contextlib.contextmanager
def survivor_slots(layer_names: list[str], index: torch.Tensor) -> Iterator[None]:
    """The deep layers' cache writes go to the survivors' slots while the survivors run (restored after)."""
    slots = get_forward_context().slot_mapping
    saved = {name: slots[name] for name in layer_names}
    try:
        for name in layer_names:
            slots[name] = saved[name][index]
        yield
    finally:
        slots.update(saved)


def write_kv(layer_name: str, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write K/V rows [T, H_kv * D] of the step's first T tokens into the layer's paged cache slots."""
    _, attn, kv_cache, slot_mapping = get_attention_context(layer_name)
    if slot_mapping is None:  # no cache bound yet (profiling)
        return
    tokens = key.shape[0]
    attn.impl.do_kv_cache_update(attn, key.view(tokens, attn.num_kv_heads, attn.head_size),
                                 value.view(tokens, attn.num_kv_heads, attn.head_size_v), kv_cache,
                                 slot_mapping[:tokens])
