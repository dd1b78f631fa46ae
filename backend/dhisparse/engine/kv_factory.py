"""Builds the KV manager an engine configuration asks for."""

from __future__ import annotations

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.dense_kv import DenseKVManager
from dhisparse.model.config import ModelConfig


def make_kv_manager(model_cfg: ModelConfig, cfg: EngineConfig, max_query_len: int = 1, extra_required_bytes: int = 0):
    """``dense`` is the unbounded reference store; ``resident``/``hisparse``/``adaptive`` are the hierarchy's
    policies (``dhisparse.kv``). ``extra_required_bytes`` is per-request speculative state (draft ring, verification
    staging) that the budget must count as required memory."""
    device = torch.device(cfg.device)
    if cfg.kv_policy == "dense":
        return DenseKVManager(model_cfg, cfg.torch_dtype, device, max_query_len)
    from dhisparse.kv import KVConfig, KVLayout, KVManager

    layout = KVLayout.from_model_config(model_cfg, cfg.torch_dtype, "fp8" if cfg.kv_dtype == "fp8" else "native")
    hot_rows = cfg.hot_rows or default_hot_rows(model_cfg, max_query_len)
    kv_cfg = KVConfig(
        policy=cfg.kv_policy, pool_bytes=cfg.pool_bytes, hot_rows=hot_rows, page_rows=cfg.page_rows,
        reserve_bytes=cfg.reserve_bytes, refill_pages_per_step=cfg.refill_pages_per_step,
        max_query_len=max_query_len, host_bytes=cfg.host_bytes,
        **({"extra_required_bytes": extra_required_bytes} if extra_required_bytes else {}),
    )
    return KVManager(layout, kv_cfg, device)


def default_hot_rows(model_cfg: ModelConfig, max_query_len: int) -> int:
    """Hot-cache rows per source: room for the union of all verification queries' selections."""
    return model_cfg.index_topk * max_query_len
