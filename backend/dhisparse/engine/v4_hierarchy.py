"""DeepSeek-V4 over the KV hierarchy: CSA's compressed entries are the sparse, selectable rows.

What goes where:

* **CSA compressed entries** (one ``head_dim`` row per ``compress_rate_csa`` tokens per CSA source) live in the
  hierarchy (:class:`dhisparse.kv.KVManager`): host store, optional pages (adaptive), hot cache, tail, and
  every selection goes through the three-step resolver. One KV source per CSA layer that owns a compressor; a
  layer that reuses another layer's compressed KV (``kv_source_layers``) maps to that layer's source, writes
  nothing, and — when it also reuses the top-k — reuses the source's resolved location vector (same positions
  tensor ⇒ no second resolution, no second copy).
* **Required tail** (a slot of a :class:`V4StatePool`, device, never lent): every layer's sliding-window rows,
  the compressors' pending projections, the CSA indexer keys and HCA's entries (small: one per 128 tokens).
  Their bytes are reserved per request (``KVConfig.model_state_bytes``), bounded by ``max_model_len``; the
  running requests' tails are batched slot-indexed tensors, updated in place by each step.

Positions: the hierarchy of a request counts compressed entries, not tokens — entry ``w`` of a CSA source is
row ``w + 1`` (row 0 is a zero row, so a prompt shorter than one window still imports one row). Each decode
step opens a hierarchy step of one row per request: the compressor's entry when the new token completes a
window (accepted), else a zero row that ``end_step`` rolls back (accepted 0) — the same rollback speculative
verification uses. So host store, pages, hot cache and tail hold exactly one row per compressed entry.
A verification step of ``Q`` tokens opens ``ceil(Q / rate)`` rows per request (at most that many windows
complete) and keeps those completed by the accepted tokens.
"""

from __future__ import annotations

import torch

from dhisparse.kv import KVConfig, KVLayout, KVManager
from dhisparse.kv.step import StepKV
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import Key, V4RequestKV, state_keys
from dhisparse.model.deepseek_v4.state_pool import V4PooledStepKV, V4StatePool


def csa_layout(cfg: DeepseekV4Config, dtype: torch.dtype) -> tuple[KVLayout, dict[int, int]]:
    """The hierarchy's layout for ``cfg``'s CSA layers and the map V4 layer → hierarchy layer."""
    csa = [i for i, t in enumerate(cfg.layer_types) if t == CSA]
    owners = [i for i in csa if cfg.source_of(i) == i]
    source = {owner: s for s, owner in enumerate(owners)}
    layout = KVLayout(num_layers=len(csa), source_of_layer=tuple(source[cfg.source_of(i)] for i in csa),
                      row_dim=cfg.head_dim, dtype=dtype, indexer_layers=(), index_key_dim=cfg.index_head_dim,
                      index_topk=cfg.index_topk)
    return layout, {layer: k for k, layer in enumerate(csa)}


