"""The collectives of one rank over ``torch.distributed`` (gloo on CPU, NCCL on GPUs), counted by layer type.

:class:`RankCollectives` implements the model's :class:`~dhisparse.model.collectives.Collectives` (attention output,
indexer scores, vocabulary-split logits, the start of each forward) and the MLP layers' token exchange
(``engine/parallel/mlp.py``). Contracts:

- **Same bits on every rank.** A sum over ranks is an all-gather followed by a sum in rank order, never a
  backend all-reduce (whose summation order is the backend's): every rank of the group computes the identical
  result, so top-k selections, sampled tokens and KV residency decisions agree without being broadcast. (Against
  the single-process engine a split sum rounds differently: tokens are equal in float64, see docs/parallel.md.)
- **Timeouts.** Every collective runs under the process group's timeout (``collective_timeout_s``); a collective
  that fails (a peer died, a timeout) marks the rank ``broken`` and raises :class:`CollectiveError`.
- **Forward pairing.** Under tensor parallelism every rank runs the same forwards; ``begin_forward`` checks that
  the ranks agree on the forward's token count (a rank that diverged fails loudly instead of pairing the wrong
  collectives). Under data-parallel attention ranks run different numbers of forwards per step (their own prefills
  and decodes); ``begin_forward`` all-gathers ``(active, tokens)`` so that every rank knows every rank's token
  count, and :meth:`drain` makes a rank that has finished its step join the others' remaining forwards as an idle
  participant (zero tokens) until no rank is active.
- **Volume.** ``volume`` counts the bytes this rank contributes per ``(layer, op)``: ``all_reduce`` the summed
  tensor's bytes, ``all_gather`` this rank's piece (padded), ``all_to_all`` the bytes sent to *other* ranks.
  :func:`dhisparse.engine.parallel.comm.step_comm_bytes` models the same figures from a step's shape.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.host_values import to_device
from dhisparse.model.collectives import Collectives


class CollectiveError(RuntimeError):
    """A collective between ranks failed (a peer died or diverged, or it timed out): the engine cannot go on."""


class RankCollectives(Collectives):
    """One rank's collectives over the engine's data process group (``group``: every rank, with the collective
    timeout). ``shape``: the engine's parallel shape."""

    def __init__(self, shape: ParallelShape, rank: int, device: torch.device, group: Any = None) -> None:
        self.shape, self.rank, self.device = shape, rank, device
        self.group = group  # the data process group (None: the default group)
        self.world = shape.world_size
        self.volume: collections.Counter[str] = collections.Counter()  # "<layer>_<op>" -> bytes contributed
        self.tokens_per_rank: list[int] = [0] * self.world  # this forward's MLP rows per rank (DP)
        self.forward_open = False  # a forward began and has not reached its output head
        self.broken: str | None = None  # why collectives can no longer be trusted (None: fine)
        self.forwards = 0
        self.idle_forwards = 0

    # ------------------------------------------------------------------------------------ primitives
    def _run(self, what: str, op: Callable[[], object]) -> None:
        if self.broken is not None:
            raise CollectiveError(f"rank {self.rank}: collectives are broken ({self.broken}); not running {what}")
        try:
            op()
        except Exception as exc:
            self.broken = f"{what} failed: {type(exc).__name__}: {exc}"
            raise CollectiveError(f"rank {self.rank}: {self.broken}") from exc

    def _gather(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._run(what, lambda: dist.all_gather(parts, x, group=self.group))
        return parts

    def all_gather(self, x: torch.Tensor, layer: str) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape everywhere), in rank order."""
        self.volume[f"{layer}_all_gather"] += x.numel() * x.element_size()
        return self._gather(x, f"all_gather ({layer})")

    def sum(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        """The sum over ranks of ``x``, added in rank order (identical bits on every rank; counted as the logical
        all-reduce of ``x``)."""
        self.volume[f"{layer}_all_reduce"] += x.numel() * x.element_size()
        parts = self._gather(x, f"all_reduce ({layer})")
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out

    def all_to_all(self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], layer: str
                   ) -> torch.Tensor:
        """Send ``rows[...]`` in consecutive blocks of ``send_counts[r]`` rows to rank ``r``; returns the blocks
        received, ``recv_counts[r]`` rows from rank ``r``, concatenated in rank order."""
        rows = rows.contiguous()
        out = rows.new_empty((int(sum(recv_counts)), *rows.shape[1:]))
        self._run(f"all_to_all ({layer})", lambda: dist.all_to_all_single(
            out, rows, [int(c) for c in recv_counts], [int(c) for c in send_counts], group=self.group))
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self.volume[f"{layer}_all_to_all"] += (int(sum(send_counts)) - int(send_counts[self.rank])) * row_bytes
        return out

    def exchange_counts(self, send_counts: torch.Tensor, layer: str) -> list[int]:
        """``send_counts [world]`` int64 → how many rows each rank will send here (an all-to-all of one count)."""
        recv = torch.empty_like(send_counts)
        self._run(f"all_to_all ({layer} counts)", lambda: dist.all_to_all_single(recv, send_counts, group=self.group))
        self.volume[f"{layer}_all_to_all"] += (self.world - 1) * send_counts.element_size()
        return recv.tolist()

    def gather_codes(self, codes: list[int], layer: str) -> list[list[int]]:
        """Every rank's ``codes`` (small integers; one list per rank, in rank order), outside any forward. The
        lengths are checked first: ranks that disagree on how many they hold have diverged
        (:class:`CollectiveError`)."""
        self.usable()
        lengths = self.all_gather(to_device([len(codes)], torch.int64, self.device), layer)
        if any(int(n) != len(codes) for n in lengths):
            self.broken = f"tensor-parallel ranks diverged: {layer} lists of {[int(n) for n in lengths]} entries"
            raise CollectiveError(f"rank {self.rank}: {self.broken}")
        if not codes:
            return [[] for _ in range(self.world)]
        parts = self.all_gather(to_device(codes, torch.int64, self.device), layer)
        return [[int(c) for c in part.tolist()] for part in parts]

    # ------------------------------------------------------------------------------- the model's seam
    def usable(self) -> None:
        """Raise :class:`CollectiveError` when this rank's collectives can no longer be paired with its peers': one
        failed, or a forward stopped half-way (the peers are still inside it). Checked before any new collective
        sequence (a forward, the drain), so a rank never issues a collective its peers are not running."""
        if self.forward_open and self.broken is None:
            self.broken = "a forward stopped half-way (an exception inside it): its collectives cannot be paired"
        if self.broken is not None:
            raise CollectiveError(f"rank {self.rank}: {self.broken}")

    def begin_forward(self, tokens: int) -> None:
        self.usable()
        self.forward_open = True
        self.forwards += 1
        if self.world == 1:
            return
        if self.shape.data_parallel:
            self._sync_round(active=True, tokens=tokens)
            return
        counts = self.all_gather(torch.tensor([tokens], dtype=torch.int64), "sync")
        if any(int(c) != tokens for c in counts):
            self.broken = f"tensor-parallel ranks diverged: forward token counts {[int(c) for c in counts]}"
            raise CollectiveError(f"rank {self.rank}: {self.broken}")

    def attention_output(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.shape.attention_split == 1 else self.sum(partial, "attention")

    def indexer_scores(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.shape.indexer_split == 1 else self.sum(partial, "indexer")

    def vocab_logits(self, shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
        self.forward_open = False  # the output head is the forward's last step
        if self.shape.attention_split == 1:
            return shard
        return torch.cat(self.all_gather(shard, "lm_head"), dim=-1)[..., :vocab_size]

    # ------------------------------------------------------------------------- data-parallel pairing
    def _sync_round(self, active: bool, tokens: int) -> bool:
        """All-gather ``(active, tokens)``; record every rank's tokens; whether any rank is active."""
        flags = self.all_gather(torch.tensor([int(active), tokens], dtype=torch.int64), "sync")
        self.tokens_per_rank = [int(f[1]) for f in flags]
        return any(int(f[0]) for f in flags)

    def drain(self, idle_forward: Callable[[], None]) -> None:
        """Data-parallel attention: after this rank's step, take part in the other ranks' remaining forwards
        (``idle_forward`` runs every collective layer with zero tokens) until no rank is active."""
        self.usable()
        if not self.shape.data_parallel:
            return
        while self._sync_round(active=False, tokens=0):
            self.idle_forwards += 1
            idle_forward()

    def stats(self) -> dict[str, float]:
        out = {f"comm_bytes_{name}": float(v) for name, v in self.volume.items()}
        out["comm_forwards"] = float(self.forwards)
        out["comm_idle_forwards"] = float(self.idle_forwards)
        return out
