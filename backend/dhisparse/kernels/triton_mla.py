"""Sparse MLA decode in Triton-lang: each selected row read once per request for all of its queries and heads.

Absorbed MLA attends every head to the same latent row (``rank`` values, plus ``rope`` values for the scores):
``out[q, h] = sum_j softmax_j(scale * (q_lat[q, h] . row_j[:rank] + q_pe[q, h] . row_j[rank:])) row_j[:rank]``.
The kernel (FlashMLA's sparse-decode structure, written here independently in Triton) therefore makes the heads
the M dimension of two tensor-core products per block of ``BLOCK_N`` rows — ``S = Q K^T`` over ``rank + rope``
and ``O += P V`` with ``V = K[:, :rank]`` — so a row is loaded once for all heads:

- **Rows shared by queries**: the ``γ + 1`` verification queries of a request are rows of the same M dimension
  (``m = q * H + h``); the kernel walks the request's union of selected rows (:mod:`mla_union`) and masks, per
  query, the rows that query did not select. With ``Q * H <= BLOCK_M`` every row is read once per request; above,
  the M tiles of a request are neighbouring programs (grid axis 0), so a row comes from HBM once and from L2 after.
- **Split over the rows** when the batch is small: the grid is ``(M tiles, splits, B)``; each split keeps a partial
  output normalised by its own sum and its log-sum-exp, and :func:`_combine_kernel` merges the splits.
- **Row formats**: float32 / bfloat16 rows of ``rank + rope`` values, and DeepSeek-V3.2's 656-byte FP8 rows (512
  e4m3 latent values with a float32 scale per 128, 64 bfloat16 rope values), decoded in the kernel (bit
  arithmetic, exact) and multiplied in the query's dtype (bfloat16 products for bfloat16 queries).

Precision: products in the query dtype (float32 queries: IEEE float32 products, no TF32), softmax and accumulation
in float32, ``P`` rounded to the query dtype for ``P V`` (as FlashMLA does for bfloat16).

The same source runs on the CPU under ``TRITON_INTERPRET=1`` (tests). Its interpreter multiplies bfloat16
matrices wrongly (it treats their bits as integers), so in interpreter mode only, ``tl.dot`` operands are widened
to float32 first — the products of bfloat16 values are exact in float32, so the values are the same; everything
else is the GPU code path.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from dhisparse.kernels.mla_union import RowUnion, union_of_queries

# Triton is optional (the extra ``kernels``): the CUDA C++ kernel and the torch reference serve without it. Its
# kernels live in ``triton_mla_kernels``, imported on first use: importing Triton costs ~0.6 s, and Triton decides
# between compiling and interpreting (``TRITON_INTERPRET``) when a kernel is defined.
_TRITON_FOUND = importlib.util.find_spec("triton") is not None

FP8_RANK, FP8_ROPE, FP8_ROW_BYTES = 512, 64, 656
KV_FLOAT, KV_FP8 = 0, 1
LOG2E = 1.4426950408889634


def available() -> bool:
    """Whether Triton-lang is installed (the kernels then run on CUDA tensors, or on CPU tensors in interpreter
    mode)."""
    return _TRITON_FOUND


@cache
def _kernels() -> ModuleType:
    from dhisparse.kernels import triton_mla_kernels  # optional dependency, defined on first use (see above)

    return triton_mla_kernels


def interpreting() -> bool:
    """Whether the kernels are (or, not defined yet, will be) made for Triton's CPU interpreter: ``TRITON_INTERPRET=1``
    when they are defined."""
    if not _TRITON_FOUND:
        return False
    if _kernels.cache_info().currsize:
        return type(_kernels()._split_kernel).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class MlaConfig:
    """Launch configuration: ``block_m`` query-head rows and ``block_n`` KV rows per program step, ``splits`` of
    each request's rows (``0``: chosen from the batch so that about ``target_programs`` programs run)."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    splits: int = 0
    target_programs: int = 264  # two per SM of an H100 / H200

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.splits < 0 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"splits must be >= 0 and num_warps / num_stages >= 1, got {self}")


# Smaller tiles to fall back to when a configuration does not fit the device (shared memory, registers): tried in
# order, the first that compiles is kept for that launch signature.
FALLBACKS = ((None, 16, None, 1), (32, 16, 4, 1), (16, 16, 4, 1))
_WORKING: dict[tuple, MlaConfig] = {}


def _out_of_resources(exc: BaseException) -> bool:
    import triton  # installed: a launch got this far

    errors = getattr(getattr(triton, "runtime", None), "errors", None)
    kind = getattr(errors, "OutOfResources", None)
    return (kind is not None and isinstance(exc, kind)) or "out of resource" in str(exc).lower()


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << max(n - 1, 0).bit_length())