def tail_state_bytes(cfg: DeepseekV4Config, max_model_len: int, *, row_bytes: int, index_key_bytes: int,
                     pending_value_bytes: int) -> int:
    """Device bytes of one request's required V4 state at ``max_model_len`` tokens: window rows (``W - 1`` per
    layer), compressor pending projections, CSA indexer keys and HCA entries (CSA KV entries excluded: they are
    in the hierarchy). Byte sizes are arguments so a caller can price the FP8 serving layout."""
    total = cfg.num_hidden_layers * (cfg.sliding_window - 1) * row_bytes
    for (layer, kind), (rate, pending, width) in state_keys(cfg).items():
        total += 2 * pending * width * pending_value_bytes
        if kind == "index":
            total += (max_model_len // rate) * index_key_bytes
        elif cfg.layer_types[layer] != CSA:
            total += (max_model_len // rate) * row_bytes
    return total


def entry_rows(prompt_len: int, max_new_tokens: int, rate: int) -> tuple[int, int]:
    """The hierarchy's ``(prompt rows, max new rows)`` for a request of ``prompt_len`` + ``max_new_tokens``
    tokens: entries complete in the prompt + the zero row 0; at most ``ceil(max_new / rate)`` more entries plus
    the provisional row of the last step."""
    return prompt_len // rate + 1, -(-max_new_tokens // rate) + 1


class V4HierarchyStepKV(V4PooledStepKV):
    """A step whose CSA entries are written to and gathered from the hierarchy's step."""

    def __init__(self, pool: V4StatePool, slots: list[int], query_len: int, device: torch.device, inner: StepKV,
                 kv_layer: dict[int, int]) -> None:
        super().__init__(pool, slots, query_len, device)
        self.inner, self.kv_layer = inner, kv_layer

    def _in_hierarchy(self, key: Key) -> bool:
        return key[1] == "kv" and key[0] in self.kv_layer

    def add_entries(self, key: Key, first: torch.Tensor, counts: torch.Tensor, entries: torch.Tensor) -> None:
        if not self._in_hierarchy(key):
            super().add_entries(key, first, counts, entries)
            return
        b, m, n = self.batch, self.inner.query_len, entries.shape[1]
        if n > m:
            raise RuntimeError(f"{n} entries completed in one step; the hierarchy step holds {m}")
        rows = entries.new_zeros(b, m, entries.shape[-1])
        valid = torch.arange(n, device=self.device) < counts.unsqueeze(1)  # [B, n]
        rows[:, :n] = entries.masked_fill(~valid.unsqueeze(-1), 0)
        self.inner.write(self.kv_layer[key[0]], rows, None)

    def gather_entries(self, layer: int, key: Key, rate: int, selection: torch.Tensor) -> torch.Tensor:
        if not self._in_hierarchy(key):
            return super().gather_entries(layer, key, rate, selection)
        positions = torch.where(selection >= 0, selection + 1, torch.full_like(selection, -1))
        return self.inner.gather(self.kv_layer[layer], positions)


class V4HierarchyKVManager:
    """Manager interface of ``dhisparse.kv.KVManager`` for a V4 model (see the module docstring); admission
    and budgets are the inner manager's, in entry rows."""

    def __init__(self, cfg: DeepseekV4Config, kv_config: KVConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        self.cfg, self.device = cfg, device
        self.rate = cfg.compress_rate_csa
        self.layout, self.kv_layer = csa_layout(cfg, dtype)
        item = dtype.itemsize
        self.state_bytes = tail_state_bytes(cfg, max_model_len, row_bytes=cfg.head_dim * item,
                                            index_key_bytes=cfg.index_head_dim * item, pending_value_bytes=item)
        kv_config = KVConfig(**{**kv_config.__dict__,
                                "model_state_bytes": kv_config.model_state_bytes + self.state_bytes})
        self.inner = KVManager(self.layout, kv_config, device)
        self.policy = kv_config.policy
        in_hierarchy = {(layer, "kv") for layer in self.kv_layer}
        self.pool = V4StatePool(cfg, dtype, device, entry_keys={k for k in state_keys(cfg) if k not in in_hierarchy})
        self.slots: dict[str, int] = {}
        self.step: V4HierarchyStepKV | None = None
        self._step_ids: list[str] = []

    def required_bytes(self, prompt_len: int, max_new_tokens: int) -> int:
        """Device bytes a request reserves at admission (entry rows in the hierarchy + the V4 tail)."""
        return self.inner.required_bytes(*entry_rows(prompt_len, max_new_tokens, self.rate))

    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        if self.inner.never_admissible(*entry_rows(prompt_len, max_new_tokens, self.rate)) is None:
            return None
        cfg = self.inner.config
        return (f"the request needs {self.required_bytes(prompt_len, max_new_tokens)} device bytes ({cfg.policy}: "
                f"prompt {prompt_len} + max_new_tokens {max_new_tokens} tokens, of which {self.state_bytes} are the "
                f"deepseek_v4 window/compressor/indexer-key/HCA state bounded by max_model_len) but pool_bytes "
                f"{cfg.pool_bytes} - reserve_bytes {cfg.reserve_bytes} leaves {cfg.pool_bytes - cfg.reserve_bytes}; "
                "raise pool_bytes, or lower reserve_bytes, max_new_tokens or max_model_len")

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        return self.inner.try_admit(request_id, *entry_rows(prompt_len, max_new_tokens, self.rate))

    def import_prompt(self, request_id: str, rows: V4RequestKV, index_keys: dict[int, torch.Tensor]) -> None:
        """Move the prefilled state's CSA entries into the hierarchy (rows ``1 … E``); keep the rest of the
        state as the request's required tail."""
        state = rows
        if not isinstance(state, V4RequestKV):
            raise TypeError("a deepseek_v4 request imports the V4RequestKV its prefill produced")
        n = state.length // self.rate
        sources = torch.zeros(self.layout.num_sources, n + 1, self.cfg.head_dim, dtype=self.layout.dtype,
                              device=self.device)
        for layer, k in self.kv_layer.items():
            if self.cfg.source_of(layer) == layer:
                sources[self.layout.source_of_layer[k], 1:] = state.entries.pop((layer, "kv"))[:n]
        self.inner.import_prompt(request_id, sources, {})
        self.slots[request_id] = self.pool.load(state)

    def begin_step(self, request_ids: list[str], query_len: int) -> V4HierarchyStepKV:
        inner = self.inner.begin_step(request_ids, -(-query_len // self.rate))  # entries one step may complete
        self.step = V4HierarchyStepKV(self.pool, [self.slots[r] for r in request_ids], query_len, self.device,
                                      inner, self.kv_layer)
        self._step_ids = list(request_ids)
        return self.step

    def end_step(self, accepted: dict[str, int]) -> None:
        """Commit the tokens; the hierarchy keeps its provisional row where a window completed."""
        step = self.step
        assert step is not None
        before = torch.div(self.pool.length[step.slot], self.rate, rounding_mode="floor")
        step.commit([accepted.get(r, step.query_len) for r in self._step_ids])
        kept = torch.div(self.pool.length[step.slot], self.rate, rounding_mode="floor") - before
        self.inner.end_step(dict(zip(self._step_ids, kept.tolist(), strict=True)))
        self.step = None

    def abort_step(self) -> None:
        """Roll the hierarchy's open step back after a fault. The V4 window/compressor state of the step's
        requests is not restored: ``owners_of`` names every request of an open step, so the engine ends them all."""
        if self.step is not None:
            self.inner.abort_step()
            self.step = None

    def owners_of(self, ticket: object) -> list[str]:
        return list(self._step_ids) if self.step is not None else self.inner.owners_of(ticket)

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.pool.release(slot)
        self.inner.release(request_id)

    def poll(self) -> None:
        self.inner.poll()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def request_stats(self, request_id: str) -> dict[str, float]:
        out = dict(self.inner.request_stats(request_id))
        slot = self.slots.get(request_id)
        if slot is not None:
            out.update({f"kv_{k}_bytes": float(v) for k, v in self.pool.nbytes(slot).items()})
        return out

    def check_invariants(self) -> None:
        self.inner.check_invariants()
