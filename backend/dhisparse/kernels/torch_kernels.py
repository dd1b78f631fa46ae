"""The torch implementation behind the kernel interface: the CPU path and the reference of the CUDA kernels.

:class:`TorchKernels` has the methods of :class:`dhisparse.kernels.cuda_kernels.CudaKernels` with the
semantics of the references (``dhisparse.kernels.resolver.resolve``, :mod:`dhisparse.kernels.reference`).
``on_device`` is False: with it selected, the KV step and the model keep their own torch code paths (the
ones the exactness tests compare with transformers); its methods serve the self-check as the reference.
"""

from __future__ import annotations

import torch

from dhisparse.kernels.reference import padded_resolution, row_copy_reference, sparse_mla_reference
from dhisparse.kernels.resolver import Resolution, resolve


class TorchKernels:
    name = "torch"
    on_device = False

    def resolve(
        self, positions: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
        hot_loc: torch.Tensor, stamp: int, page_rows: int,
    ) -> Resolution:
        return resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)

    def resolve_padded(
        self, positions: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
        hot_loc: torch.Tensor, stamp: int, page_rows: int,
    ) -> dict[str, torch.Tensor]:
        """The resolver kernel's output form (see ``reference.padded_resolution``)."""
        res = resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
        return padded_resolution(res, positions.shape[0], positions.shape[1])

    def copy_rows(self, host_rows: torch.Tensor, device_rows: torch.Tensor, src_rows: torch.Tensor,
                  dst_rows: torch.Tensor, stream: object = None) -> None:
        device_rows.copy_(row_copy_reference(host_rows, device_rows, src_rows, dst_rows))

    def sparse_mla(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor,
                   softmax_scale: float, kv_format: int | None = None) -> torch.Tensor:
        if kv_format is not None:
            raise ValueError("the torch reference takes decoded rows (see reference.decode_fp8_rows)")
        return sparse_mla_reference(q_lat, q_pe, kv, locations, softmax_scale).to(q_lat.dtype)

    def supports_attention(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return True
