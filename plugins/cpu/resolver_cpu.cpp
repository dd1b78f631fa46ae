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
int32_t resolve_batch(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows, Idx page_rows,
    Idx const* selection, Idx const* meta, Idx const* page_locations, Idx* hot_positions, Idx* hot_last_use,
    Idx* locations, Idx* copy_positions, Idx* copy_locations, int32_t* summary)
{
    if (num_sources < 0 || n_select < 0 || num_pages < 0 || hot_rows < 0 || page_rows <= 0)
    {
        return -1;
    }
    std::vector<Idx> union_positions(static_cast<size_t>(n_select));
    std::vector<Idx> union_locations(static_cast<size_t>(n_select));
    std::vector<int64_t> victim_keys(static_cast<size_t>(hot_rows));
    std::vector<uint8_t> slot_needed(static_cast<size_t>(hot_rows));
    dhisparse::ResolveScratch<Idx> const scratch{
        union_positions.data(), union_locations.data(), victim_keys.data(), slot_needed.data()};
    int32_t first_error = 0;
    for (int64_t r = 0; r < num_sources; ++r)
    {
        auto const view = dhisparse::batch_source_view<Idx>(
            r, meta, page_locations, num_pages, hot_positions, hot_last_use, hot_rows, page_rows);
        Idx* const row_copy_positions = copy_positions + r * n_select;
        Idx* const row_copy_locations = copy_locations + r * n_select;
        auto const s = dhisparse::resolve_source<Idx>(view, selection + r * n_select, n_select, scratch,
            locations + r * n_select, row_copy_positions, row_copy_locations);
        int64_t const written = s.status == dhisparse::kResolveOk ? s.num_copies : 0;
        for (int64_t i = written; i < n_select; ++i)
        {
            row_copy_positions[i] = -1;
            row_copy_locations[i] = -1;
        }
        if (s.status != dhisparse::kResolveOk)
        {
            for (int64_t i = 0; i < n_select; ++i)
            {
                locations[r * n_select + i] = -1;
            }
        }
        int32_t* const out = summary + r * DHS_SUMMARY_COLUMNS;
        out[DHS_SUMMARY_STATUS] = s.status;
        out[DHS_SUMMARY_NUM_UNION] = s.num_union;
        out[DHS_SUMMARY_NUM_COPIES] = s.num_copies;
        out[DHS_SUMMARY_DIRECT] = s.counts[dhisparse::kStepDirect];
        out[DHS_SUMMARY_HOT] = s.counts[dhisparse::kStepHot];
        out[DHS_SUMMARY_HOST] = s.counts[dhisparse::kStepHost];
        if (first_error == 0 && s.status != dhisparse::kResolveOk)
        {
            first_error = s.status;
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
    int64_t page_rows, int64_t const* selection, int64_t const* meta, int64_t const* page_locations,
    int64_t* hot_positions, int64_t* hot_last_use, int64_t* locations, int64_t* copy_positions,
    int64_t* copy_locations, int32_t* summary)
{
    return resolve_batch<int64_t>(num_sources, n_select, num_pages, hot_rows, page_rows, selection, meta,
        page_locations, hot_positions, hot_last_use, locations, copy_positions, copy_locations, summary);
}

int32_t dhs_resolve_batch_i32(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int32_t page_rows, int32_t const* selection, int32_t const* meta, int32_t const* page_locations,
    int32_t* hot_positions, int32_t* hot_last_use, int32_t* locations, int32_t* copy_positions,
    int32_t* copy_locations, int32_t* summary)
{
    return resolve_batch<int32_t>(num_sources, n_select, num_pages, hot_rows, page_rows, selection, meta,
        page_locations, hot_positions, hot_last_use, locations, copy_positions, copy_locations, summary);
}

int32_t dhs_copy_grid_blocks(int64_t batch)
{
    return dhisparse::copy_grid_blocks(batch);
}

} // extern "C"
