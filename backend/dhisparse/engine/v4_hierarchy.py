"""DeepSeek-V4 over the KV hierarchy: CSA's compressed entries are the sparse, selectable rows.

What goes where:

* **CSA compressed entries** (one ``head_dim`` row per ``compress_rate_csa`` tokens per CSA source) live in the
  hierarchy (:class:`dhisparse.kv.KVManager`): host store, optional pages (adaptive), hot cache, tail, and
  every selection goes through the three-step resolver. One KV source per CSA layer that owns a compressor; a
  layer that reuses another layer's compressed KV (``kv_source_layers``) maps to that layer's source, writes
  nothing, and — when it also reuses the top-k — reuses the source's resolved location vector (same positions
  tensor ⇒ no second resolution, no second copy).
* **Required tail** (:class:`V4RequestKV`, device, never lent): every layer's sliding-window rows, the
  compressors' pending projections, the CSA indexer keys and HCA's entries (small: one per 128 tokens). Their
  bytes are reserved per request (``extra_required_bytes``), bounded by ``max_model_len``.

Entry ``w`` of a CSA source is stored at token position ``w·rate + rate − 1`` (the token that completes its
window), so the hierarchy's per-token positions, pages and tail work unchanged; the other ``rate − 1`` positions
of each window hold zero rows that are never selected. That costs ``rate``× the host and optional-page memory
of a dense entry index (4× for V4's CSA) — the simple, exact first version; see ``docs/deepseek_v4.md``.
"""

from __future__ import annotations

import torch

from dhisparse.kv import KVConfig, KVLayout, KVManager
from dhisparse.kv.step import StepKV
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import Key, V4RequestKV, V4StepKV, state_keys


def csa_layout(cfg: DeepseekV4Config, dtype: torch.dtype) -> tuple[KVLayout, dict[int, int]]:
    """The hierarchy's layout for ``cfg``'s CSA layers and the map V4 layer → hierarchy layer."""
    csa = [i for i, t in enumerate(cfg.layer_types) if t == CSA]
    owners = [i for i in csa if cfg.source_of(i) == i]
    source = {owner: s for s, owner in enumerate(owners)}
    layout = KVLayout(num_layers=len(csa), source_of_layer=tuple(source[cfg.source_of(i)] for i in csa),
                      row_dim=cfg.head_dim, dtype=dtype, indexer_layers=(), index_key_dim=cfg.index_head_dim,
                      index_topk=cfg.index_topk)
    return layout, {layer: k for k, layer in enumerate(csa)}


