"""Builds the KV manager an engine configuration asks for."""

from __future__ import annotations

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.dense_kv import DenseKVManager
from dhisparse.kv.policies import policy_named
from dhisparse.model.config import ModelConfig


def make_kv_manager(model_cfg: ModelConfig, cfg: EngineConfig, max_query_len: int = 1, draft_ring_bytes: int = 0):
    """``dense`` is the unbounded reference store; ``resident``/``hisparse``/``adaptive`` are the hierarchy's
    policies (``dhisparse.kv``). ``draft_ring_bytes`` is the per-request draft ring; with verification staging
    (sized by the KV config) it is the speculative state the budget counts as required memory."""
    device = torch.device(cfg.device)
    if policy_named(cfg.kv_policy, "kv_policy").reference_store:
        return DenseKVManager(model_cfg, cfg.torch_dtype, device, max_query_len)
    from dhisparse.kv import KVConfig, KVLayout, KVManager

    layout = KVLayout.from_model_config(model_cfg, cfg.torch_dtype)
    kv_cfg = KVConfig(
        policy=cfg.kv_policy, pool_bytes=cfg.pool_bytes, hot_rows=cfg.hot_rows, page_rows=cfg.page_rows,
        reserve_bytes=cfg.reserve_bytes, refill_pages_per_step=cfg.refill_pages_per_step,
        max_query_len=max_query_len, draft_ring_bytes=draft_ring_bytes,
    )
    return KVManager(layout, kv_cfg, device)

