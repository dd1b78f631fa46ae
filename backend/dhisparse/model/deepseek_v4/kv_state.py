"""What DeepSeek-V4 keeps per request between steps, and the batched view of one step.

Per request (:class:`V4RequestKV`), after ``length`` tokens:

* ``window[layer]`` ``[W-1, head_dim]``: the K=V rows of positions ``length-W+1 … length-1`` (zeros before 0),
  every layer (the sliding branch; a query sees these plus itself: ``W`` rows);
* ``pending[key]`` ``(kv, gate)`` ``[P, width]``: the compressor projections of positions ``length-P …
  length-1`` — ``P = 2·rate`` for CSA (entry ``w`` pools window ``w-1``'s first half with window ``w``'s second
  half), ``P = rate`` for HCA; keys are ``(layer, "kv")`` and, for CSA, ``(layer, "index")``;
* ``entries[key]`` ``[≥ length // rate, d]`` (grown on demand): the compressed entries, ``length // rate`` of
  them valid: KV rows of ``head_dim`` (CSA: the selectable rows; HCA: all attended) and, for CSA, indexer
  keys of ``index_head_dim``.

A layer that reuses another layer's KV source (``cfg.source_of``) reads that layer's ``entries``; it keeps no
compressor state and writes no entries of its own.

``restored`` (prefix reuse, ``prefix.py``): the entries of windows complete within the first ``restored`` tokens came
from the prefix cache; a prefill that recomputes positions before ``restored`` keeps them (never rewrites them).

:class:`V4StepKV` serves one batched forward of ``Q`` new tokens per request. It builds the per-step
"extended" tensors (stored state followed by the new tokens) that the attention and compressors index, and
``commit`` keeps what the accepted tokens leave behind. It loops over the requests of a batch (never over rows):
prefill (one request) and references use it; serving steps use the batched, slot-indexed
:class:`~dhisparse.model.deepseek_v4.state_pool.V4StatePool` / ``V4PooledStepKV`` (no loop over requests).
"""

from __future__ import annotations

import torch

from dhisparse.host_values import to_device
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config

Key = tuple[int, str]


def state_keys(cfg: DeepseekV4Config) -> dict[Key, tuple[int, int, int]]:
    """``{(layer, "kv"|"index"): (rate, pending tokens P, projection width)}`` for every compressor."""
    out: dict[Key, tuple[int, int, int]] = {}
    for i in range(cfg.num_hidden_layers):
        if not cfg.owns_compressor(i):
            continue
        rate = cfg.compress_rate(i)
        if cfg.layer_types[i] == CSA:
            out[(i, "kv")] = (rate, 2 * rate, 2 * cfg.head_dim)
            out[(i, "index")] = (rate, 2 * rate, 2 * cfg.index_head_dim)
        else:
            out[(i, "kv")] = (rate, rate, cfg.head_dim)
    return out


