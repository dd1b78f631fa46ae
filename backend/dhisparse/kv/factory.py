"""Builds the KV store an engine configuration asks for (the only place that knows the concrete stores)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dhisparse.errors import ConfigError
from dhisparse.kernels import selection
from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.deepseek_v4 import V4DenseKVStore, V4HierarchyKVStore
from dhisparse.kv.dense import DenseKVStore
from dhisparse.kv.manager import KVManager
from dhisparse.kv.policies import KVPolicy, policy_named
from dhisparse.kv.store import KVStore
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4.config import DeepseekV4Config


def is_deepseek_v4(model_cfg: object) -> bool:
    return isinstance(model_cfg, DeepseekV4Config)


def streams_prefill(model_cfg: object, policy: KVPolicy, stream_prefill: bool, kv_dtype: str) -> bool:
    """Whether a request's prefill streams its rows into the host store (what :meth:`KVManager.prefill_kv` does):
    a DSA model under a policy with a host store, native rows, ``stream_prefill`` on."""
    return stream_prefill and not is_deepseek_v4(model_cfg) and kv_dtype == "auto" and policy.uses_host


def make_kv_store(model_cfg: ModelConfig | DeepseekV4Config, *, policy: str | KVPolicy, dtype: torch.dtype,
                  device: torch.device, kv_config: KVConfig | None, kernels: str = "auto", kv_dtype: str = "auto",
                  index_key_dtype: str = "auto", stream_prefill: bool = True, max_query_len: int = 1,
                  max_model_len: int = 0, copy_fault_hook: Callable[[str], None] | None = None) -> KVStore:
    """The store for ``policy``: ``dense`` is the unbounded reference (a DSA or a DeepSeek-V4 model);
    ``resident`` / ``hisparse`` / ``adaptive`` are the hierarchy's (``kv_config`` required, from
    :func:`hierarchy_config`). ``kernels`` is selected (and on a GPU self-checked) here, before anything serves: an
    impossible ``kernels='cuda'`` fails here. ``copy_fault_hook``: fault injection at copy completion (drills)."""
    chosen = policy_named(policy, "kv_policy")
    kernel_selection = selection.select_kernels(kernels, device)
    if is_deepseek_v4(model_cfg):
        assert isinstance(model_cfg, DeepseekV4Config)
        return _deepseek_v4_store(model_cfg, chosen, dtype, device, kv_config, kv_dtype, index_key_dtype,
                                  max_query_len, max_model_len, copy_fault_hook)
    assert isinstance(model_cfg, ModelConfig)
    if chosen.reference_store:
        return DenseKVStore(model_cfg, dtype, device, max_query_len)
    if kv_config is None:
        raise ConfigError(f"kv_policy {chosen.name!r} needs a KVConfig")
    layout = hierarchy_layout(model_cfg, dtype, kv_dtype, index_key_dtype)
    return KVManager(layout, kv_config, device, kernels=kernel_selection, copy_fault_hook=copy_fault_hook,
                     stream_prefill=streams_prefill(model_cfg, chosen, stream_prefill, kv_dtype))


def hierarchy_layout(model_cfg: ModelConfig, dtype: torch.dtype, kv_dtype: str = "auto",
                     index_key_dtype: str = "auto") -> KVLayout:
    """The hierarchy's :class:`KVLayout` of a DSA model."""
    return KVLayout.from_model_config(model_cfg, dtype, "fp8" if kv_dtype == "fp8" else "native",
                                      "fp8" if index_key_dtype == "fp8" else "native")


def _deepseek_v4_store(model_cfg: DeepseekV4Config, policy: KVPolicy, dtype: torch.dtype, device: torch.device,
                       kv_config: KVConfig | None, kv_dtype: str, index_key_dtype: str, max_query_len: int,
                       max_model_len: int, copy_fault_hook: Callable[[str], None] | None) -> KVStore:
    """V4: ``dense`` keeps whole states; the hierarchy's policies hold CSA entries (``kv/deepseek_v4.py``). The
    hierarchy resolves with torch here (docs/deepseek_v4.md)."""
    if kv_dtype != "auto":
        raise ConfigError(f"kv_dtype {kv_dtype!r}: deepseek_v4 keeps its entries in the model dtype; "
                          "use kv_dtype='auto'")
    if index_key_dtype != "auto":
        raise ConfigError(f"index_key_dtype {index_key_dtype!r}: deepseek_v4 keeps its keys in the model dtype; "
                          "use index_key_dtype='auto'")
    if policy.reference_store:
        return V4DenseKVStore(model_cfg, device, max_query_len)
    if not model_cfg.csa_layers:
        raise ConfigError(f"kv_policy {policy.name!r}: this deepseek_v4 model has no compressed_sparse_attention "
                          "layer, so nothing is selectable; use kv_policy='dense'")
    if kv_config is None:
        raise ConfigError(f"kv_policy {policy.name!r} needs a KVConfig")
    union = model_cfg.index_topk * max_query_len
    if kv_config.hot_rows and kv_config.hot_rows < union and policy.hot_cache:
        # V4 has no verification staging: a block's whole union of selections must fit the hot cache
        raise ConfigError(f"hot_rows ({kv_config.hot_rows}) must hold a verification block's selections on "
                          f"deepseek_v4, index_topk x max_query_len = {union} (V4 has no verification staging); "
                          f"raise hot_rows or leave it 0")
    v4_config = KVConfig(
        policy=kv_config.policy, pool_bytes=kv_config.pool_bytes, hot_rows=kv_config.hot_rows or union,
        page_rows=kv_config.page_rows, reserve_bytes=kv_config.reserve_bytes,
        refill_pages_per_step=kv_config.refill_pages_per_step,
        max_query_len=-(-max_query_len // model_cfg.compress_rate_csa), draft_ring_bytes=kv_config.draft_ring_bytes,
        host_bytes=kv_config.host_bytes, prefix_reuse=kv_config.prefix_reuse,
        prefix_min_suffix_tokens=kv_config.prefix_min_suffix_tokens, prefix_model_key=kv_config.prefix_model_key,
    )
    return V4HierarchyKVStore(model_cfg, v4_config, dtype, device, max_model_len, copy_fault_hook=copy_fault_hook)



def agree_copy_completion(store: KVStore) -> bool:
    """Turn on agreed copy completion (``kv/copies.py``) in ``store``'s hierarchy: when copies and reader epochs
    complete becomes a function of the step sequence, never of device event timing, so ranks that must take the
    same KV decisions (tensor parallelism) do. Returns False for a store that copies nothing between tiers (the
    dense reference stores), where completion is already deterministic."""
    manager = store.inner if isinstance(store, V4HierarchyKVStore) else store
    if not isinstance(manager, KVManager):
        return False
    manager.copies.agreed = manager.fence.agreed = True
    return True
