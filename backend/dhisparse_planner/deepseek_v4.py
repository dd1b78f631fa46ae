"""DeepSeek-V4-Flash preset and its per-request device footprint, from the code the V4 manager admits with.

Sources (every number here):

* transformers 5.24 ``DeepseekV4Config`` defaults (documented as ``deepseek-ai/DeepSeek-V4-Flash-Base``) and its
  ``DeepseekV4GroupedLinear`` docstring ("V4-Flash: num_attention_heads=64, head_dim=512, o_groups=8,
  o_lora_rank=1024, hidden_size=4096"): 43 layers, hidden 4096, 64 heads of 512 (64 RoPE), q_lora_rank 1024,
  sliding window 128, compress rates 4 (CSA) / 128 (HCA), indexer 64 heads x 128, index_topk 512, 256 routed
  experts top-6 + 1 shared, moe_intermediate_size 2048, hc_mult 4, 3 hash-routed layers.
* Layer schedule, DeepSeek-V4-Flash model card as summarised in antirez/ds4 ``MODEL_CARD.md``: layers 0-1
  sliding window only, even layers from 2 CSA (ratio 4), odd layers from 3 HCA (ratio 128): 2 / 21 / 20.
* 284B total / 13B active parameters (DeepSeek-V4-Flash model card).
* FP8 KV row as FlashMLA stores V4's latent: 584 B = 448 e4m3 values + 64 bf16 RoPE values (128 B) + 7 e8m0
  scales + 1 pad byte (issue #14).
* ASSUMED: indexer keys in FP8 as DeepSeek-V3.2's (128 e4m3 + a float32 scale = 132 B); compressor pending
  projections in float32 (4 B/value); weights 1 B/param (FP8; V4 ships FP4 experts, so this over-counts
  weights and under-counts the pool) over 8 GPUs, a 1.5 GB DSpark drafter and 10 GB workspace per GPU, as the
  DeepSeek-V3.2 preset assumes.
"""

from __future__ import annotations

import dataclasses

import torch

from dhisparse.kv.config import KVConfig
from dhisparse.kv.deepseek_v4 import csa_layout, entry_rows, tail_state_bytes
from dhisparse.kv.footprint import request_footprint
from dhisparse.model.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from dhisparse_planner.specs import DRAFTERS, H200, HardwareSpec

FP8_ROW_BYTES = 584  # 448 e4m3 + 64 bf16 + 7 e8m0 scales + 1 pad
FP8_INDEX_KEY_BYTES = 132  # ASSUMED, as DeepSeek-V3.2's FP8 indexer key
PENDING_VALUE_BYTES = 4  # ASSUMED float32 compressor state
FLASH_TOTAL_PARAMS = 284e9
FLASH_GPUS = 8
WORKSPACE_BYTES = 10e9

DSV4_FLASH = DeepseekV4Config(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64, num_experts_per_tok=6, n_routed_experts=256,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=1048576,
    layer_types=(SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(2, 43)),
    compress_rate_csa=4, compress_rate_hca=128,
    rope_main={"rope_type": "default", "rope_theta": 10000.0},
    rope_compress={"rope_type": "default", "rope_theta": 160000.0},
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 40,
    swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
    index_topk=512,
)


def kv_pool_bytes(hw: HardwareSpec = H200, drafter: str | None = "dspark") -> float:
    """Device KV budget per GPU: HBM minus FP8 weights over ``FLASH_GPUS``, drafter weights and workspace."""
    extra = DRAFTERS[drafter].weight_bytes if drafter else 0.0
    return hw.hbm_bytes - FLASH_TOTAL_PARAMS / FLASH_GPUS - extra - WORKSPACE_BYTES


def request_split(cfg: DeepseekV4Config, policy: str, prompt_tokens: int, output_tokens: int, *,
                  hot_rows: int = 4096, page_rows: int = 64, pool_bytes: float | None = None,
                  max_query_len: int = 1, draft_ring_bytes: int = 0) -> dict[str, float]:
    """Per-request device bytes under ``policy``: ``required`` (what admission reserves: the hierarchy's
    footprint of the CSA entries in entry rows + the V4 tail), its parts, and ``optional`` (adaptive: complete
    pages of the prompt's CSA entries kept on device while memory is spare). ``max_query_len`` / ``draft_ring_bytes``:
    speculative decoding's verification length and draft ring (``KVConfig``'s fields of the same names)."""
    layout, _ = csa_layout(cfg, torch.float32)
    layout = dataclasses.replace(layout, row_dim=FP8_ROW_BYTES // 4,
                                 index_key_dim=FP8_INDEX_KEY_BYTES // 4)  # float32 words of the FP8 row
    tail = tail_state_bytes(cfg, prompt_tokens + output_tokens, row_bytes=FP8_ROW_BYTES,
                            index_key_bytes=FP8_INDEX_KEY_BYTES, pending_value_bytes=PENDING_VALUE_BYTES)
    pool = int(pool_bytes if pool_bytes is not None else kv_pool_bytes())
    config = KVConfig(policy=policy, pool_bytes=pool, hot_rows=hot_rows, page_rows=page_rows,
                      model_state_bytes=tail, max_query_len=max_query_len, draft_ring_bytes=draft_ring_bytes)
    prompt_rows, new_rows = entry_rows(prompt_tokens, output_tokens, cfg.compress_rate_csa)
    fp = request_footprint(layout, config, prompt_rows, new_rows)
    csa_sources = layout.num_sources
    index_keys = len(cfg.csa_layers) * ((prompt_tokens + output_tokens) // cfg.compress_rate_csa) * FP8_INDEX_KEY_BYTES
    optional_pages = config.kv_policy.optional_prompt_pages(prompt_rows, page_rows)
    optional = csa_sources * optional_pages * page_rows * layout.row_bytes
    return {"required_bytes": float(fp.required_bytes), "csa_pages_bytes": float(fp.pages_bytes),
            "metadata_bytes": float(fp.metadata_bytes), "tail_bytes": float(tail),
            "index_key_bytes": float(index_keys), "optional_bytes": float(optional),
            "all_csa_entries_bytes": float(csa_sources * (prompt_rows + new_rows) * layout.row_bytes)}
