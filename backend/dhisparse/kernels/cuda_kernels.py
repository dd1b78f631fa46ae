"""The CUDA kernels behind the launcher layer: resolvers, host→device row copy, sparse MLA decode.

Every resolver and copy call packs an argument struct (:mod:`dhisparse.kernels.abi`) and launches through
``dhisparse::cuda::launch_*`` — the host code the TensorRT plugins' ``enqueue`` runs — on torch's current
CUDA stream (or the stream given). Launches are asynchronous; nothing here synchronises with the host except
:meth:`CudaKernels.resolve`, which compacts the copy list like :func:`dhisparse.kernels.resolver.resolve` (the
self-check uses it). The request path uses :meth:`CudaKernels.resolve_step` (an index group for the whole batch in
one launch, fetch lists padded with ``-1`` on the device for the row copy to consume as they are). Attention runs
the Triton-lang kernel (:mod:`dhisparse.kernels.triton_mla`) when Triton is installed, else the CUDA C++ kernel.
"""

from __future__ import annotations

import ctypes

import torch

from dhisparse.kernels import abi, triton_mla
from dhisparse.kernels.resolver import HotCacheOverflowError, Resolution, from_padded

RESOLVE_OUTPUTS = ("locations", "steps", "hot_pos", "hot_stamp", "copy_position", "copy_slot", "copy_location",
                   "summary")
SUMMARY_STATUS = 0
KIND_NAMES = {abi.KIND_RESOLVER: "resolver", abi.KIND_ROW_COPY: "row copy", abi.KIND_SPARSE_MLA: "sparse MLA",
              abi.KIND_STEP_RESOLVER: "step resolver"}


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class KernelLaunchError(RuntimeError):
    """A CUDA launcher refused its arguments or the launch failed."""


