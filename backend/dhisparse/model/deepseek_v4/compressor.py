"""The V4 compressors: every ``rate`` tokens become one compressed entry (transformers'
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / the indexer's own compressor).

Entry ``w`` is ``rms_norm(Σ_slots softmax(gate + position_bias) ⊙ kv)`` over its slots, RoPE'd (``compress`` set)
at position ``w · rate``:

* HCA: the ``rate`` tokens of window ``w``;
* CSA (overlapping): ``2·rate`` slots — window ``w-1``'s first-half projections (``Ca``) and window ``w``'s
  second-half projections (``Cb``); for ``w = 0`` the ``Ca`` slots get weight 0.

It is a pure function of the projections of positions ``(w-1)·rate … (w+1)·rate - 1``, so chunking prefill or
decoding token by token gives the same entries as one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhisparse.model.deepseek_v4.kv_state import Key, V4StepKV
from dhisparse.model.deepseek_v4.layers import Rotary, apply_rope, rms_norm


class Compressor:
    """One compressor's weights; ``overlap`` for CSA (projections of ``2·d``), plain windows for HCA."""

    def __init__(self, key: Key, w: dict[str, torch.Tensor], prefix: str, rate: int, overlap: bool,
                 eps: float) -> None:
        self.key, self.rate, self.overlap, self.eps = key, rate, overlap, eps
        self.kv_proj = w[prefix + "kv_proj.weight"]
        self.gate_proj = w[prefix + "gate_proj.weight"]
        self.position_bias = w[prefix + "position_bias"]
        self.norm = w[prefix + "kv_norm.weight"]
        self.dim = self.norm.shape[0]
        self.pending = 2 * rate if overlap else rate

    def __call__(self, x: torch.Tensor, kv: V4StepKV, rotary: Rotary) -> None:
        """Project ``x [B, Q, hidden]``, emit the entries whose windows complete in this step into ``kv``."""
        rate, p = self.rate, self.pending
        ext_kv, ext_gate = kv.extend_pending(self.key, F.linear(x, self.kv_proj), F.linear(x, self.gate_proj))
        first = torch.div(kv.starts, rate, rounding_mode="floor")
        counts = torch.div(kv.lengths, rate, rounding_mode="floor") - first
        n_max = int(counts.max())
        if n_max == 0:  # still reported: a store may write a row for every new token
            kv.add_entries(self.key, first, counts, x.new_zeros(x.shape[0], 0, self.dim))
            return
        device = x.device
        windows = first.unsqueeze(1) + torch.arange(n_max, device=device)  # [B, n]
        slots = torch.arange(rate, device=device)
        cur = windows.unsqueeze(-1) * rate + slots - kv.starts.view(-1, 1, 1) + p  # ext index [B, n, rate]
        cur = cur.clamp(0, ext_kv.shape[1] - 1)
        b_idx = torch.arange(x.shape[0], device=device).view(-1, 1, 1)
        d = self.dim
        if self.overlap:
            prev = (cur - rate).clamp(min=0)
            kv_slots = torch.cat([ext_kv[b_idx, prev, :d], ext_kv[b_idx, cur, d:]], dim=2)
            gate_prev = ext_gate[b_idx, prev, :d] + self.position_bias[:, :d]
            gate_cur = ext_gate[b_idx, cur, d:] + self.position_bias[:, d:]
            no_prev = (windows == 0).view(*windows.shape, 1, 1)
            kv_slots[:, :, :rate] = kv_slots[:, :, :rate].masked_fill(no_prev, 0)
            gate_prev = gate_prev.masked_fill(no_prev, float("-inf"))
            gate_slots = torch.cat([gate_prev, gate_cur], dim=2)
        else:
            kv_slots = ext_kv[b_idx, cur]
            gate_slots = ext_gate[b_idx, cur] + self.position_bias
        weights = gate_slots.softmax(dim=2, dtype=torch.float32).to(kv_slots.dtype)
        pooled = rms_norm((kv_slots * weights).sum(dim=2), self.norm, self.eps)  # [B, n, d]
        cos, sin = rotary(windows * rate, pooled.dtype)
        kv.add_entries(self.key, first, counts, apply_rope(pooled, cos, sin))
