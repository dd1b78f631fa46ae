"""Turn a model built from this rank's weight slice (``sharding.py``) into this rank's part of the parallel model:
the collectives go into the attention layers and the output head, the output head keeps this rank's slice of the
vocabulary (tensor parallelism), and every MLP layer is replaced by its cross-rank form (``mlp.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dhisparse.engine.executor import Model
from dhisparse.engine.parallel.group import RankCollectives
from dhisparse.engine.parallel.mlp import (
    DispatchedTokens,
    GatheredTokens,
    LocalExperts,
    ReplicatedTokens,
    replicated_expert_partial,
)
from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.model.deepseek_v4.layers import V4MoE
from dhisparse.model.deepseek_v4.model import DeepseekV4Model
from dhisparse.model.layers import MoE, gated_mlp


def vocab_shard(lm_head: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Rows ``[index * s, (index + 1) * s)`` of ``lm_head [V, H]``, ``s = ceil(V / parts)``, the last shard padded
    with zero rows (their logits are cut off after the gather)."""
    size = -(-lm_head.shape[0] // parts)
    shard = lm_head[index * size:(index + 1) * size]
    if shard.shape[0] < size:
        shard = torch.cat([shard, shard.new_zeros(size - shard.shape[0], shard.shape[1])])
    return shard.contiguous()


def parallelize(model: Model, shape: ParallelShape, comm: RankCollectives) -> Callable[[], None]:
    """Install ``comm`` and the cross-rank MLP layers into ``model`` (built from this rank's slice); returns the
    *idle forward*: every cross-rank layer run with zero tokens (a data-parallel rank pairing another's forward)."""
    rank, cfg = comm.rank, model.cfg
    model.collectives = comm
    for attention in model.attn:
        attention.collectives = comm
    if shape.attention_split > 1:
        model.lm_head = vocab_shard(model.lm_head, shape.attention_split, rank % shape.attention_split)
    hidden, dtype, device = cfg.hidden_size, model.dtype, model.device
    layers: list[GatheredTokens | ReplicatedTokens | DispatchedTokens] = []
    for i, mlp in enumerate(model.mlp):
        if isinstance(mlp, MoE | V4MoE):
            layers.append(_moe(mlp, shape, comm, hidden, dtype, cfg.n_routed_experts))
            continue
        local = _ignore_ids(mlp)  # a dense MLP built from this rank's slice: a partial output
        layers.append(GatheredTokens(comm, "dense", hidden, dtype, local) if shape.data_parallel
                      else ReplicatedTokens(comm, "dense", hidden, dtype, local))
        assert not isinstance(model, DeepseekV4Model), i  # every deepseek_v4 layer is MoE
    model.mlp = layers

    def idle_forward() -> None:
        for layer in layers:
            layer.idle(device)

    return idle_forward


def _ignore_ids(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor | None],
                                                                      torch.Tensor]:
    return lambda x2d, ids: fn(x2d)


def _moe(moe: MoE | V4MoE, shape: ParallelShape, comm: RankCollectives, hidden: int, dtype: torch.dtype,
         num_experts: int) -> GatheredTokens | ReplicatedTokens | DispatchedTokens:
    v4 = isinstance(moe, V4MoE)
    if not shape.expert_parallel:  # intermediate channels split: the MoE of this slice gives a partial output
        local = (lambda x2d, ids: moe(x2d, ids)) if v4 else (lambda x2d, ids: moe(x2d))  # type: ignore[call-arg]
        return (GatheredTokens(comm, "moe", hidden, dtype, local, with_ids=v4) if shape.data_parallel
                else ReplicatedTokens(comm, "moe", hidden, dtype, local))
    first, stop = shape.expert_slice(num_experts, comm.rank)
    if isinstance(moe, V4MoE):
        v4_moe = moe

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(rows, v4_moe.gate_up[e]).chunk(2, dim=-1)
            return F.linear(v4_moe._swiglu(gate, up), v4_moe.down[e])

        gate_w, up_w, down_w = v4_moe.shared

        def shared(x: torch.Tensor) -> torch.Tensor:
            return F.linear(v4_moe._swiglu(F.linear(x, gate_w), F.linear(x, up_w)), down_w)

        def route(x2d: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            assert ids is not None  # deepseek_v4 MoE layers always get their token ids
            return v4_moe.route(x2d, ids)

        shared_fn: Callable[[torch.Tensor], torch.Tensor] | None = shared
    else:
        dsa_moe = moe
        dsa_moe.num_experts = num_experts  # the router sees every expert; only the local ones are held here

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return gated_mlp(rows, dsa_moe.experts_gate[e], dsa_moe.experts_up[e], dsa_moe.experts_down[e])

        weights = dsa_moe.shared
        shared_fn = (lambda x: gated_mlp(x, *weights)) if weights is not None else None

        def route(x2d: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            return dsa_moe.route(x2d)

    experts = LocalExperts(first, stop - first, expert)
    if shape.data_parallel:
        return DispatchedTokens(comm, hidden, dtype, route, experts, shared_fn)
    return ReplicatedTokens(comm, "moe", hidden, dtype, replicated_expert_partial(route, experts, shared_fn))