class CudaKernels:
    """Kernels from ``libdhisparse_cuda.so``; ``name == "cuda"``. Construct only where a GPU exists."""

    name = "cuda"
    on_device = True

    def __init__(self, lib: ctypes.CDLL, device: torch.device, attention: str = "auto") -> None:
        """``attention``: ``"triton"`` (the Triton-lang kernel, :mod:`triton_mla`: rows read once per request for
        all heads, tensor-core products), ``"cuda"`` (the CUDA C++ kernel the TensorRT plugin shares), or
        ``"auto"``: Triton when it is installed."""
        if attention not in ("auto", "triton", "cuda"):
            raise ValueError(f"attention must be auto, triton or cuda, got {attention!r}")
        if attention == "triton" and not triton_mla.available():
            raise ValueError("attention='triton' needs Triton-lang (pip install triton)")
        self._lib = lib
        self.device = device
        self.attention = "triton" if attention == "auto" and triton_mla.available() else (
            "cuda" if attention == "auto" else attention)

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            name = self._lib.dhs_cuda_error_name(rc).decode()
            raise KernelLaunchError(f"{what} kernel launch failed: {name} ({rc})")

    @staticmethod
    def _stream(stream: torch.cuda.Stream | None) -> int:
        return (stream or torch.cuda.current_stream()).cuda_stream

    # ---------------------------------------------------------------------------------------- resolver
    def resolve_padded(
        self, positions: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
        hot_loc: torch.Tensor, stamp: int, page_rows: int,
    ) -> dict[str, torch.Tensor]:
        """Outputs of the resolver kernel as device tensors (``RESOLVE_OUTPUTS``): locations / steps / copy
        lists ``[R, N]`` (copy lists ``-1`` padded, ascending), hot state ``[R, B]``, ``summary [R, 6]`` int32
        (column 0 non-zero: that row's hot cache overflowed). Inputs: int64 device tensors, not modified."""
        ins = [t.contiguous() for t in (positions, page_table, hot_pos, hot_stamp, hot_loc)]
        positions, page_table, hot_pos, hot_stamp, hot_loc = ins
        r, n = positions.shape
        out = {
            "locations": torch.empty_like(positions),
            "steps": torch.empty(r, n, dtype=torch.int8, device=positions.device),
            "hot_pos": torch.empty_like(hot_pos),
            "hot_stamp": torch.empty_like(hot_stamp),
            "copy_position": torch.empty_like(positions),
            "copy_slot": torch.empty_like(positions),
            "copy_location": torch.empty_like(positions),
            "summary": torch.zeros(r, 6, dtype=torch.int32, device=positions.device),
        }
        stamp_t = torch.full((1,), stamp, dtype=positions.dtype, device=positions.device)
        args = abi.pack_resolver(stamp_t, positions, page_table, hot_pos, hot_stamp, hot_loc, page_rows, out)
        plan = self.plan(abi.KIND_RESOLVER, args)
        workspace = self._workspace(plan, positions.device)
        rc = self._lib.dhs_cuda_launch_resolver(ctypes.byref(args), _address(workspace), self._stream(None))
        self._check("resolver", rc)
        # The caching allocator may hand these to other work as soon as Python drops them: they were used on
        # the current stream only, so ordinary stream semantics keep them valid until the kernel ran.
        return out

    def resolve_step(self, stamp: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None,
                     sources: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor,
                     hot_stamp: torch.Tensor, hot_loc: torch.Tensor, host_pages: torch.Tensor | None,
                     staging: tuple[torch.Tensor, torch.Tensor] | None, page_rows: int,
                     out: dict[str, torch.Tensor]) -> None:
        """One KV step's index group (``G = sources.numel()`` sources selected by ``positions [B, N]``) for the
        whole batch in **one launch** (``StepResolveArgs`` of launch.h; shapes in :func:`abi.pack_step_resolver`):
        hot state updated in place in the batch state's ``slots``, ``out``'s per-entry locations and ``[G, B, N]``
        fetch lists (host rows → arena rows, each request's copies first, ``-1`` after: the row-copy kernel's
        input as is) written, verification staging from ``staging = (staging_loc [slots, staging slots, T],
        staging_slots [G])`` (None: none), counts / staged added, error bits or-ed into ``out["flags"]``. Every
        tensor on the device (``stamp`` too: a captured graph replays the launch with the next step's stamp);
        asynchronous."""
        args = abi.pack_step_resolver(stamp, positions, lengths, sources, slots, page_table, hot_pos, hot_stamp,
                                      hot_loc, host_pages, staging, page_rows, out)
        plan = self.plan(abi.KIND_STEP_RESOLVER, args)
        workspace = self._workspace(plan, positions.device)
        rc = self._lib.dhs_cuda_launch_step_resolver(ctypes.byref(args), _address(workspace), self._stream(None))
        self._check("step resolver", rc)

    @staticmethod
    def _workspace(plan: abi.LaunchPlan, device: torch.device) -> torch.Tensor | None:
        """Device workspace of a resolver plan (rows whose scratch exceeds shared memory), or None. Used on the
        current stream only: once the caller drops it, the caching allocator reuses it after the kernel."""
        if plan.workspace_bytes <= 0:
            return None
        return torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device)

    def resolve(
        self, positions: torch.Tensor, page_table: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
        hot_loc: torch.Tensor, stamp: int, page_rows: int,
    ) -> Resolution:
        """:func:`dhisparse.kernels.resolver.resolve` computed by the kernel (synchronises to compact the copy list)."""
        out = self.resolve_padded(positions, page_table, hot_pos, hot_stamp, hot_loc, stamp, page_rows)
        status = out["summary"][:, SUMMARY_STATUS]
        if bool((status != 0).any()):
            row = int(torch.nonzero(status)[0, 0])
            raise HotCacheOverflowError(
                f"request row {row}: the resolver kernel reports more misses than its hot cache of "
                f"{hot_pos.shape[1]} slots can take; raise hot_rows (B)")
        return from_padded(out["locations"], out["steps"], out["hot_pos"], out["hot_stamp"], out["copy_position"],
                           out["copy_slot"], out["copy_location"], out["summary"])

    # ---------------------------------------------------------------------------------------- row copy
    def copy_rows(self, host_rows: torch.Tensor, device_rows: torch.Tensor, src_rows: torch.Tensor,
                  dst_rows: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """``device_rows[dst[r, i]] = host_rows[src[r, i]]`` where ``src >= 0``, read straight from pinned
        ``host_rows`` by copy_grid_blocks(R) blocks (4..32). ``src_rows`` / ``dst_rows`` ``[R, M]`` on the
        device. ``host_rows`` may also be a tensor on ``device_rows``' device: the host store's mapped view
        (``kv.mapped_host``, a device tensor aliasing pinned chunks at their host addresses) or device memory.
        Asynchronous on ``stream``; the caller keeps every tensor alive until it completes."""
        if not host_rows.is_pinned() and not (host_rows.is_cuda and host_rows.device == device_rows.device):
            raise ValueError("copy_rows: host_rows must be pinned host memory (the kernel reads it over UVA) or a "
                             "tensor on the destination's device (the host store's mapped view)")
        args = abi.pack_row_copy(host_rows, device_rows, src_rows, dst_rows)
        self._check("row copy", self._lib.dhs_cuda_launch_row_copy(ctypes.byref(args), self._stream(stream)))

    # ---------------------------------------------------------------------------------------- attention
    def sparse_mla(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor,
                   softmax_scale: float, kv_format: int | None = None) -> torch.Tensor:
        """Absorbed sparse MLA decode (see :func:`dhisparse.kernels.reference.sparse_mla_reference`);
        returns ``out_lat [B, Q, H, rank]`` in ``q_lat``'s dtype. A query's rows are distinct (its top-k): with
        several queries the Triton kernel reads their union once (:mod:`dhisparse.kernels.mla_union`)."""
        if self.attention == "triton":
            return triton_mla.sparse_mla(q_lat, q_pe, kv, locations, softmax_scale,
                                         fp8_rows=kv_format == abi.KV_FORMAT_FP8)
        q_lat, q_pe, locations = q_lat.contiguous(), q_pe.contiguous(), locations.contiguous()
        out = torch.empty_like(q_lat)
        args = abi.pack_sparse_mla(q_lat, q_pe, kv, locations, softmax_scale, out, kv_format)
        self._check("sparse MLA", self._lib.dhs_cuda_launch_sparse_mla(ctypes.byref(args), self._stream(None)))
        return out

    def supports_attention(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether :meth:`sparse_mla` takes this query / KV-row dtype pair (float32 or bfloat16, equal)."""
        return q_dtype in abi.KV_FORMAT and kv_dtype in abi.KV_FORMAT

    # ---------------------------------------------------------------------------------------- plans
    def plan(self, kind: int, args: ctypes.Structure) -> abi.LaunchPlan:
        """The launch plan of ``args`` (``plan_of_kind`` of launch.h, as the launcher computes it)."""
        plan = abi.LaunchPlan()
        status = self._lib.dhs_cuda_launch_plan(kind, ctypes.byref(args), ctypes.byref(plan))
        if status not in (abi.PLAN_OK, abi.PLAN_EMPTY):
            raise KernelLaunchError(abi.plan_error(KIND_NAMES.get(kind, f"kind {kind}"), status))
        return plan
