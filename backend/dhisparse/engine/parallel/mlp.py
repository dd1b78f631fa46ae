"""MLP layers (dense and MoE) spanning every rank: the callables that replace a parallel model's ``mlp[i]``.

Each takes ``x [B, Q, H]`` (and, for deepseek_v4, ``token_ids [B, Q]``) and returns the layer's output for this
rank's tokens. Every rank calls every layer in every forward, with zero tokens when it has none (``idle``), because
the layers exchange data with all ranks:

- :class:`ReplicatedTokens` (tensor parallelism: every rank holds every token): this rank's slice of the layer gives
  a partial output, summed over ranks. With expert parallelism the slice is this rank's whole experts
  (:class:`LocalExperts`) plus its slice of the shared experts.
- :class:`GatheredTokens` (data-parallel attention, dense layers and MoE without expert parallelism): the tokens of
  every rank are all-gathered, this rank's slice is applied to all of them, and each rank's partial outputs go back
  to it (all-to-all), summed in rank order.
- :class:`DispatchedTokens` (data-parallel attention with expert parallelism): each (token, expert) assignment goes
  to the rank that owns the expert (all-to-all with its expert id), comes back as the expert's output (all-to-all),
  and each token sums its weighted contributions in ascending expert order — the single-process MoE's order — then
  adds its shared experts (whole on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dhisparse.engine.parallel.group import RankCollectives

Local = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x2d [N, H], token ids [N] or None) -> [N, H]
Route = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]  # -> (weights, ids) [N, k]
Expert = Callable[[int, torch.Tensor], torch.Tensor]  # (local expert index, rows [n, H]) -> [n, H]


@dataclass
class LocalExperts:
    """The experts ``[first, first + count)`` this rank owns: ``expert(e - first, rows)`` applies expert ``e``."""

    first: int
    count: int
    expert: Expert

    def apply(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``rows [R, H]`` each for expert ``ids [R]`` (all owned here) → outputs ``[R, H]`` (one matmul chain per
        expert that has rows: a loop over experts, never over rows)."""
        out = torch.zeros_like(rows)
        if rows.shape[0] == 0:
            return out
        for e in torch.unique(ids).tolist():
            pick = (ids == e).nonzero().squeeze(1)
            out[pick] = self.expert(int(e) - self.first, rows[pick]).to(rows.dtype)
        return out


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum each token's weighted expert outputs ``y [N, k, H]`` (router ``weights [N, k]``, expert ``ids [N, k]``) in
    ascending expert order starting from zero, as the single-process MoE does; unused slots hold zeros (exact)."""
    contributions = (y * weights.unsqueeze(-1)).to(dtype)
    ordered = contributions.gather(1, ids.argsort(dim=1).unsqueeze(-1).expand_as(contributions))
    out = torch.zeros_like(ordered[:, 0])
    for j in range(ordered.shape[1]):
        out = out + ordered[:, j]
    return out


class _Layer:
    def __init__(self, comm: RankCollectives, layer: str, hidden: int, dtype: torch.dtype) -> None:
        self.comm, self.layer, self.hidden, self.dtype = comm, layer, hidden, dtype

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        flat_ids = token_ids.reshape(-1) if token_ids is not None else None
        return self.rows(x.reshape(-1, x.shape[-1]), flat_ids).view(x.shape)

    def rows(self, x2d: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def idle(self, device: torch.device) -> None:
        """Take part in the layer's exchanges with no token of this rank's own."""
        self.rows(torch.empty(0, self.hidden, dtype=self.dtype, device=device),
                  torch.empty(0, dtype=torch.int64, device=device))


class ReplicatedTokens(_Layer):
    """Tensor parallelism: ``local`` gives this rank's partial output for every token; summed over ranks."""

    def __init__(self, comm: RankCollectives, layer: str, hidden: int, dtype: torch.dtype, local: Local) -> None:
        super().__init__(comm, layer, hidden, dtype)
        self.local = local

    def rows(self, x2d: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        return self.comm.sum(self.local(x2d, ids), self.layer)


class GatheredTokens(_Layer):
    """Data-parallel attention: all ranks' tokens in, this rank's slice, each rank's partials back and summed.
    ``with_ids``: the layer routes by token id (deepseek_v4 hash layers), so ids are gathered too."""

    def __init__(self, comm: RankCollectives, layer: str, hidden: int, dtype: torch.dtype, local: Local,
                 with_ids: bool = False) -> None:
        super().__init__(comm, layer, hidden, dtype)
        self.local, self.with_ids = local, with_ids

    def rows(self, x2d: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        comm = self.comm
        counts = comm.tokens_per_rank
        mine = counts[comm.rank]
        if x2d.shape[0] != mine:
            raise RuntimeError(f"{self.layer}: {x2d.shape[0]} rows but the forward announced {mine}")
        longest = max(counts)
        if longest == 0:
            return x2d
        pad = longest - mine
        padded = torch.cat([x2d, x2d.new_zeros(pad, x2d.shape[1])]) if pad else x2d
        every = torch.cat([part[:n] for part, n in zip(comm.all_gather(padded, self.layer), counts, strict=True)])
        every_ids = None
        if self.with_ids:
            assert ids is not None
            ids_padded = torch.cat([ids, ids.new_zeros(pad)]) if pad else ids
            every_ids = torch.cat([part[:n] for part, n in zip(comm.all_gather(ids_padded, self.layer), counts,
                                                                strict=True)])
        partial = self.local(every, every_ids)  # [sum(counts), H] in rank order: rank r's rows go back to r
        back = comm.all_to_all(partial, counts, [mine] * comm.world, self.layer).view(comm.world, mine, x2d.shape[1])
        out = back[0]
        for part in back[1:]:
            out = out + part
        return out


class DispatchedTokens(_Layer):
    """Data-parallel attention with expert parallelism (module docstring). ``shared``: the shared experts, whole."""

    def __init__(self, comm: RankCollectives, hidden: int, dtype: torch.dtype, route: Route, experts: LocalExperts,
                 shared: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        super().__init__(comm, "moe", hidden, dtype)
        self.route, self.experts, self.shared = route, experts, shared

    def rows(self, x2d: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        comm, world = self.comm, self.comm.world
        n = x2d.shape[0]
        if n:
            weights, experts = self.route(x2d, ids)
        else:
            weights = torch.empty(0, 1, dtype=torch.float32, device=x2d.device)
            experts = torch.empty(0, 1, dtype=torch.int64, device=x2d.device)
        k = experts.shape[1]
        flat = experts.reshape(-1)
        owner = torch.div(flat, self.experts.count, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # assignments grouped by destination rank
        send_counts = torch.bincount(owner, minlength=world).to(torch.int64)
        recv_counts = comm.exchange_counts(send_counts, "moe_counts")
        send_counts_l = send_counts.tolist()
        rows_in = comm.all_to_all(x2d.index_select(0, torch.div(order, k, rounding_mode="floor")), send_counts_l,
                                  recv_counts, "moe_dispatch")
        ids_in = comm.all_to_all(flat.index_select(0, order), send_counts_l, recv_counts, "moe_dispatch")
        y_out = self.experts.apply(rows_in, ids_in)
        y_back = comm.all_to_all(y_out, recv_counts, send_counts_l, "moe_combine")
        if n == 0:
            return x2d
        y = torch.empty_like(y_back).index_copy_(0, order, y_back).view(n, k, -1)
        out = combine(y, weights, experts, x2d.dtype)
        return out if self.shared is None else out + self.shared(x2d)


def replicated_expert_partial(route: Route, experts: LocalExperts, shared: Callable[[torch.Tensor], torch.Tensor] | None
                              ) -> Local:
    """Tensor parallelism with expert parallelism: this rank's experts applied to every token (the other ranks'
    slots contribute zero here) plus its slice of the shared experts — a partial output to sum over ranks."""

    def local(x2d: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        weights, chosen = route(x2d, ids)
        n, k = chosen.shape
        flat = chosen.reshape(-1)
        mine = (flat >= experts.first) & (flat < experts.first + experts.count)
        pick = mine.nonzero().squeeze(1)
        y = x2d.new_zeros(n * k, x2d.shape[1])
        y[pick] = experts.apply(x2d.index_select(0, torch.div(pick, k, rounding_mode="floor")), flat[pick])
        out = combine(y.view(n, k, -1), weights, chosen, x2d.dtype)
        return out if shared is None else out + shared(x2d)

    return local
