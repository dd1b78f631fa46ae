"""What the KV hierarchy stores (:class:`KVLayout`) and how it is budgeted (:class:`KVConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dhisparse import defaults
from dhisparse.errors import ConfigError
from dhisparse.kv.fp8 import (
    dequantize_keys,
    dequantize_rows,
    fp8_key_bytes,
    fp8_row_bytes,
    quantize_keys,
    quantize_rows,
)
from dhisparse.kv.policies import KV_POLICIES, KVPolicy, policy_named

__all__ = ["KV_POLICIES", "ROW_FORMATS", "AdmissionError", "KVConfig", "KVLayout"]
ROW_FORMATS = ("native", "fp8")
KEY_FORMATS = ("native", "fp8")
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class AdmissionError(ConfigError):
    """A request that could never be admitted, even on an empty pool; the message says what to change."""


def _ints(values: Any, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except TypeError as exc:
        raise ConfigError(f"{name} must be a sequence of integers") from exc


@dataclass(frozen=True)
class KVLayout:
    """The KV streams of one model.

    Attributes:
        num_layers: decoder layers.
        source_of_layer: ``[num_layers]`` KV source read by each layer; sources are ``0 .. S-1`` and each is
            read by at least one layer (identity for the real families; several layers may share one).
        row_dim: values per row (one token in one source), e.g. ``kv_lora_rank + qk_rope_head_dim``.
        dtype: element type of rows and indexer keys.
        indexer_layers: layers that own an indexer and keep one key of ``index_key_dim`` values per token.
        index_key_dim: values per indexer key.
        index_groups: GLM-style sharing: each group is a layer with an indexer followed by the layers that
            reuse its top-k positions (their sources are resolved and prefetched with the first layer's).
        index_topk: the most positions one query selects per layer.
        row_format: ``native`` (rows stored as ``row_dim`` values of ``dtype``) or ``fp8`` (FlashMLA's FP8 row:
            ``latent_dim`` e4m3 values, a float32 scale per 128 of them, then the rest as bfloat16; stored as
            ``uint8`` bytes, dequantized at gather; see :mod:`dhisparse.kv.fp8`).
        latent_dim: values of the latent part of a row (``kv_lora_rank``; needed by ``fp8``).
        index_key_format: ``native`` (keys of ``dtype``) or ``fp8`` (e4m3 values and one float32 scale per key,
            ``index_key_dim + 4`` bytes; quantized when stored, dequantized when scored).
    """

    num_layers: int
    source_of_layer: tuple[int, ...]
    row_dim: int
    dtype: torch.dtype
    indexer_layers: tuple[int, ...]
    index_key_dim: int
    index_topk: int
    index_groups: tuple[tuple[int, ...], ...] = ()
    row_format: str = "native"
    latent_dim: int = 0
    index_key_format: str = "native"

    def __post_init__(self) -> None:
        object.__setattr__(self, "source_of_layer", _ints(self.source_of_layer, "source_of_layer"))
        object.__setattr__(self, "indexer_layers", _ints(self.indexer_layers, "indexer_layers"))
        object.__setattr__(self, "index_groups", tuple(_ints(g, "index_groups") for g in self.index_groups))
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if len(self.source_of_layer) != self.num_layers:
            raise ConfigError(
                f"source_of_layer has {len(self.source_of_layer)} entries for {self.num_layers} layers"
            )
        if sorted(set(self.source_of_layer)) != list(range(max(self.source_of_layer) + 1)):
            raise ConfigError("source_of_layer must use every source 0 .. S-1 (and no negative source)")
        if self.row_dim < 1 or self.index_key_dim < 1 or self.index_topk < 1:
            raise ConfigError("row_dim, index_key_dim and index_topk must all be >= 1")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.row_format not in ROW_FORMATS:
            raise ConfigError(f"row_format must be one of {ROW_FORMATS}, got {self.row_format!r}")
        if self.row_format == "fp8":
            if not 0 < self.latent_dim < self.row_dim:
                raise ConfigError(f"fp8 rows need 0 < latent_dim < row_dim ({self.row_dim}), got {self.latent_dim}")
            try:
                fp8_row_bytes(self.latent_dim, self.row_dim - self.latent_dim)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        if self.index_key_format not in KEY_FORMATS:
            raise ConfigError(f"index_key_format must be one of {KEY_FORMATS}, got {self.index_key_format!r}")
        for layer in self.indexer_layers:
            if not 0 <= layer < self.num_layers:
                raise ConfigError(f"indexer layer {layer} is outside 0 .. {self.num_layers - 1}")
        seen: set[int] = set()
        for group in self.index_groups:
            if not group:
                raise ConfigError("index_groups must not contain an empty group")
            if group[0] not in self.indexer_layers:
                raise ConfigError(f"index group {group} must start with a layer that has an indexer")
            for layer in group:
                if not 0 <= layer < self.num_layers or layer in seen:
                    raise ConfigError(f"layer {layer} of index group {group} is out of range or in two groups")
                seen.add(layer)

    @classmethod
    def from_model_config(cls, model_cfg: Any, dtype: torch.dtype, row_format: str = "native",
                          index_key_format: str = "native") -> KVLayout:
        """Layout of a ``dhisparse.model.config.ModelConfig`` (both families: one source per layer, a latent
        row of ``kv_lora_rank + qk_rope_head_dim``, keys of ``index_head_dim``, GLM groups from
        ``indexer_types``)."""
        layers = int(model_cfg.num_hidden_layers)
        return cls(
            num_layers=layers,
            source_of_layer=tuple(range(layers)),
            row_dim=int(model_cfg.row_dim),
            dtype=dtype,
            indexer_layers=tuple(model_cfg.indexer_layers),
            index_key_dim=int(model_cfg.index_head_dim),
            index_topk=int(model_cfg.index_topk),
            index_groups=tuple(g for g in model_cfg.index_groups if len(g) > 1),
            row_format=row_format,
            latent_dim=int(model_cfg.kv_lora_rank),
            index_key_format=index_key_format,
        )

    @property
    def num_sources(self) -> int:
        return max(self.source_of_layer) + 1

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element type of stored rows (arena, host store): ``dtype``, or ``uint8`` bytes for ``fp8``."""
        return torch.uint8 if self.row_format == "fp8" else self.dtype

    @property
    def storage_dim(self) -> int:
        """Elements of one stored row: ``row_dim``, or its byte count for ``fp8``."""
        if self.row_format == "fp8":
            return fp8_row_bytes(self.latent_dim, self.row_dim - self.latent_dim)
        return self.row_dim

    @property
    def row_bytes(self) -> int:
        return self.storage_dim * self.storage_dtype.itemsize

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., row_dim]`` → stored rows ``[..., storage_dim]`` of ``storage_dtype``."""
        if self.row_format == "fp8":
            return quantize_rows(rows, self.latent_dim)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., storage_dim]`` → rows ``[..., row_dim]`` of ``dtype``."""
        if self.row_format == "fp8":
            return dequantize_rows(stored, self.latent_dim, self.dtype)
        return stored

    @property
    def key_storage_dtype(self) -> torch.dtype:
        """Element type of stored indexer keys: ``dtype``, or ``uint8`` bytes for ``fp8``."""
        return torch.uint8 if self.index_key_format == "fp8" else self.dtype

    @property
    def key_storage_dim(self) -> int:
        """Elements of one stored key: ``index_key_dim``, or its byte count for ``fp8``."""
        return fp8_key_bytes(self.index_key_dim) if self.index_key_format == "fp8" else self.index_key_dim

    @property
    def index_key_bytes(self) -> int:
        return self.key_storage_dim * self.key_storage_dtype.itemsize

    def encode_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys ``[..., index_key_dim]`` → stored keys ``[..., key_storage_dim]`` of ``key_storage_dtype``."""
        if self.index_key_format == "fp8":
            return quantize_keys(keys)
        return keys if keys.dtype == self.dtype else keys.to(self.dtype)

    def decode_keys(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored keys → keys ``[..., index_key_dim]`` of ``dtype``."""
        return dequantize_keys(stored, self.dtype) if self.index_key_format == "fp8" else stored

    @property
    def staging_slots(self) -> int:
        """Verification staging slots: one per layer of the longest index group (1 without groups). A group's
        sources are resolved together, so its overflow rows are staged together; the next group reuses the
        slots once the previous group's layers have consumed them."""
        return max((len(g) for g in self.index_groups), default=1)

    def staging_slot_of_layer(self, layer: int) -> int:
        """The staging slot a layer's source uses: its index within its index group (0 outside groups)."""
        for group in self.index_groups:
            if layer in group:
                return group.index(layer)
        return 0

    def group_of_layer(self, layer: int) -> tuple[int, ...]:
        """The layers resolved together with ``layer`` when it leads a group (else just ``(layer,)``)."""
        for group in self.index_groups:
            if group[0] == layer:
                return group
        return (layer,)


