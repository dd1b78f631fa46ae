"""This rank's slice of a model's weights (canonical names, smaller shapes), taken at load before anything reaches the
device. Which slice follows ``ParallelShape`` (``shape.py``):

- attention (TP): the heads of ``q_b``/``kv_b``/``o_proj`` (DSA) or whole output groups with their heads of
  ``q_b``/``sinks``/``o_a``/``o_b`` (deepseek_v4), and the indexer heads (``wq_b``/``weights_proj``; whole when
  ``tp_split_indexer`` is off); the latent row's projections, norms and the indexer key stay whole (every rank
  writes the same KV rows);
- dense MLPs and, without expert parallelism, every routed expert and the shared experts: a contiguous slice of the
  intermediate channels over all ranks (column-parallel gate/up, row-parallel down);
- with expert parallelism: whole experts, ``n_routed_experts / world`` per rank; the shared experts are split like a
  dense MLP under TP and kept whole under DP attention (every rank applies them to its own tokens);
- the router, norms, embeddings, hyper-connections and compressors: whole. (The output head's vocabulary is split
  when the model is parallelised, ``engine/parallel/model.py``.)
"""

from __future__ import annotations

import torch

from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config

Weights = dict[str, torch.Tensor]


def shard_weights(weights: Weights, cfg: ModelConfig | DeepseekV4Config, shape: ParallelShape, rank: int) -> Weights:
    """``weights`` with every split tensor replaced by ``rank``'s slice (the others are shared, not copied)."""
    if shape.world_size == 1:
        return weights
    out = dict(weights)
    if isinstance(cfg, DeepseekV4Config):
        _shard_v4(out, cfg, shape, rank)
    else:
        _shard_dsa(out, cfg, shape, rank)
    return out


def _rows(t: torch.Tensor, start: int, stop: int, per: int = 1) -> torch.Tensor:
    return t[start * per:stop * per].contiguous()


def _cols(t: torch.Tensor, start: int, stop: int, per: int = 1) -> torch.Tensor:
    return t[..., start * per:stop * per].contiguous()


def _split_mlp(w: Weights, gate: str, up: str, down: str, start: int, stop: int) -> None:
    """Column-parallel gate/up ``[..., I, H]`` (rows of the last two dims), row-parallel down ``[..., H, I]``."""
    w[gate] = w[gate][..., start:stop, :].contiguous()
    w[up] = w[up][..., start:stop, :].contiguous()
    w[down] = _cols(w[down], start, stop)


def _shard_dsa(w: Weights, cfg: ModelConfig, shape: ParallelShape, rank: int) -> None:
    h0, h1 = shape.attention_slice(cfg.num_attention_heads, rank)
    i0, i1 = shape.indexer_slice(cfg.index_n_heads, rank)
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        if shape.attention_split > 1:  # data-parallel attention: every rank holds the whole attention
            w[a + "q_b_proj.weight"] = _rows(w[a + "q_b_proj.weight"], h0, h1, cfg.qk_head_dim)
            w[a + "kv_b_proj.weight"] = _rows(w[a + "kv_b_proj.weight"], h0, h1,
                                              cfg.qk_nope_head_dim + cfg.v_head_dim)
            w[a + "o_proj.weight"] = _cols(w[a + "o_proj.weight"], h0, h1, cfg.v_head_dim)
            if cfg.indexer_types[i] == "full" and shape.indexer_split > 1:
                x = a + "indexer."
                w[x + "wq_b.weight"] = _rows(w[x + "wq_b.weight"], i0, i1, cfg.index_head_dim)
                w[x + "weights_proj.weight"] = _rows(w[x + "weights_proj.weight"], i0, i1)
        m = f"model.layers.{i}.mlp."
        if cfg.mlp_layer_types[i] == "dense":
            _split_mlp(w, m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight",
                       *shape.mlp_slice(cfg.intermediate_size, rank))
            continue
        names = (m + "experts.gate_proj", m + "experts.up_proj", m + "experts.down_proj")
        if shape.expert_parallel:
            e0, e1 = shape.expert_slice(cfg.n_routed_experts, rank)
            for name in names:
                w[name] = w[name][e0:e1].contiguous()
        else:
            _split_mlp(w, *names, *shape.mlp_slice(cfg.moe_intermediate_size, rank))
        if cfg.n_shared_experts > 0 and not (shape.expert_parallel and shape.data_parallel):
            s = m + "shared_experts."
            _split_mlp(w, s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight",
                       *shape.mlp_slice(cfg.moe_intermediate_size * cfg.n_shared_experts, rank))


def _shard_v4(w: Weights, cfg: DeepseekV4Config, shape: ParallelShape, rank: int) -> None:
    g0, g1 = shape.attention_slice(cfg.o_groups, rank)
    heads_per_group = cfg.num_attention_heads // cfg.o_groups
    h0, h1 = g0 * heads_per_group, g1 * heads_per_group
    i0, i1 = shape.indexer_slice(cfg.index_n_heads, rank)
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        if shape.attention_split > 1:  # data-parallel attention: every rank holds the whole attention
            w[a + "q_b_proj.weight"] = _rows(w[a + "q_b_proj.weight"], h0, h1, cfg.head_dim)
            w[a + "sinks"] = _rows(w[a + "sinks"], h0, h1)
            w[a + "o_a_proj.weight"] = _rows(w[a + "o_a_proj.weight"], g0, g1, cfg.o_lora_rank)
            w[a + "o_b_proj.weight"] = _cols(w[a + "o_b_proj.weight"], g0, g1, cfg.o_lora_rank)
            if cfg.layer_types[i] == CSA and cfg.owns_indexer(i) and shape.indexer_split > 1:
                x = a + "compressor.indexer."
                w[x + "q_b_proj.weight"] = _rows(w[x + "q_b_proj.weight"], i0, i1, cfg.index_head_dim)
                w[x + "scorer.weights_proj.weight"] = _rows(w[x + "scorer.weights_proj.weight"], i0, i1)
        m = f"model.layers.{i}.mlp."
        gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
        if shape.expert_parallel:
            e0, e1 = shape.expert_slice(cfg.n_routed_experts, rank)
            w[gate_up], w[down] = w[gate_up][e0:e1].contiguous(), w[down][e0:e1].contiguous()
        else:
            s0, s1 = shape.mlp_slice(inter, rank)
            both = w[gate_up]  # [E, 2I, H]: the gate's channels, then the up projection's
            w[gate_up] = torch.cat([both[:, s0:s1], both[:, inter + s0:inter + s1]], dim=1).contiguous()
            w[down] = _cols(w[down], s0, s1)
        if not (shape.expert_parallel and shape.data_parallel):
            s = m + "shared_experts."
            _split_mlp(w, s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight",
                       *shape.mlp_slice(inter, rank))
