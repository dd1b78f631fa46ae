"""DeepSeek-V4's DSpark drafter: ``mtp.{0..S-1}.*`` stages inside a V4 checkpoint, each a V4 block whose attention
reads a 128-token sliding window of the target.

Rule (as DeepSeek-V4's inference code and the serving ports of it run it):

* features: per position the mean over the ``hc_mult`` residual streams of the outputs of the target layers
  ``dspark_target_layer_ids`` (what the V4 runtime captures), concatenated; ``main_x = main_norm(main_proj(·))``
  (stage 0's weights);
* context rows: per stage ``s``, ``RoPE_p(kv_norm_s(wkv_s(main_x)))`` (one MQA latent row of ``head_dim``); the
  ring holds the latest ``sliding_window`` positions;
* block: ``[last token, noise × (block - 1)]`` at positions ``p .. p + block - 1``, the target's embedding
  expanded to the mHC streams, through every stage (mHC-wrapped attention and MoE); each block query attends to
  every ring row and every block row (bidirectional) plus the per-head sink; the output's RoPE slice is rotated
  back; grouped low-rank output projection;
* head (last stage): ``hc_head`` collapse, ``norm``, the target's LM head in float32 -> base logits of every slot;
  the Markov bias ``W2 W1[prev]`` is added left to right as tokens are chosen; confidence
  ``proj([x_i, W1[prev_i]])`` per slot (``x`` before the norm), cut as DeepSpec cuts it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dhisparse.errors import ConfigError
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.deepseek_v4.layers import (
    HyperConnection,
    Rotary,
    V4MoE,
    apply_rope,
    grouped_output,
    hyper_head,
    hyper_merge,
    rms_norm,
    unweighted_rms_norm,
)
from dhisparse.spec.proposal_law import choose

from .runtime_types import DraftOutput, ProposalContext


@dataclass(frozen=True)
class V4DSparkSpec:
    """The ``dspark_*`` fields of a DeepSeek-V4 config and the number of ``mtp`` stages its tensors hold."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    stages: int
    n_routed_experts: int
    num_experts_per_tok: int

    @classmethod
    def parse(cls, raw: dict[str, Any], cfg: DeepseekV4Config, stages: int, where: str) -> V4DSparkSpec:
        def need(key: str, minimum: int) -> int:
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{where}: field {key!r} must be an integer >= {minimum}, got {value!r}")
            return value

        ids = raw.get("dspark_target_layer_ids")
        if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ConfigError(f"{where}: dspark_target_layer_ids must be a non-empty list of layer indices, "
                              f"got {ids!r}")
        bad = [i for i in ids if not 0 <= i < cfg.num_hidden_layers]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(f"{where}: dspark_target_layer_ids {ids} must be distinct layers of the "
                              f"{cfg.num_hidden_layers}-layer model")
        noise = need("dspark_noise_token_id", 0)
        if noise >= cfg.vocab_size:
            raise ConfigError(f"{where}: dspark_noise_token_id {noise} is outside the vocabulary ({cfg.vocab_size})")
        if stages < 1:
            raise ConfigError(f"{where}: no mtp.0.* tensors: this DeepSeek-V4 checkpoint carries no DSpark stages")
        experts = raw.get("dspark_n_routed_experts") or cfg.n_routed_experts
        top_k = raw.get("dspark_num_experts_per_tok") or cfg.num_experts_per_tok
        if top_k > experts:
            raise ConfigError(f"{where}: dspark_num_experts_per_tok {top_k} exceeds dspark_n_routed_experts {experts}")
        return cls(need("dspark_block_size", 1), noise, tuple(ids), need("dspark_markov_rank", 1), stages,
                   int(experts), int(top_k))


