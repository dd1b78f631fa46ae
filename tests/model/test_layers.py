"""The model's small layers against the formulas they stand for."""

from __future__ import annotations

import pytest
import torch

from dhisparse.model.layers import rms_norm


def _rms_norm_as_transformers(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``DeepseekV3RMSNorm.forward`` written out: float32 variance and scaling, cast back, then the weight."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 64, 193, 576])
def test_rms_norm_is_bit_identical_to_the_reference_formula(dtype, width):
    g = torch.Generator().manual_seed(width)
    for eps in (1e-6, 1e-5):
        x = (torch.randn(3, 5, width, generator=g, dtype=torch.float64) * 4).to(dtype)
        w = torch.randn(width, generator=g, dtype=torch.float64).to(dtype)
        assert torch.equal(rms_norm(x, w, eps), _rms_norm_as_transformers(x, w, eps))
