"""The device workspace bound: what a forward allocates on the device beside the KV pool, from the configuration.

The KV pool (``pool_bytes``) is the arena: the budget admission charges for what a request holds (tail, hot-cache,
staging and optional pages, and its indexer keys, which live in arena pages too: ``kv/index_keys.py``). What the
KV side keeps on the device beyond it is fixed by the configuration and part of this bound: the persistent batch
state (``kv/batch_state.py``: page tables, host page ids, hot-cache state, staging rows and key-page tables of
``max_batch_size`` slots of ``max_model_len`` positions, ``batch_state_bytes`` in ``stats()``), the draft ring
(``max_batch_size`` slots, when speculating) and the arena's scratch and zero pages. Admission still charges
each request's page-table / hot-state bytes and its draft ring against the pool as well (the per-request
footprint model of them), so those are counted twice: conservative, and small beside the pages.
Each forward also allocates temporaries; they are bounded here by the configuration alone —
``max_batch_size``, ``prefill_chunk_tokens``, the verification length and the model config — because the indexer
scores keys ``INDEX_TILE_TOKENS`` at a time and queries ``QUERY_TILE_TOKENS`` at a time, and prefill attention reads
its selected rows ``QUERY_TILE_TOKENS`` queries at a time: neither grows with the context, and the attention part
is capped by ``index_topk`` (rows attended per query), not by the chunk. What scales with ``max_model_len`` is the
prefill's own KV: with a host store (``hisparse``/``adaptive``, native rows) prompts stream into their host pages
chunk by chunk (``kv/prefill_stream.py``) and their indexer keys into the request's key pages, so nothing
scales (with FP8 keys the prompt's exact keys are held until import: ``index_head_dim`` values per token and
indexer layer); otherwise (``resident``, FP8 rows, the dense reference) the
prefill's ``LocalKV`` holds the whole prompt's rows and keys until import.

The estimate counts every temporary of one layer live at once (an upper bound: the forward frees them between
layers) and is checked against torch's memory profiler in tests/engine/test_workspace.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.errors import ConfigError
from dhisparse.kv.batch_state import BatchState
from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.factory import hierarchy_layout, is_deepseek_v4, streams_prefill
from dhisparse.kv.policies import policy_named
from dhisparse.model import attention as mla
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.spec.speculator import Speculator

F32, I64 = 4, 8


@dataclass(frozen=True)
class WorkspaceBound:
    """Device bytes a forward may allocate beyond the KV pool (per part; ``total_bytes`` is their sum)."""

    indexer_bytes: int  # one layer's tiled indexer scoring and running top-k
    attention_bytes: int  # one layer's gathered rows, scores and probabilities
    resolver_bytes: int  # one resolve call's temporaries and the step's stacked state
    activation_bytes: int  # hidden states of one forward (a few copies)
    prefill_kv_bytes: int  # prefill KV until import: a chunk of rows (streamed) or all rows, and the prompt's keys
    kv_fixed_bytes: int = 0  # the KV side's fixed state beside the arena: batch state, draft ring, zero page

    @property
    def total_bytes(self) -> int:
        return (self.indexer_bytes + self.attention_bytes + self.resolver_bytes + self.activation_bytes
                + self.prefill_kv_bytes + self.kv_fixed_bytes)

    def describe(self) -> str:
        mib = 1 << 20
        return (f"device workspace bound {self.total_bytes / mib:.1f} MiB beside the KV pool (indexer "
                f"{self.indexer_bytes / mib:.1f}, attention {self.attention_bytes / mib:.1f}, resolver "
                f"{self.resolver_bytes / mib:.1f}, activations {self.activation_bytes / mib:.1f}, prefill KV "
                f"{self.prefill_kv_bytes / mib:.1f}, KV fixed state {self.kv_fixed_bytes / mib:.1f} MiB)")


def workspace_bound(cfg: ModelConfig, dtype: torch.dtype, *, max_batch_size: int, prefill_chunk_tokens: int,
                    query_len: int, max_model_len: int, page_rows: int, hot_rows: int,
                    streamed_prefill: bool = False, kv_fixed_bytes: int = 0,
                    keys_in_place: bool = False) -> WorkspaceBound:
    """The bound for one engine configuration (see the module docstring). ``streamed_prefill``: prompts stream
    into their host pages chunk by chunk (``kv/prefill_stream.py``), so the prefill holds one chunk of rows.
    ``kv_fixed_bytes``: the KV side's fixed state beside the arena (:func:`kv_fixed_bytes`). ``keys_in_place``: the
    streamed prefill writes the prompt's indexer keys into the request's key pages (native keys), so it holds none."""
    e = dtype.itemsize
    topk = min(cfg.index_topk, max_model_len)
    tile = min(mla.INDEX_TILE_TOKENS, max_model_len)
    heads, idx_heads, d = cfg.num_attention_heads, cfg.index_n_heads, cfg.index_head_dim
    layers = cfg.num_hidden_layers
    # The largest forward: a prefill chunk (1 request) or a decode/verification step of the full batch.
    # A prefill chunk runs over its LocalKV (attention tiled over queries); a step's few queries are read at once.
    shapes = ((1, prefill_chunk_tokens, True), (max_batch_size, query_len, False))
    indexer = attention = resolver = activations = 0
    qt = mla.QUERY_TILE_TOKENS
    for batch, q, prefill in shapes:
        rows = batch * q
        # Indexer: scores of one (query tile × key tile) and its top-k merge; the running top-k of every query.
        iq = batch * min(q, qt)
        indexer = max(indexer, iq * (3 * idx_heads * tile * F32 + 2 * idx_heads * d * F32 + 3 * tile * F32
                                     + 3 * tile + 2 * (topk + tile) * (F32 + I64))
                      + rows * (2 * topk * (F32 + I64) + idx_heads * F32) + batch * tile * d * (e + 2 * F32)
                      # a key tile is gathered from whole key pages: up to two arena pages more per request
                      + batch * 2 * page_rows * cfg.row_dim * e)
        # Attention: gathered rows, scores and probabilities of one query tile (a prefill chunk over its LocalKV
        # is read QUERY_TILE_TOKENS queries at a time; a decode/verification step's few queries at once).
        aq = batch * (min(q, qt) if prefill else q)
        attention = max(attention, aq * topk * (3 * cfg.row_dim * e + 6 * heads * F32 + I64)
                        + rows * heads * (2 * cfg.kv_lora_rank + cfg.qk_head_dim + cfg.v_head_dim) * F32 * 2)
        # ~20 int64 arrays of one resolve over [B, Q*K] entries; stacked hot state and page/host tables (a step
        # of the hierarchy; the prefill's LocalKV resolves nothing).
        pages = -(-max_model_len // page_rows)
        if not prefill:
            resolver = max(resolver, rows * topk * 20 * I64 + batch * layers * (6 * hot_rows + 3 * pages) * I64)
        # Hidden states, the dense MLP, the MoE's per-assignment operands (grouped dispatch), the logits.
        moe = cfg.num_experts_per_tok * (3 * cfg.hidden_size + 3 * cfg.moe_intermediate_size) * F32
        activations = max(activations, rows * (8 * cfg.hidden_size + 4 * cfg.intermediate_size) * F32
                          + rows * moe + rows * cfg.vocab_size * F32 * 2)
    # the prompt's indexer keys until import (none when a streamed prefill writes them into the key pages)
    keys = 0 if streamed_prefill and keys_in_place else max_model_len * len(cfg.indexer_layers) * d * e
    if streamed_prefill:  # one chunk of rows per layer on the device, plus the distinct earlier rows one
        # query tile selected, fetched from the host store (host rows, their device copy, the row index)
        fetched = min(qt, prefill_chunk_tokens) * topk * (2 * cfg.row_dim * e + 3 * I64)
        prefill_kv = prefill_chunk_tokens * layers * cfg.row_dim * e + fetched + keys
    else:  # the whole prompt's rows (LocalKV)
        prefill_kv = max_model_len * layers * cfg.row_dim * e + keys
    return WorkspaceBound(indexer, attention, resolver, activations, prefill_kv, kv_fixed_bytes)


def plan_device(model_cfg: ModelConfig | DeepseekV4Config, cfg: EngineConfig, spec: Speculator | None,
                query_len: int, max_model_len: int) -> tuple[EngineConfig, WorkspaceBound | None, KVConfig | None]:
    """The device plan of an engine: its configuration with ``pool_bytes`` resolved (0 = "auto": the device's free
    memory less the workspace bound), the workspace bound (``None`` for deepseek_v4, which has none yet) and the
    hierarchy's :class:`KVConfig` (``None`` for the dense reference store)."""
    policy = policy_named(cfg.kv_policy, "kv_policy")
    ring = spec.ring_bytes_per_request if spec is not None else 0
    workspace = None
    if not is_deepseek_v4(model_cfg):
        assert isinstance(model_cfg, ModelConfig)
        ring_tensors = 0 if spec is None else sum(t.numel() * t.element_size()
                                                  for t in (spec.ring.rows, spec.ring.count))
        fixed = ring_tensors
        if not policy.reference_store:
            sized = dataclasses.replace(cfg, pool_bytes=max(cfg.pool_bytes, cfg.reserve_bytes + 1))
            layout = hierarchy_layout(model_cfg, cfg.torch_dtype, cfg.kv_dtype, cfg.index_key_dtype)
            fixed = kv_fixed_bytes(layout, sized.kv_config(query_len, ring, max_model_len), ring_tensors)
        workspace = workspace_bound(
            model_cfg, cfg.torch_dtype, max_batch_size=cfg.max_batch_size,
            prefill_chunk_tokens=cfg.prefill_chunk_tokens, query_len=query_len, max_model_len=max_model_len,
            page_rows=cfg.page_rows,
            hot_rows=cfg.hot_rows or model_cfg.index_topk,
            streamed_prefill=streams_prefill(model_cfg, policy, cfg.stream_prefill, cfg.kv_dtype),
            kv_fixed_bytes=fixed, keys_in_place=cfg.index_key_dtype != "fp8")
    if cfg.pool_bytes == 0:  # "auto"
        if workspace is None:
            raise ConfigError("pool_bytes 0 ('auto') needs the device workspace bound, which is not modelled "
                              "for deepseek_v4; set pool_bytes")
        cfg = dataclasses.replace(cfg, pool_bytes=auto_pool_bytes(resolve_device(cfg.device), workspace))
    # Prefix reuse leaves the drafter's window uncached (its ring is seeded from the prefill's hidden states) and
    # keys pages by the model's configuration.
    window = spec.ring.window if spec is not None else 1
    kv_config = None if policy.reference_store else cfg.kv_config(query_len, ring, max_model_len, window,
                                                                  repr(model_cfg))
    return cfg, workspace, kv_config


def kv_fixed_bytes(layout: KVLayout, config: KVConfig, ring_tensor_bytes: int = 0) -> int:
    """Device bytes the KV hierarchy allocates beside the arena for a fixed-size configuration: the persistent batch
    state, the draft ring's tensors and the arena's scratch and zero pages (``kv/device_pool.py``)."""
    return (BatchState.size_bytes(layout, config) + ring_tensor_bytes
            + 2 * config.page_rows * layout.row_bytes)


def auto_pool_bytes(device: torch.device, workspace: WorkspaceBound, fraction: float = 0.9) -> int:
    """A pool for ``pool_bytes=0`` ("auto"): ``fraction`` of the device's free memory (CUDA: ``mem_get_info``;
    CPU: ``MemAvailable``) minus the workspace bound. Call it after the model's weights are on the device."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = _mem_available()
    pool = int(free * fraction) - workspace.total_bytes
    if pool < 1:
        raise ValueError(f"pool_bytes=auto: {free} bytes free on {device} leave nothing after the workspace "
                         f"bound of {workspace.total_bytes} bytes; set pool_bytes explicitly")
    return pool


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
