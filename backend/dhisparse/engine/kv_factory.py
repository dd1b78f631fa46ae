"""Builds the KV manager an engine configuration asks for."""

from __future__ import annotations

import torch

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.dense_kv import DenseKVManager
from dhisparse.errors import ConfigError
from dhisparse.kv.policies import policy_named
from dhisparse.model.config import ModelConfig


def make_kv_manager(model_cfg: ModelConfig, cfg: EngineConfig, max_query_len: int = 1, draft_ring_bytes: int = 0):
    """``dense`` is the unbounded reference store; ``resident``/``hisparse``/``adaptive`` are the hierarchy's
    policies (``dhisparse.kv``). ``draft_ring_bytes`` is the per-request draft ring; with verification staging
    (sized by the KV config) it is the speculative state the budget counts as required memory."""
    from dhisparse.kernels import selection

    device = resolve_device(cfg.device)
    # Decided (and on a GPU self-checked) before anything serves; an impossible kernels='cuda' fails here.
    kernels = selection.select_kernels(cfg.kernels, device)
    if getattr(model_cfg, "model_type", None) == "deepseek_v4":  # torch path only (see docs/deepseek_v4.md)
        return _deepseek_v4_manager(model_cfg, cfg, device, max_query_len, draft_ring_bytes)
    if policy_named(cfg.kv_policy, "kv_policy").reference_store:  # the reference store: always torch
        return DenseKVManager(model_cfg, cfg.torch_dtype, device, max_query_len)
    from dhisparse.kv import KVManager

    layout, kv_cfg = hierarchy_layout_config(model_cfg, cfg, max_query_len, draft_ring_bytes)
    return KVManager(layout, kv_cfg, device, kernels=kernels)


def hierarchy_layout_config(model_cfg: ModelConfig, cfg: EngineConfig, max_query_len: int = 1,
                            draft_ring_bytes: int = 0):
    """The ``(KVLayout, KVConfig)`` of the hierarchy's policies for a DSA model (what ``make_kv_manager`` builds)."""
    from dhisparse.kv import KVConfig, KVLayout

    layout = KVLayout.from_model_config(model_cfg, cfg.torch_dtype, "fp8" if cfg.kv_dtype == "fp8" else "native",
                                        "fp8" if cfg.index_key_dtype == "fp8" else "native")
    kv_cfg = KVConfig(
        policy=cfg.kv_policy, pool_bytes=cfg.pool_bytes, hot_rows=cfg.hot_rows, page_rows=cfg.page_rows,
        reserve_bytes=cfg.reserve_bytes, refill_pages_per_step=cfg.refill_pages_per_step,
        max_query_len=max_query_len, draft_ring_bytes=draft_ring_bytes, host_bytes=cfg.host_bytes,
        # The persistent batch state (kv/batch_state.py) is allocated once for these.
        max_batch_size=cfg.max_batch_size,
        max_model_len=min(cfg.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings),
    )
    return layout, kv_cfg


def _deepseek_v4_manager(model_cfg, cfg: EngineConfig, device: torch.device, max_query_len: int,
                         draft_ring_bytes: int):
    """V4: ``dense`` keeps whole states; the hierarchy's policies hold CSA entries (``engine/v4_hierarchy.py``)."""
    if cfg.kv_dtype != "auto":
        raise ConfigError(f"kv_dtype {cfg.kv_dtype!r}: deepseek_v4 keeps its entries in the model dtype; "
                          "use kv_dtype='auto'")
    if cfg.index_key_dtype != "auto":
        raise ConfigError(f"index_key_dtype {cfg.index_key_dtype!r}: deepseek_v4 keeps its keys in the model dtype; "
                          "use index_key_dtype='auto'")
    if policy_named(cfg.kv_policy, "kv_policy").reference_store:
        from dhisparse.engine.v4_kv import V4DenseKVManager

        return V4DenseKVManager(model_cfg, device, max_query_len)
    if not model_cfg.csa_layers:
        raise ConfigError(f"kv_policy {cfg.kv_policy!r}: this deepseek_v4 model has no compressed_sparse_attention "
                          "layer, so nothing is selectable; use kv_policy='dense'")
    from dhisparse.engine.v4_hierarchy import V4HierarchyKVManager
    from dhisparse.kv import KVConfig

    max_model_len = min(cfg.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    union = model_cfg.index_topk * max_query_len
    if cfg.hot_rows and cfg.hot_rows < union and policy_named(cfg.kv_policy, "kv_policy").hot_cache:
        # V4 has no verification staging: a block's whole union of selections must fit the hot cache
        raise ConfigError(f"hot_rows ({cfg.hot_rows}) must hold a verification block's selections on "
                          f"deepseek_v4, index_topk x max_query_len = {union} (V4 has no verification staging); "
                          f"raise hot_rows or leave it 0")
    kv_cfg = KVConfig(
        policy=cfg.kv_policy, pool_bytes=cfg.pool_bytes, hot_rows=cfg.hot_rows or union,
        page_rows=cfg.page_rows, reserve_bytes=cfg.reserve_bytes, refill_pages_per_step=cfg.refill_pages_per_step,
        max_query_len=-(-max_query_len // model_cfg.compress_rate_csa), draft_ring_bytes=draft_ring_bytes,
        host_bytes=cfg.host_bytes,
    )
    return V4HierarchyKVManager(model_cfg, kv_cfg, cfg.torch_dtype, device, max_model_len)
