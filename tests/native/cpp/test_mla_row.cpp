// Unit tests of dhisparse/mla_row.h (fp8_e4m3 / bf16 decoding, the 656-byte FP8 row) and copy_grid.h.
#include "check.h"
#include "dhisparse/copy_grid.h"
#include "dhisparse/mla_row.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace
{

void test_fp8_e4m3_all_patterns()
{
    for (int bits = 0; bits < 256; ++bits)
    {
        int const sign = bits >> 7;
        int const exponent = (bits >> 3) & 0xF;
        int const mantissa = bits & 0x7;
        float const got = dhisparse::fp8_e4m3_bits_to_float(static_cast<uint8_t>(bits));
        if (exponent == 0xF && mantissa == 0x7)
        {
            DHS_CHECK(std::isnan(got));
            continue;
        }
        double const magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                               : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
        DHS_CHECK(static_cast<double>(got) == (sign ? -magnitude : magnitude));
    }
    DHS_CHECK(dhisparse::fp8_e4m3_bits_to_float(0x38) == 1.0f);
    DHS_CHECK(dhisparse::fp8_e4m3_bits_to_float(0x7E) == 448.0f);
    DHS_CHECK(dhisparse::fp8_e4m3_bits_to_float(0xB8) == -1.0f);
}

void test_bf16()
{
    DHS_CHECK(dhisparse::bf16_bits_to_float(0x3F80) == 1.0f);
    DHS_CHECK(dhisparse::bf16_bits_to_float(0xC040) == -3.0f);
    DHS_CHECK(dhisparse::bf16_bits_to_float(0x0000) == 0.0f);
}

void test_fp8_row_layout()
{
    std::vector<uint8_t> row(dhisparse::kFp8RowBytes, 0);
    float const scales[4] = {0.5f, 2.0f, -1.0f, 0.25f};
    std::memcpy(row.data() + 512, scales, sizeof(scales));
    for (int i = 0; i < 512; ++i)
    {
        row[static_cast<size_t>(i)] = 0x38;  // 1.0
    }
    row[130] = 0x40;  // 2.0, group 1
    uint16_t const rope_bits[2] = {0x3F80, 0x4000};  // 1.0, 2.0
    std::memcpy(row.data() + 528, rope_bits, sizeof(rope_bits));
    DHS_CHECK(dhisparse::fp8_row_latent(row.data(), 0) == 0.5f);
    DHS_CHECK(dhisparse::fp8_row_latent(row.data(), 127) == 0.5f);
    DHS_CHECK(dhisparse::fp8_row_latent(row.data(), 128) == 2.0f);
    DHS_CHECK(dhisparse::fp8_row_latent(row.data(), 130) == 4.0f);
    DHS_CHECK(dhisparse::fp8_row_latent(row.data(), 300) == -1.0f);
    DHS_CHECK(dhisparse::fp8_row_latent(row.data(), 511) == 0.25f);
    DHS_CHECK(dhisparse::fp8_row_rope(row.data(), 0) == 1.0f);
    DHS_CHECK(dhisparse::fp8_row_rope(row.data(), 1) == 2.0f);
    DHS_CHECK(dhisparse::kv_row_value(dhisparse::kKvFp8Ds32, row.data(), 512, 513) == 2.0f);
    DHS_CHECK_EQ(dhisparse::kv_row_bytes(dhisparse::kKvFp8Ds32, 512, 64), 656);
    DHS_CHECK_EQ(dhisparse::kv_row_bytes(dhisparse::kKvFp8Ds32, 256, 64), 0);
    DHS_CHECK_EQ(dhisparse::kv_row_bytes(dhisparse::kKvBFloat16, 512, 64), 1152);
    DHS_CHECK_EQ(dhisparse::kv_row_bytes(dhisparse::kKvFloat32, 512, 64), 2304);
}

void test_copy_grid_rule()
{
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(0), 4);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(1), 4);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(16), 4);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(17), 5);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(64), 16);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(124), 31);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(128), 32);
    DHS_CHECK_EQ(dhisparse::copy_grid_blocks(100000), 32);
    for (int64_t batch = 1; batch < 300; ++batch)
    {
        DHS_CHECK(dhisparse::copy_grid_blocks(batch) >= dhisparse::copy_grid_blocks(batch - 1));
    }
}

} // namespace

int main()
{
    test_fp8_e4m3_all_patterns();
    test_bf16();
    test_fp8_row_layout();
    test_copy_grid_rule();
    DHS_TEST_MAIN_END();
}
