"""Kernel selection (``kernels = auto | cuda | torch``) and the start-up self-check's comparison code, on CPU.

The self-check must reject a kernel that is wrong in one place: deliberately wrong torch stand-ins (one
corrupted copied row, one wrong location, one perturbed attention value) are run through the same checks
the engine runs on a GPU before serving.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.errors import ConfigError
from dhisparse.kernels.resolver import Resolution
from dhisparse.kernels.selection import select_kernels
from dhisparse.kernels.self_check import (
    KernelSelfCheckError,
    compare_attention,
    failures,
    run_self_check,
)
from dhisparse.kernels.torch_kernels import TorchKernels

CPU = torch.device("cpu")


class CorruptOneCopiedRow(TorchKernels):
    """Copies correctly, then flips one value of the last destination row it wrote."""

    name = "cuda"

    def copy_rows(self, host_rows, device_rows, src_rows, dst_rows, stream=None) -> None:
        super().copy_rows(host_rows, device_rows, src_rows, dst_rows)
        written = dst_rows[src_rows >= 0]
        device_rows[int(written[-1])].view(-1)[0] += 1


class WrongLocation(TorchKernels):
    name = "cuda"

    def resolve(self, *args, **kwargs) -> Resolution:
        res = super().resolve(*args, **kwargs)
        locations = res.locations.clone()
        r, n = torch.nonzero(locations >= 0)[0]
        locations[r, n] += 1
        return Resolution(**{**res.__dict__, "locations": locations})


class PerturbedAttention(TorchKernels):
    name = "cuda"

    def sparse_mla(self, q_lat, q_pe, kv, locations, softmax_scale, kv_format=None) -> torch.Tensor:
        out = super().sparse_mla(q_lat, q_pe, kv, locations, softmax_scale)
        out[0, 0, 0, 0] += 0.05
        return out


class WrongFetch(TorchKernels):
    """Resolves the step correctly, then sends one copy to the wrong arena row."""

    name = "cuda"

    def resolve_step(self, *args, **kwargs) -> None:
        super().resolve_step(*args, **kwargs)
        out = args[-1]
        dst = out["fetch_dst"].view(-1)
        first = torch.nonzero(dst >= 0)
        if first.numel():
            dst[int(first[0, 0])] += 1


def on_cpu(kernels, device):
    """The engine's self-check, run on CPU tensors (the stand-ins are torch code)."""
    return run_self_check(kernels, CPU)


def test_the_reference_passes_its_own_self_check() -> None:
    results = run_self_check(TorchKernels(), CPU)
    assert {r.kernel for r in results} == {"resolver", "step_resolver", "row_copy", "sparse_mla"}
    assert failures(results) is None


@pytest.mark.parametrize(("standin", "kernel", "what"), [
    (CorruptOneCopiedRow, "row_copy", "row "), (WrongLocation, "resolver", "locations["),
    (PerturbedAttention, "sparse_mla", "out_lat["), (WrongFetch, "step_resolver", "fetch_dst"),
])
def test_self_check_rejects_a_kernel_wrong_in_one_place(standin, kernel, what) -> None:
    results = run_self_check(standin(), CPU)
    bad = [r for r in results if not r.ok]
    assert bad and {r.kernel for r in bad} == {kernel}
    assert what in (bad[0].mismatch or "")
    with pytest.raises(KernelSelfCheckError, match=kernel):
        select_kernels("cuda", "cuda", load_cuda=lambda d: standin(), self_check=on_cpu, has_gpu=lambda: True)


def test_attention_comparison_rejects_nan() -> None:
    want = torch.zeros(1, 1, 2, 3)
    got = want.clone()
    got[0, 0, 1, 2] = float("nan")
    assert "out_lat[0, 0, 1, 2]" in (compare_attention(got, want, 1e-4) or "")


def test_auto_falls_back_to_torch_with_a_warning_and_a_metric(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dhisparse.kernels"):
        sel = select_kernels("auto", "cuda", load_cuda=lambda d: CorruptOneCopiedRow(), self_check=on_cpu,
                             has_gpu=lambda: True)
    assert sel.name == "torch" and sel.fallback and not sel.on_device
    assert sel.stats() == {"kernels_cuda": 0.0, "kernels_fallback": 1.0, "kernels_native_resolver": 0.0}
    assert "row_copy" in caplog.text and "falls back" in caplog.text
    sel = select_kernels("auto", "cuda", load_cuda=lambda d: None, has_gpu=lambda: True)
    assert sel.fallback and "not built" in sel.reason


def test_cpu_selects_torch_and_cuda_is_refused_without_a_gpu() -> None:
    sel = select_kernels("auto", "cpu")
    assert sel.name == "torch" and not sel.fallback and sel.stats()["kernels_fallback"] == 0.0
    assert select_kernels("torch", "cuda", has_gpu=lambda: False).name == "torch"
    with pytest.raises(ConfigError, match=r"kernels='cuda' needs device='cuda'.*device is 'cpu'"):
        select_kernels("cuda", "cpu")
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        select_kernels("cuda", "cuda", has_gpu=lambda: False)
    with pytest.raises(ConfigError, match="libdhisparse_cuda.so"):
        select_kernels("cuda", "cuda", load_cuda=lambda d: None, has_gpu=lambda: True)


def test_the_kernels_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="kernels must be one of auto, cuda, torch"):
        EngineConfig(kernels="gpu")
    with pytest.raises(ConfigError, match="kernels must be one of"):
        select_kernels("triton", "cpu")
    assert EngineConfig().kernels == "auto"
