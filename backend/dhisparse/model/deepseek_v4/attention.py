"""DeepSeek-V4 attention (transformers' ``DeepseekV4Attention``), over a :class:`V4StepKV`.

Single K=V latent head of ``head_dim`` shared by every query head (MQA), partial interleaved RoPE on the
trailing ``qk_rope_head_dim`` channels, a learnable per-head sink logit, and per query the union of

* the sliding window: the ``W`` most recent rows (itself included), every layer;
* CSA layers: the lightning indexer's top-``index_topk`` compressed entries among those complete before the
  query (entry ``w`` is visible at position ``t`` iff ``w < (t + 1) // rate``);
* HCA layers: every compressed entry visible by the same rule.

The output's RoPE slice is rotated back (``-sin``) at the query position and projected by the grouped low-rank
output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.model.collectives import LOCAL, Collectives
from dhisparse.model.deepseek_v4.compressor import Compressor
from dhisparse.model.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import V4StepKV
from dhisparse.model.deepseek_v4.layers import Rotary, apply_rope, grouped_output, rms_norm, unweighted_rms_norm


class V4Attention:
    """One layer's attention. Under tensor parallelism the weights are this rank's slice: whole output groups of
    ``o_a``/``o_b`` with their heads of ``q_b`` and ``sinks``, and the indexer heads; the K=V row and the compressors
    stay whole. ``collectives`` completes the partial output projection and indexer scores."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, w: dict[str, torch.Tensor]) -> None:
        p = f"model.layers.{layer}.self_attn."
        self.cfg, self.layer, self.kind = cfg, layer, cfg.layer_types[layer]
        self.rope_set = "main" if self.kind == SLIDING else "compress"
        self.q_a, self.q_a_norm, self.q_b = w[p + "q_a_proj.weight"], w[p + "q_a_norm.weight"], w[p + "q_b_proj.weight"]
        self.kv_proj, self.kv_norm = w[p + "kv_proj.weight"], w[p + "kv_norm.weight"]
        self.o_a, self.o_b, self.sinks = w[p + "o_a_proj.weight"], w[p + "o_b_proj.weight"], w[p + "sinks"]
        self.scaling = cfg.head_dim**-0.5
        self.o_groups = self.o_a.shape[0] // cfg.o_lora_rank  # this rank's output groups (all on one rank)
        self.collectives: Collectives = LOCAL
        self.rate = cfg.compress_rate(layer)
        self.source = cfg.source_of(layer)
        self.compressor = self.index_compressor = None
        if self.kind != SLIDING and cfg.owns_compressor(layer):
            c = p + "compressor."
            self.compressor = Compressor((layer, "kv"), w, c, self.rate, self.kind == CSA, cfg.rms_norm_eps)
            if self.kind == CSA:
                self.index_compressor = Compressor((layer, "index"), w, c + "indexer.", self.rate, True,
                                                   cfg.rms_norm_eps)
        self.has_indexer = self.kind == CSA and cfg.owns_indexer(layer)
        if self.has_indexer:
            x = p + "compressor.indexer."
            self.idx_q_b = w[x + "q_b_proj.weight"]
            self.idx_weights = w[x + "scorer.weights_proj.weight"]

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, kv: V4StepKV, rotary: dict[str, Rotary],
        shared_selection: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, Q, hidden]`` (input-normed), ``positions [B, Q]``. Returns ``(out [B, Q, hidden], selection)``
        where ``selection [B, Q, K]`` holds the CSA entries each query attends to (−1 = none), else ``None``.
        A layer that reuses its source's top-k passes it in ``shared_selection``."""
        cfg = self.cfg
        b, q_len, _ = x.shape
        eps = cfg.rms_norm_eps
        cos, sin = rotary[self.rope_set](positions, x.dtype)
        cos_h, sin_h = cos.unsqueeze(2), sin.unsqueeze(2)
        q_resid = rms_norm(F.linear(x, self.q_a), self.q_a_norm, eps)
        q = unweighted_rms_norm(F.linear(q_resid, self.q_b).view(b, q_len, -1, cfg.head_dim), eps)
        q = apply_rope(q, cos_h, sin_h)  # [B, Q, H, d]
        row = apply_rope(rms_norm(F.linear(x, self.kv_proj), self.kv_norm, eps), cos, sin)  # [B, Q, d]
        win_rows, win_valid = kv.window(self.layer, row)
        logits = [torch.einsum("bqhd,bqwd->bqhw", q, win_rows) * self.scaling]
        masks = [win_valid]
        values = [win_rows]
        selection = None
        if self.kind != SLIDING:
            if self.compressor is not None:
                self.compressor(x, kv, rotary["compress"])
            threshold = torch.div(positions + 1, self.rate, rounding_mode="floor")  # [B, Q]
            if self.kind == HCA:
                entries = kv.entries((self.source, "kv"), self.rate)  # [B, E, d]
                visible = torch.arange(entries.shape[1], device=x.device) < threshold.unsqueeze(-1)  # [B, Q, E]
                logits.append(torch.einsum("bqhd,bed->bqhe", q, entries) * self.scaling)
                masks.append(visible)
                values.append(entries.unsqueeze(1).expand(-1, q_len, -1, -1))
            else:
                if self.index_compressor is not None:
                    self.index_compressor(x, kv, rotary["compress"])
                if self.has_indexer:
                    selection = self._select(x, q_resid, positions, threshold, kv, rotary["compress"])
                elif shared_selection is None:
                    raise ValueError(f"layer {self.layer} reuses the top-k of layer {self.source}, which gave none")
                else:
                    selection = shared_selection
                picked = kv.gather_entries(self.layer, (self.source, "kv"), self.rate, selection)
                logits.append(torch.einsum("bqhd,bqkd->bqhk", q, picked) * self.scaling)
                masks.append(selection >= 0)
                values.append(picked)
        scores = torch.cat([lg.masked_fill(~m.unsqueeze(2), float("-inf")) for lg, m in zip(logits, masks,
                                                                                            strict=True)], dim=-1)
        sinks = self.sinks.view(1, 1, -1, 1).expand(b, q_len, -1, 1)
        scores = torch.cat([scores, sinks], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(row.dtype)
        out = torch.zeros_like(q)
        start = 0
        for v in values:
            n = v.shape[2]
            out = out + torch.einsum("bqhk,bqkd->bqhd", probs[..., start:start + n], v)
            start += n
        out = apply_rope(out, cos_h, -sin_h)
        partial = grouped_output(out.reshape(b, q_len, -1), self.o_a, self.o_b, self.o_groups)
        return self.collectives.attention_output(partial), selection

    def _select(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, threshold: torch.Tensor,
                kv: V4StepKV, rotary: Rotary) -> torch.Tensor:
        """Lightning indexer over the compressed indexer keys: ``Σ_h w_h · relu(q_h·k) · scale``, causal by
        window, ``K = min(index_topk, entries)``; −1 marks picks that are not visible."""
        cfg = self.cfg
        b, q_len, _ = x.shape
        keys = kv.entries((self.source, "index"), self.rate)  # [B, E, d_index]
        cos, sin = rotary(positions, x.dtype)
        q = F.linear(q_resid, self.idx_q_b).view(b, q_len, -1, cfg.index_head_dim)  # this rank's indexer heads
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)))
        scores = scores * cfg.index_head_dim**-0.5  # [B, Q, heads, E]
        head_w = F.linear(x, self.idx_weights).float() * cfg.index_n_heads**-0.5
        index_scores = self.collectives.indexer_scores((scores * head_w.unsqueeze(-1)).sum(dim=2))  # [B, Q, E]
        n_entries = keys.shape[1]
        if n_entries == 0:
            return torch.empty(b, q_len, 0, dtype=torch.int64, device=x.device)
        future = torch.arange(n_entries, device=x.device) >= threshold.unsqueeze(-1)
        top = index_scores.masked_fill(future, float("-inf")).topk(min(cfg.index_topk, n_entries), dim=-1).indices
        return torch.where(top >= threshold.unsqueeze(-1), torch.full_like(top, -1), top)
