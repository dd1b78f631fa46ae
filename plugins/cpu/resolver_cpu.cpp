// CPU build of the shared resolver logic behind a C ABI (see include/dhisparse/c_api.h).
#include "dhisparse/c_api.h"

#include "dhisparse/copy_grid.h"
#include "dhisparse/resolver.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace
{

// Every field of DhsStepArgs is 8 bytes, in declaration order (native.py packs it as an int64 array).
static_assert(sizeof(DhsStepArgs) == 39 * sizeof(int64_t), "DhsStepArgs layout");
static_assert(offsetof(DhsStepArgs, counts) == 31 * sizeof(int64_t), "DhsStepArgs layout");
static_assert(sizeof(DhsSetupArgs) == 19 * sizeof(int64_t), "DhsSetupArgs layout");
static_assert(offsetof(DhsSetupArgs, out) == 18 * sizeof(int64_t), "DhsSetupArgs layout");

template <typename Idx>
int32_t resolve_batch(int64_t num_sources, int64_t n, int64_t num_pages, int64_t hot_rows, Idx page_rows,
    Idx stamp, Idx const* positions, Idx const* page_table, Idx* hot_pos, Idx* hot_stamp, Idx const* hot_loc,
    Idx* locations, int8_t* steps, Idx* copy_position, Idx* copy_slot, Idx* copy_location, int32_t* summary)
{
    if (num_sources < 0 || n < 0 || num_pages < 0 || hot_rows < 0 || hot_rows >= (int64_t{1} << 24)
        || page_rows <= 0 || stamp < 0)
    {
        return -1;
    }
    std::vector<Idx> union_positions(static_cast<size_t>(n));
    std::vector<Idx> union_locations(static_cast<size_t>(n));
    std::vector<int8_t> union_steps(static_cast<size_t>(n));
    std::vector<int64_t> hot_keys(static_cast<size_t>(hot_rows));
    std::vector<int64_t> victim_keys(static_cast<size_t>(hot_rows));
    std::vector<uint8_t> slot_needed(static_cast<size_t>(hot_rows));
    dhisparse::ResolveScratch<Idx> const scratch{union_positions.data(), union_locations.data(),
        union_steps.data(), hot_keys.data(), victim_keys.data(), slot_needed.data()};
    int32_t first_error = 0;
    for (int64_t r = 0; r < num_sources; ++r)
    {
        auto const view = dhisparse::batch_source_view<Idx>(
            r, page_rows, stamp, page_table, num_pages, hot_pos, hot_stamp, hot_loc, hot_rows);
        int64_t const o = r * n;
        dhisparse::ResolveOutputs<Idx> const out{locations + o, steps + o, copy_position + o, copy_slot + o,
            copy_location + o, summary + r * DHS_SUMMARY_COLUMNS};
        int32_t const status = dhisparse::resolve_source<Idx>(view, positions + o, n, scratch, out);
        int64_t const written = status == dhisparse::kResolveOk ? out.summary[DHS_SUMMARY_NUM_COPIES] : 0;
        for (int64_t i = written; i < n; ++i)
        {
            out.copy_position[i] = -1;
            out.copy_slot[i] = -1;
            out.copy_location[i] = -1;
        }
        if (status != dhisparse::kResolveOk)
        {
            for (int64_t i = 0; i < n; ++i)
            {
                out.locations[i] = -1;
                out.steps[i] = dhisparse::kStepUnused;
            }
            first_error = first_error == 0 ? status : first_error;
        }
    }
    return first_error;
}


//! Strided view of a [rows, sources, width] int64 tensor whose last dimension is contiguous.
struct Strided3
{
    int64_t* data;
    int64_t row_stride;
    int64_t source_stride;

    int64_t* at(int64_t row, int64_t source) const
    {
        return data + row * row_stride + source * source_stride;
    }
};

//! Step 1 alone for every (request, source) of a step whose whole history is direct (sizes checked by the caller).
int32_t resolve_step_direct(DhsStepArgs const& a)
{
    int64_t const n = a.n;
    int32_t flags = 0;
    std::vector<int64_t> distinct(static_cast<size_t>(n));
    Strided3 const table{const_cast<int64_t*>(a.page_table), a.table_row_stride, a.table_source_stride};
    for (int64_t b = 0; b < a.batch; ++b)
    {
        int64_t const* const selection = a.positions + b * n;
        int64_t valid = 0;
        for (int64_t i = 0; i < n; ++i)
        {
            if (selection[i] >= 0)
            {
                distinct[static_cast<size_t>(valid++)] = selection[i];
            }
        }
        dhisparse::heap_sort(distinct.data(), valid);
        int64_t unique = 0;
        for (int64_t i = 0; i < valid; ++i)
        {
            unique += (i == 0 || distinct[static_cast<size_t>(i)] != distinct[static_cast<size_t>(i - 1)]) ? 1 : 0;
        }
        for (int64_t g = 0; g < a.groups; ++g)
        {
            dhisparse::SourceView<int64_t> const view{a.page_rows, a.stamp, table.at(b, a.sources[g]), a.num_pages,
                nullptr, nullptr, nullptr, 0};
            int64_t* const out = a.locations + (g * a.batch + b) * n;
            for (int64_t i = 0; i < n; ++i)
            {
                int64_t const loc = selection[i] >= 0 ? dhisparse::direct_location(view, selection[i]) : -1;
                flags |= (selection[i] >= 0 && loc < 0) ? DHS_STEP_UNMAPPED : 0;
                out[i] = loc;
            }
            a.counts[b * a.counts_row_stride] += unique;
        }
    }
    return flags;
}

int32_t resolve_step(DhsStepArgs const& a)
{
    if (a.batch < 0 || a.n < 0 || a.groups < 0 || a.hot_rows < 0 || a.hot_rows >= (int64_t{1} << 24)
        || a.page_rows <= 0 || a.stamp < 0 || a.num_pages < 0 || (a.host_pages != nullptr && a.host_num_pages < 0))
    {
        return -1;
    }
    bool const staged_step = a.staging_rows > 0 && a.staging_loc != nullptr;
    if (a.staging_rows < 0 || (staged_step && (a.staging_slots == nullptr || a.staged == nullptr)))
    {
        return -1;
    }
    for (int64_t g = 0; g < a.groups; ++g)
    {
        if (a.sources[g] < 0 || a.sources[g] >= a.num_sources
            || (staged_step && (a.staging_slots[g] < 0 || a.staging_slots[g] >= a.staging_count)))
        {
            return -1;
        }
    }
    for (int64_t b = 0; b < a.batch; ++b)
    {
        if (a.slots[b] < 0 || a.slots[b] >= a.num_slots)
        {
            return -1;
        }
    }
    int64_t const n = a.n;
    // Checks first: a selected position at or past its request's length resolves nothing (the step fails).
    int32_t flags = 0;
    for (int64_t b = 0; b < a.batch; ++b)
    {
        for (int64_t i = 0; i < n; ++i)
        {
            if (a.positions[b * n + i] >= a.lengths[b])
            {
                flags |= DHS_STEP_BAD_POSITION;
            }
        }
    }
    for (int64_t g = 0; g < a.groups; ++g)
    {
        a.fetch_count[g] = 0;
    }
    if (flags != 0)
    {
        for (int64_t i = 0; i < a.groups * a.batch * n; ++i)
        {
            a.locations[i] = -1;
        }
        return flags;
    }
    if (a.direct_only != 0)
    {
        return flags | resolve_step_direct(a);
    }
    std::vector<int64_t> union_positions(static_cast<size_t>(n));
    std::vector<int64_t> union_locations(static_cast<size_t>(n));
    std::vector<int8_t> union_steps(static_cast<size_t>(n));
    std::vector<int64_t> hot_keys(static_cast<size_t>(a.hot_rows));
    std::vector<int64_t> victim_keys(static_cast<size_t>(a.hot_rows));
    std::vector<uint8_t> slot_needed(static_cast<size_t>(a.hot_rows));
    std::vector<int8_t> steps(static_cast<size_t>(n));
    std::vector<int64_t> copy_position(static_cast<size_t>(n));
    std::vector<int64_t> copy_slot(static_cast<size_t>(n));
    std::vector<int64_t> copy_location(static_cast<size_t>(n));
    int32_t summary[DHS_SUMMARY_COLUMNS];
    dhisparse::ResolveScratch<int64_t> const scratch{union_positions.data(), union_locations.data(),
        union_steps.data(), hot_keys.data(), victim_keys.data(), slot_needed.data()};
    Strided3 const table{const_cast<int64_t*>(a.page_table), a.table_row_stride, a.table_source_stride};
    Strided3 const hot_pos{a.hot_pos, a.hot_slot_stride, a.hot_source_stride};
    Strided3 const hot_stamp{a.hot_stamp, a.hot_slot_stride, a.hot_source_stride};
    Strided3 const hot_loc{const_cast<int64_t*>(a.hot_loc), a.hot_slot_stride, a.hot_source_stride};
    Strided3 const host{const_cast<int64_t*>(a.host_pages), a.host_slot_stride, a.host_source_stride};
    bool const staging = staged_step;
    for (int64_t g = 0; g < a.groups; ++g)
    {
        int64_t const source = a.sources[g];
        int64_t* const src = a.fetch_src + g * a.batch * n;
        int64_t* const dst = a.fetch_dst + g * a.batch * n;
        int64_t fetched = 0;
        for (int64_t b = 0; b < a.batch; ++b)
        {
            int64_t const slot = a.slots[b];
            int64_t const* const staging_loc = staging
                ? a.staging_loc + slot * a.staging_slot_stride + a.staging_slots[g] * a.staging_group_stride
                : nullptr;
            dhisparse::SourceView<int64_t> const view{a.page_rows, a.stamp, table.at(b, source), a.num_pages,
                hot_pos.at(slot, source), hot_stamp.at(slot, source), hot_loc.at(slot, source), a.hot_rows,
                staging_loc, staging ? a.staging_rows : 0};
            dhisparse::ResolveOutputs<int64_t> const out{a.locations + (g * a.batch + b) * n, steps.data(),
                copy_position.data(), copy_slot.data(), copy_location.data(), summary};
            int32_t const status = dhisparse::resolve_source<int64_t>(view, a.positions + b * n, n, scratch, out);
            int64_t* const counts = a.counts + b * a.counts_row_stride;
            counts[0] += summary[DHS_SUMMARY_DIRECT];
            counts[1] += summary[DHS_SUMMARY_HOT];
            counts[2] += status == dhisparse::kResolveOk ? summary[DHS_SUMMARY_HOST] : 0;
            if (status != dhisparse::kResolveOk)
            {
                for (int64_t i = 0; i < n; ++i)
                {
                    out.locations[i] = -1;
                }
                flags |= DHS_STEP_HOT_CACHE_OVERFLOW;
                continue;
            }
            int64_t const copies = summary[DHS_SUMMARY_NUM_COPIES];
            int64_t const* const pages = a.host_pages != nullptr ? host.at(slot, source) : nullptr;
            for (int64_t c = 0; c < copies; ++c)
            {
                if (staging && copy_slot[c] < 0)
                {
                    ++a.staged[b];
                }
                int64_t const page = copy_position[c] / a.page_rows;
                int64_t const host_page = pages != nullptr && page < a.host_num_pages ? pages[page] : -1;
                if (host_page < 0)
                {
                    flags |= DHS_STEP_NO_HOST_COPY;
                    continue;
                }
                src[fetched] = host_page * a.page_rows + copy_position[c] % a.page_rows;
                dst[fetched] = copy_location[c];
                ++fetched;
            }
        }
        a.fetch_count[g] = fetched;
    }
    return flags;
}

int32_t step_setup(DhsSetupArgs const& a)
{
    if (a.batch < 0 || a.query_len < 1 || a.num_sources < 0 || a.indexers < 0 || a.page_rows <= 0
        || a.keys_per_page <= 0 || a.width < 0 || a.width > a.table_pages || (a.indexers > 0 && a.key_pages == nullptr))
    {
        return -1;
    }
    int64_t const b_count = a.batch;
    int64_t const q_count = a.query_len;
    int64_t const bq = b_count * q_count;
    int64_t* const starts = a.out;
    int64_t* const lengths = a.out + b_count;
    int64_t* const snapshot = lengths + b_count;
    int64_t* const rows = snapshot + b_count * a.num_sources * a.width;
    int64_t* const key_write = rows + a.num_sources * bq;
    int64_t* const key_within = key_write + a.indexers * bq;
    int32_t flags = 0;
    for (int64_t b = 0; b < b_count; ++b)
    {
        int64_t const slot = a.slots[b];
        int64_t const start = a.starts[b];
        if (slot < 0 || slot >= a.num_slots || start < 0)
        {
            return -1;
        }
        starts[b] = start;
        lengths[b] = start + q_count;
        for (int64_t s = 0; s < a.num_sources; ++s)
        {
            int64_t const* const table = a.page_table + slot * a.table_slot_stride + s * a.table_source_stride;
            int64_t* const copy = snapshot + (b * a.num_sources + s) * a.width;
            for (int64_t m = 0; m < a.width; ++m)
            {
                copy[m] = table[m];
            }
            for (int64_t q = 0; q < q_count; ++q)
            {
                int64_t const pos = start + q;
                int64_t const page = pos / a.page_rows;
                int64_t const arena_page = page < a.width ? copy[page] : -1;
                flags |= arena_page < 0 ? DHS_STEP_UNMAPPED : 0;
                rows[(s * b_count + b) * q_count + q] = arena_page < 0 ? 0 : arena_page * a.page_rows + pos % a.page_rows;
            }
        }
        for (int64_t q = 0; q < q_count; ++q)
        {
            int64_t const pos = start + q;
            int64_t const block = pos / a.keys_per_page;
            if (a.indexers > 0 && block >= a.key_blocks)
            {
                return -1;
            }
            key_within[b * q_count + q] = pos % a.keys_per_page;
            for (int64_t l = 0; l < a.indexers; ++l)
            {
                key_write[(l * b_count + b) * q_count + q]
                    = a.key_pages[slot * a.key_slot_stride + l * a.key_layer_stride + block];
            }
        }
    }
    return flags;
}

} // namespace

