"""MLA attention with the lightning indexer (DeepSeek Sparse Attention), absorbed over latent KV rows.

Per token and layer the KV *row* is ``[kv_a_layernorm(c_kv) (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim)]``.
Attention never expands rows into per-head keys/values: the query's no-RoPE part is absorbed through
``W_UK`` (``q_lat = q_nope @ W_UK``), scores are ``q_lat·c + q_pe·k_pe``, and the output ``Σ p·c`` is projected
through ``W_UV`` — mathematically identical to transformers' expanded form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.model.collectives import LOCAL, Collectives
from dhisparse.model.config import ModelConfig
from dhisparse.model.kv_view import StepKV
from dhisparse.model.layers import attention_softmax_scale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not config.rms_norm_eps
INDEX_TILE_TOKENS = 2048  # key positions scored at once: the indexer's workspace does not grow with the context
QUERY_TILE_TOKENS = 64  # queries scored / attended at once: a prefill chunk's workspace does not grow with the chunk


class IndexedMLA:
    """One layer's attention; ``weights`` holds canonical tensor names (``model.layers.{i}.self_attn.…``).

    Under tensor parallelism the weights are this rank's slice (``engine/parallel/sharding.py``): the heads of
    ``q_b``/``kv_b``/``o_proj`` and the indexer heads of ``wq_b``/``weights_proj``, their counts read from the
    shapes; the latent row (``kv_a``) and the indexer key (``wk``) stay whole, so every rank writes the same rows.
    ``collectives`` completes the partial output projection and indexer scores (:mod:`dhisparse.model.collectives`).
    """

    def __init__(self, cfg: ModelConfig, layer: int, weights: dict[str, torch.Tensor]) -> None:
        p = f"model.layers.{layer}.self_attn."
        self.cfg, self.layer = cfg, layer
        self.qk_head_dim = cfg.qk_head_dim
        self.q_a = weights[p + "q_a_proj.weight"]
        self.q_a_bias = weights.get(p + "q_a_proj.bias")
        self.q_a_norm = weights[p + "q_a_layernorm.weight"]
        self.q_b = weights[p + "q_b_proj.weight"]
        self.kv_a = weights[p + "kv_a_proj_with_mqa.weight"]
        self.kv_a_bias = weights.get(p + "kv_a_proj_with_mqa.bias")
        self.kv_a_norm = weights[p + "kv_a_layernorm.weight"]
        self.o = weights[p + "o_proj.weight"]
        self.o_bias = weights.get(p + "o_proj.bias")
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.heads = self.q_b.shape[0] // self.qk_head_dim  # this rank's heads (all of them on one rank)
        kv_b = weights[p + "kv_b_proj.weight"].view(self.heads, nope + v, cfg.kv_lora_rank)
        self.w_uk = kv_b[:, :nope, :].contiguous()  # [H, nope, rank]
        self.w_uv = kv_b[:, nope:, :].contiguous()  # [H, v, rank]
        self.scaling = attention_softmax_scale(cfg)
        self.has_indexer = cfg.indexer_types[layer] == "full"
        self.collectives: Collectives = LOCAL
        if self.has_indexer:
            x = p + "indexer."
            self.idx_wq = weights[x + "wq_b.weight"]
            self.idx_wk = weights[x + "wk.weight"]
            self.idx_norm_w = weights[x + "k_norm.weight"]
            self.idx_norm_b = weights[x + "k_norm.bias"]
            self.idx_weights = weights[x + "weights_proj.weight"]
            self.idx_scale = cfg.index_head_dim**-0.5
            self.idx_rope = apply_rope_interleaved if cfg.indexer_interleaved_rope else apply_rope_half_split

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: StepKV,
        shared_selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, Q, hidden]`` (already input-normed), ``positions [B, Q]``, ``cos/sin [B, Q, rope]``.

        Returns ``(output [B, Q, hidden], selection [B, Q, K])`` where ``selection`` holds the positions each
        query attends to (−1 = unused); shared layers pass the group's selection in ``shared_selection``.
        """
        cfg = self.cfg
        b, q_len, _ = x.shape
        rank = cfg.kv_lora_rank
        # RMSNorms as DeepseekV3RMSNorm (float32, cast back, then scaled: ``layers.rms_norm``), written with torch's
        # fused op in place: the decode step calls them twice per layer (``test_layers.py`` checks the equality).
        q_resid = F.linear(x, self.q_a, self.q_a_bias)
        q_resid = self.q_a_norm * F.rms_norm(q_resid.float(), self.q_a_norm.shape, eps=LATENT_NORM_EPS).to(x.dtype)
        q = F.linear(q_resid, self.q_b).view(b, q_len, self.heads, self.qk_head_dim)
        q_nope, q_rot = torch.split(q, [cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        compressed = F.linear(x, self.kv_a, self.kv_a_bias)
        kv_pass, k_rot = torch.split(compressed, [rank, cfg.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_a_norm * F.rms_norm(kv_pass.float(), self.kv_a_norm.shape, eps=LATENT_NORM_EPS).to(x.dtype)
        q_rot = apply_rope_interleaved(q_rot, cos.unsqueeze(2), sin.unsqueeze(2))
        k_rot = apply_rope_interleaved(k_rot, cos, sin)
        rows = torch.cat([k_pass, k_rot], dim=-1)  # [B, Q, row_dim]

        index_q = index_k = None
        if self.has_indexer:
            index_q, index_k = self._indexer_qk(x, q_resid, cos, sin)
        kv.write(self.layer, rows, index_k)
        if self.has_indexer:
            selection = self._select(x, index_q, kv, positions)
        else:
            if shared_selection is None:
                raise ValueError(f"layer {self.layer} shares top-k but no earlier layer produced a selection")
            selection = shared_selection

        q_lat = torch.einsum("bqhn,hnr->bqhr", q_nope, self.w_uk)
        # A KV step with device kernels (dhisparse.kernels) attends over resolved rows in one kernel.
        out_lat = kv.attend(self.layer, selection, q_lat, q_rot, self.scaling) if kv.device_attention else None
        if out_lat is None:
            # Stores whose gather is a plain lookup (the prefill's LocalKV) are read QUERY_TILE_TOKENS queries at a
            # time; a hierarchical step resolves each layer's selection once, with its few decode/verify queries.
            # (One tile passes the selection tensor itself: a hierarchical step recognises a shared selection by
            # identity.)
            tile = QUERY_TILE_TOKENS if kv.query_tiled_gather else q_len
            if tile >= q_len:
                out_lat = self._attend_rows(kv, selection, q_lat, q_rot)
            else:
                out_lat = torch.cat([self._attend_rows(kv, selection[:, s:s + tile], q_lat[:, s:s + tile],
                                                       q_rot[:, s:s + tile]) for s in range(0, q_len, tile)], dim=1)
        out = torch.einsum("bqhr,hvr->bqhv", out_lat, self.w_uv).reshape(b, q_len, -1)
        if self.collectives is LOCAL:  # one rank: nothing to combine, no call
            return F.linear(out, self.o, self.o_bias), selection
        if self.o_bias is not None:  # row-parallel: the bias once, after the sum
            return self.collectives.attention_output(F.linear(out, self.o)) + self.o_bias, selection
        return self.collectives.attention_output(F.linear(out, self.o)), selection

    def _attend_rows(self, kv: StepKV, selection: torch.Tensor, q_lat: torch.Tensor, q_rot: torch.Tensor
                     ) -> torch.Tensor:
        """Absorbed attention of queries ``[B, q, …]`` over their selected rows: ``[B, q, heads, rank]``."""
        rank = self.cfg.kv_lora_rank
        gathered = kv.gather(self.layer, selection)  # [B, q, K, row_dim]
        latent, pe = gathered[..., :rank], gathered[..., rank:]
        scores = torch.einsum("bqhr,bqkr->bqhk", q_lat, latent) + torch.einsum("bqhp,bqkp->bqhk", q_rot, pe)
        scores = (scores * self.scaling).masked_fill((selection < 0).unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return torch.einsum("bqhk,bqkr->bqhr", probs, latent)

    def _indexer_qk(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        b, q_len, _ = x.shape
        rope = cfg.qk_rope_head_dim
        q = F.linear(q_resid, self.idx_wq).view(b, q_len, -1, cfg.index_head_dim)  # this rank's indexer heads
        k = F.layer_norm(F.linear(x, self.idx_wk), (cfg.index_head_dim,), self.idx_norm_w, self.idx_norm_b, 1e-6)
        q = torch.cat([self.idx_rope(q[..., :rope], cos.unsqueeze(2), sin.unsqueeze(2)), q[..., rope:]], dim=-1)
        k = torch.cat([self.idx_rope(k[..., :rope], cos, sin), k[..., rope:]], dim=-1)
        return q, k

    def _select(self, x: torch.Tensor, index_q: torch.Tensor, kv: StepKV, positions: torch.Tensor) -> torch.Tensor:
        """Lightning-indexer top-k: ``Σ_h w_h · relu(scale · q_h·k)`` in float32, causal, ``K = min(topk, T)``.

        Keys are scored ``INDEX_TILE_TOKENS`` positions at a time and the running top-k is merged tile by tile,
        queries ``QUERY_TILE_TOKENS`` at a time, so the scores' workspace is ``[B, q_tile, heads, tile]`` float32
        at any context length and chunk size. With one tile (short
        contexts) this is the plain top-k over all positions; across tiles it selects the same positions in the
        same order whenever the scores are distinct."""
        cfg = self.cfg
        total = kv.max_length
        head_w = F.linear(x.to(self.idx_weights.dtype), self.idx_weights).float() * (cfg.index_n_heads**-0.5)
        k = min(cfg.index_topk, total)
        lengths = kv.lengths.view(-1, 1, 1)
        q_len = index_q.shape[1]
        q_tiles = [(a, min(q_len, a + QUERY_TILE_TOKENS)) for a in range(0, q_len, QUERY_TILE_TOKENS)]
        best: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(q_tiles)
        for start in range(0, total, INDEX_TILE_TOKENS):
            stop = min(total, start + INDEX_TILE_TOKENS)
            keys_t = kv.index_keys(self.layer, start, stop).transpose(-1, -2).float().unsqueeze(1)  # [B, 1, d, tile]
            t = torch.arange(start, stop, device=keys_t.device).view(1, 1, -1)
            for i, (a, b) in enumerate(q_tiles):
                scores = F.relu(torch.matmul(index_q[:, a:b].float(), keys_t) * self.idx_scale)  # [B, q, heads, tile]
                index_scores = torch.matmul(head_w[:, a:b].unsqueeze(-2), scores).squeeze(-2)  # [B, q, tile]
                if self.collectives is not LOCAL:
                    index_scores = self.collectives.indexer_scores(index_scores)
                visible = (t <= positions[:, a:b].unsqueeze(-1)) & (t < lengths)
                index_scores = index_scores.masked_fill(~visible, float("-inf"))
                idx = t.expand_as(index_scores)
                prev = best[i]
                if prev is not None:
                    index_scores = torch.cat([prev[0], index_scores], dim=-1)
                    idx = torch.cat([prev[1], idx], dim=-1)
                values, pick = index_scores.topk(min(k, index_scores.shape[-1]), dim=-1)
                best[i] = (values, idx.gather(-1, pick) if start else pick)
        done = [pair for pair in best if pair is not None]
        assert len(done) == len(best)
        values_all = torch.cat([v for v, _ in done], dim=1) if len(done) > 1 else done[0][0]
        idx_all = torch.cat([j for _, j in done], dim=1) if len(done) > 1 else done[0][1]
        return torch.where(torch.isneginf(values_all), torch.full_like(idx_all, -1), idx_all)


# --------------------------------------------------------------------------- RoPE applied to queries and keys
def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x0, x1), (x2, x3) …``; output is de-interleaved (evens then odds).

    ``x [..., rope_dim]``; ``cos``/``sin`` broadcastable to ``x`` without their last dim halved.
    """
    cos = cos[..., : cos.shape[-1] // 2]
    sin = sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Standard rotate-half RoPE (first half / second half pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
