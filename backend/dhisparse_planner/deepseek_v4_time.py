"""The DeepSeek-V4 time model: what one decode / verification step costs one GPU (seconds).

Same structure and hardware constants as the DSA model (:mod:`dhisparse_planner.timing`); what differs is
what a V4 step reads and computes. Per query token and layer (``L`` = context tokens, ``W`` = sliding window,
``E = L // rate_csa`` compressed CSA entries, ``H = L // rate_hca`` HCA entries, ``k`` = ``index_topk``)::

    rows   = every layer: min(L, W) window rows  + CSA layer: min(k, E) selected entries  + HCA layer: H entries
    keys   = CSA layer that owns an indexer: E indexer keys (the lightning indexer scores every entry)

    hbm    = weight bytes read + rows * row_bytes + keys_per_request * index_key_bytes   (keys read once per step)
    flops  = 2 * active_params * T / gpus                                    (every projection, MoE, mHC, head)
           + (heads / attn_tp) * attn_flops_per_head_row * rows              (K=V MQA over the rows)
           + (index_heads / attn_tp) * 2 * index_head_dim * keys             (indexer scores)
    compute = max(hbm / hbm_bw, flops / (flop_rate * mfu))
    fetch  = host_bytes / host_bw        (CSA entries the resolver fetched; every CSA layer owns its indexer,
                                          so its fetch follows its own top-k: exposed, overlap.py group size 1)
    t      = max(step_overhead + compute + exposed(fetch) + draft, (host_bytes + refill_bytes) / host_bw)

Rows are summed over the step's query tokens (each query its own selection, the DSA model's convention); indexer
keys are read once per request and step (the indexer scores every query of a verification block against each key
it loads) and scored per query (FLOPs). With ``V4Deployment.kv_read_once`` the bytes of the window rows and HCA
entries are counted once per request and step too (a kernel that serves a verification block's ``next_n`` queries
from one read of the request's KV), FLOPs and the CSA selected rows still per query (an ASSUMPTION either way:
both are reported). Parameters come from the V4 config's own tensor list (``weights.expected_shapes``): every tensor but
the embedding table is a matmul weight read once per step; routed experts are read for the experts the step's
tokens touch, ``E * (1 - (1 - k/E)^T)`` per MoE layer with ``T`` the instance's tokens. Compressors,
indexer projections, mHC mixing and the hyper head are parameters too (in ``active_params``); the Sinkhorn
iterations on the ``hc_mult x hc_mult`` mixing matrix and the compressors' elementwise state updates are not
counted (O(hc^2 * iters) and O(width) per token and layer: below 0.1% of a layer's projections).

Deployment (:class:`V4Deployment`): weights sharded over ``gpus`` (the preset's pool assumes it); attention
tensor-parallel over ``attn_tp`` GPUs (``attn_tp = gpus``: TP attention, the single K=V latent head is
replicated, so every GPU holds and reads the whole instance's KV; ``attn_tp = 1``: data-parallel attention,
each GPU holds and attends its own requests). Linear work is the instance's tokens over ``gpus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.deepseek_v4.weights import expected_shapes
from dhisparse_planner.specs import DrafterSpec, HardwareSpec
from dhisparse_planner.timing import combine_step


@dataclass(frozen=True)
class V4Params:
    """Parameter counts of a V4 config (from its tensor list). ``dense``: every matmul weight but the routed
    experts (embedding lookup excluded); ``expert``: one routed expert; ``active``: per token."""

    total: float
    dense: float
    expert: float
    active: float
    moe_layers: int
    num_experts: int
    experts_per_token: int

    @classmethod
    def of(cls, cfg: DeepseekV4Config) -> V4Params:
        shapes = expected_shapes(cfg)
        total = float(sum(math.prod(s) for s in shapes.values()))
        routed = float(sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n))
        embed = float(math.prod(shapes["model.embed_tokens.weight"]))
        layers, e, k = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
        expert = routed / (layers * e)
        dense = total - routed - embed
        return cls(total, dense, expert, dense + layers * k * expert, layers, e, k)


@dataclass(frozen=True)
class V4Deployment:
    """``gpus`` the weights are sharded over; ``attn_tp`` GPUs one request's attention is split over (see the
    module docstring); ``weight_bytes_per_param`` (FP8: 1.0); ``kv_read_once``: window rows and HCA entries
    read once per request and step instead of once per query token (indexer keys always are)."""

    gpus: int = 8
    attn_tp: int = 8
    weight_bytes_per_param: float = 1.0
    kv_read_once: bool = False

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.attn_tp < 1 or self.gpus % self.attn_tp:
            raise ValueError(f"V4Deployment: attn_tp ({self.attn_tp}) must divide gpus ({self.gpus}), both >= 1")

    @property
    def kv_groups(self) -> int:
        """Groups of GPUs that hold disjoint requests (data-parallel attention ranks)."""
        return self.gpus // self.attn_tp


@dataclass(frozen=True)
class V4Costs:
    """What the time model needs of a V4 config, with the serving byte sizes (see the module docstring)."""

    cfg: DeepseekV4Config
    params: V4Params
    row_bytes: int
    index_key_bytes: int
    attn_flops_per_head_row: float

    @classmethod
    def of(cls, cfg: DeepseekV4Config, row_bytes: int, index_key_bytes: int) -> V4Costs:
        # K = V: scores over head_dim and the value accumulation over head_dim
        return cls(cfg, V4Params.of(cfg), row_bytes, index_key_bytes, 2.0 * (cfg.head_dim + cfg.head_dim))

    def rows_and_keys(self, context_tokens: torch.Tensor, query_lens: torch.Tensor) -> dict[str, float]:
        """Over the step (``context_tokens`` / ``query_lens`` ``[B]``): ``rows`` attended and indexer ``keys``
        scanned (per query); ``selected`` of the rows are CSA top-k entries, the rest window rows and HCA
        entries; ``shared_rows`` / ``shared_keys``: the window + HCA rows and the keys counted once per request."""
        c = self.cfg
        ctx = context_tokens.to(torch.float64)
        q = query_lens.to(torch.float64)
        shared = c.num_hidden_layers * torch.clamp(ctx, max=c.sliding_window)
        shared = shared + len(c.hca_layers) * torch.div(ctx, c.compress_rate_hca, rounding_mode="floor")
        entries = torch.div(ctx, c.compress_rate_csa, rounding_mode="floor")
        selected = len(c.csa_layers) * torch.clamp(entries, max=c.index_topk)
        keys = sum(1 for layer in c.csa_layers if c.owns_indexer(layer)) * entries
        return {"rows": float((q * (shared + selected)).sum()), "keys": float((q * keys).sum()),
                "selected": float((q * selected).sum()), "shared_rows": float(shared.sum()),
                "shared_keys": float(keys.sum())}


@dataclass(frozen=True)
class V4StepLoad:
    """One real step on one GPU: the requests this GPU's pool holds (``context_tokens``, ``query_lens`` [B]),
    ``host_bytes`` fetched / ``refill_bytes`` refilled over its link, ``draft_tokens`` proposed."""

    context_tokens: torch.Tensor
    query_lens: torch.Tensor
    host_bytes: float = 0.0
    refill_bytes: float = 0.0
    draft_tokens: int = 0


def weight_bytes_read(costs: V4Costs, dep: V4Deployment, instance_tokens: int) -> float:
    """Weight bytes one GPU reads in a forward over the instance's ``instance_tokens`` tokens."""
    p = costs.params
    frac = 1.0 - (1.0 - p.experts_per_token / p.num_experts) ** max(instance_tokens, 0)
    params = p.dense + p.moe_layers * p.num_experts * frac * p.expert
    return params * dep.weight_bytes_per_param / dep.gpus


