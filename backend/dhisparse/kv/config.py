"""What the KV hierarchy stores (:class:`KVLayout`) and how it is budgeted (:class:`KVConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dhisparse.errors import ConfigError
from dhisparse.kv.fp8 import dequantize_rows, fp8_row_bytes, quantize_rows

KV_POLICIES = ("resident", "hisparse", "adaptive")
ROW_FORMATS = ("native", "fp8")
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
    def from_model_config(cls, model_cfg: Any, dtype: torch.dtype, row_format: str = "native") -> KVLayout:
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
        return rows.to(self.dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., storage_dim]`` → rows ``[..., row_dim]`` of ``dtype``."""
        if self.row_format == "fp8":
            return dequantize_rows(stored, self.latent_dim, self.dtype)
        return stored

    @property
    def index_key_bytes(self) -> int:
        return self.index_key_dim * self.dtype.itemsize

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
        hot_rows: ``B``, hot-cache rows per request and source (ignored by ``resident``).
        page_rows: rows per page.
        reserve_bytes: admission reserve kept free at every change.
        refill_pages_per_step: the most optional pages (of any source) refilled from host per ``poll()``.
        max_query_len: the most new tokens per request per step: 1, or ``gamma + 1`` when speculating.
        extra_required_bytes: further device bytes every request holds while admitted and never lends — the
            speculative state (draft ring buffer and verification staging) when a drafter is configured.
        host_bytes: capacity of the host store in bytes (``0``: half of the machine's physical memory). Every
            admitted request of a host-backed policy owns host pages for its whole capacity; an admission waits
            while they are not free.
    """

    policy: str = "adaptive"
    pool_bytes: int = 1 << 30
    hot_rows: int = 2048
    page_rows: int = 64
    reserve_bytes: int = 0
    refill_pages_per_step: int = 8
    max_query_len: int = 1
    extra_required_bytes: int = 0
    host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.policy not in KV_POLICIES:
            raise ConfigError(f"kv policy must be one of {KV_POLICIES}, got {self.policy!r}")
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
        if self.extra_required_bytes < 0:
            raise ConfigError(f"extra_required_bytes must be >= 0, got {self.extra_required_bytes}")
        if self.host_bytes < 0:
            raise ConfigError(f"host_bytes must be >= 0 (0: from the machine's memory), got {self.host_bytes}")
        if self.max_query_len < 1:
            raise ConfigError(f"max_query_len must be >= 1, got {self.max_query_len}")

    @property
    def uses_host(self) -> bool:
        """Whether history lives in the host store (every policy but ``resident``)."""
        return self.policy != "resident"

    def validate_for(self, layout: KVLayout) -> None:
        """Refuse combinations with ``layout`` that cannot work (the message says what to change)."""
        if not self.uses_host:
            return
        need = self.max_query_len * layout.index_topk
        if self.hot_rows < need:
            raise ConfigError(
                f"hot_rows (B={self.hot_rows}) must hold one step's selection: max_query_len "
                f"({self.max_query_len}) x index_topk ({layout.index_topk}) = {need}; raise hot_rows to >= {need}"
            )
