// Unit tests of dhisparse/resolver.h: exact locations, LRU order and copy lists on tiny cases, errors that
// leave state untouched, and a random-trace property test (every location holds the selected row).
#include "check.h"
#include "dhisparse/resolver.h"

#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace
{

using dhisparse::ResolveOutputs;
using dhisparse::ResolveScratch;
using dhisparse::SourceView;
using Vec = std::vector<int64_t>;

//! Outputs of one resolve call, copy lists trimmed to num_copies.
struct Result
{
    int32_t status = 0;
    Vec locations;
    std::vector<int8_t> steps;
    Vec copy_position;
    Vec copy_slot;
    Vec copy_location;
    int32_t summary[dhisparse::kSummaryColumns] = {};
};

//! One source's page table and hot cache, owning its arrays.
struct Source
{
    int64_t page_rows = 4;
    Vec page_table;
    Vec hot_pos;
    Vec hot_stamp;
    Vec hot_loc;

    Result resolve(Vec const& selection, int64_t stamp)
    {
        size_t const n = selection.size();
        size_t const b = hot_pos.size();
        Vec union_positions(n), union_locations(n), hot_keys(b), victim_keys(b);
        std::vector<int8_t> union_steps(n);
        std::vector<uint8_t> needed(b);
        ResolveScratch<int64_t> const scratch{
            union_positions.data(), union_locations.data(), union_steps.data(), hot_keys.data(), victim_keys.data(), needed.data()};
        SourceView<int64_t> const v{page_rows, stamp, page_table.data(), static_cast<int64_t>(page_table.size()),
            hot_pos.data(), hot_stamp.data(), hot_loc.data(), static_cast<int64_t>(b)};
        Result r;
        r.locations.assign(n, -7);
        r.steps.assign(n, -7);
        r.copy_position.assign(n, -1);
        r.copy_slot.assign(n, -1);
        r.copy_location.assign(n, -1);
        ResolveOutputs<int64_t> const out{r.locations.data(), r.steps.data(), r.copy_position.data(),
            r.copy_slot.data(), r.copy_location.data(), r.summary};
        r.status = dhisparse::resolve_source(v, selection.data(), static_cast<int64_t>(n), scratch, out);
        size_t const copies = static_cast<size_t>(r.summary[dhisparse::kSummaryNumCopies]);
        r.copy_position.resize(copies);
        r.copy_slot.resize(copies);
        r.copy_location.resize(copies);
        return r;
    }
};

Source tiny_source()
{
    Source src;
    src.page_rows = 4;
    // Page 1 is a ready optional page (arena page 10, rows 40..43); page 4 is the tail (arena page 25).
    src.page_table = {-1, 10, -1, -1, 25};
    src.hot_pos = {9, -1, 2, 13};
    src.hot_stamp = {5, 99, 3, 7};  // the empty slot's stamp is ignored
    src.hot_loc = {200, 310, 202, 57};
    return src;
}

std::vector<int8_t> codes(std::vector<int> const& v)
{
    return std::vector<int8_t>(v.begin(), v.end());
}

void test_exact_two_queries()
{
    Source src = tiny_source();
    // Two verification queries of K = 4 (one unused entry); union = {0, 3, 5, 9, 12, 17}.
    Result const r = src.resolve({17, 5, 9, 0, 0, 3, -1, 12}, 10);
    DHS_CHECK_EQ(r.status, dhisparse::kResolveOk);
    DHS_CHECK_EQ(r.summary[dhisparse::kSummaryNumUnion], 6);
    DHS_CHECK_EQ(r.summary[dhisparse::kSummaryDirect], 2);  // 5 (optional page), 17 (tail)
    DHS_CHECK_EQ(r.summary[dhisparse::kSummaryHot], 1);     // 9
    DHS_CHECK_EQ(r.summary[dhisparse::kSummaryHost], 3);    // 0, 3, 12
    DHS_CHECK(r.locations == (Vec{101, 41, 200, 310, 310, 202, -1, 57}));
    DHS_CHECK(r.steps == codes({1, 1, 2, 3, 3, 3, 0, 3}));
    // Victims: empty slot 1 first, then slot 2 (stamp 3), then slot 3 (stamp 7); slot 0 was hit.
    DHS_CHECK(r.copy_position == (Vec{0, 3, 12}));
    DHS_CHECK(r.copy_slot == (Vec{1, 2, 3}));
    DHS_CHECK(r.copy_location == (Vec{310, 202, 57}));
    DHS_CHECK(src.hot_pos == (Vec{9, 0, 3, 12}));
    DHS_CHECK(src.hot_stamp == (Vec{10, 10, 10, 10}));

    // Next step: ties in stamp are broken by slot index; the hit slot 0 is never evicted.
    Result const t = src.resolve({13, 9, 1, -1}, 11);
    DHS_CHECK_EQ(t.status, dhisparse::kResolveOk);
    DHS_CHECK(t.copy_position == (Vec{1, 13}));
    DHS_CHECK(t.copy_slot == (Vec{1, 2}));
    DHS_CHECK(t.locations == (Vec{202, 200, 310, -1}));
    DHS_CHECK(src.hot_pos == (Vec{9, 1, 13, 12}));
    DHS_CHECK(src.hot_stamp == (Vec{11, 11, 11, 10}));
}

void test_direct_before_hot()
{
    Source src = tiny_source();
    src.hot_pos = {5, -1, -1, -1};  // 5 is also on a ready optional page: direct wins, slot 0 untouched
    Result const r = src.resolve({5}, 10);
    DHS_CHECK(r.locations == (Vec{41}));
    DHS_CHECK(src.hot_stamp == (Vec{5, 99, 3, 7}));
}

void test_overflow_leaves_state_untouched()
{
    Source src = tiny_source();
    src.hot_pos = {9, 2};
    src.hot_stamp = {5, 3};
    src.hot_loc = {0, 1};
    // Misses 0, 1 with slot 0 needed: one evictable slot for two misses.
    Result const r = src.resolve({0, 9, 1}, 10);
    DHS_CHECK_EQ(r.status, dhisparse::kHotCacheTooSmall);
    DHS_CHECK(src.hot_pos == (Vec{9, 2}));
    DHS_CHECK(src.hot_stamp == (Vec{5, 3}));
}

//! Random traces: arena memory is modelled as "which position each arena row holds"; after applying the copy
//! list, every entry's location must hold its position, each position is in the hot cache at most once, and
//! each missing row is copied once, in ascending order.
void test_random_traces()
{
    std::mt19937_64 rng(1234);
    auto const below = [&rng](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
    for (int trial = 0; trial < 200; ++trial)
    {
        Source src;
        src.page_rows = 1 + below(8);
        int64_t const pages = 1 + below(12);
        int64_t const num_rows = pages * src.page_rows - below(src.page_rows);
        int64_t const queries = 1 + below(4);
        int64_t const topk = 1 + below(6);
        int64_t const hot_rows = queries * topk + below(4);
        std::map<int64_t, int64_t> arena;  // arena row -> position it holds
        for (int64_t page = 0; page < pages; ++page)
        {
            bool const ready = page == pages - 1 || below(3) == 0;  // the tail page is always direct
            int64_t const arena_page = 3 * page + 1;
            src.page_table.push_back(ready ? arena_page : -1);
            for (int64_t i = 0; ready && i < src.page_rows; ++i)
            {
                arena[arena_page * src.page_rows + i] = page * src.page_rows + i;
            }
        }
        int64_t const hot_base = 4 * pages * src.page_rows;
        for (int64_t s = 0; s < hot_rows; ++s)
        {
            src.hot_loc.push_back(hot_base + hot_rows - 1 - s);  // not in slot order
        }
        src.hot_pos.assign(static_cast<size_t>(hot_rows), -1);
        src.hot_stamp.assign(static_cast<size_t>(hot_rows), 0);
        for (int64_t step = 1; step <= 20; ++step)
        {
            Vec selection;
            for (int64_t i = 0; i < queries * topk; ++i)
            {
                selection.push_back(below(7) == 0 ? -1 : below(num_rows));
            }
            Result const r = src.resolve(selection, step);
            DHS_CHECK_EQ(r.status, dhisparse::kResolveOk);
            for (size_t i = 0; i < r.copy_position.size(); ++i)
            {
                DHS_CHECK(i == 0 || r.copy_position[i - 1] < r.copy_position[i]);
                DHS_CHECK_EQ(r.copy_location[i], src.hot_loc[static_cast<size_t>(r.copy_slot[i])]);
                arena[r.copy_location[i]] = r.copy_position[i];
            }
            std::set<int64_t> selected, held;
            for (size_t i = 0; i < selection.size(); ++i)
            {
                if (selection[i] < 0)
                {
                    DHS_CHECK_EQ(r.locations[i], -1);
                    DHS_CHECK_EQ(r.steps[i], 0);
                    continue;
                }
                selected.insert(selection[i]);
                DHS_CHECK(arena.count(r.locations[i]) == 1 && arena[r.locations[i]] == selection[i]);
            }
            DHS_CHECK_EQ(static_cast<size_t>(r.summary[dhisparse::kSummaryNumUnion]), selected.size());
            DHS_CHECK_EQ(r.summary[3] + r.summary[4] + r.summary[5], r.summary[dhisparse::kSummaryNumUnion]);
            for (size_t slot = 0; slot < src.hot_pos.size(); ++slot)
            {
                if (src.hot_pos[slot] >= 0)
                {
                    DHS_CHECK(held.insert(src.hot_pos[slot]).second);
                    DHS_CHECK_EQ(arena[src.hot_loc[slot]], src.hot_pos[slot]);
                }
            }
        }
    }
}

} // namespace

int main()
{
    test_exact_two_queries();
    test_direct_before_hot();
    test_overflow_leaves_state_untouched();
    test_random_traces();
    DHS_TEST_MAIN_END();
}
