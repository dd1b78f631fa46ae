// Launch-shape rule of the host->device row gather copy, shared by the kernel launcher, the plugin and tests.
#pragma once

#include "dhisparse/host_device.h"

namespace dhisparse
{

constexpr int32_t kCopyMinBlocks = 4;
constexpr int32_t kCopyMaxBlocks = 32;
constexpr int32_t kCopyRequestsPerBlock = 4;
constexpr int32_t kCopyThreads = 256;

//! Thread blocks of the gather copy for a decode batch of `batch` requests: one block per 4 requests,
//! clamped to [4, 32] (batch 1..16 -> 4 blocks, 17..20 -> 5, ..., >= 125 -> 32). Few blocks keep the copy
//! from competing with attention kernels at small batch; 32 blocks of 256 threads already saturate the
//! PCIe / C2C link with 16-byte reads of pinned host memory.
DHS_HD int32_t copy_grid_blocks(int64_t batch)
{
    int64_t const blocks = (batch + kCopyRequestsPerBlock - 1) / kCopyRequestsPerBlock;
    return static_cast<int32_t>(blocks < kCopyMinBlocks ? kCopyMinBlocks : (blocks > kCopyMaxBlocks ? kCopyMaxBlocks : blocks));
}

} // namespace dhisparse
