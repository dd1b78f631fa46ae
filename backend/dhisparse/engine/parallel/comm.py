"""The communication volume of one forward on every rank, by layer type and collective, from the step's shape alone.

This is the model both the engine and the planner use: ``LLM.stats()`` reports what the ranks actually passed to
their collectives (``comm_bytes_<layer>_<op>``, counted by ``RankCollectives``) and tests check the two agree
exactly for the deterministic parts; the planner (``dhisparse-plan``) describes its model as a :class:`ModelComm`
and calls :func:`decode_comm_bytes` (or :func:`forward_comm_bytes`) to price a parallel shape. Units: bytes this
rank contributes per forward — an ``all_reduce`` the reduced tensor, an ``all_gather`` its own (padded) piece, an
``all_to_all`` what it sends to the other ranks.

Per layer type:

- ``attention`` (TP): the output projection's partial ``[tokens, hidden]``, all-reduced, every layer;
- ``indexer`` (TP with the indexer split, ``tp_split_indexer``): the indexer scores ``[batch, query_len, keys]``
  float32, all-reduced, every layer that owns an indexer (``keys``: DSA the longest request's positions; deepseek_v4
  its compressed entries, ``length // rate``); nothing when every rank runs the whole indexer;
- ``lm_head`` (TP): the logits of this rank's vocabulary shard ``[rows, ceil(V / TP)]``, all-gathered;
- ``dense`` / ``moe`` under TP: the partial output ``[tokens, hidden]``, all-reduced (with EP too: each rank's
  experts and shared-expert slice give a partial sum);
- ``dense`` / ``moe`` under DP attention (no EP for ``moe``): every rank's tokens all-gathered (padded to the
  largest rank's; deepseek_v4 MoE layers gather the token ids too), and the partial outputs of the other ranks'
  tokens sent back (all-to-all);
- ``moe`` under DP attention with EP: ``moe_counts`` (one int64 per other rank), ``moe_dispatch`` (each
  assignment to another rank's expert: its row and its expert id), ``moe_combine`` (the rows sent back). Which
  expert a token picks is data-dependent: the model takes the fraction of assignments that go to other ranks
  (``remote_fraction``; uniform routing: ``(world - 1) / world``);
- ``sync``: the forward's pairing — TP one int64 (the ranks' token counts must agree), DP two (active, tokens);
  a DP rank also runs one closing round per step (:data:`DP_STEP_CLOSE_BYTES`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config

INT64 = 8
FLOAT32 = 4
DP_STEP_CLOSE_BYTES = 2 * INT64  # the all-gather that tells every data-parallel rank the step is over


@dataclass(frozen=True)
class ForwardShape:
    """One forward of one attention group: ``batch`` requests x ``query_len`` positions each (decode 1, verification
    1 + gamma, a prefill chunk its tokens with batch 1); ``length``: the longest request's KV length after the
    forward's tokens; ``logits_rows``: rows whose logits are computed (default ``batch``: the last positions)."""

    batch: int
    query_len: int
    length: int
    logits_rows: int | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.query_len


