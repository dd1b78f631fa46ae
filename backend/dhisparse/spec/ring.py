"""The draft ring buffer: per request, the drafter's context rows for only its visible window of positions."""

from __future__ import annotations

import torch


class DraftRing:
    """``slots`` request slots × ``window`` rows × ``row_values`` values (one preallocated tensor).

    Row ``j`` of a request's ring holds the drafter context row of one target position; writing position ``p``
    goes to ``p % window``, so the ring never holds more than ``window`` positions (older rows are overwritten).
    All operations are vectorised over the requests of a batch.
    """

    def __init__(self, slots: int, window: int, row_values: int, dtype: torch.dtype, device: torch.device) -> None:
        self.window, self.row_values = window, row_values
        # One row past the window per slot takes the writes of rows an append does not keep, so an append is
        # one fixed-shape indexed write (no boolean selection, which reads its count on the host).
        self.rows = torch.zeros(slots, window + 1, row_values, dtype=dtype, device=device)
        self.count = torch.zeros(slots, dtype=torch.int64, device=device)  # positions written so far (≤ ∞)
        self.free = list(range(slots))

    @property
    def bytes_per_request(self) -> int:
        return self.rows[0].numel() * self.rows.element_size()  # the window and the discard row

    def allocate(self) -> int:
        slot = self.free.pop()
        self.count[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.rows[slot].zero_()
        self.count[slot].zero_()
        self.free.append(slot)

    def append(self, slots: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Append ``rows [B, N, row_values]`` to the rings of ``slots [B]``; only the first ``valid[b]`` rows of
        request ``b`` are kept (``valid [B]`` int64, ≤ N)."""
        n = rows.shape[1]
        offsets = torch.arange(n, device=rows.device)
        keep = offsets.unsqueeze(0) < valid.unsqueeze(1)  # [B, N]
        # Only the last `window` kept rows of a request can survive; earlier ones would be overwritten anyway.
        keep &= offsets.unsqueeze(0) >= (valid.unsqueeze(1) - self.window)
        positions = self.count[slots].unsqueeze(1) + offsets  # [B, N]
        column = torch.where(keep, positions % self.window, self.window)  # discarded rows go past the window
        self.rows.index_put_((slots.unsqueeze(1).expand(-1, n), column), rows.to(self.rows.dtype))
        self.count[slots] += valid

    def context(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows oldest first: ``([B, window, row_values], mask [B, window])`` (mask False where a request has
        fewer than ``window`` positions; those rows are left-padded)."""
        count = self.count[slots]
        start = count - self.window  # position of the oldest row in a full window
        positions = start.unsqueeze(1) + torch.arange(self.window, device=count.device)
        mask = positions >= 0
        idx = positions.clamp(min=0) % self.window
        rows = self.rows[slots.unsqueeze(1), idx]
        return rows.masked_fill(~mask.unsqueeze(-1), 0), mask