def v4_expected_shapes(cfg: DeepseekV4Config, spec: V4DSparkSpec) -> dict[str, tuple[int, ...]]:
    """The drafter's tensors under DeepSeek's names (``mtp.S.…``), routed experts one by one."""
    h, heads, hd, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    hc, inter, mix, r = cfg.hc_mult, cfg.moe_intermediate_size, (2 + cfg.hc_mult) * cfg.hc_mult, spec.markov_rank
    shapes: dict[str, tuple[int, ...]] = {}
    for s in range(spec.stages):
        p = f"mtp.{s}."
        shapes.update({
            p + "attn.wq_a.weight": (qr, h), p + "attn.q_norm.weight": (qr,), p + "attn.wq_b.weight": (heads * hd, qr),
            p + "attn.wkv.weight": (hd, h), p + "attn.kv_norm.weight": (hd,), p + "attn.attn_sink": (heads,),
            p + "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
            p + "attn.wo_b.weight": (h, cfg.o_groups * cfg.o_lora_rank),
            p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
            p + "ffn.gate.weight": (spec.n_routed_experts, h), p + "ffn.gate.bias": (spec.n_routed_experts,),
            p + "ffn.shared_experts.w1.weight": (inter, h), p + "ffn.shared_experts.w3.weight": (inter, h),
            p + "ffn.shared_experts.w2.weight": (h, inter),
        })
        for hc_name in ("hc_attn", "hc_ffn"):
            shapes.update({f"{p}{hc_name}_fn": (mix, hc * h), f"{p}{hc_name}_base": (mix,),
                           f"{p}{hc_name}_scale": (3,)})
        for e in range(spec.n_routed_experts):
            shapes.update({f"{p}ffn.experts.{e}.w1.weight": (inter, h), f"{p}ffn.experts.{e}.w3.weight": (inter, h),
                           f"{p}ffn.experts.{e}.w2.weight": (h, inter)})
    shapes.update({"mtp.0.main_proj.weight": (h, len(spec.target_layer_ids) * h), "mtp.0.main_norm.weight": (h,)})
    last = f"mtp.{spec.stages - 1}."
    shapes.update({last + "norm.weight": (h,), last + "hc_head_fn": (hc, hc * h), last + "hc_head_base": (hc,),
                   last + "hc_head_scale": (1,), last + "markov_head.markov_w1.weight": (cfg.vocab_size, r),
                   last + "markov_head.markov_w2.weight": (cfg.vocab_size, r),
                   last + "confidence_head.proj.weight": (1, h + r)})
    return shapes


def v4_float32(name: str) -> bool:
    """Tensors V4 keeps in float32 whatever the model dtype (mHC, norms, sinks, router bias, heads)."""
    return ("hc_" in name or name.endswith(("norm.weight", "attn_sink", "gate.bias"))
            or "markov_head" in name or "confidence_head" in name)


