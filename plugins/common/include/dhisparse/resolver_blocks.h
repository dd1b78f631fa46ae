// The blocks of the two resolver launches (dhisparse/launch.h): what block `block` of the grid does, for any
// executor. The CUDA kernels (plugins/kernels/resolver_kernel.cu) run them with one thread block each; the CPU
// library (plugins/cpu/block_resolver_cpu.cpp) runs every block of a grid in turn with dhisparse::SerialBlock,
// so that the tests execute the kernels' code on the CPU.
#pragma once

#include "dhisparse/block_resolver.h"
#include "dhisparse/launch.h"

namespace dhisparse
{

//! Block r of the batched resolver (ResolverArgs): row r, no length check, no staging, no fetch list.
template <typename Ex, typename Idx>
DHS_HD void resolver_block(Ex const& ex, ResolverArgs const& a, int64_t r, BlockScratch const& s, int32_t* counters)
{
    int64_t const n = a.n_select;
    int64_t const b = a.hot_rows;
    BlockRow<Idx> row;
    row.n = n;
    row.hot_rows = b;
    row.page_rows = static_cast<Idx>(a.page_rows);
    row.stamp = *static_cast<Idx const*>(a.stamp);
    row.length = INT64_MAX;
    row.positions = static_cast<Idx const*>(a.positions) + r * n;
    row.page_table = static_cast<Idx const*>(a.page_table) + r * a.num_pages;
    row.num_pages = a.num_pages;
    row.hot_pos_in = static_cast<Idx const*>(a.hot_pos_in) + r * b;
    row.hot_stamp_in = static_cast<Idx const*>(a.hot_stamp_in) + r * b;
    row.hot_loc = static_cast<Idx const*>(a.hot_loc) + r * b;
    row.hot_pos_out = static_cast<Idx*>(a.hot_pos_out) + r * b;
    row.hot_stamp_out = static_cast<Idx*>(a.hot_stamp_out) + r * b;
    row.staging_loc = nullptr;
    row.staging_rows = 0;
    row.host_pages = nullptr;
    row.host_num_pages = 0;
    row.locations = static_cast<Idx*>(a.locations) + r * n;
    row.steps = a.steps + r * n;
    row.copy_position = static_cast<Idx*>(a.copy_position) + r * n;
    row.copy_slot = static_cast<Idx*>(a.copy_slot) + r * n;
    row.copy_location = static_cast<Idx*>(a.copy_location) + r * n;
    row.fetch_src = nullptr;
    row.fetch_dst = nullptr;
    row.summary = a.summary + r * kSummaryColumns;
    block_resolve_row(ex, row, s, counters);
}

//! Block `block` of the step resolver (StepResolveArgs): source g = block / B, request b = block % B.
template <typename Ex>
DHS_HD void step_resolver_block(Ex const& ex, StepResolveArgs const& a, int64_t block, BlockScratch const& s,
    int32_t* counters)
{
    int64_t const n = a.n;
    int64_t const g = block / a.batch;
    int64_t const b = block % a.batch;
    int64_t const source = a.sources[g];
    int64_t const slot = a.slots[b];
    int64_t* const locations = a.locations + (g * a.batch + b) * n;
    int64_t* const fetch_src = a.fetch_src + (g * a.batch + b) * n;
    int64_t* const fetch_dst = a.fetch_dst + (g * a.batch + b) * n;
    int64_t const staging_slot = a.staging_rows > 0 ? a.staging_slots[g] : 0;
    if (source < 0 || source >= a.num_sources || slot < 0 || slot >= a.num_slots
        || (a.staging_rows > 0 && (staging_slot < 0 || staging_slot >= a.staging_count)))
    {
        for (int64_t i = ex.thread(); i < n; i += ex.threads())
        {
            locations[i] = -1;
            fetch_src[i] = -1;
            fetch_dst[i] = -1;
            if (a.steps != nullptr)
            {
                a.steps[(g * a.batch + b) * n + i] = kStepUnused;
            }
        }
        if (ex.thread() == 0)
        {
            ex.bit_or(a.flags, kStepBadArgument);
        }
        return;
    }
    int64_t* const hot_pos = a.hot_pos + slot * a.hot_slot_stride + source * a.hot_source_stride;
    int64_t* const hot_stamp = a.hot_stamp + slot * a.hot_slot_stride + source * a.hot_source_stride;
    BlockRow<int64_t> row;
    row.n = n;
    row.hot_rows = a.hot_rows;
    row.page_rows = a.page_rows;
    row.stamp = *static_cast<int64_t const*>(a.stamp);
    row.length = a.lengths != nullptr ? a.lengths[b] : INT64_MAX;
    row.positions = a.positions + b * n;
    row.page_table = a.page_table + b * a.table_row_stride + source * a.table_source_stride;
    row.num_pages = a.num_pages;
    row.hot_pos_in = hot_pos;
    row.hot_stamp_in = hot_stamp;
    row.hot_loc = a.hot_loc + slot * a.hot_slot_stride + source * a.hot_source_stride;
    row.hot_pos_out = hot_pos;
    row.hot_stamp_out = hot_stamp;
    row.staging_loc = a.staging_rows > 0
        ? a.staging_loc + slot * a.staging_slot_stride + staging_slot * a.staging_group_stride
        : nullptr;
    row.staging_rows = a.staging_rows;
    row.host_pages = a.host_pages != nullptr ? a.host_pages + slot * a.host_slot_stride + source * a.host_source_stride
                                             : nullptr;
    row.host_num_pages = a.host_num_pages;
    row.locations = locations;
    row.steps = a.steps != nullptr ? a.steps + (g * a.batch + b) * n : nullptr;
    row.copy_position = nullptr;
    row.copy_slot = nullptr;
    row.copy_location = nullptr;
    row.fetch_src = fetch_src;
    row.fetch_dst = fetch_dst;
    row.summary = nullptr;
    BlockRowResult const r = block_resolve_row(ex, row, s, counters);
    if (ex.thread() == 0)
    {
        ex.add64(a.counts + b * 3 + 0, r.direct);
        ex.add64(a.counts + b * 3 + 1, r.hot);
        ex.add64(a.counts + b * 3 + 2, r.host);
        if (a.staged != nullptr)
        {
            ex.add64(a.staged + b, r.staged);
        }
        if (r.flags != 0)
        {
            ex.bit_or(a.flags, r.flags);
        }
    }
}

} // namespace dhisparse
