"""The Qwen3 block-drafter backbone shared by DFlash, DFlash2 and Qwen3 DSpark (plain tensors, batched).

Context path (one row per target position, computed once and kept in the draft ring):
``c = hidden_norm(fc(features))``; per draft layer ``K = RoPE_p(k_norm(k_proj(c)))`` and ``V = v_proj(c)`` — no
input norm on the context, K rotated at the position's absolute index, as the references cache it.

Block path (the proposal's queries ``x [B, n, H]`` at positions ``p .. p + n - 1``): pre-norm Qwen3 layers whose
attention reads the ring's K/V and the block's own K/V (masks in ``qwen_config``), then the final ``norm``.
DFlash2 wraps each sublayer in a two-tap grouped dynamic convolution over the block
(``out[i] = Σ_t (base[t] + δ[i, t, g]) · x[i - t]``, taps zero across the block boundary), its coefficients
projected from the sublayer's input.

Numerics follow transformers (the references run there): RMSNorm in float32 cast back, RoPE tables in float32
cast to the model dtype, the attention softmax in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.model.layers import gated_mlp, rms_norm

from .qwen_config import QwenDrafterConfig


def qwen_expected_shapes(cfg: QwenDrafterConfig, target_hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the drafter (checkpoint names without a ``model.`` prefix) and its shape."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layer_ids) * target_hidden_size), "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                       a + "o_proj.weight": (h, q), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                           a + "o_proj.bias": (h,)})
        if cfg.fmt == "dflash2":
            taps, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes.update({f"{p}{conv}.base_kernel": (2, taps, h),
                               f"{p}{conv}.kernel_projection.weight": (2 * taps * groups, h)})
    if cfg.fmt == "dflash2":
        r = cfg.selector_rank
        shapes.update({"candidate_selector.predecessor_codebook": (cfg.vocab_size, r),
                       "candidate_selector.successor_codebook": (cfg.vocab_size, r),
                       "candidate_selector.hidden_projection.weight": (r, h)})
    if cfg.fmt == "dspark":
        r = cfg.markov_rank
        shapes.update({"embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h)})
        if r:
            shapes.update({"markov_head.markov_w1.weight": (cfg.vocab_size, r),
                           "markov_head.markov_w2.weight": (cfg.vocab_size, r)})
        if cfg.markov_head_type == "gated":
            shapes.update({"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)})
        if cfg.markov_head_type == "rnn":
            shapes.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + h),
                           "markov_head.joint_proj.bias": (3 * r,)})
        if cfg.confidence_head:
            shapes.update({"confidence_head.proj.weight": (1, h + (r if cfg.confidence_with_markov else 0)),
                           "confidence_head.proj.bias": (1,)})
    return shapes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class QwenBlockBackbone:
    """Weights ``w`` (checkpoint names) of a Qwen3 block drafter, in the model dtype."""

    def __init__(self, cfg: QwenDrafterConfig, w: dict[str, torch.Tensor]) -> None:
        self.cfg, self.w = cfg, w
        self.dtype = w["fc.weight"].dtype
        self.device = w["fc.weight"].device
        d = cfg.head_dim
        exponent = torch.arange(0, d, 2, dtype=torch.int64).to(device=self.device, dtype=torch.float32) / d
        self.inv_freq = 1.0 / (cfg.rope_theta ** exponent)

    # ------------------------------------------------------------------------------------------------ helpers
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, N]`` -> cos/sin ``[B, 1, N, head_dim]`` in the model dtype."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype).unsqueeze(1), emb.sin().to(self.dtype).unsqueeze(1)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], heads, self.cfg.head_dim).transpose(1, 2)  # [B, heads, N, hd]

    # ------------------------------------------------------------------------------------------------ context
    @property
    def row_values(self) -> int:
        return self.cfg.num_layers * self.cfg.kv_values

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``features [B, N, F]`` at ``positions [B, N]`` -> ring rows ``[B, N, layers * 2 * kv_heads * hd]``."""
        cfg = self.cfg
        c = rms_norm(F.linear(features.to(self.dtype), self.w["fc.weight"]), self.w["hidden_norm.weight"],
                     cfg.rms_norm_eps)
        cos, sin = self._rope(positions)
        rows = []
        for i in range(cfg.num_layers):
            a = f"layers.{i}.self_attn."
            k = rms_norm(self._heads(self._linear(c, a + "k_proj"), cfg.num_kv_heads), self.w[a + "k_norm.weight"],
                         cfg.rms_norm_eps)
            k = (k * cos + _rotate_half(k) * sin).transpose(1, 2)  # [B, N, kvh, hd]
            v = self._linear(c, a + "v_proj").view(*c.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
            rows.append(torch.stack((k, v), dim=2))  # [B, N, 2, kvh, hd]
        return torch.stack(rows, dim=2).flatten(2)

    # -------------------------------------------------------------------------------------------------- block
    def _conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Grouped convolution over the block, taps reaching back inside it only: ``x [B, n, H]``,
        ``delta [B, n, taps, G]``, ``base [taps, H]``."""
        cfg = self.cfg
        groups = cfg.hidden_size // cfg.conv_group_size
        blocks = x.unflatten(-1, (groups, cfg.conv_group_size))  # [B, n, G, gs]
        coeff = base.view(cfg.conv_kernel_size, groups, cfg.conv_group_size) + delta.unsqueeze(-1)
        out = coeff[:, :, 0] * blocks
        for tap in range(1, cfg.conv_kernel_size):
            shifted = F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))  # x[i - tap], zero before the block
            out = out + coeff[:, :, tap] * shifted
        return out.flatten(-2)

    def _conv_prepare(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        coeff = F.linear(x, self.w[name + ".kernel_projection.weight"]).view(
            *x.shape[:-1], 2, cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size)
        return self._conv(x, coeff[..., 0, :, :], self.w[name + ".base_kernel"][0]), coeff[..., 1, :, :]

    def _attention(self, i: int, x: torch.Tensor, ring: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention: queries ``x [B, n, H]`` over the ring's K/V (``ring [B, W, layers, 2, kvh,
        hd]``) and the block's own; ``mask [B, n, W + n]`` True = visible; cos/sin of the block positions."""
        cfg = self.cfg
        a = f"layers.{i}.self_attn."
        q = rms_norm(self._heads(self._linear(x, a + "q_proj"), cfg.num_heads), self.w[a + "q_norm.weight"],
                     cfg.rms_norm_eps)
        k = rms_norm(self._heads(self._linear(x, a + "k_proj"), cfg.num_kv_heads), self.w[a + "k_norm.weight"],
                     cfg.rms_norm_eps)
        v = self._heads(self._linear(x, a + "v_proj"), cfg.num_kv_heads)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = torch.cat((ring[:, :, i, 0].transpose(1, 2), k), dim=2)
        v = torch.cat((ring[:, :, i, 1].transpose(1, 2), v), dim=2)
        groups = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * cfg.head_dim**-0.5
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(*x.shape[:-1], cfg.num_heads * cfg.head_dim)
        return self._linear(out, a + "o_proj")

    def masks(self, ring_positions: torch.Tensor, ring_valid: torch.Tensor, positions: torch.Tensor
              ) -> list[torch.Tensor]:
        """Per layer ``[B, n, W + n]`` visibility: ring key ``k`` (valid) and block key ``k`` for the query at
        ``q``: ``k > q - W`` on sliding layers, ``k <= q`` for block keys of causal layers."""
        qpos = positions.unsqueeze(-1)  # [B, n, 1]
        keys = torch.cat((ring_positions, positions), dim=1).unsqueeze(1)  # [B, 1, W + n]
        present = torch.cat((ring_valid, torch.ones_like(positions, dtype=torch.bool)), dim=1).unsqueeze(1)
        in_block = torch.zeros_like(present)
        in_block[..., ring_positions.shape[1]:] = True
        out = []
        for window, causal in zip(self.cfg.layer_windows, self.cfg.layer_causal, strict=True):
            visible = present.expand(-1, positions.shape[1], -1)
            if window is not None:
                visible = visible & (keys > qpos - window)
            if causal:
                visible = visible & (~in_block | (keys <= qpos))
            out.append(visible)
        return out

    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor,
                     ring_positions: torch.Tensor, ring_valid: torch.Tensor) -> torch.Tensor:
        """Hidden states of the block after the final norm: ``x [B, n, H]`` (embedded block) at ``positions
        [B, n]``; ``ring [B, W, row_values]`` with ``ring_positions [B, W]`` and ``ring_valid [B, W]``."""
        cfg = self.cfg
        x = x.to(self.dtype)
        ring = ring.to(self.dtype).view(*ring.shape[:2], cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = self._rope(positions)
        masks = self.masks(ring_positions, ring_valid, positions)
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            if cfg.fmt == "dflash2":
                h, finish = self._conv_prepare(h, p + "attention_conv")
                h = self._attention(i, h, ring, masks[i], cos, sin)
                h = self._conv(h, finish, self.w[p + "attention_conv.base_kernel"][1])
            else:
                h = self._attention(i, h, ring, masks[i], cos, sin)
            x = x + h
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            mlp = (self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"],
                   self.w[p + "mlp.down_proj.weight"])
            if cfg.fmt == "dflash2":
                h, finish = self._conv_prepare(h, p + "mlp_conv")
                h = self._conv(gated_mlp(h, *mlp), finish, self.w[p + "mlp_conv.base_kernel"][1])
            else:
                h = gated_mlp(h, *mlp)
            x = x + h
        return rms_norm(x, self.w["norm.weight"], cfg.rms_norm_eps)
