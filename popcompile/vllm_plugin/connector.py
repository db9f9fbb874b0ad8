"""``PopConnector``: vLLM's KV connector for POP's prefill/decode split (vLLM 0.32, V1 connector API).

    router ──prompt, max_tokens=1──▶ prefill instance: the POP folder, kv_role "kv_producer"
       │                                  writes the prompt's K/V rows 0..N-2 (handoff.py)
       └──the same prompt, max_tokens=G──▶ decode instance: the same folder, kv_role "kv_consumer",
                                          served unpruned (settings.PopSettings.for_instance): loads rows
                                          0..N-2, runs x_N through the full model, samples y_1..y_G

The decode instance's output is single-instance POP's: rows 0..N-2 are POP's cache (deep layers: the
K/V projections of h_cut, or POP+'s fitted ones), and x_N, the boundary token, runs every layer, exactly as
POP runs it. A prompt with no entry (never prefilled, or another layout's) is prefilled in full on the
decode instance: the full model's tokens, never an error. Both instances refuse a store folder that holds
another model's layout (``handoff.Layout``).

    --kv-transfer-config '{"kv_connector": "PopConnector", "kv_role": "kv_producer",
                           "kv_connector_module_path": "popcompile.vllm_plugin.connector",
                           "kv_connector_extra_config": {"shared_storage_path": "/shared/pop-kv"}}'

Scheduler side: which rows to store (when a prompt's last chunk is scheduled) or load (a hit in the
store). Worker side: copies between the paged cache and the store, before the step's forward (loads) and
after it (stores). Whole entries through the file system: the reference transport, like vLLM's
ExampleConnector; GPU deployments move the same rows with NixlConnector (docs/vllm.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger

from ..errors import ConfigError
from .handoff import HandoffStore, Layout, entry_key, weights_fingerprint
from .settings import POP_ARCHITECTURES

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: printed with its own lines
STORAGE_KEY = "shared_storage_path"


@dataclass
class Transfer:
    """One request's copy in this step: prompt rows ``start..end-1`` to or from the store's ``key``."""

    key: str
    start: int
    end: int
    slots: list[int]  # the cache slot of each row start..end-1 (block id * block size + offset)
    store: bool


@dataclass
class PopConnectorMetadata(KVConnectorMetadata):
    transfers: list[Transfer] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request the scheduler side follows: its prompt and the cache blocks it holds so far."""

    prompt: list[int]
    mm_hashes: list[str]
    blocks: list[int]
    stored: bool = False

    @property
    def key(self) -> str:
        return entry_key(self.prompt, self.mm_hashes)


def instance_layout(vllm_config) -> Layout:
    """The KV layout this instance serves (handoff.Layout), from vLLM's resolved config."""
    model = vllm_config.model_config
    text = model.hf_config.get_text_config()
    architecture = (model.hf_config.architectures or ["?"])[0]
    heads = text.num_attention_heads
    return Layout(architecture=POP_ARCHITECTURES.get(architecture, architecture),
                  num_layers=text.num_hidden_layers,
                  num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                  head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                  dtype=str(model.dtype).removeprefix("torch."), weights=weights_fingerprint(model.model))


class PopConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        root = config.get_from_extra_config(STORAGE_KEY, None)
        if not root:
            raise ConfigError(f"PopConnector needs kv_connector_extra_config.{STORAGE_KEY}: a folder both "
                              "instances can read and write")
        self._store = HandoffStore(root, instance_layout(vllm_config))
        self._produces, self._consumes = config.is_kv_producer, config.is_kv_consumer
        self._block_size = vllm_config.cache_config.block_size
        self._tracked: dict[str, _Tracked] = {}
        self._hits: dict[str, int] = {}  # request id -> rows the store holds for it (this scheduling try)
        self._loads: dict[str, int] = {}  # request id -> the first row to load
        if role == KVConnectorRole.SCHEDULER:
            self._store.claim_layout()

    # --- scheduler side ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """The rows the store holds for this exact prompt beyond the local hit (at most N - 1)."""
        if not self._consumes:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        rows = min(self._store.has(entry_key(prompt, _mm_hashes(request))), len(prompt) - 1)
        self._hits[request.request_id] = rows
        return max(rows - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rows = self._hits.pop(request.request_id, 0)
        if num_external_tokens > 0:
            self._loads[request.request_id] = rows - num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = PopConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = _Tracked(list(new.prompt_token_ids or []), [f.identifier for f in new.mm_features],
                               list(_group(new.block_ids)))
            self._tracked[new.req_id] = tracked
            self._plan(meta, new.req_id, tracked, new.num_computed_tokens,
                       scheduler_output.num_scheduled_tokens[new.req_id], resumed=False)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            resumed = req_id in cached.resumed_req_ids
            added = cached.new_block_ids[i]
            if added is not None:
                tracked.blocks = list(_group(added)) if resumed else tracked.blocks + list(_group(added))
            self._plan(meta, req_id, tracked, cached.num_computed_tokens[i],
                       scheduler_output.num_scheduled_tokens[req_id], resumed)
        return meta

    def _plan(self, meta: PopConnectorMetadata, req_id: str, tracked: _Tracked, computed: int,
              scheduled: int, resumed: bool) -> None:
        start = self._loads.pop(req_id, None)
        if start is not None:
            end = len(tracked.prompt) - 1
            meta.transfers.append(Transfer(tracked.key, start, end, self._slots(tracked, start, end), False))
        prompt_ends = computed + scheduled >= len(tracked.prompt) > 1
        if self._produces and prompt_ends and not tracked.stored and not resumed:
            tracked.stored = True
            if not self._store.has(tracked.key):
                end = len(tracked.prompt) - 1
                meta.transfers.append(Transfer(tracked.key, 0, end, self._slots(tracked, 0, end), True))

    def _slots(self, tracked: _Tracked, start: int, end: int) -> list[int]:
        size = self._block_size
        return [tracked.blocks[t // size] * size + t % size for t in range(start, end)]

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        return False, None

    # --- worker side ------------------------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Write each loaded entry's rows start..end-1 into their slots, in every attention layer."""
        metadata = self._get_connector_metadata()
        loads = [t for t in metadata.transfers if not t.store]
        if not loads:
            return
        caches = _layer_caches(forward_context)
        for transfer in loads:
            rows = self._store.read(transfer.key)
            missing = set(caches) - set(rows)
            if missing:
                raise ConfigError(f"hand-off entry {transfer.key} lacks layers {sorted(missing)[:3]}: the "
                                  "prefill instance serves another model")
            for name, cache in caches.items():
                blocks, offsets = _split(transfer.slots, cache)
                cache.write(blocks, offsets, rows[name][transfer.start:transfer.end])
            logger.debug("PopConnector loaded %d prompt rows of %s", transfer.end - transfer.start,
                         transfer.key)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole entries after the step (wait_for_save): POP's deep layers skip a mid-prompt chunk

    def wait_for_save(self) -> None:
        """Store each prompt that ended in this step: rows 0..N-2 of every attention layer."""
        metadata = self._get_connector_metadata()
        stores = [t for t in metadata.transfers if t.store]
        if not stores:
            return
        caches = _layer_caches(get_forward_context())
        for transfer in stores:
            rows = {}
            for name, cache in caches.items():
                blocks, offsets = _split(transfer.slots, cache)
                rows[name] = cache.read(blocks, offsets)
            self._store.write(transfer.key, rows)


def _mm_hashes(request) -> list[str]:
    return [feature.identifier for feature in (getattr(request, "mm_features", None) or [])]


def _group(block_ids) -> list[int]:
    """The block ids of the one KV cache group (a tuple of per-group lists in vLLM 0.32)."""
    if len(block_ids) != 1:
        raise ConfigError(f"PopConnector serves models with one KV cache group, not {len(block_ids)} "
                          "(sliding-window and full-attention layers in separate groups): start vLLM with "
                          "--disable-hybrid-kv-cache-manager")
    return block_ids[0]


def _layer_caches(forward_context) -> dict[str, TokenRows]:
    """Attention layer name -> its cache read and written by token (``_LAYOUTS``)."""
    caches = {}
    for name, layer in forward_context.no_compile_layers.items():
        cache = getattr(layer, "kv_cache", None)
        if cache is None:
            continue
        kind = (layer.attn_backend.get_name(), getattr(layer, "isa", None))
        if kind not in _LAYOUTS:
            raise ConfigError(f"PopConnector does not know the cache layout of attention backend {kind[0]} "
                              f"with kernel {kind[1]!r} (it knows {sorted(_LAYOUTS)}): serve float32 or "
                              "float16 on x86 CPUs, and on GPUs move POP's cache with NixlConnector "
                              "(docs/vllm.md)")
        caches[name] = _LAYOUTS[kind](cache)
    return caches


class TokenRows:
    """A paged cache seen by token: ``read(blocks, offsets)`` -> [T, H_kv, 2, D] (K, V), ``write`` back.

    CPU_ATTN with the "vec" kernel (float32/float16 on x86) keeps, per block and KV head, the block's keys
    transposed, [D, block_size], then its values, [block_size, D], in the per-layer tensor
    [blocks, H_kv, block_size, 2 * D] (measured: tests_vllm/test_vllm_disagg.py compares the rows with
    transformers' cache)."""

    def __init__(self, cache: torch.Tensor):
        blocks, heads, self.block_size, width = cache.shape
        dim, flat = width // 2, cache.view(blocks, heads, -1)
        self.keys = flat[..., :self.block_size * dim].view(blocks, heads, dim, self.block_size)
        self.values = flat[..., self.block_size * dim:].view(blocks, heads, self.block_size, dim)

    def read(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        keys = self.keys[blocks, :, :, offsets]  # [T, H, D]
        values = self.values[blocks, :, offsets]  # [T, H, D]
        return torch.stack([keys, values], dim=2)

    def write(self, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
        rows = rows.to(self.keys)
        self.keys[blocks, :, :, offsets] = rows[:, :, 0]
        self.values[blocks, :, offsets] = rows[:, :, 1]


#: (attention backend, kernel) -> how its cache is read by token; anything else is refused, not guessed
_LAYOUTS = {("CPU_ATTN", "vec"): TokenRows}


def _split(slots: list[int], tokens: TokenRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots -> (block, offset) in the cache's own block size (the kernel's may be smaller)."""
    flat = torch.tensor(slots, dtype=torch.int64, device=tokens.keys.device)
    return flat // tokens.block_size, flat % tokens.block_size
