// CPU build of the shared resolver logic behind a C ABI (see include/dhisparse/c_api.h).
#include "dhisparse/c_api.h"

#include "dhisparse/copy_grid.h"
#include "dhisparse/resolver.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace
{

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

int32_t dhs_copy_grid_blocks(int64_t batch)
{
    return dhisparse::copy_grid_blocks(batch);
}

} // extern "C"
