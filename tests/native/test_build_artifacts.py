"""The native build produced every artifact CI promises: CPU library, CUDA kernels for sm_80 and sm_90 (compiled
here, executed only where a GPU exists), the CUDA C ABI library and the TensorRT plugin library.

Missing pieces skip on a developer's partial setup and fail in CI (DHISPARSE_STRICT=1, tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

BUILD = Path(__file__).resolve().parents[2] / "build" / "native"
ARTIFACTS = {
    "CPU library": BUILD / "plugins" / "libdhisparse_cpu.so",
    "CUDA kernels": BUILD / "plugins" / "libdhisparse_kernels.a",
    "CUDA C ABI library": BUILD / "plugins" / "libdhisparse_cuda.so",
    "TensorRT plugin library": BUILD / "plugins" / "tensorrt" / "libdhisparse_trt_plugins.so",
}


@pytest.mark.parametrize("name", list(ARTIFACTS))
def test_native_artifact_was_built(name):
    path = ARTIFACTS[name]
    if not path.is_file():
        pytest.skip(f"{name} not built ({path}); run scripts/setup_native.sh")
    assert path.stat().st_size > 0


def test_cuda_kernels_hold_sm80_and_sm90_code():
    kernels = ARTIFACTS["CUDA kernels"]
    if not kernels.is_file():
        pytest.skip(f"CUDA kernels not built ({kernels}); run scripts/setup_native.sh")
    data = kernels.read_bytes()  # the embedded fatbinary names the target of each cubin
    for arch in (b"sm_80", b"sm_90"):
        assert arch in data, f"no {arch.decode()} code in {kernels}"
