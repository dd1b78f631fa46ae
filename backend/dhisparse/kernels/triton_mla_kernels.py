"""The Triton-lang kernels of sparse MLA decode (see :mod:`dhisparse.kernels.triton_mla`, their launcher, for the
design). Importing this module imports Triton and defines the kernels — compiled for the GPU, or for Triton's CPU
interpreter when ``TRITON_INTERPRET=1`` at that moment — so the launcher imports it on first use."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp8_e4m3_to_float(u):
    """OCP e4m3 bits (int32 0..255) -> float32, exactly (NaN for 0x7f / 0xff)."""
    sign = (u >> 7) << 31
    exponent = (u >> 3) & 15
    mantissa = u & 7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    tiny = mantissa.to(tl.float32) * 0.001953125  # subnormal: mantissa * 2^-9
    tiny = tl.where(sign != 0, -tiny, tiny)
    value = tl.where(exponent == 0, tiny, normal)
    return tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)

@triton.jit
def _operand(x, DOT: tl.constexpr, EMULATE: tl.constexpr):
    """A tensor-core operand in the product dtype (float32 in interpreter mode: see the module docstring)."""
    if EMULATE:
        return x.to(DOT).to(tl.float32)
    return x.to(DOT)

@triton.jit
def _split_kernel(
    q_lat, q_pe, kv, kv_f32, kv_bf16, locs, member, lengths, out, part, lse,
    stride_qb, stride_qq, stride_qh, stride_pb, stride_pq, stride_ph, row_stride,
    stride_lb, stride_ob, stride_oq, stride_oh,
    heads, qh, rank, rope, splits, scale_log2,
    FORMAT: tl.constexpr, HAS_MEMBER: tl.constexpr, DIRECT: tl.constexpr, DOT: tl.constexpr,
    IEEE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < qh
    query = offs_m // heads
    head = offs_m % heads
    d = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    d_ok = d < rank
    p_ok = p < rope
    q_rows = b * stride_qb + query.to(tl.int64) * stride_qq + head.to(tl.int64) * stride_qh
    ql = tl.load(q_lat + q_rows[:, None] + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    p_rows = b * stride_pb + query.to(tl.int64) * stride_pq + head.to(tl.int64) * stride_ph
    qp = tl.load(q_pe + p_rows[:, None] + p[None, :], mask=m_ok[:, None] & p_ok[None, :], other=0.0)
    ql = _operand(ql, DOT, EMULATE)
    qp = _operand(qp, DOT, EMULATE)

    length = tl.load(lengths + b)
    per_split = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    begin = pid_s * per_split
    end = tl.minimum(begin + per_split, length)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for start in range(begin, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        loc = tl.load(locs + b * stride_lb + offs_n, mask=n_ok, other=-1).to(tl.int64)
        row_ok = loc >= 0
        row = tl.where(row_ok, loc, 0)
        if FORMAT == 1:  # 656-byte FP8 rows: e4m3 latent * per-128 scale, bf16 rope
            bits = tl.load(kv + row[:, None] * row_stride + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                           other=0).to(tl.int32)
            scale = tl.load(kv_f32 + row[:, None] * (row_stride // 4) + 128 + d[None, :] // 128,
                            mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            k_lat = _fp8_e4m3_to_float(bits) * scale
            k_pe = tl.load(kv_bf16 + row[:, None] * (row_stride // 2) + 264 + p[None, :],
                           mask=row_ok[:, None] & p_ok[None, :], other=0.0)
        else:
            k_lat = tl.load(kv + row[:, None] * row_stride + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                            other=0.0)
            k_pe = tl.load(kv + row[:, None] * row_stride + rank + p[None, :],
                           mask=row_ok[:, None] & p_ok[None, :], other=0.0)
        k_lat = _operand(k_lat, DOT, EMULATE)
        k_pe = _operand(k_pe, DOT, EMULATE)
        if IEEE:
            s = tl.dot(ql, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(qp, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(ql, tl.trans(k_lat))
            s += tl.dot(qp, tl.trans(k_pe))
        keep = row_ok[None, :] & m_ok[:, None]
        if HAS_MEMBER:
            bitmask = tl.load(member + b * stride_lb + offs_n, mask=n_ok, other=0)
            keep = keep & (((bitmask[None, :] >> query[:, None]) & 1) != 0)
        s = tl.where(keep, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(_operand(prob, DOT, EMULATE), k_lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(_operand(prob, DOT, EMULATE), k_lat)
        m_i = m_new

    has = l_i > 0.0
    result = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        o_rows = b * stride_ob + query.to(tl.int64) * stride_oq + head.to(tl.int64) * stride_oh
        tl.store(out + o_rows[:, None] + d[None, :], result.to(out.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])
    else:
        slot = (b * splits + pid_s) * qh + offs_m
        tl.store(part + slot.to(tl.int64)[:, None] * rank + d[None, :], result, mask=m_ok[:, None] & d_ok[None, :])
        tl.store(lse + slot, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=m_ok)

@triton.jit
def _combine_kernel(
    part, lse, out, stride_ob, stride_oq, stride_oh, heads, qh, rank, splits,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < qh
    d = tl.arange(0, BLOCK_R)
    d_ok = d < rank
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, splits):
        top = tl.maximum(top, tl.load(lse + (b * splits + s) * qh + offs_m, mask=m_ok, other=float("-inf")))
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for s in range(0, splits):
        slot = (b * splits + s) * qh + offs_m
        weight = tl.exp2(tl.load(lse + slot, mask=m_ok, other=float("-inf")) - top_safe)
        values = tl.load(part + slot.to(tl.int64)[:, None] * rank + d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                         other=0.0)
        acc += weight[:, None] * values
        total += weight
    result = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    query = offs_m // heads
    head = offs_m % heads
    o_rows = b * stride_ob + query.to(tl.int64) * stride_oq + head.to(tl.int64) * stride_oh
    tl.store(out + o_rows[:, None] + d[None, :], result.to(out.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