@dataclass(frozen=True)
class KVConfig:
    """Budget and policy of the KV hierarchy (engine config, ``dhisparse-build`` flags, ``LLM(...)``).

    Attributes:
        policy: ``resident`` (all KV on device; admitted only if all of it fits), ``hisparse`` (hot cache of
            ``hot_rows`` per request and source, host is the source of truth, eager backup) or ``adaptive``
            (hisparse plus optional device residency of imported pages while memory is spare).
        pool_bytes: device KV budget in bytes; everything the manager keeps on device is carved from it.
        hot_rows: ``B``, hot-cache rows per request and source (ignored by ``resident``); 0 = the layout's
            ``index_topk`` (:meth:`hot_rows_for`).
        page_rows: rows per page.
        reserve_bytes: admission reserve kept free at every change.
        refill_pages_per_step: the most optional pages (of any source) refilled from host per ``poll()``.
        max_query_len: the most new tokens per request per step: 1, or ``gamma + 1`` when speculating.
        draft_ring_bytes: device bytes of one request's draft ring buffer (the drafter's visible window) when a
            drafter is configured; required memory, never lent. Verification staging is derived from the layout
            and this config (:meth:`staging_rows`) and is required memory as well.
        staging_share: fraction of its verification staging a request holds (and is charged for); 1 on a real
            engine. Only a scaled simulation (a capacity model) sets it below 1: there one simulated index group stands
            for several real ones, while a real GPU keeps one staging for all of its groups; the staging rows
            then alias each other (the simulation's rows carry no payload).
        model_state_bytes: per-request device bytes a model family keeps beside the hierarchy (deepseek_v4: the
            sliding window, compressor pending state, indexer keys and HCA entries); required memory, never lent.
        host_bytes: capacity of the host store in bytes (``0``: half of the machine's physical memory). Every
            admitted request of a host-backed policy owns host pages for its whole capacity; an admission waits
            while they are not free.
        max_batch_size: the most requests admitted at once (slots of the persistent batch state,
            ``kv/batch_state.py``; its initial size when it grows); 0 = grow from a few slots.
        max_model_len: the most tokens of one request (positions per slot of the batch state); 0 = grow on demand.
            With both set (the engine sets both) the batch state is allocated once, at start.
        prefix_reuse: keep complete pages of finished and running requests in a prefix cache and let a request
            whose prompt starts with cached pages reuse them (``kv/prefix_reuse.py``; host-store policies with
            native rows and keys and the streamed prefill; a no-op elsewhere).
        prefix_min_suffix_tokens: the fewest trailing prompt tokens a prefill computes with a hit (>= 1: the last
            token's logits; the engine sets the drafter's window when speculating, whose hidden states seed its
            ring).
        prefix_model_key: what names the model in the cache's page keys (with the layout, dtype and page size).
    """

    policy: KVPolicy | str = defaults.KV_POLICY  # a name is turned into its policy object (validated)
    pool_bytes: int = defaults.POOL_BYTES
    hot_rows: int = defaults.HOT_ROWS
    page_rows: int = defaults.PAGE_ROWS
    reserve_bytes: int = defaults.RESERVE_BYTES
    refill_pages_per_step: int = defaults.REFILL_PAGES_PER_STEP
    max_query_len: int = 1
    draft_ring_bytes: int = 0
    staging_share: float = 1.0
    model_state_bytes: int = 0
    host_bytes: int = defaults.HOST_BYTES
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_model_len: int = defaults.MAX_MODEL_LEN
    prefix_reuse: bool = defaults.PREFIX_REUSE
    prefix_min_suffix_tokens: int = 1
    prefix_model_key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", policy_named(self.policy, "kv policy", KV_POLICIES))
        if self.pool_bytes < 1:
            raise ConfigError(f"pool_bytes must be positive, got {self.pool_bytes}")
        if self.page_rows < 1:
            raise ConfigError(f"page_rows must be >= 1, got {self.page_rows}")
        if self.hot_rows < 0 or self.reserve_bytes < 0 or self.refill_pages_per_step < 0:
            raise ConfigError("hot_rows, reserve_bytes and refill_pages_per_step must be >= 0")
        if self.reserve_bytes >= self.pool_bytes:
            raise ConfigError(
                f"reserve_bytes ({self.reserve_bytes}) must be smaller than pool_bytes ({self.pool_bytes})"
            )
        if not 0.0 < self.staging_share <= 1.0:
            raise ConfigError(f"staging_share must be in (0, 1], got {self.staging_share}")
        if self.draft_ring_bytes < 0:
            raise ConfigError(f"draft_ring_bytes must be >= 0, got {self.draft_ring_bytes}")
        if self.model_state_bytes < 0:
            raise ConfigError(f"model_state_bytes must be >= 0, got {self.model_state_bytes}")
        if self.host_bytes < 0:
            raise ConfigError(f"host_bytes must be >= 0 (0: from the machine's memory), got {self.host_bytes}")
        if self.max_batch_size < 0 or self.max_model_len < 0:
            raise ConfigError(f"max_batch_size and max_model_len must be >= 0 (0: grow on demand), got "
                              f"{self.max_batch_size}, {self.max_model_len}")
        if self.max_query_len < 1:
            raise ConfigError(f"max_query_len must be >= 1, got {self.max_query_len}")
        if self.prefix_min_suffix_tokens < 1:
            raise ConfigError(f"prefix_min_suffix_tokens must be >= 1, got {self.prefix_min_suffix_tokens}")

    @property
    def kv_policy(self) -> KVPolicy:
        """The policy object that owns this config's decisions (:mod:`dhisparse.kv.policies`)."""
        assert isinstance(self.policy, KVPolicy)  # made one at construction
        return self.policy

    @property
    def uses_host(self) -> bool:
        """Whether history lives in the host store (every policy but ``resident``)."""
        return self.kv_policy.uses_host

    def hot_rows_for(self, layout: KVLayout) -> int:
        """``B`` for ``layout``: ``hot_rows``, or ``index_topk`` when it is 0; 0 without a hot cache."""
        if not self.kv_policy.hot_cache:
            return 0
        return self.hot_rows or layout.index_topk

    def staging_rows(self, layout: KVLayout) -> int:
        """Verification staging rows per staging slot (one slot per source of the longest index group): the
        most rows of one step's union of ``max_query_len`` selections that the hot cache cannot take,
        ``max(0, max_query_len * index_topk - hot_rows)`` (0 without speculation or under ``resident``)."""
        if not self.kv_policy.hot_cache or self.max_query_len == 1:
            return 0
        return max(0, self.max_query_len * layout.index_topk - self.hot_rows_for(layout))

    def validate_for(self, layout: KVLayout) -> None:
        """Refuse combinations with ``layout`` that cannot work (the message says what to change)."""
        if not self.kv_policy.hot_cache:
            return
        if self.hot_rows_for(layout) < layout.index_topk:
            raise ConfigError(
                f"hot_rows (B={self.hot_rows}) must hold one query's selection, index_topk "
                f"({layout.index_topk}); raise hot_rows to >= {layout.index_topk}"
            )