extern "C" {

int32_t dhs_cpu_abi_version(void)
{
    return DHS_CPU_ABI_VERSION;
}

int32_t dhs_resolve_batch_i64(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int64_t page_rows, int64_t stamp, int64_t const* positions, int64_t const* page_table, int64_t* hot_pos,
    int64_t* hot_stamp, int64_t const* hot_loc, int64_t* locations, int8_t* steps, int64_t* copy_position,
    int64_t* copy_slot, int64_t* copy_location, int32_t* summary)
{
    return resolve_batch<int64_t>(num_sources, n_select, num_pages, hot_rows, page_rows, stamp, positions,
        page_table, hot_pos, hot_stamp, hot_loc, locations, steps, copy_position, copy_slot, copy_location, summary);
}

int32_t dhs_resolve_batch_i32(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int32_t page_rows, int32_t stamp, int32_t const* positions, int32_t const* page_table, int32_t* hot_pos,
    int32_t* hot_stamp, int32_t const* hot_loc, int32_t* locations, int8_t* steps, int32_t* copy_position,
    int32_t* copy_slot, int32_t* copy_location, int32_t* summary)
{
    return resolve_batch<int32_t>(num_sources, n_select, num_pages, hot_rows, page_rows, stamp, positions,
        page_table, hot_pos, hot_stamp, hot_loc, locations, steps, copy_position, copy_slot, copy_location, summary);
}

int32_t dhs_resolve_step_i64(DhsStepArgs const* args)
{
    return args == nullptr ? -1 : resolve_step(*args);
}

int32_t dhs_step_setup_i64(DhsSetupArgs const* args)
{
    return args == nullptr ? -1 : step_setup(*args);
}

int32_t dhs_copy_grid_blocks(int64_t batch)
{
    return dhisparse::copy_grid_blocks(batch);
}

} // extern "C"