class V4DSparkDrafter:
    """A loaded V4 DSpark drafter bound to the target's ``embed [V, H]`` and ``lm_head [V, H]``."""

    fmt = "dspark-v4"
    has_confidence = True

    def __init__(self, cfg: DeepseekV4Config, spec: V4DSparkSpec, w: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.cfg, self.spec, self.w = cfg, spec, w
        self.embed, self.lm_head = embed, lm_head
        self.dtype = w["mtp.0.main_proj.weight"].dtype
        self.target_layer_ids = spec.target_layer_ids
        self.max_gamma = spec.block_size
        self.context_window = cfg.sliding_window
        self.row_values = spec.stages * cfg.head_dim
        self.rotary = Rotary(cfg.rope_sets["main"], w["mtp.0.main_proj.weight"].device)
        moe_cfg = dataclasses.replace(cfg, n_routed_experts=spec.n_routed_experts,
                                      num_experts_per_tok=spec.num_experts_per_tok)
        self.attn_hc, self.ffn_hc, self.moe = [], [], []
        for s in range(spec.stages):
            p = f"mtp.{s}."
            self.attn_hc.append(HyperConnection(*(w[f"{p}hc_attn_{k}"] for k in ("fn", "base", "scale")), cfg))
            self.ffn_hc.append(HyperConnection(*(w[f"{p}hc_ffn_{k}"] for k in ("fn", "base", "scale")), cfg))
            experts = range(spec.n_routed_experts)
            moe_w = {
                "gate.weight": w[p + "ffn.gate.weight"], "gate.e_score_correction_bias": w[p + "ffn.gate.bias"],
                "experts.gate_up_proj": torch.cat([torch.stack([w[f"{p}ffn.experts.{e}.{k}.weight"] for e in experts])
                                                   for k in ("w1", "w3")], dim=1),
                "experts.down_proj": torch.stack([w[f"{p}ffn.experts.{e}.w2.weight"] for e in experts]),
                "shared_experts.gate_proj.weight": w[p + "ffn.shared_experts.w1.weight"],
                "shared_experts.up_proj.weight": w[p + "ffn.shared_experts.w3.weight"],
                "shared_experts.down_proj.weight": w[p + "ffn.shared_experts.w2.weight"],
            }
            self.moe.append(V4MoE(moe_w, "", moe_cfg, hashed=False))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.cfg.rms_norm_eps)

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``features [B, N, len(ids) * H]`` -> ``[B, N, stages * head_dim]`` (each stage's rotated latent row)."""
        main_x = self._norm(F.linear(features.to(self.dtype), self.w["mtp.0.main_proj.weight"]),
                            "mtp.0.main_norm.weight")
        cos, sin = self.rotary(positions, self.dtype)
        rows = [apply_rope(self._norm(F.linear(main_x, self.w[f"mtp.{s}.attn.wkv.weight"]),
                                      f"mtp.{s}.attn.kv_norm.weight"), cos, sin) for s in range(self.spec.stages)]
        return torch.cat(rows, dim=-1)

    def _attention(self, s: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ring: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
        """Stage ``s``: block queries ``x [B, n, H]`` over ``ring [B, W, hd]`` (``valid [B, W]``) and the block."""
        cfg, w, p = self.cfg, self.w, f"mtp.{s}.attn."
        b, n, _ = x.shape
        eps = cfg.rms_norm_eps
        q = unweighted_rms_norm(F.linear(self._norm(F.linear(x, w[p + "wq_a.weight"]), p + "q_norm.weight"),
                                         w[p + "wq_b.weight"]).view(b, n, -1, cfg.head_dim), eps)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv = apply_rope(self._norm(F.linear(x, w[p + "wkv.weight"]), p + "kv_norm.weight"), cos, sin)
        keys = torch.cat((ring.to(kv.dtype), kv), dim=1)  # [B, W + n, hd]: K = V (one latent head)
        visible = torch.cat((valid, torch.ones(b, n, dtype=torch.bool, device=x.device)), dim=1)
        scores = torch.einsum("bqhd,bkd->bqhk", q, keys) * cfg.head_dim**-0.5
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        sinks = w[p + "attn_sink"].to(scores.dtype).view(1, 1, -1, 1).expand(b, n, -1, 1)
        scores = torch.cat((scores, sinks), dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(keys.dtype)
        out = apply_rope(torch.einsum("bqhk,bkd->bqhd", probs, keys), cos.unsqueeze(2), -sin.unsqueeze(2))
        return grouped_output(out.reshape(b, n, -1), w[p + "wo_a.weight"], w[p + "wo_b.weight"], cfg.o_groups)

    def block(self, ctx: ProposalContext, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's collapsed block ``x [B, n, H]`` (before its norm) and base logits ``[B, n, V]`` float32."""
        cfg, spec = self.cfg, self.spec
        n = spec.block_size
        ids = torch.cat((last_tokens.unsqueeze(1), last_tokens.new_full((last_tokens.shape[0], n - 1),
                                                                         spec.noise_token_id)), dim=1)
        positions = ctx.start.unsqueeze(1) + torch.arange(n, device=ids.device)
        cos, sin = self.rotary(positions, self.dtype)
        streams = F.embedding(ids, self.embed).to(self.dtype).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        ring = ctx.rows.view(*ctx.rows.shape[:2], spec.stages, cfg.head_dim)
        for s in range(spec.stages):
            post, comb, collapsed = self.attn_hc[s](streams)
            a = self._attention(s, self._norm(collapsed, f"mtp.{s}.attn_norm.weight"), cos, sin, ring[:, :, s],
                                ctx.valid)
            streams = hyper_merge(streams, a, post, comb)
            post, comb, collapsed = self.ffn_hc[s](streams)
            m = self.moe[s](self._norm(collapsed, f"mtp.{s}.ffn_norm.weight"), ids)
            streams = hyper_merge(streams, m, post, comb)
        last = f"mtp.{spec.stages - 1}."
        x = hyper_head(streams, self.w[last + "hc_head_fn"], self.w[last + "hc_head_base"],
                       self.w[last + "hc_head_scale"], cfg)
        logits = F.linear(self._norm(x, last + "norm.weight").float(), self.lm_head.float())
        return x, logits

    def propose(self, ctx: ProposalContext, last_tokens: torch.Tensor, gamma: int, temperature: torch.Tensor,
                u: torch.Tensor) -> DraftOutput:
        """Draft ``γ`` tokens left to right; ``temperature [B]``, ``u [B, γ]``."""
        x, base = self.block(ctx, last_tokens)
        last = f"mtp.{self.spec.stages - 1}."
        w1, w2 = self.w[last + "markov_head.markov_w1.weight"], self.w[last + "markov_head.markov_w2.weight"]
        previous, tokens, laws, embeds, scores = last_tokens, [], [], [], []
        for i in range(gamma):
            e = F.embedding(previous, w1)
            embeds.append(e)
            logits = base[:, i] + F.linear(e.float(), w2.float())
            previous, q = choose(logits, temperature, u[:, i])
            tokens.append(previous)
            laws.append(q)
            scores.append(logits)
        features = torch.cat((x[:, :gamma].float(), torch.stack(embeds, dim=1).float()), dim=-1)
        confidence = F.linear(features, self.w[last + "confidence_head.proj.weight"].float()).squeeze(-1)
        return DraftOutput(torch.stack(tokens, dim=1), torch.stack(laws, dim=1), confidence,
                           torch.stack(scores, dim=1).to(torch.float64))
