"""Verification staging: the gathered rows of one layer group, reused by the next group once consumed.

During a verification step every layer attends over ``Q = gamma + 1`` queries × ``K`` selected rows. Those rows are
gathered into a staging buffer sized for *one* index group (the layers that share one selection) and the next group
overwrites it after the previous group's attention has consumed it, so staging memory is independent of the number
of layers: ``group_len × max_batch × Q × K × row_dim`` values in all.
"""

from __future__ import annotations

import torch

from dhisparse.model.kv_view import StepKV


class VerificationStaging:
    def __init__(self, group_len: int, max_batch: int, query_len: int, topk: int, row_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.zeros(group_len, max_batch, query_len, topk, row_dim, dtype=dtype, device=device)
        self.uses = 0  # gathers served (for statistics and tests)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def bytes_per_request(self) -> int:
        return self.nbytes // self.buffer.shape[1]

    def wrap(self, inner: StepKV, slot_of_layer: tuple[int, ...]) -> StagedStepKV:
        return StagedStepKV(inner, self, slot_of_layer)


class StagedStepKV:
    """A ``StepKV`` whose ``gather`` results live in the staging buffer slot of the layer's position in its group."""

    def __init__(self, inner: StepKV, staging: VerificationStaging, slot_of_layer: tuple[int, ...]) -> None:
        self.inner, self.staging, self.slot_of_layer = inner, staging, slot_of_layer
        self.lengths = inner.lengths
        self.max_length = inner.max_length

    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        self.inner.write(layer, rows, index_keys)

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.inner.index_keys(layer, start, stop)

    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        rows = self.inner.gather(layer, positions)
        b, q, k, _ = rows.shape
        view = self.staging.buffer[self.slot_of_layer[layer], :b, :q, :k]
        view.copy_(rows)
        self.staging.uses += 1
        return view
