"""KV stores for DeepSeek-V4 models: the reference (:class:`V4DenseKVStore`, every request's state whole) and the
hierarchy (:class:`V4HierarchyKVStore`), where CSA's compressed entries are the sparse, selectable rows.

The reference (``dense`` policy): every request's V4 state (sliding-window rows, compressor pending state,
compressed entries and indexer keys) held whole on the device, no budget, no tiers; the states of running requests
are slots of one :class:`V4StatePool` (batched, updated in place).

The hierarchy (``resident``, ``hisparse``, ``adaptive``):

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

Prefix reuse (``hisparse``, ``adaptive``; ``kv/prefix_v4.py``): a hit restores every compressed entry of its pages
(:meth:`V4HierarchyKVStore.prefill_kv`); the prefill recomputes windows and pending projections from
``model.deepseek_v4.prefix.restart_position``. A released request's slot stays until the manager frees its memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dhisparse.host_values import HostSync
from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.copies import CopyError
from dhisparse.kv.manager import KVManager
from dhisparse.kv.policies import DENSE, KVPolicy
from dhisparse.kv.prefix_v4 import V4PrefixRows
from dhisparse.kv.step import StepKV
from dhisparse.kv.store import HostRowsTarget, KVMemory, PromptRows
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import Key, V4RequestKV, state_keys
from dhisparse.model.deepseek_v4.prefix import restored_state
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


class V4DenseStepKV(V4PooledStepKV):
    """A reference step: the pool's state is the whole history; nothing is deferred, so the report is empty."""

    def report(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64, device=self.device)


class V4HierarchyStepKV(V4PooledStepKV):
    """A step whose CSA entries are written to and gathered from the hierarchy's step."""

    def __init__(self, pool: V4StatePool, slots: list[int], query_len: int, device: torch.device, inner: StepKV,
                 kv_layer: dict[int, int]) -> None:
        super().__init__(pool, slots, query_len, device)
        self.inner, self.kv_layer = inner, kv_layer

    def report(self) -> torch.Tensor:
        """The hierarchy step's report (its checks and resolution counts)."""
        return self.inner.report()

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


def _v4_state(rows: PromptRows | None) -> V4RequestKV:
    if not isinstance(rows, V4RequestKV):
        raise TypeError("a deepseek_v4 request imports the V4RequestKV its prefill produced")
    return rows


