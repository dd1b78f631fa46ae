// Byte layouts of one MLA latent KV row and scalar decoders usable on host and device.
//
// A row holds kv_lora_rank latent values followed by qk_rope_head_dim rope values.
//   * fp32 / bf16 rows: (rank + rope) values of one type, contiguous.
//   * FP8 row of DeepSeek-V3.2 (656 bytes, rank = 512, rope = 64):
//       bytes [0, 512)   512 fp8_e4m3 latent values (value i is scaled by scale[i / 128])
//       bytes [512, 528) 4 fp32 scales, one per 128 latent values
//       bytes [528, 656) 64 bf16 rope values (not quantised)
#pragma once

#include "dhisparse/host_device.h"

namespace dhisparse
{

enum KvFormat : int32_t
{
    kKvFloat32 = 0,
    kKvBFloat16 = 1,
    kKvFp8Ds32 = 2,  //!< 656-byte DeepSeek-V3.2 row
};

constexpr int32_t kFp8Rank = 512;
constexpr int32_t kFp8Rope = 64;
constexpr int32_t kFp8ScaleGroup = 128;
constexpr int32_t kFp8RowBytes = kFp8Rank + 4 * (kFp8Rank / kFp8ScaleGroup) + 2 * kFp8Rope;  // 656
constexpr int32_t kFp8ScaleOffset = kFp8Rank;
constexpr int32_t kFp8RopeOffset = kFp8Rank + 4 * (kFp8Rank / kFp8ScaleGroup);
static_assert(kFp8RowBytes == 656, "DeepSeek-V3.2 FP8 row is 656 bytes");

//! Bytes of one row in `format` (0 for an unknown format).
DHS_HD int64_t kv_row_bytes(int32_t format, int64_t rank, int64_t rope)
{
    switch (format)
    {
    case kKvFloat32: return 4 * (rank + rope);
    case kKvBFloat16: return 2 * (rank + rope);
    case kKvFp8Ds32: return (rank == kFp8Rank && rope == kFp8Rope) ? kFp8RowBytes : 0;
    default: return 0;
    }
}

//! bf16 bit pattern -> float (exact).
DHS_HD float bf16_bits_to_float(uint16_t bits)
{
    uint32_t const u = static_cast<uint32_t>(bits) << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
}

//! OCP fp8_e4m3 (bias 7, no infinities, 0x7f / 0xff are NaN) bit pattern -> float (exact).
DHS_HD float fp8_e4m3_bits_to_float(uint8_t bits)
{
    uint32_t const sign = static_cast<uint32_t>(bits >> 7) << 31;
    uint32_t const exponent = (bits >> 3) & 0xF;
    uint32_t const mantissa = bits & 0x7;
    uint32_t u;
    if (exponent == 0xF && mantissa == 0x7)
    {
        u = sign | 0x7FC00000u;  // NaN
    }
    else if (exponent != 0)
    {
        u = sign | ((exponent + 127 - 7) << 23) | (mantissa << 20);
    }
    else if (mantissa == 0)
    {
        u = sign;  // +-0
    }
    else
    {
        // Subnormal: mantissa * 2^-9; normalise into float's exponent.
        uint32_t m = mantissa;
        int32_t e = 1 - 7;
        while ((m & 0x8) == 0)
        {
            m <<= 1;
            --e;
        }
        u = sign | (static_cast<uint32_t>(e + 127) << 23) | ((m & 0x7) << 20);
    }
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
}

//! Latent value i (< 512) of a 656-byte FP8 row, dequantised.
DHS_HD float fp8_row_latent(uint8_t const* row, int32_t i)
{
    float scale;
    __builtin_memcpy(&scale, row + kFp8ScaleOffset + 4 * (i / kFp8ScaleGroup), sizeof(scale));
    return fp8_e4m3_bits_to_float(row[i]) * scale;
}

//! Rope value i (< 64) of a 656-byte FP8 row.
DHS_HD float fp8_row_rope(uint8_t const* row, int32_t i)
{
    uint16_t bits;
    __builtin_memcpy(&bits, row + kFp8RopeOffset + 2 * i, sizeof(bits));
    return bf16_bits_to_float(bits);
}

//! Value d (< rank + rope) of a row of any format, as float.
DHS_HD float kv_row_value(int32_t format, uint8_t const* row, int32_t rank, int32_t d)
{
    if (format == kKvFloat32)
    {
        float f;
        __builtin_memcpy(&f, row + 4 * d, sizeof(f));
        return f;
    }
    if (format == kKvBFloat16)
    {
        uint16_t bits;
        __builtin_memcpy(&bits, row + 2 * d, sizeof(bits));
        return bf16_bits_to_float(bits);
    }
    return d < rank ? fp8_row_latent(row, d) : fp8_row_rope(row, d - rank);
}

} // namespace dhisparse
