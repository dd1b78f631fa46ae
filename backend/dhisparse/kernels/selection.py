"""``kernels = auto | cuda | torch``: which implementation the request path runs, decided once at start.

- ``torch``: the torch implementation (always available; the CPU path and the reference).
- ``cuda``: the CUDA kernels, or a clear error: without a GPU (``device`` is not CUDA or no GPU is visible),
  without the built ``libdhisparse_cuda.so``, or when the self-check finds a kernel that disagrees with the
  reference.
- ``auto`` (default): the CUDA kernels on a CUDA device when they are built and pass the self-check; else torch,
  with a warning (logged) and the ``kv_kernels_fallback`` metric set to 1 when a GPU was there but the
  kernels could not be used. On a CPU device ``auto`` is torch, whose KV step resolves through the native CPU
  library (``libdhisparse_cpu.so``: the resolver shared with the CUDA kernel, one call per resolution instead
  of dozens of small torch operations) when it is built and agrees with the torch resolver on a start-up
  self-check (``kv_kernels_native_resolver`` 1); else the torch resolver, without a warning.

The result is a :class:`KernelSelection`; the KV manager takes it (``KVManager(..., kernels=…)``), the KV
step reads ``selection.kernels`` and the model reaches attention through the step (``StepKV.attend``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dhisparse.errors import ConfigError
from dhisparse.kernels import abi, native
from dhisparse.kernels.cuda_kernels import CudaKernels
from dhisparse.kernels.self_check import (
    CheckResult,
    KernelSelfCheckError,
    check_resolver,
    check_step_resolution,
    failures,
    run_self_check,
)
from dhisparse.kernels.torch_kernels import TorchKernels

KERNEL_OPTIONS = ("auto", "cuda", "torch")
log = logging.getLogger("dhisparse.kernels")


@dataclass
class KernelSelection:
    """What was selected and why. ``kernels`` has ``name`` (``"cuda"`` / ``"torch"``), ``on_device`` and the
    methods ``resolve``, ``copy_rows``, ``sparse_mla``, ``supports_attention``."""

    requested: str
    kernels: Any
    reason: str
    fallback: bool = False
    self_check: list[CheckResult] = field(default_factory=list)
    # The CPU library that resolves the torch path's steps on a CPU device (``dhisparse.kernels.native``), or None.
    native_resolver: Any = None

    @property
    def name(self) -> str:
        return str(self.kernels.name)

    @property
    def on_device(self) -> bool:
        """Whether the request path runs the kernels on the device (else the KV step's own torch code)."""
        return bool(self.kernels.on_device)

    def stats(self) -> dict[str, float]:
        """``kernels_cuda`` 1 when the CUDA kernels serve, ``kernels_fallback`` 1 when ``auto`` fell back on a GPU."""
        return {"kernels_cuda": float(self.name == "cuda"), "kernels_fallback": float(self.fallback),
                "kernels_native_resolver": float(self.native_resolver is not None)}


def torch_selection(reason: str = "torch requested") -> KernelSelection:
    return KernelSelection("torch", TorchKernels(), reason)


def gpu_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def select_kernels(
    option: str,
    device: torch.device | str,
    *,
    load_cuda: Callable[[torch.device], Any] | None = None,
    self_check: Callable[[Any, torch.device], list[CheckResult]] = run_self_check,
    has_gpu: Callable[[], bool] = gpu_visible,
    native_check: Callable[[Any], list[CheckResult]] | None = None,
) -> KernelSelection:
    """Choose the kernels for ``device`` (see the module docstring). ``load_cuda`` (default: the built
    library) returns the CUDA kernel set or ``None``; ``self_check``, ``has_gpu`` and ``native_check`` (the CPU
    library's check against the torch resolver) are injectable for tests.

    Raises:
        ConfigError: ``option`` is unknown, or ``cuda`` cannot be honoured (no GPU, library not built).
        KernelSelfCheckError: ``cuda`` was requested and a kernel disagrees with the reference.
    """
    if option not in KERNEL_OPTIONS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNEL_OPTIONS)}, got {option!r}")
    device = torch.device(device)
    if option == "torch":
        return torch_selection()
    if device.type != "cuda" or not has_gpu():
        if option == "cuda":
            where = f"device is {str(device)!r}" if device.type != "cuda" else "no CUDA GPU is visible to torch"
            raise ConfigError(f"kernels='cuda' needs device='cuda' on a machine with a GPU, but {where}; "
                              "use kernels='auto' or 'torch'")
        if device.type == "cpu":
            return _cpu_selection(native_check)
        return torch_selection(f"device {device} has no CUDA kernels")
    kernels = (load_cuda or _load_built_kernels)(device)
    if kernels is None:
        why = (f"the CUDA kernel library is not built or has another ABI (looked for {abi.cuda_library_path()}; "
               "build it with scripts/setup_native.sh)")
        return _refuse_or_fall_back(option, why)
    results = self_check(kernels, device)
    bad = failures(results)
    if bad is not None:
        if option == "cuda":
            raise KernelSelfCheckError(f"CUDA kernel self-check failed against the torch reference: {bad}")
        return _refuse_or_fall_back(option, f"CUDA kernel self-check failed: {bad}", results)
    return KernelSelection(option, kernels, f"CUDA kernels passed {len(results)} self-checks", self_check=results)


def _cpu_selection(native_check: Callable[[Any], list[CheckResult]] | None) -> KernelSelection:
    """Torch on a CPU device, resolving through the native CPU library when it is built and self-checks."""
    lib = native.load()
    if lib is None:
        return torch_selection(f"CPU device; native resolver not built ({native.library_path()})")
    if native_check is not None:
        results = native_check(lib)
    else:  # the loaded library does not change: checked once, the result kept with it (later engines skip it)
        results = getattr(lib, "dhs_self_check", None)
        if results is None:
            results = check_native_resolver(lib)
            lib.dhs_self_check = results
    bad = failures(results)
    if bad is not None:
        log.warning("the native CPU resolver disagrees with the torch resolver; resolving with torch: %s", bad)
        return KernelSelection("auto", TorchKernels(), f"native resolver self-check failed: {bad}",
                               self_check=results)
    return KernelSelection("auto", TorchKernels(), f"CPU device; native resolver passed {len(results)} self-checks",
                           self_check=results, native_resolver=lib)


def check_native_resolver(lib: Any, seed: int = 0) -> list[CheckResult]:
    """The CPU library's resolver against the torch resolver on random irregular cases (the CUDA kernels'
    resolver self-check, on the CPU), and its whole-step resolution (what the KV step calls) likewise."""
    g = torch.Generator().manual_seed(seed)
    return [*check_resolver(native, torch.device("cpu"), g), *check_step_resolution(native, lib, g)]


def _load_built_kernels(device: torch.device) -> Any:
    lib = abi.cuda_library()
    return None if lib is None else CudaKernels(lib, device)


def _refuse_or_fall_back(option: str, why: str, results: list[CheckResult] | None = None) -> KernelSelection:
    if option == "cuda":
        raise ConfigError(f"kernels='cuda': {why}")
    log.warning("kernels=auto falls back to the torch implementation: %s", why)
    return KernelSelection(option, TorchKernels(), why, fallback=True, self_check=results or [])