@dataclass(frozen=True)
class ModelComm:
    """What a model's communication depends on (``of`` reads it from a runtime config; the planner builds it from
    its own model description). ``indexer_rates``: one entry per layer that owns an indexer, its keys per query
    being ``length // rate`` (DSA 1, deepseek_v4 its CSA compress rate)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    dense_layers: int
    moe_layers: int
    experts_per_token: int
    indexer_rates: tuple[int, ...]
    moe_gathers_token_ids: bool = False  # deepseek_v4's hash-routed MoE gathers the token ids with the rows

    @classmethod
    def of(cls, cfg: ModelConfig | DeepseekV4Config) -> ModelComm:
        if isinstance(cfg, DeepseekV4Config):
            rates = tuple(cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)
                          if cfg.layer_types[i] == CSA and cfg.owns_indexer(i))
            return cls(cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, 0, cfg.num_hidden_layers,
                       cfg.num_experts_per_tok, rates, moe_gathers_token_ids=True)
        dense = sum(k == "dense" for k in cfg.mlp_layer_types)
        return cls(cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, dense, cfg.num_hidden_layers - dense,
                   cfg.num_experts_per_tok, (1,) * len(cfg.indexer_layers))


def forward_comm_bytes(cfg: ModelComm | ModelConfig | DeepseekV4Config, shape: ParallelShape,
                       forwards: Sequence[ForwardShape], dtype_bytes: int, remote_fraction: float | None = None
                       ) -> list[dict[str, float]]:
    """Bytes each rank contributes in one forward round, ``{"<layer>_<op>": bytes}`` per rank (module docstring).
    ``forwards``: the forward of each data-parallel group (one entry under tensor parallelism; an idle group is
    ``ForwardShape(0, 0, 0)``). ``remote_fraction``: DP+EP only, the share of assignments sent to other ranks."""
    m = cfg if isinstance(cfg, ModelComm) else ModelComm.of(cfg)
    world = shape.world_size
    if len(forwards) != shape.data_parallel_size:
        raise ValueError(f"{len(forwards)} forwards for {shape.data_parallel_size} data-parallel groups")
    if world == 1:
        return [{}]
    e, hidden = dtype_bytes, m.hidden_size
    kinds = ["dense"] * m.dense_layers + ["moe"] * m.moe_layers
    out: list[dict[str, float]] = []
    for rank in range(world):
        f = forwards[shape.dp_rank(rank)]
        v: dict[str, float] = collections.defaultdict(float)
        if not shape.data_parallel:
            v["sync_all_gather"] += INT64
            v["attention_all_reduce"] += m.num_layers * f.tokens * hidden * e
            for rate in m.indexer_rates if shape.split_indexer else ():
                v["indexer_all_reduce"] += f.tokens * (f.length // rate) * FLOAT32
            rows = f.batch if f.logits_rows is None else f.logits_rows
            v["lm_head_all_gather"] += rows * -(-m.vocab_size // shape.tensor_parallel_size) * e
            for kind in kinds:
                v[f"{kind}_all_reduce"] += f.tokens * hidden * e
        else:
            tokens = [g.tokens for g in forwards]
            v["sync_all_gather"] += 2 * INT64
            others = sum(tokens) - f.tokens
            for kind in kinds:
                if kind == "moe" and shape.expert_parallel:
                    fraction = (world - 1) / world if remote_fraction is None else remote_fraction
                    assignments = f.tokens * m.experts_per_token * fraction
                    v["moe_counts_all_to_all"] += (world - 1) * INT64
                    v["moe_dispatch_all_to_all"] += assignments * (hidden * e + INT64)
                    v["moe_combine_all_to_all"] += assignments * hidden * e  # symmetric loads: what comes back
                    continue
                if max(tokens) == 0:
                    continue
                ids = INT64 if kind == "moe" and m.moe_gathers_token_ids else 0
                v[f"{kind}_all_gather"] += max(tokens) * (hidden * e + ids)
                v[f"{kind}_all_to_all"] += others * hidden * e
        out.append({k: float(x) for k, x in v.items()})
    return out


def decode_comm_bytes(cfg: ModelComm | ModelConfig | DeepseekV4Config, shape: ParallelShape, batch_per_group: int,
                      length: int, dtype_bytes: int, query_len: int = 1) -> dict[str, float]:
    """The planner's figure: bytes per rank of one decode (or verification, ``query_len = 1 + gamma``) step with
    ``batch_per_group`` requests on every data-parallel group, uniform expert routing; by ``<layer>_<op>`` and
    ``total``."""
    logits = batch_per_group * query_len if query_len > 1 else None
    forward = ForwardShape(batch_per_group, query_len, length, logits)
    per_rank = forward_comm_bytes(cfg, shape, [forward] * shape.data_parallel_size, dtype_bytes)[0]
    if shape.data_parallel:
        per_rank["sync_all_gather"] = per_rank.get("sync_all_gather", 0.0) + DP_STEP_CLOSE_BYTES
    per_rank["total"] = sum(per_rank.values())
    return per_rank
