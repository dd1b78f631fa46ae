"""The time model: what a decode step and a prefill cost on one GPU (the only modelled quantity).

Decode step (seconds)::

    compute = max(hbm_bytes / hbm_bw, flops / (flop_rate * mfu))
    path    = step_overhead + compute + exposed(host_bytes / host_bw, compute) [+ draft pass]
    t       = max(path, (host_bytes + refill_bytes) / host_bw)
        draft pass: drafter overhead + drafter weights / hbm_bw + drafter flops / (flop_rate * mfu)

``exposed`` is the index-group schedule of :mod:`dhisparse_planner.overlap`: a full layer's fetched rows are
on the critical path, its shared layers' rows are copied while the layers before them compute. Refilled
optional pages are asynchronous and only bound the step by the link's total busy time.

- ``hbm_bytes``: weights read (dense part + the routed experts the step's tokens touch:
  ``E * (1 - (1 - k/E)^tokens)`` per MoE layer), the rows attention reads (each query its own selection,
  ``min(index_topk, L)`` rows per layer), and the indexer keys (``L`` keys per indexer layer, read once per
  request and step: the indexer scores every query of a verification block against each key it loads).
- ``flops``: ``2 * active_params`` per token, indexer ``2 * heads * dim`` per key and query, attention
  ``attn_flops_per_head_row * heads`` per selected row.
- ``host_bytes``: rows fetched from host (resolver step 3); ``refill_bytes``: optional pages refilled (real bytes).

Prefill (seconds): ``2 * active_params * T`` + indexer ``2 * heads * dim * T^2 / 2`` per indexer layer + sparse
attention ``T * min(topk, T)`` rows per layer, at ``flop_rate * mfu``, divided over the model's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse_planner.overlap import exposed_fetch_seconds
from dhisparse_planner.specs import DrafterSpec, HardwareSpec, ModelSpec


@dataclass(frozen=True)
class StepLoad:
    """What one real decode step does (all real quantities).

    Attributes:
        batch: requests in the step.
        query_tokens: query tokens over the batch (``sum q_i``).
        attention_rows: rows read by attention over all layers and queries.
        index_keys_scanned: indexer keys scored over all indexer layers and queries (FLOPs: per query).
        index_keys_read: indexer keys loaded over all indexer layers (HBM bytes: once per request and step).
        host_bytes: bytes of rows fetched host→device by the resolver (on the step's critical path unless
            the index-group schedule hides them).
        draft_tokens: draft tokens proposed (0 without speculation).
        refill_bytes: bytes of optional pages refilled host→device (asynchronous).
    """

    batch: int
    query_tokens: int
    attention_rows: float
    index_keys_scanned: float
    index_keys_read: float
    host_bytes: float
    draft_tokens: int = 0
    refill_bytes: float = 0.0


def weight_bytes_read(model: ModelSpec, tokens: int) -> float:
    """Weight bytes one GPU reads in a forward over ``tokens`` tokens of its attention rank (the instance runs
    ``attention_dp`` times as many through its MoE / dense layers)."""
    instance = max(tokens, 0) * model.attention_dp
    frac = 1.0 - (1.0 - model.experts_per_token / model.num_experts) ** instance
    experts = model.moe_layers * model.num_experts * frac * model.expert_params
    rest = model.dense_params - model.attention_params + experts
    return (model.attention_params / model.attn_tp + rest / model.gpus) * model.weight_bytes_per_param


def decode_step_seconds(hw: HardwareSpec, model: ModelSpec, load: StepLoad,
                        drafter: DrafterSpec | None = None) -> dict[str, float]:
    """Time of one real decode (or verification) step and its parts (seconds): ``host`` is the exposed
    fetch time, ``fetch`` all of it, ``link`` the host link's busy time (fetches + refills)."""
    kv_bytes = load.attention_rows * model.row_bytes + load.index_keys_read * model.index_key_bytes
    hbm = (weight_bytes_read(model, load.query_tokens) + kv_bytes) / hw.hbm_bytes_per_s
    linear = model.active_params - model.attention_params
    flops = (2.0 * model.attention_params / model.attn_tp * load.query_tokens
             + 2.0 * linear / model.gpus * load.query_tokens * model.attention_dp
             + 2.0 * model.index_heads * model.index_head_dim * load.index_keys_scanned / model.attn_tp
             + model.attn_flops_per_head_row * model.heads_per_gpu * load.attention_rows)
    parts = combine_step(hw, hbm, flops, load.host_bytes, load.refill_bytes, load.draft_tokens, model.num_layers,
                         model.index_group_size, drafter)
    return {**parts, "hbm": hbm, "flops_s": flops / (hw.flops_per_s * hw.mfu)}


def combine_step(hw: HardwareSpec, hbm_s: float, flops: float, host_bytes: float, refill_bytes: float,
                 draft_tokens: int, num_layers: int, index_group_size: int,
                 drafter: DrafterSpec | None = None) -> dict[str, float]:
    """A step's time from its parts (seconds), shared by every model family's time model: compute is the larger of
    HBM time and FLOP time; the host fetch is exposed as the index-group schedule says (overlap.py); the drafter's
    pass is serial; the link (fetches + asynchronous refills) bounds the step from below."""
    rate = hw.flops_per_s * hw.mfu
    compute = max(hbm_s, flops / rate)
    fetch = host_bytes / hw.host_link_bytes_per_s
    host = exposed_fetch_seconds(fetch, compute, num_layers, index_group_size, hw.prefetch_efficiency)
    draft = 0.0
    if drafter is not None and draft_tokens > 0:
        draft = (drafter.pass_overhead_s + drafter.weight_bytes / hw.hbm_bytes_per_s
                 + drafter.flops_per_token * draft_tokens / rate)
    link = (host_bytes + refill_bytes) / hw.host_link_bytes_per_s
    total = max(hw.step_overhead_s + compute + host + draft, link)
    return {"total": total, "overhead": hw.step_overhead_s, "compute": compute, "host": host, "draft": draft,
            "fetch": fetch, "link": link}


def prefill_seconds(hw: HardwareSpec, model: ModelSpec, tokens: int) -> float:
    """Time to prefill ``tokens`` prompt tokens on the serving GPUs (seconds)."""
    t = float(tokens)
    flops = (2.0 * model.active_params * t
             + model.num_indexers * 2.0 * model.index_heads * model.index_head_dim * t * t / 2.0
             + model.num_layers * model.attn_flops_per_head_row * model.attn_heads * model.gpus
             * t * min(model.index_topk, t))
    # one attention rank's prompt on its attn_tp GPUs (the ranks prefill side by side: the instance's MoE work of
    # attention_dp prompts is spread over all gpus, i.e. one prompt's over attn_tp of them)
    return flops / model.attn_tp / (hw.flops_per_s * hw.mfu)