def v4_step_seconds(hw: HardwareSpec, costs: V4Costs, dep: V4Deployment, load: V4StepLoad,
                    drafter: DrafterSpec | None = None) -> dict[str, float]:
    """Time of one real decode / verification step on one GPU and its parts (seconds)."""
    n = costs.rows_and_keys(load.context_tokens, load.query_lens)
    rows, keys = n["rows"], n["keys"]
    gpu_tokens = int(load.query_lens.sum())
    instance_tokens = gpu_tokens * dep.kv_groups
    c = costs.cfg
    kv_rows = n["selected"] + n["shared_rows"] if dep.kv_read_once else rows
    kv_bytes = kv_rows * costs.row_bytes + n["shared_keys"] * costs.index_key_bytes  # keys: once per request
    hbm = (weight_bytes_read(costs, dep, instance_tokens) + kv_bytes) / hw.hbm_bytes_per_s
    flops = (2.0 * costs.params.active * instance_tokens / dep.gpus
             + c.num_attention_heads / dep.attn_tp * costs.attn_flops_per_head_row * rows
             + c.index_n_heads / dep.attn_tp * 2.0 * c.index_head_dim * keys)
    parts = combine_step(hw, hbm, flops, load.host_bytes, load.refill_bytes, load.draft_tokens,
                         max(1, len(c.csa_layers)), 1, drafter)  # each CSA layer owns its indexer: groups of 1
    return {**parts, "hbm": hbm, "flops_s": flops / (hw.flops_per_s * hw.mfu), "rows": rows, "keys": keys}

