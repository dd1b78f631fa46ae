"""Batched DeepSeek-V4 state for serving: every running request's state in slot-indexed tensors.

:class:`V4StatePool` holds, for ``S`` slots, what :class:`~dhisparse.model.deepseek_v4.kv_state.V4RequestKV`
holds for one request: ``length [S]``, ``window [layers, S, W-1, d]``, ``pending[key] [2, S, P, width]``
(projections, gates) and ``entries[key] [S, capacity, d]``. A manager loads a prefilled ``V4RequestKV`` into a
slot at admission (one copy) and frees the slot at release; :class:`V4PooledStepKV` serves a batched forward
over a list of slots with gathers and scatters on those tensors and commits in place — no loop over requests
on the decode path. ``entry_keys`` limits the pool to the entry tables it keeps (the hierarchy keeps CSA
entries itself). Slots grow (doubling) at admission; an entry table grows geometrically when a request outgrows it.
Every tensor is created and updated under ``torch.inference_mode`` (the model's forward runs in it).
"""

from __future__ import annotations

import torch

from dhisparse.host_values import to_device
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import Key, V4RequestKV, V4StepKV, state_keys


class V4StatePool:
    """Slot-indexed V4 state of up to ``slots`` requests (grows); see the module docstring."""

    @torch.inference_mode()
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype, device: torch.device, slots: int = 8,
                 entry_keys: set[Key] | None = None) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.keys = state_keys(cfg)
        self.entry_keys = set(self.keys) if entry_keys is None else set(entry_keys)
        w, d = cfg.sliding_window - 1, cfg.head_dim
        self.length = torch.zeros(slots, dtype=torch.int64, device=device)
        self.window = torch.zeros(cfg.num_hidden_layers, slots, w, d, dtype=dtype, device=device)
        self.pending = {key: torch.zeros(2, slots, p, width, dtype=dtype, device=device)
                        for key, (_, p, width) in self.keys.items()}
        self.entries = {key: torch.zeros(slots, 1, self._entry_width(key), dtype=dtype, device=device)
                        for key in self.keys if key in self.entry_keys}
        self.free: list[int] = list(range(slots))

    def _entry_width(self, key: Key) -> int:
        rate, p, width = self.keys[key]
        return width // 2 if p == 2 * rate else width

    @property
    def slots(self) -> int:
        return self.length.shape[0]

    # ------------------------------------------------------------------------------------------ slots
    @torch.inference_mode()
    def _grow_slots(self) -> None:
        n = self.slots

        def more(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        self.length = more(self.length, 0)
        self.window = more(self.window, 1)
        self.pending = {k: more(t, 1) for k, t in self.pending.items()}
        self.entries = {k: more(t, 0) for k, t in self.entries.items()}
        self.free.extend(range(n, 2 * n))

    @torch.inference_mode()
    def reserve(self, key: Key, rows: int) -> torch.Tensor:
        """The entry table of ``key`` with room for at least ``rows`` entries per slot (grown geometrically)."""
        table = self.entries[key]
        if rows > table.shape[1]:
            grown = table.new_zeros(table.shape[0], max(2 * table.shape[1], rows), table.shape[2])
            grown[:, : table.shape[1]] = table
            self.entries[key] = table = grown
        return table

    @torch.inference_mode()
    def load(self, state: V4RequestKV) -> int:
        """Copy a prefilled request's state into a free slot; returns the slot (entries the pool does not keep
        are left in ``state``)."""
        if not self.free:
            self._grow_slots()
        slot = self.free.pop(0)
        cfg = self.cfg
        self.length[slot] = state.length
        self.window[:, slot] = torch.stack(state.window)
        for key, (kv, gate) in state.pending.items():
            self.pending[key][0, slot] = kv
            self.pending[key][1, slot] = gate
        for key in self.entries:
            n = state.length // cfg.compress_rate(key[0])
            table = self.reserve(key, n)
            table[slot] = 0
            table[slot, :n] = state.entries[key][:n].to(table.dtype)
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def nbytes(self, slot: int) -> dict[str, int]:
        """Bytes one slot holds, by kind (the keys of ``V4RequestKV.nbytes``; entries at their valid length)."""
        item = self.window.element_size()
        out = {"window": self.window[:, slot].numel() * item,
               "pending": sum(t[:, slot].numel() * item for t in self.pending.values()),
               "csa_entries": 0, "csa_index_keys": 0, "hca_entries": 0}
        length = int(self.length[slot])
        for (layer, kind), t in self.entries.items():
            size = (length // self.cfg.compress_rate(layer)) * t.shape[2] * item
            if self.cfg.layer_types[layer] == CSA:
                out["csa_index_keys" if kind == "index" else "csa_entries"] += size
            else:
                out["hca_entries"] += size
        return out


class V4PooledStepKV(V4StepKV):
    """One batched forward over ``slots`` of ``pool`` (same interface as :class:`V4StepKV`)."""

    def __init__(self, pool: V4StatePool, slots: list[int], query_len: int, device: torch.device) -> None:
        self.pool, self.query_len, self.device = pool, query_len, device
        self.slot = to_device(slots, torch.int64, device)
        self.starts = pool.length[self.slot].clone()
        self.lengths = self.starts + query_len
        self._window: dict[int, torch.Tensor] = {}
        self._pending: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stores = []  # no per-request objects: the state is the pool's

    @property
    def batch(self) -> int:
        return self.slot.shape[0]

    def window(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ext = torch.cat([self.pool.window[layer, self.slot], rows], dim=1)
        self._window[layer] = ext
        return self._window_view(ext)

    def _window_view(self, ext: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.pool.cfg.sliding_window
        q = self.query_len
        idx = torch.arange(q, device=self.device).view(q, 1) + torch.arange(w, device=self.device).view(1, w)
        key_pos = self.positions.unsqueeze(-1) - (w - 1) + torch.arange(w, device=self.device)
        return ext[:, idx], key_pos >= 0

    def extend_pending(self, key: Key, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stored = self.pool.pending[key][:, self.slot]  # [2, B, P, width]
        ext = (torch.cat([stored[0], kv], dim=1), torch.cat([stored[1], gate], dim=1))
        self._pending[key] = ext
        return ext

    @torch.inference_mode()
    def add_entries(self, key: Key, first: torch.Tensor, counts: torch.Tensor, entries: torch.Tensor) -> None:
        n = entries.shape[1]
        if n == 0:
            return
        table = self.pool.reserve(key, int((first + counts).max()))
        valid = torch.arange(n, device=self.device) < counts.unsqueeze(1)  # [B, n]
        rows = self.slot.view(-1, 1).expand(-1, n)[valid]
        cols = (first.unsqueeze(1) + torch.arange(n, device=self.device))[valid]
        table[rows, cols] = entries[valid].to(table.dtype)

    def entries(self, key: Key, rate: int) -> torch.Tensor:
        e_max = int(self.lengths.max()) // rate
        return self.pool.reserve(key, e_max)[self.slot, :e_max]

    @torch.inference_mode()
    def commit(self, accepted: list[int] | None = None) -> None:
        """Keep the state after the first ``accepted[b]`` new tokens (all ``Q`` by default), in place."""
        q = self.query_len
        keep = (torch.full_like(self.slot, q) if accepted is None
                else to_device(accepted, torch.int64, self.device))
        for layer, ext in self._window.items():
            self.pool.window[layer, self.slot] = _shifted(ext, keep, ext.shape[1] - q)
        for key, (ext_kv, ext_gate) in self._pending.items():
            p = ext_kv.shape[1] - q
            self.pool.pending[key][0, self.slot] = _shifted(ext_kv, keep, p)
            self.pool.pending[key][1, self.slot] = _shifted(ext_gate, keep, p)
        self.pool.length[self.slot] += keep
        self._window.clear()
        self._pending.clear()


def _shifted(ext: torch.Tensor, keep: torch.Tensor, size: int) -> torch.Tensor:
    """``ext[b, keep[b] : keep[b] + size]`` for every ``b`` (``ext [B, T, d]``)."""
    idx = keep.view(-1, 1) + torch.arange(size, device=ext.device)
    return ext.gather(1, idx.unsqueeze(-1).expand(-1, -1, ext.shape[2]))
