"""CPU checks of the pure-torch references the CUDA kernels are compared with (start-up self-check and
scripts/gpu_check.py), and of gpu_check.py's behaviour without a GPU."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from dhisparse.kernels import reference

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert spec is not None and spec.loader is not None
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def naive_sparse_mla(q_lat, q_pe, kv, locations, scale):
    """One (b, q, h) at a time, in float64, straight from the definition."""
    b_, q_, h_, rank = q_lat.shape
    out = torch.zeros(b_, q_, h_, rank, dtype=torch.float64)
    for b in range(b_):
        for q in range(q_):
            valid = [int(j) for j in locations[b, q] if j >= 0]
            for h in range(h_):
                if not valid:
                    continue
                scores = [
                    scale
                    * (
                        float(q_lat[b, q, h] @ kv[j, :rank].double())
                        + float(q_pe[b, q, h] @ kv[j, rank:].double())
                    )
                    for j in valid
                ]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, valid, strict=False):
                    out[b, q, h] += w / total * kv[j, :rank].double()
    return out


def test_sparse_mla_reference_matches_the_definition() -> None:
    g = torch.Generator().manual_seed(3)
    q_lat, q_pe = torch.randn(2, 3, 2, 5, generator=g).double(), torch.randn(2, 3, 2, 3, generator=g).double()
    kv = torch.randn(11, 8, generator=g).double()
    locations = torch.randint(0, 11, (2, 3, 4), generator=g)
    locations[0, 0, 1] = -1
    locations[1, 2] = -1  # fully masked: zeros
    got = reference.sparse_mla_reference(q_lat, q_pe, kv, locations, 0.3)
    torch.testing.assert_close(
        got.double(), naive_sparse_mla(q_lat, q_pe, kv, locations, 0.3), rtol=1e-5, atol=1e-6
    )
    assert torch.count_nonzero(got[1, 2]) == 0


def test_fp8_row_layout_round_trip() -> None:
    values = torch.randn(9, 576, generator=torch.Generator().manual_seed(4))
    rows = reference.encode_fp8_rows(values)
    assert rows.shape == (9, 656) and rows.dtype == torch.uint8
    decoded = reference.decode_fp8_rows(rows)
    # e4m3 keeps 3 mantissa bits: relative error <= 1/16 of the group's scale-normalised value; rope is bf16.
    scale = values[:, :512].view(9, 4, 128).abs().amax(dim=2).repeat_interleave(128, dim=1)
    assert torch.all((decoded[:, :512] - values[:, :512]).abs() <= scale / 16 + 1e-6)
    torch.testing.assert_close(decoded[:, 512:], values[:, 512:].to(torch.bfloat16).float())
    # Byte layout: scales are fp32 at bytes 512..527, one per 128 latent values.
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, values[:, :512].view(9, 4, 128).abs().amax(dim=2) / 448.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_refuses_to_claim_anything_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    argv = sys.argv
    sys.argv = ["gpu_check.py", "--no-build"]
    try:
        assert gpu_check.main() == 0
    finally:
        sys.argv = argv
    assert "nothing was run: no GPU" in capsys.readouterr().out
