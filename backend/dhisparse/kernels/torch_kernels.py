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

    def resolve_step(self, stamp: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None,
                     sources: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor,
                     hot_stamp: torch.Tensor, hot_loc: torch.Tensor, host_pages: torch.Tensor | None,
                     staging: tuple[torch.Tensor, torch.Tensor] | None, page_rows: int,
                     out: dict[str, torch.Tensor]) -> None:
        """The step resolver's contract (``CudaKernels.resolve_step``, ``StepResolveArgs`` of launch.h) computed with
        :func:`resolve` per source, outputs in the kernel's form (padded fetch lists: copy ``k`` of a request at
        index ``k``, ``-1`` where it has no host page and after its copies). Reads the stamp on the host."""
        batch, n = positions.shape
        bad = (positions >= lengths.view(-1, 1)).any(1) if lengths is not None else torch.zeros(
            batch, dtype=torch.bool, device=positions.device)
        flags = int(bool(bad.any()))
        for g, source in enumerate(sources.tolist()):
            rows = staging[0][slots, int(staging[1][g])] if staging is not None and staging[0].shape[2] else None
            res = resolve(positions, page_table[:, source], hot_pos[slots, source], hot_stamp[slots, source],
                          hot_loc[slots, source], int(stamp[0]), page_rows, rows, on_device=True)
            assert res.overflow is not None and res.fetch_mask is not None and res.fetch_position is not None
            assert res.fetch_location is not None
            ok = ~res.overflow & ~bad
            flags |= 2 * int(bool((res.overflow & ~bad).any()))
            out["locations"][g] = torch.where(ok.view(-1, 1), res.locations, -1)
            hot_pos[slots[ok], source] = res.hot_pos[ok]
            hot_stamp[slots[ok], source] = res.hot_stamp[ok]
            out["counts"][:, :2] += torch.where((~bad).view(-1, 1), res.counts[:, :2], 0)
            out["counts"][:, 2] += torch.where(ok, res.counts[:, 2], 0)
            if out.get("staged") is not None:
                out["staged"] += torch.where(ok, res.staged, 0)
            # Copy k of a request (k-th miss in ascending position order) at index k, as the kernel writes it.
            mask = res.fetch_mask & ok.view(-1, 1)
            order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
            sorted_mask = mask.gather(1, order)
            pos = res.fetch_position.gather(1, order).clamp(min=0)
            pages = host_pages[slots, source] if host_pages is not None else None
            if pages is not None:
                page = pages.gather(1, (pos // page_rows).clamp(max=pages.shape[1] - 1))
                page = torch.where(pos // page_rows < pages.shape[1], page, -1)
            else:
                page = torch.full_like(pos, -1)
            copied = sorted_mask & (page >= 0)
            flags |= 4 * int(bool((sorted_mask & (page < 0)).any()))
            out["fetch_src"][g] = torch.where(copied, page * page_rows + pos % page_rows, -1)
            out["fetch_dst"][g] = torch.where(copied, res.fetch_location.gather(1, order), -1)
            if out.get("steps") is not None:
                out["steps"][g] = -1  # not produced by the reference (the step path does not use them)
        out["flags"] |= flags

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
