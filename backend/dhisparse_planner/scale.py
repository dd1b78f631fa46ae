"""The scale model: how a GPU-scale configuration is mapped onto a KVManager small enough to run on a CPU.

Two reductions, both exact in the byte accounting's dominant terms (see docs/planner.md):

- **Sources**: only ``index_groups`` index groups (``S_s = index_groups * index_group_size`` layers) are
  simulated; each stands for ``S_r / S_s`` real layers with the same selection statistics.
- **Tokens**: positions, page size, ``index_topk``, ``B``, prompt and output lengths are divided by
  ``token_scale = g``. One simulated row stands for ``g`` real rows, one simulated decode step for ``g`` real
  decode steps (the step's shares of direct / hot / host rows apply to each of those ``g`` steps).

Rows keep their real byte size (``row_bytes``, stored as float32 ``row_bytes / 4`` values), so page bytes and the
LRU metadata (24 B per slot) scale by the same factor ``F = (S_r / S_s) * g``; the indexer key width is chosen
so that key bytes scale by ``F`` too (rounded to whole float32 values). Page tables (8 B per page and source)
keep their page *count*, so ``F`` over-counts them ``g``-fold (+4.8% of a ``hisparse`` request's required
bytes at 32K/8K on DeepSeek-V3.2 with ``g = 64``, +1.2% with ``g = 16``), and the tail ring has
``ceil((P_s - 1 + q) / P_s) + 1`` pages instead of ``ceil((P_r - 1 + q) / P_r) + 1``;
:func:`footprint_error` reports the resulting relative error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dhisparse.kv import KVConfig, KVLayout
from dhisparse.kv.footprint import request_footprint
from dhisparse.kv.host_memory import memory_limit_bytes
from dhisparse_planner.specs import ModelSpec

DTYPE = torch.float32


@dataclass(frozen=True)
class ScaleSpec:
    """Attributes:
        token_scale: ``g``; must divide page_rows, index_topk and hot_rows.
        index_groups: index groups simulated (each of ``index_group_size`` layers).
    """

    token_scale: int = 1
    index_groups: int = 1

    def __post_init__(self) -> None:
        if self.token_scale < 1 or self.index_groups < 1:
            raise ValueError("token_scale and index_groups must be >= 1")


@dataclass(frozen=True)
class ScaledKV:
    """The simulated KV configuration and the factors that map it back to the real GPU.

    Attributes:
        layout / config: what the real :class:`KVManager` is built with.
        real_layout / real_config: the unscaled layout and budget (used for footprints and reporting only).
        byte_factor: real bytes per simulated byte (``F``), also real rows per simulated row.
        source_factor: real layers per simulated layer (``S_r / S_s``).
        token_scale: ``g``.
    """

    layout: KVLayout
    config: KVConfig
    real_layout: KVLayout
    real_config: KVConfig
    byte_factor: float
    source_factor: float
    token_scale: int

    def sim_tokens(self, real_tokens: int) -> int:
        """Simulated length of ``real_tokens`` tokens (at least 1)."""
        return max(1, round(real_tokens / self.token_scale))

    def sim_output_tokens(self, real_tokens: int) -> int:
        """Simulated output budget: the prefill token plus ``ceil((out - 1) / g)`` decode steps of ``g``."""
        return 1 + -(-(real_tokens - 1) // self.token_scale)


def _layout(num_layers: int, group: int, row_bytes: int, key_dim: int, topk: int) -> KVLayout:
    leaders = tuple(range(0, num_layers, group))
    groups = tuple(tuple(range(i, min(i + group, num_layers))) for i in leaders) if group > 1 else ()
    return KVLayout(num_layers=num_layers, source_of_layer=tuple(range(num_layers)), row_dim=row_bytes // 4,
                    dtype=DTYPE, indexer_layers=leaders, index_key_dim=key_dim, index_topk=topk,
                    index_groups=groups)


def byte_factor(model: ModelSpec, scale: ScaleSpec) -> float:
    """``F``: real bytes (and rows) per simulated one, ``(S_r / S_s) * g`` (module docstring)."""
    return model.num_layers / min(model.num_layers, scale.index_groups * model.index_group_size) * scale.token_scale


UNBOUNDED_HOST_BYTES = 1 << 60  # a host store no workload fills (never the machine the planner runs on)


def build_scaled_kv(model: ModelSpec, scale: ScaleSpec, policy: str, pool_bytes: float, hot_rows: int,
                    page_rows: int, reserve_bytes: float, refill_pages_per_step: int,
                    max_query_len: int, draft_ring_bytes: float = 0.0,
                    host_bytes: float = UNBOUNDED_HOST_BYTES) -> ScaledKV:
    """Build the simulated and real KV layouts/configs (all byte and row arguments are *real* values).

    ``host_bytes`` is the simulated machine's host store per rank (``HardwareSpec.host_bytes_per_gpu``); it is
    scaled like every other byte (the simulated store holds ``host_bytes / F``), never taken from the machine the
    planner runs on.

    ``hot_rows`` 0 means ``index_topk``. Speculative state: the draft ring (``draft_ring_bytes`` per request) is
    charged ``1 / F`` in the simulation; verification staging is one staging for all of a GPU's index groups, so
    the simulated group, which stands for ``S_r / S_s`` real ones, charges ``S_s / S_r`` of its staging
    (``KVConfig.staging_share``)."""
    g = scale.token_scale
    if model.row_bytes % 4 or model.index_key_bytes % 4:
        raise ValueError("row_bytes and index_key_bytes must be multiples of 4 (stored as float32)")
    for name, value in (("page_rows", page_rows), ("index_topk", model.index_topk), ("hot_rows", hot_rows)):
        if value % g:
            raise ValueError(f"token_scale {g} must divide {name} ({value})")
    sim_layers = min(model.num_layers, scale.index_groups * model.index_group_size)
    source_factor = model.num_layers / sim_layers
    byte_factor = source_factor * g
    sim_indexers = -(-sim_layers // model.index_group_size)
    real_layout = _layout(model.num_layers, model.index_group_size, model.row_bytes, model.index_key_bytes // 4,
                          model.index_topk)
    # Keys live in arena pages (kv/index_keys.py), so what scales is their pages: the real GPU holds n_r pages of
    # kpp_r keys per kpp_r positions, the simulation n_s pages of kpp_s keys per kpp_s simulated positions (g real
    # ones each, F real bytes per byte of its g-times smaller pages); equal key bytes per real position give
    # kpp_s = n_s * source_factor * kpp_r / (g * n_r). The simulated key width is chosen for that count (a width
    # scaled by bytes alone could lose a key per page to the floor: up to 20 % at g = 64); the simulation's keys
    # carry no payload, only their pages count.
    real_page = page_rows * model.row_bytes
    real_per_page = real_page // model.index_key_bytes
    sim_page = (page_rows // g) * model.row_bytes
    target = sim_indexers * source_factor * real_per_page / (g * model.num_indexers)
    width = sim_page / (4 * target)  # in float32 values: the whole width nearby whose page count is nearest
    widths = range(max(1, math.floor(width) - 2), math.ceil(width) + 3)
    key_dim = min(widths, key=lambda w: (abs(sim_page // (4 * w) - target), abs(w - width)))
    layout = _layout(sim_layers, model.index_group_size, model.row_bytes, key_dim, model.index_topk // g)
    real_config = KVConfig(policy=policy, pool_bytes=int(pool_bytes), hot_rows=hot_rows, page_rows=page_rows,
                           reserve_bytes=int(reserve_bytes), refill_pages_per_step=refill_pages_per_step,
                           max_query_len=max_query_len, draft_ring_bytes=int(draft_ring_bytes),
                           host_bytes=int(host_bytes))
    # a simulated page is S_r / S_s real pages; a simulated step is g real steps
    refill = 0 if refill_pages_per_step == 0 else max(1, round(refill_pages_per_step * g / source_factor))
    config = KVConfig(policy=policy, pool_bytes=int(pool_bytes / byte_factor), hot_rows=hot_rows // g,
                      page_rows=page_rows // g, reserve_bytes=int(reserve_bytes / byte_factor),
                      refill_pages_per_step=refill, max_query_len=max_query_len,
                      draft_ring_bytes=round(draft_ring_bytes / byte_factor), staging_share=1.0 / source_factor,
                      host_bytes=max(1, int(host_bytes / byte_factor)))
    config.validate_for(layout)
    real_config.validate_for(real_layout)
    return ScaledKV(layout, config, real_layout, real_config, byte_factor, source_factor, g)


def check_simulated_host(kvs: ScaledKV, limit: int | None = None) -> None:
    """Refuse a simulation whose host store this process could not hold, naming the planner's own fields.

    The simulated host store is a real ``HostStore`` of ``host_bytes / F`` bytes (memory is taken only for the pages
    the run hands out), and the runtime refuses a store larger than this process may use (physical memory or its
    cgroup limit: ``dhisparse.kv.host_memory``). The planner does not shrink the store to fit (results would then
    depend on the machine it runs on); it raises ``ValueError`` before the runtime's ``ConfigError`` would, saying
    which of its figures to change. ``limit`` (bytes) defaults to ``memory_limit_bytes()``."""
    limit = memory_limit_bytes() if limit is None else limit
    simulated = kvs.config.host_bytes
    if simulated > limit:
        raise ValueError(f"the simulated host store holds {simulated} bytes (HardwareSpec.host_bytes_per_gpu "
                         f"{kvs.real_config.host_bytes} / byte factor {kvs.byte_factor:.1f}), more than this process "
                         f"may use ({limit} bytes); raise ScaleSpec.token_scale (now {kvs.token_scale}) or lower "
                         "host_bytes_per_gpu")


def footprint_error(kv: ScaledKV, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    """Required bytes of one request: real (analytic) vs simulated x ``F``; ``relative_error`` = sim/real - 1."""
    real = request_footprint(kv.real_layout, kv.real_config, prompt_tokens, output_tokens).required_bytes
    sim = request_footprint(kv.layout, kv.config, kv.sim_tokens(prompt_tokens),
                            kv.sim_output_tokens(output_tokens)).required_bytes * kv.byte_factor
    return {"real_required_bytes": float(real), "scaled_required_bytes": float(sim),
            "relative_error": sim / real - 1.0}
