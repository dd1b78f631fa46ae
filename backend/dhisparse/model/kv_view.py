"""The narrow interface between the model's forward pass and whatever stores the KV (dense or hierarchical).

One ``StepKV`` serves one batched forward: ``B`` requests, each with ``Q`` new tokens at positions
``lengths[b] - Q … lengths[b] - 1``. For every layer the model calls ``write`` first, then (indexer layers)
``index_keys``, then ``gather`` with the layer's selection.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dhisparse.host_values import to_device


class StepKV(Protocol):
    lengths: torch.Tensor
    """``[B]`` int64: history length of each request including the ``Q`` new tokens."""
    max_length: int
    """``max(lengths)``, known on the host (no device read)."""
    query_tiled_gather: bool
    """``gather`` is a plain lookup with no per-layer state: attention may call it once per tile of queries."""
    device_attention: bool
    """``attend`` runs sparse MLA with a device kernel (else the model attends over ``gather``)."""

    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store the new tokens' latent rows ``[B, Q, row_dim]`` and, for indexer layers, keys ``[B, Q, d]``."""

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Indexer keys of ``layer`` at positions ``start .. stop-1`` (``stop`` defaults to ``max_length``):
        ``[B, stop - start, d]``; entries at or past ``lengths[b]`` are zero."""

    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows at ``positions [B, Q, K]`` (int64, −1 = unused) of ``layer``'s source: ``[B, Q, K, row_dim]``,
        zeros where the position is −1."""

    def attend(self, layer: int, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> torch.Tensor | None:
        """Sparse MLA ``[B, Q, H, rank]`` over the rows at ``positions`` by a device kernel (only called when
        ``device_attention``); ``None`` when the kernel cannot serve these dtypes (the model attends itself)."""


class PrefillKV(StepKV, Protocol):
    """A store one request's prefill runs over, chunk after chunk (``LocalKV``, or the engine's streamed store)."""

    keys: dict[int, torch.Tensor]
    """``{layer: [capacity, d]}``: the prompt's indexer keys."""

    def begin(self, query_len: int) -> StepKV:
        """Start a forward over the next ``query_len`` tokens (B = 1)."""

    def end(self) -> None:
        """Commit the forward's rows."""


class LocalKV:
    """KV of one request held in plain tensors: used by prefill (chunk after chunk) and as the dense reference.

    ``rows [num_layers, capacity, row_dim]``; ``keys {layer: [capacity, d]}`` for indexer layers.
    ``gather`` is a plain lookup, so attention may call it once per tile of queries (``query_tiled_gather``).
    """

    query_tiled_gather = True
    device_attention = False

    def __init__(
        self, num_layers: int, indexer_layers: tuple[int, ...], capacity: int, row_dim: int, key_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.rows = torch.zeros(num_layers, capacity, row_dim, dtype=dtype, device=device)
        self.keys = {i: torch.zeros(capacity, key_dim, dtype=dtype, device=device) for i in indexer_layers}
        self.length = 0  # committed rows
        self.query_len = 0
        self.lengths = torch.zeros(1, dtype=torch.int64, device=device)
        self.max_length = 0

    def begin(self, query_len: int) -> LocalKV:
        """Start a forward over the next ``query_len`` tokens (B = 1)."""
        self.query_len = query_len
        self.max_length = self.length + query_len
        self.lengths = to_device([self.length + query_len], torch.int64, self.rows.device)
        return self

    def end(self) -> None:
        self.length += self.query_len
        self.query_len = 0

    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        end = self.length + self.query_len
        self.rows[layer, self.length:end] = rows[0]
        if index_keys is not None:
            self.keys[layer][self.length:end] = index_keys[0]

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.max_length if stop is None else stop
        return self.keys[layer][start:stop].unsqueeze(0)

    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        out = self.rows[layer][positions.clamp(min=0)]
        return out.masked_fill((positions < 0).unsqueeze(-1), 0)

    def attend(self, layer: int, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> None:
        return None  # the model attends over the gathered rows
