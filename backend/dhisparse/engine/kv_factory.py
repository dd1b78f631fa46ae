"""Builds the KV manager an engine configuration asks for."""

from __future__ import annotations

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.dense_kv import DenseKVManager
from dhisparse.errors import ConfigError
from dhisparse.model.config import ModelConfig


def make_kv_manager(model_cfg: ModelConfig, cfg: EngineConfig, max_query_len: int = 1, extra_required_bytes: int = 0):
    """``dense`` is the unbounded reference store; ``resident``/``hisparse``/``adaptive`` are the hierarchy's
    policies (``dhisparse.kv``). ``extra_required_bytes`` is per-request speculative state (draft ring, verification
    staging) that the budget must count as required memory."""
    device = torch.device(cfg.device)
    if getattr(model_cfg, "model_type", None) == "deepseek_v4":
        return _deepseek_v4_manager(model_cfg, cfg, device, max_query_len)
    if cfg.kv_policy == "dense":
        return DenseKVManager(model_cfg, cfg.torch_dtype, device, max_query_len)
    from dhisparse.kv import KVConfig, KVLayout, KVManager

    layout = KVLayout.from_model_config(model_cfg, cfg.torch_dtype)
    hot_rows = cfg.hot_rows or default_hot_rows(model_cfg, max_query_len)
    kv_cfg = KVConfig(
        policy=cfg.kv_policy, pool_bytes=cfg.pool_bytes, hot_rows=hot_rows, page_rows=cfg.page_rows,
        reserve_bytes=cfg.reserve_bytes, refill_pages_per_step=cfg.refill_pages_per_step,
        max_query_len=max_query_len,
        **({"extra_required_bytes": extra_required_bytes} if extra_required_bytes else {}),
    )
    return KVManager(layout, kv_cfg, device)


def default_hot_rows(model_cfg: ModelConfig, max_query_len: int) -> int:
    """Hot-cache rows per source: room for the union of all verification queries' selections."""
    return model_cfg.index_topk * max_query_len


def _deepseek_v4_manager(model_cfg, cfg: EngineConfig, device: torch.device, max_query_len: int):
    from dhisparse.engine.v4_kv import V4DenseKVManager

    if cfg.kv_policy != "dense":
        raise ConfigError(f"kv_policy {cfg.kv_policy!r} does not serve deepseek_v4 models yet; use kv_policy='dense'")
    if max_query_len != 1:
        raise ConfigError("speculative decoding does not serve deepseek_v4 models yet; unset 'speculative'")
    return V4DenseKVManager(model_cfg, device, max_query_len)