class V4DenseKVStore:
    """The reference store for V4: admits everything, keeps each request's whole state (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config, device: torch.device, max_query_len: int = 1) -> None:
        self.cfg, self.device, self.max_query_len = cfg, device, max_query_len
        self.pool: V4StatePool | None = None  # created at the first import (the model's dtype)
        self.slots: dict[str, int] = {}
        self.sync = HostSync()
        self._step: tuple[list[str], V4DenseStepKV] | None = None

    @property
    def policy(self) -> KVPolicy:
        return DENSE

    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        return None

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        return True

    def set_token_ids(self, request_id: str, token_ids: Sequence[int], reuse: bool = True) -> None:
        return None  # the reference store keeps nothing beyond a request: no prefix cache

    def cached_prefix_tokens(self, request_id: str) -> int:
        return 0

    def prefill_kv(self, request_id: str, chunk_tokens: int) -> None:
        return None

    def import_target(self, request_id: str) -> HostRowsTarget | None:
        return None

    def import_prompt(self, request_id: str, rows: PromptRows | None,
                      index_keys: Mapping[int, torch.Tensor] | None) -> None:
        state = _v4_state(rows)
        if self.pool is None:
            self.pool = V4StatePool(self.cfg, state.window[0].dtype, self.device)
        self.slots[request_id] = self.pool.load(state)

    def begin_step(self, request_ids: Sequence[str], query_len: int) -> V4DenseStepKV:
        assert self.pool is not None
        step = V4DenseStepKV(self.pool, [self.slots[r] for r in request_ids], query_len, self.device)
        self._step = (list(request_ids), step)
        return step

    def end_step(self, accepted: Mapping[str, int], report: Sequence[int] | None = None) -> None:
        assert self._step is not None
        request_ids, step = self._step
        step.commit([accepted.get(r, step.query_len) for r in request_ids])
        self._step = None

    def abort_step(self) -> None:
        """Drop the open step after a fault; the engine ends every request of it (their state is not restored)."""
        self._step = None

    def owners_of(self, failure: CopyError) -> list[str]:
        return []  # the reference store issues no copies

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None and self.pool is not None:
            self.pool.release(slot)

    def poll(self) -> None:
        return None

    def read(self, *tensors: torch.Tensor) -> list[list[int]]:
        return self.sync.read(*tensors)

    def memory(self) -> KVMemory:
        return KVMemory()

    def stats(self) -> dict[str, float]:
        return {"kv_requests": float(len(self.slots)), "kv_host_syncs": float(self.sync.reads),
                "kv_prefix_reuse_enabled": 0.0}

    def request_stats(self, request_id: str) -> dict[str, float]:
        slot = self.slots.get(request_id)
        if slot is None or self.pool is None:
            return {}
        return {f"kv_{k}_bytes": float(v) for k, v in self.pool.nbytes(slot).items()}

    def check_invariants(self) -> None:
        return None

    def corrupt_accounting(self) -> None:
        """No byte accounting to break (the drill's step still fails)."""


class V4HierarchyKVStore:
    """A V4 model over the hierarchy (see the module docstring); admission and budgets are the inner
    :class:`KVManager`'s, in entry rows."""

    def __init__(self, cfg: DeepseekV4Config, kv_config: KVConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, **manager_options: object) -> None:
        self.cfg, self.device = cfg, device
        self.rate = cfg.compress_rate_csa
        self.layout, self.kv_layer = csa_layout(cfg, dtype)
        item = dtype.itemsize
        self.state_bytes = tail_state_bytes(cfg, max_model_len, row_bytes=cfg.head_dim * item,
                                            index_key_bytes=cfg.index_head_dim * item, pending_value_bytes=item)
        kv_config = KVConfig(**{**kv_config.__dict__,
                                "model_state_bytes": kv_config.model_state_bytes + self.state_bytes})
        self.prefix_rows = V4PrefixRows(cfg, kv_config.page_rows, self._entry_tables, self._forgotten)
        self.inner = KVManager(self.layout, kv_config, device, prefix_rows=self.prefix_rows,
                               **manager_options)  # type: ignore[arg-type]
        in_hierarchy = {(layer, "kv") for layer in self.kv_layer}
        self.pool = V4StatePool(cfg, dtype, device, entry_keys={k for k in state_keys(cfg) if k not in in_hierarchy})
        self.slots: dict[str, int] = {}
        self.released: dict[str, int] = {}  # released requests' slots, kept until the manager frees them
        self.restart: dict[str, int] = {}  # admitted with a hit: the position their prefill restarts at
        self.step: V4HierarchyStepKV | None = None
        self._step_ids: list[str] = []

    @property
    def policy(self) -> KVPolicy:
        return self.inner.policy

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
        if not self.inner.try_admit(request_id, *entry_rows(prompt_len, max_new_tokens, self.rate)):
            return False
        hit = self.prefix_rows.hits.get(request_id)
        if hit is not None:  # the admission hit hit.shape[0] cached pages
            rows = self.prefix_rows
            self.restart[request_id] = rows.reused_tokens(rows.page_end(hit.shape[0], self.inner.config.page_rows))
        return True

    def set_token_ids(self, request_id: str, token_ids: Sequence[int], reuse: bool = True) -> None:
        """The request's token ids (prompt before ``try_admit``, whole sequence before ``release``): page keys over
        the tokens each page's entries depend on (``kv/prefix_v4.py``)."""
        self.inner.set_token_ids(request_id, token_ids, reuse)

    def cached_prefix_tokens(self, request_id: str) -> int:
        """Where the prefill starts: the restart position of the request's hit (0 without one)."""
        return self.restart.get(request_id, 0)

    def prefill_kv(self, request_id: str, chunk_tokens: int) -> V4RequestKV | None:
        """With a hit, the state the prefill restarts from (``prefix.restored_state``): the hit's CSA entries from its
        cached pages' host rows, its indexer keys and HCA entries from their packed state; else ``None`` (the
        prefill builds its whole state)."""
        hit = self.prefix_rows.take_hit(request_id)
        if hit is None:
            return None
        hit_tokens, entries = hit
        target = self.inner.import_target(request_id)
        assert target is not None, "a hit implies a host store"
        n = hit_tokens // self.rate
        cached = target.rows.index_select(0, target.row_index[:, 1:n + 1].reshape(-1))
        cached = cached.view(self.layout.num_sources, n, self.cfg.head_dim)
        for layer, k in self.kv_layer.items():
            if self.cfg.source_of(layer) == layer:
                entries[(layer, "kv")] = cached[self.layout.source_of_layer[k]]
        return restored_state(self.cfg, hit_tokens, self.layout.dtype, self.device, self.restart[request_id],
                              hit_tokens, entries)

    def import_target(self, request_id: str) -> HostRowsTarget | None:
        return None

    def import_prompt(self, request_id: str, rows: PromptRows | None,
                      index_keys: Mapping[int, torch.Tensor] | None) -> None:
        """Move the prefilled state's CSA entries into the hierarchy (rows ``1 … E``); keep the rest of the
        state as the request's required tail. With prefix reuse the rows past a hit's are written to the request's
        host pages (the hit's are shared and never written) and imported from there, which registers its pages."""
        state = _v4_state(rows)
        self.restart.pop(request_id, None)
        n = state.length // self.rate
        sources = torch.zeros(self.layout.num_sources, n + 1, self.cfg.head_dim, dtype=self.layout.dtype,
                              device=self.device)
        for layer, k in self.kv_layer.items():
            if self.cfg.source_of(layer) == layer:
                sources[self.layout.source_of_layer[k], 1:] = state.entries.pop((layer, "kv"))[:n]
        self.slots[request_id] = self.pool.load(state)  # before the import: registration reads its entries
        target = self.inner.import_target(request_id) if self.inner.prefix.enabled else None
        if target is None:
            self.inner.import_prompt(request_id, sources, {})
            return
        new = target.row_index[:, target.cached_rows:]
        target.rows.index_copy_(0, new.reshape(-1), sources[:, target.cached_rows:].reshape(-1, self.cfg.head_dim)
                                .cpu())
        self.inner.import_prompt(request_id, None, None)

    def _entry_tables(self, request_id: str) -> dict[Key, torch.Tensor]:
        """The entry tables (``[capacity, d]`` per key kept outside the hierarchy) of a running or released request."""
        slot = self.slots.get(request_id, self.released.get(request_id))
        if slot is None:
            raise KeyError(f"request {request_id!r} has no V4 state")
        return {key: table[slot] for key, table in self.pool.entries.items()}

    def _forgotten(self, request_id: str) -> None:
        slot = self.released.pop(request_id, None)
        if slot is not None:
            self.pool.release(slot)

    def begin_step(self, request_ids: Sequence[str], query_len: int) -> V4HierarchyStepKV:
        inner = self.inner.begin_step(request_ids, -(-query_len // self.rate))  # entries one step may complete
        self.step = V4HierarchyStepKV(self.pool, [self.slots[r] for r in request_ids], query_len, self.device,
                                      inner, self.kv_layer)
        self._step_ids = list(request_ids)
        return self.step

    def end_step(self, accepted: Mapping[str, int], report: Sequence[int] | None = None) -> None:
        """Commit the tokens; the hierarchy keeps its provisional row where a window completed."""
        step = self.step
        assert step is not None
        before = torch.div(self.pool.length[step.slot], self.rate, rounding_mode="floor")
        step.commit([accepted.get(r, step.query_len) for r in self._step_ids])
        kept = torch.div(self.pool.length[step.slot], self.rate, rounding_mode="floor") - before
        self.step = None
        self.inner.end_step(dict(zip(self._step_ids, kept.tolist(), strict=True)), report)

    def abort_step(self) -> None:
        """Roll the hierarchy's open step back after a fault. The V4 window/compressor state of the step's
        requests is not restored: ``owners_of`` names every request of an open step, so the engine ends them all."""
        if self.step is not None:
            self.inner.abort_step()
            self.step = None

    def owners_of(self, failure: CopyError) -> list[str]:
        return list(self._step_ids) if self.step is not None else self.inner.owners_of(failure)

    def release(self, request_id: str) -> None:
        """Release in the hierarchy; the slot is freed with the request's memory (``_forgotten``), after its decoded
        pages registered from it."""
        self.restart.pop(request_id, None)
        self.prefix_rows.hits.pop(request_id, None)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.released[request_id] = slot
        self.inner.release(request_id)

    def poll(self) -> None:
        self.inner.poll()

    def read(self, *tensors: torch.Tensor) -> list[list[int]]:
        return self.inner.read(*tensors)

    def memory(self) -> KVMemory:
        return self.inner.memory()

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

    def corrupt_accounting(self) -> None:
        self.inner.corrupt_accounting()