class V4RequestKV:
    """One request's state (see the module docstring); ``capacity`` sizes the entry tables initially (they grow
    when a request outlives it)."""

    def __init__(self, cfg: DeepseekV4Config, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.length = cfg, 0
        self.restored = 0  # tokens whose complete windows' entries are restored (kept by add_entries)
        w = cfg.sliding_window - 1
        self.window = [torch.zeros(w, cfg.head_dim, dtype=dtype, device=device)
                       for _ in range(cfg.num_hidden_layers)]
        self.pending: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entries: dict[Key, torch.Tensor] = {}
        for key, (rate, p, width) in state_keys(cfg).items():
            self.pending[key] = (torch.zeros(p, width, dtype=dtype, device=device),
                                 torch.zeros(p, width, dtype=dtype, device=device))
            self.entries[key] = torch.zeros(capacity // rate + 1, width // (2 if p == 2 * rate else 1),
                                            dtype=dtype, device=device)

    def reserve(self, key: Key, rows: int) -> torch.Tensor:
        """The entry table of ``key`` with room for at least ``rows`` entries (grown geometrically)."""
        table = self.entries[key]
        if rows > table.shape[0]:
            grown = table.new_zeros(max(2 * table.shape[0], rows), table.shape[1])
            grown[: table.shape[0]] = table
            self.entries[key] = table = grown
        return table

    def entry_count(self, layer: int) -> int:
        rate = self.cfg.compress_rate(layer)
        return self.length // rate if rate else 0

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: ``window``, ``pending``, ``csa_entries``, ``csa_index_keys``, ``hca_entries``
        (entries counted at their valid length)."""
        out = {"window": sum(t.numel() * t.element_size() for t in self.window),
               "pending": sum(2 * kv.numel() * kv.element_size() for kv, _ in self.pending.values()),
               "csa_entries": 0, "csa_index_keys": 0, "hca_entries": 0}
        for (layer, kind), t in self.entries.items():
            size = self.entry_count(layer) * t.shape[1] * t.element_size()
            name = ("csa_index_keys" if kind == "index" else "csa_entries") if self.cfg.layer_types[layer] == CSA \
                else "hca_entries"
            out[name] += size
        return out


class V4StepKV:
    """The KV view of one batched forward; ``starts [B]`` are the positions of each request's first new token."""

    def __init__(self, stores: list[V4RequestKV], query_len: int, device: torch.device) -> None:
        self.stores, self.query_len, self.device = stores, query_len, device
        self.starts = to_device([s.length for s in stores], torch.int64, device)
        self.lengths = self.starts + query_len
        self._window: dict[int, torch.Tensor] = {}
        self._pending: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def positions(self) -> torch.Tensor:
        """``[B, Q]`` positions of the new tokens."""
        return self.starts.unsqueeze(1) + torch.arange(self.query_len, device=self.device)

    # ----------------------------------------------------------------------------------------- window
    def window(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new rows ``[B, Q, d]`` of ``layer``; return every query's window ``[B, Q, W, d]`` and its
        validity ``[B, Q, W]`` (positions below 0 are invalid)."""
        ext = torch.cat([torch.stack([s.window[layer] for s in self.stores]), rows], dim=1)
        self._window[layer] = ext
        w = self.stores[0].cfg.sliding_window
        q = self.query_len
        idx = torch.arange(q, device=self.device).view(q, 1) + torch.arange(w, device=self.device).view(1, w)
        keys = ext[:, idx]  # [B, Q, W, d]
        key_pos = self.positions.unsqueeze(-1) - (w - 1) + torch.arange(w, device=self.device)
        return keys, key_pos >= 0

    # ------------------------------------------------------------------------------------- compressors
    def extend_pending(self, key: Key, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projections ``[B, P+Q, width]`` of positions ``start-P … start+Q-1`` (stored pending + new)."""
        ext_kv = torch.cat([torch.stack([s.pending[key][0] for s in self.stores]), kv], dim=1)
        ext_gate = torch.cat([torch.stack([s.pending[key][1] for s in self.stores]), gate], dim=1)
        self._pending[key] = (ext_kv, ext_gate)
        return ext_kv, ext_gate

    def add_entries(self, key: Key, first: torch.Tensor, counts: torch.Tensor, entries: torch.Tensor) -> None:
        """Store ``counts[b]`` new entries ``entries[b, :counts[b]]`` at indices ``first[b] …`` (those below the
        request's restored entries are kept)."""
        rate = self.stores[0].cfg.compress_rate(key[0]) if self.stores else 1
        for b, s in enumerate(self.stores):
            n = int(counts[b])
            f = int(first[b])
            skip = min(n, max(0, s.restored // rate - f))
            if n > skip:
                table = s.reserve(key, f + n)
                table[f + skip:f + n] = entries[b, skip:n].to(table.dtype)

    def entries(self, key: Key, rate: int) -> torch.Tensor:
        """Every entry complete after this step's tokens, ``[B, Emax, d]`` (rows past a request's count are
        stale or zero: callers mask them by position)."""
        e_max = int(self.lengths.max()) // rate
        return torch.stack([s.reserve(key, e_max)[:e_max] for s in self.stores])

    def gather_entries(self, layer: int, key: Key, rate: int, selection: torch.Tensor) -> torch.Tensor:
        """Entries ``[B, Q, K, d]`` of ``key`` at ``selection [B, Q, K]`` (−1: unused, any row returned there)
        for ``layer`` (which may read another layer's source)."""
        entries = self.entries(key, rate)
        b_idx = torch.arange(entries.shape[0], device=entries.device).view(-1, 1, 1)
        return entries[b_idx, selection.clamp(min=0)]

    # ------------------------------------------------------------------------------------------ commit
    def commit(self, accepted: list[int] | None = None) -> None:
        """Keep the state after the first ``accepted[b]`` new tokens (all ``Q`` by default)."""
        q = self.query_len
        for b, s in enumerate(self.stores):
            keep = q if accepted is None else accepted[b]
            for layer, ext in self._window.items():
                s.window[layer] = ext[b, keep:keep + ext.shape[1] - q].clone()
            for key, (ext_kv, ext_gate) in self._pending.items():
                p = ext_kv.shape[1] - q
                s.pending[key] = (ext_kv[b, keep:keep + p].clone(), ext_gate[b, keep:keep + p].clone())
            s.length += keep
        self._window.clear()
        self._pending.clear()