def tail_state_bytes(cfg: DeepseekV4Config, dtype: torch.dtype, max_model_len: int) -> int:
    """Device bytes of one request's required V4 state at ``max_model_len`` tokens: window rows, compressor
    pending projections, CSA indexer keys and HCA entries (CSA KV entries excluded: they are in the hierarchy)."""
    item = dtype.itemsize
    total = cfg.num_hidden_layers * (cfg.sliding_window - 1) * cfg.head_dim * item
    for (layer, kind), (rate, pending, width) in state_keys(cfg).items():
        total += 2 * pending * width * item
        if kind == "index":
            total += (max_model_len // rate) * cfg.index_head_dim * item
        elif cfg.layer_types[layer] != CSA:
            total += (max_model_len // rate) * cfg.head_dim * item
    return total


class V4HierarchyStepKV(V4StepKV):
    """A step whose CSA entries are written to and gathered from the hierarchy's step."""

    def __init__(self, stores: list[V4RequestKV], query_len: int, device: torch.device, inner: StepKV,
                 kv_layer: dict[int, int]) -> None:
        super().__init__(stores, query_len, device)
        self.inner, self.kv_layer = inner, kv_layer

    def _in_hierarchy(self, key: Key) -> bool:
        return key[1] == "kv" and key[0] in self.kv_layer

    def add_entries(self, key: Key, first: torch.Tensor, counts: torch.Tensor, entries: torch.Tensor) -> None:
        if not self._in_hierarchy(key):
            super().add_entries(key, first, counts, entries)
            return
        layer = key[0]
        rate = self.stores[0].cfg.compress_rate(layer)
        b, q = len(self.stores), self.query_len
        rows = entries.new_zeros(b, q, entries.shape[-1])
        n = entries.shape[1]
        if n:
            j = torch.arange(n, device=self.device)
            offset = (first.unsqueeze(1) + j) * rate + rate - 1 - self.starts.unsqueeze(1)  # [B, n]
            valid = j < counts.unsqueeze(1)
            b_idx = torch.arange(b, device=self.device).unsqueeze(1).expand(-1, n)
            rows[b_idx[valid], offset[valid]] = entries[valid]
        self.inner.write(self.kv_layer[layer], rows, None)

    def gather_entries(self, layer: int, key: Key, rate: int, selection: torch.Tensor) -> torch.Tensor:
        if not self._in_hierarchy(key):
            return super().gather_entries(layer, key, rate, selection)
        positions = torch.where(selection >= 0, selection * rate + rate - 1, torch.full_like(selection, -1))
        return self.inner.gather(self.kv_layer[layer], positions)


class V4HierarchyKVManager:
    """Manager interface of ``dhisparse.kv.KVManager`` for a V4 model (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config, kv_config: KVConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        self.cfg, self.device = cfg, device
        self.layout, self.kv_layer = csa_layout(cfg, dtype)
        self.state_bytes = tail_state_bytes(cfg, dtype, max_model_len)
        kv_config = KVConfig(**{**kv_config.__dict__,
                                "extra_required_bytes": kv_config.extra_required_bytes + self.state_bytes})
        self.inner = KVManager(self.layout, kv_config, device)
        self.policy = kv_config.policy
        self.states: dict[str, V4RequestKV] = {}
        self.step: V4HierarchyStepKV | None = None
        self._step_ids: list[str] = []

    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        return self.inner.never_admissible(prompt_len, max_new_tokens)

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        return self.inner.try_admit(request_id, prompt_len, max_new_tokens)

    def import_prompt(self, request_id: str, rows: V4RequestKV, index_keys: dict[int, torch.Tensor]) -> None:
        """Move the prefilled state's CSA entries into the hierarchy (at their completing positions); keep the
        rest as the request's required tail."""
        state = rows
        if not isinstance(state, V4RequestKV):
            raise TypeError("a deepseek_v4 request imports the V4RequestKV its prefill produced")
        t = state.length
        sources = torch.zeros(self.layout.num_sources, t, self.cfg.head_dim, dtype=self.layout.dtype,
                              device=self.device)
        for layer, k in self.kv_layer.items():
            if self.cfg.source_of(layer) != layer:
                continue
            rate = self.cfg.compress_rate(layer)
            n = t // rate
            sources[self.layout.source_of_layer[k], rate - 1:n * rate:rate] = state.entries.pop((layer, "kv"))[:n]
        self.inner.import_prompt(request_id, sources, {})
        self.states[request_id] = state

    def begin_step(self, request_ids: list[str], query_len: int) -> V4HierarchyStepKV:
        inner = self.inner.begin_step(request_ids, query_len)
        self.step = V4HierarchyStepKV([self.states[r] for r in request_ids], query_len, self.device, inner,
                                      self.kv_layer)
        self._step_ids = list(request_ids)
        return self.step

    def end_step(self, accepted: dict[str, int]) -> None:
        assert self.step is not None
        self.step.commit([accepted.get(r, self.step.query_len) for r in self._step_ids])
        self.inner.end_step(accepted)
        self.step = None

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.inner.release(request_id)

    def poll(self) -> None:
        self.inner.poll()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def request_stats(self, request_id: str) -> dict[str, float]:
        out = dict(self.inner.request_stats(request_id))
        state = self.states.get(request_id)
        if state is not None:
            out.update({f"kv_{k}_bytes": float(v) for k, v in state.nbytes().items()})
        return out

    def check_invariants(self) -> None:
        self.inner.check_invariants()