def choose_splits(config: MlaConfig, batch: int, m_tiles: int, rows: int) -> int:
    """Splits of each request's ``rows`` so that ``batch * m_tiles * splits`` is about the target (at most one
    split per ``block_n`` rows; 1 for a large batch, where the combine step is skipped)."""
    if config.splits:
        return max(1, min(config.splits, -(-rows // config.block_n)))
    want = -(-config.target_programs // max(batch * m_tiles, 1))
    return max(1, min(want, -(-rows // config.block_n)))


def sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, locations: torch.Tensor,
               softmax_scale: float, fp8_rows: bool = False, config: MlaConfig | None = None,
               union: RowUnion | None = None) -> torch.Tensor:
    """Absorbed sparse MLA decode (the semantics of ``reference.sparse_mla_reference``).

    Args:
        q_lat: ``[B, Q, H, rank]``, q_pe: ``[B, Q, H, rope]``, float32 or bfloat16 (one dtype; strides free in all
            but the last dimension).
        kv: arena rows ``[rows, rank + rope]`` in q's dtype, or ``[rows, 656]`` uint8 FP8 rows (``fp8_rows``).
        locations: ``[B, Q, K]`` int32 / int64 arena rows, ``-1`` = masked; or pass ``union`` (its form for these
            locations, e.g. made once for several layers).
        softmax_scale: scale of the scores.

    Returns:
        ``out_lat [B, Q, H, rank]`` in q's dtype; zeros for a query with no valid row.
    """
    if not _TRITON_FOUND:
        raise RuntimeError("Triton-lang is not installed (pip install triton): the Triton sparse MLA kernel is "
                           "unavailable")
    batch, queries, heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    if q_pe.shape[:3] != q_lat.shape[:3] or q_pe.dtype != q_lat.dtype or q_lat.dtype not in (torch.float32,
                                                                                              torch.bfloat16):
        raise ValueError(f"q_lat [B, Q, H, rank] and q_pe [B, Q, H, rope] must share B, Q, H and a float32 / bfloat16 "
                         f"dtype, got {list(q_lat.shape)} {q_lat.dtype} and {list(q_pe.shape)} {q_pe.dtype}")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("q_lat, q_pe and kv need a contiguous last dimension")
    if fp8_rows:
        if (rank, rope) != (FP8_RANK, FP8_ROPE) or kv.dtype != torch.uint8 or kv.shape[-1] != FP8_ROW_BYTES:
            raise ValueError("FP8 rows are [rows, 656] uint8 with rank 512 and rope 64")
        if kv.stride(0) % 4 or kv.data_ptr() % 4:
            raise ValueError("FP8 rows must start at 4-byte aligned addresses (their scales are float32)")
    elif kv.dtype != q_lat.dtype or kv.shape[-1] < rank + rope:
        raise ValueError(f"kv rows must be [rows, >= rank + rope] in q's dtype, got {list(kv.shape)} {kv.dtype}")
    if union is None:
        if locations.dim() != 3 or locations.shape[:2] != (batch, queries):
            raise ValueError(f"locations must be [B, Q, K] = [{batch}, {queries}, K], got {list(locations.shape)}")
        union = union_of_queries(locations.contiguous())
    config = config or MlaConfig()
    key = (config, q_lat.dtype, fp8_rows, queries > 1, heads, rank, rope, q_lat.device.type)
    config = _WORKING.get(key, config)
    for m, n, warps, stages in ((None, None, None, None), *FALLBACKS):
        attempt = MlaConfig(block_m=m or config.block_m, block_n=n or config.block_n,
                            num_warps=warps or config.num_warps, num_stages=stages or config.num_stages,
                            splits=config.splits, target_programs=config.target_programs)
        try:
            out = _launch(q_lat, q_pe, kv, union, softmax_scale, fp8_rows, attempt)
        except Exception as exc:
            if not _out_of_resources(exc) or (m, n, warps, stages) == FALLBACKS[-1]:
                raise
            continue
        _WORKING[key] = attempt
        return out
    raise AssertionError("unreachable")


def _launch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, union: RowUnion, softmax_scale: float,
            fp8_rows: bool, config: MlaConfig) -> torch.Tensor:
    """One launch of the split kernel (and the combine kernel when the rows are split) with ``config``."""
    batch, queries, heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    out = torch.empty(batch, queries, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    qh = queries * heads
    if batch == 0 or qh == 0:
        return out
    width = union.locations.shape[1]
    block_m = min(config.block_m, _pow2(qh))
    m_tiles = -(-qh // block_m)
    splits = choose_splits(config, batch, m_tiles, width)
    direct = splits == 1
    device = q_lat.device
    part = lse = out  # unused when direct
    if not direct:
        part = torch.empty(batch * splits * qh, rank, dtype=torch.float32, device=device)
        lse = torch.empty(batch * splits * qh, dtype=torch.float32, device=device)
    locs = union.locations.contiguous()
    member = union.member.contiguous() if union.member is not None else locs
    kv_f32 = kv.view(torch.float32) if fp8_rows else kv
    kv_bf16 = kv.view(torch.bfloat16) if fp8_rows else kv
    k = _kernels()
    dot = k.tl.bfloat16 if q_lat.dtype == torch.bfloat16 else k.tl.float32
    k._split_kernel[(m_tiles, splits, batch)](
        q_lat, q_pe, kv, kv_f32, kv_bf16, locs, member, union.length, out, part, lse,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        kv.stride(0), locs.stride(0), out.stride(0), out.stride(1), out.stride(2),
        heads, qh, rank, rope, splits, softmax_scale * LOG2E,
        FORMAT=KV_FP8 if fp8_rows else KV_FLOAT, HAS_MEMBER=union.member is not None, DIRECT=direct, DOT=dot,
        IEEE=q_lat.dtype == torch.float32, EMULATE=interpreting(),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_R=_pow2(rank), BLOCK_P=_pow2(rope),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not direct:
        k._combine_kernel[(m_tiles, batch)](
            part, lse, out, out.stride(0), out.stride(1), out.stride(2), heads, qh, rank, splits,
            BLOCK_M=block_m, BLOCK_R=_pow2(rank), num_warps=config.num_warps,
        )
    return out
