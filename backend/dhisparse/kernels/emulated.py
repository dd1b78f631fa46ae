"""The CUDA kernels' stand-in on a CPU: the torch reference for the row copy and attention, and the step resolver's
own block code run by the native CPU library (``abi.emulate_launch``). Tests drive GPU code paths with it (the KV step's
device path, the layer-step bench) where no GPU exists."""

from __future__ import annotations

import torch

from dhisparse.kernels import abi
from dhisparse.kernels.reference import decode_fp8_rows, sparse_mla_reference
from dhisparse.kernels.torch_kernels import TorchKernels


class EmulatedKernels(TorchKernels):
    """:class:`TorchKernels` plus ``resolve_step`` (the kernel's block code on the CPU), selected as on-device."""

    name = "emulated"
    on_device = True

    def resolve_step(self, stamp: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None,
                     sources: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor,
                     hot_stamp: torch.Tensor, hot_loc: torch.Tensor, host_pages: torch.Tensor | None,
                     staging: tuple[torch.Tensor, torch.Tensor] | None, page_rows: int,
                     out: dict[str, torch.Tensor]) -> None:
        """``CudaKernels.resolve_step`` computed by the kernel's block code on the CPU (CPU tensors)."""
        args = abi.pack_step_resolver(stamp, positions, lengths, sources, slots, page_table, hot_pos, hot_stamp,
                                      hot_loc, host_pages, staging, page_rows, out)
        status = abi.emulate_launch(abi.KIND_STEP_RESOLVER, args)
        if status != abi.PLAN_OK:
            raise ValueError(abi.plan_error("step resolver", status))

    def sparse_mla(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor,
                   softmax_scale: float, kv_format: int | None = None) -> torch.Tensor:
        if kv_format == abi.KV_FORMAT_FP8:
            kv = decode_fp8_rows(kv)
        return sparse_mla_reference(q_lat, q_pe, kv, locations, softmax_scale).to(q_lat.dtype)
