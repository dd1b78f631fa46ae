"""Stateless building blocks with the numerics of transformers 5.24 (norms in float32, router in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, then scaled (as ``DeepseekV3RMSNorm``)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``. Weights in ``nn.Linear`` layout ``[out, in]``."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class MoE:
    """Shared + routed experts with the DeepSeek-V3 sigmoid router (grouped top-k, bias-corrected choice).

    Weights: ``gate_weight [E, H]`` and ``correction_bias [E]`` in float32; ``experts_gate/up [E, I, H]``,
    ``experts_down [E, H, I]``; shared expert MLP weights (or ``None`` when ``n_shared_experts == 0``).
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        prefix: str,
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        has_shared: bool,
    ) -> None:
        self.gate_weight = weights[prefix + "gate.weight"]
        self.correction_bias = weights[prefix + "gate.e_score_correction_bias"]
        self.experts_gate = weights[prefix + "experts.gate_proj"]
        self.experts_up = weights[prefix + "experts.up_proj"]
        self.experts_down = weights[prefix + "experts.down_proj"]
        self.shared = (
            (weights[prefix + "shared_experts.gate_proj.weight"], weights[prefix + "shared_experts.up_proj.weight"],
             weights[prefix + "shared_experts.down_proj.weight"])
            if has_shared
            else None
        )
        self.num_experts = self.experts_gate.shape[0]
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def route(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(weights [N, k] float32, expert ids [N, k])`` for tokens ``x2d [N, H]``."""
        scores = F.linear(x2d.to(torch.float32), self.gate_weight.to(torch.float32)).sigmoid()
        choice = scores + self.correction_bias
        if self.n_group > 1:
            n = x2d.shape[0]
            grouped = choice.view(n, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, self.num_experts)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        weights, ids = self.route(x2d)
        if _grouped_mm_works(x2d, self.experts_gate.shape[1]):
            out = self._grouped(x2d, weights, ids)
        else:
            out = self._masked(x2d, weights, ids)
        out = out.view(shape)
        if self.shared is not None:
            out = out + gated_mlp(x, *self.shared)
        return out

    def _grouped(self, x2d: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sync-free dispatch: the ``N·k`` (token, expert) assignments sorted by expert, one grouped matmul per
        projection over fixed-shape ``[N·k, …]`` operands with device-side group offsets (no host read of which
        experts were chosen). Each token then sums its ``k`` contributions in ascending expert order, as
        transformers' eager experts accumulate."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignment indices, grouped by expert
        # Group ends: assignments to experts <= e, searched in the sorted ids (bincount would read its size on
        # the host).
        experts = torch.arange(self.num_experts, device=flat.device, dtype=flat.dtype)
        offs = torch.searchsorted(flat.index_select(0, order), experts, right=True).to(torch.int32)
        xs = x2d.index_select(0, order // k)
        gate = torch._grouped_mm(xs, self.experts_gate.transpose(1, 2), offs=offs)
        up = torch._grouped_mm(xs, self.experts_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(gate) * up, self.experts_down.transpose(1, 2), offs=offs)
        y = (y * weights.reshape(-1).index_select(0, order).unsqueeze(-1)).to(x2d.dtype)
        per_slot = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)  # back to (token, slot) order
        by_expert = per_slot.gather(1, ids.argsort(dim=1).unsqueeze(-1).expand_as(per_slot))
        out = torch.zeros_like(x2d)
        for j in range(k):
            out = out + by_expert[:, j]
        return out

    def _masked(self, x2d: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Fallback where grouped matmuls are unavailable (float64, dimensions not 16-byte aligned): every expert
        over every token with the router weight (0 when not chosen), in ascending expert order — sync-free, exact
        (adding ``0·y`` leaves a sum unchanged), at ``E / k`` times the expert compute (test models only)."""
        out = torch.zeros_like(x2d)
        for expert in range(self.num_experts):
            coef = (weights * (ids == expert)).sum(dim=-1, keepdim=True)  # the weight, or 0 if not chosen
            y = gated_mlp(x2d, self.experts_gate[expert], self.experts_up[expert], self.experts_down[expert])
            out = out + (y * coef).to(out.dtype)
        return out


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(x: torch.Tensor, intermediate: int) -> bool:
    """Whether ``torch._grouped_mm`` serves this device and dtype (probed once: it exists for float32 / bfloat16 /
    float16 on CPU and recent GPUs) and the rows are 16-byte aligned as it requires."""
    if not hasattr(torch, "_grouped_mm") or (x.shape[-1] * x.element_size()) % 16 or (
            intermediate * x.element_size()) % 16:
        return False
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_OK:
        a = torch.ones(4, 8, dtype=x.dtype, device=x.device)
        b = torch.ones(2, 8, 8, dtype=x.dtype, device=x.device)
        try:
            got = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=x.device))
            _GROUPED_OK[key] = bool((got == 8).all())  # a one-off probe at first use, not per step
        except (RuntimeError, NotImplementedError):
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]
