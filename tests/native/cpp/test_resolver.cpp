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

using dhisparse::ResolveScratch;
using dhisparse::ResolveSummary;
using dhisparse::SourceView;

//! One source's state plus scratch, owning its arrays.
struct Source
{
    int64_t num_rows = 0;
    int64_t page_rows = 4;
    int64_t tail_start = 0;
    int64_t tail_location = 0;
    int64_t hot_location = 0;
    std::vector<int64_t> page_locations;
    std::vector<int64_t> hot_positions;
    std::vector<int64_t> hot_last_use;

    ResolveSummary resolve(std::vector<int64_t> const& selection, int64_t step, std::vector<int64_t>& locations,
        std::vector<int64_t>& copy_positions, std::vector<int64_t>& copy_locations)
    {
        size_t const n = selection.size();
        std::vector<int64_t> union_positions(n), union_locations(n), victim_keys(hot_positions.size());
        std::vector<uint8_t> needed(hot_positions.size());
        ResolveScratch<int64_t> const scratch{
            union_positions.data(), union_locations.data(), victim_keys.data(), needed.data()};
        SourceView<int64_t> const v{num_rows, page_rows, tail_start, tail_location, hot_location, step,
            page_locations.data(), static_cast<int64_t>(page_locations.size()), hot_positions.data(),
            hot_last_use.data(), static_cast<int64_t>(hot_positions.size())};
        locations.assign(n, -7);
        copy_positions.assign(n, -1);
        copy_locations.assign(n, -1);
        ResolveSummary const s = dhisparse::resolve_source(v, selection.data(), static_cast<int64_t>(n), scratch,
            locations.data(), copy_positions.data(), copy_locations.data());
        copy_positions.resize(static_cast<size_t>(s.num_copies));
        copy_locations.resize(static_cast<size_t>(s.num_copies));
        return s;
    }
};

Source tiny_source()
{
    Source src;
    src.num_rows = 18;  // positions 0..17; pages 0..3 complete, tail page 4 holds 16, 17
    src.page_rows = 4;
    src.tail_start = 16;
    src.tail_location = 100;
    src.hot_location = 200;
    src.page_locations = {-1, 40, -1, -1};  // page 1 is a ready optional page at device rows 40..43
    src.hot_positions = {9, -1, 2, 13};
    src.hot_last_use = {5, -1, 3, 7};
    return src;
}

void test_exact_two_queries()
{
    Source src = tiny_source();
    std::vector<int64_t> loc, cp, cl;
    // Two verification queries of K = 4 (one padding entry); union = {0, 3, 5, 9, 12, 17}.
    ResolveSummary const s = src.resolve({17, 5, 9, 0, 0, 3, -1, 12}, 10, loc, cp, cl);
    DHS_CHECK_EQ(s.status, dhisparse::kResolveOk);
    DHS_CHECK_EQ(s.num_union, 6);
    DHS_CHECK_EQ(s.counts[0], 2);  // 5 (optional page), 17 (tail)
    DHS_CHECK_EQ(s.counts[1], 1);  // 9
    DHS_CHECK_EQ(s.counts[2], 3);  // 0, 3, 12
    DHS_CHECK(loc == (std::vector<int64_t>{101, 41, 200, 201, 201, 202, -1, 203}));
    // Victims: empty slot 1 first, then slot 2 (last use 3), then slot 3 (7); slot 0 was hit.
    DHS_CHECK(cp == (std::vector<int64_t>{0, 3, 12}));
    DHS_CHECK(cl == (std::vector<int64_t>{201, 202, 203}));
    DHS_CHECK(src.hot_positions == (std::vector<int64_t>{9, 0, 3, 12}));
    DHS_CHECK(src.hot_last_use == (std::vector<int64_t>{10, 10, 10, 10}));

    // Next step: ties in last use are broken by slot index; the hit slot 0 is never evicted.
    ResolveSummary const t = src.resolve({13, 9, 1, -1}, 11, loc, cp, cl);
    DHS_CHECK_EQ(t.status, dhisparse::kResolveOk);
    DHS_CHECK(cp == (std::vector<int64_t>{1, 13}));
    DHS_CHECK(cl == (std::vector<int64_t>{201, 202}));
    DHS_CHECK(loc == (std::vector<int64_t>{202, 200, 201, -1}));
    DHS_CHECK(src.hot_positions == (std::vector<int64_t>{9, 1, 13, 12}));
    DHS_CHECK(src.hot_last_use == (std::vector<int64_t>{11, 11, 11, 10}));
}

void test_errors_leave_state_untouched()
{
    Source src = tiny_source();
    src.hot_positions = {9, 2};
    src.hot_last_use = {5, 3};
    std::vector<int64_t> loc, cp, cl;
    // Misses 0, 1 with slot 0 needed: one evictable slot for two misses.
    ResolveSummary const s = src.resolve({0, 9, 1}, 10, loc, cp, cl);
    DHS_CHECK_EQ(s.status, dhisparse::kHotCacheTooSmall);
    DHS_CHECK(src.hot_positions == (std::vector<int64_t>{9, 2}));
    DHS_CHECK(src.hot_last_use == (std::vector<int64_t>{5, 3}));

    ResolveSummary const t = src.resolve({0, 18}, 10, loc, cp, cl);
    DHS_CHECK_EQ(t.status, dhisparse::kPositionOutOfRange);
    DHS_CHECK(src.hot_positions == (std::vector<int64_t>{9, 2}));
}

//! Random traces: device memory is modelled as "which position each device row holds"; after applying the
//! copy list, every selection entry's location must hold that position, each position is in the hot cache at
//! most once, copies go only to slots the step did not otherwise need, and each missing row is copied once.
void test_random_traces()
{
    std::mt19937_64 rng(1234);
    for (int trial = 0; trial < 200; ++trial)
    {
        Source src;
        src.page_rows = 1 + static_cast<int64_t>(rng() % 8);
        int64_t const pages = 1 + static_cast<int64_t>(rng() % 12);
        src.num_rows = pages * src.page_rows - static_cast<int64_t>(rng() % static_cast<uint64_t>(src.page_rows));
        src.tail_start = (src.num_rows - 1) / src.page_rows * src.page_rows;
        int64_t const queries = 1 + static_cast<int64_t>(rng() % 4);
        int64_t const topk = 1 + static_cast<int64_t>(rng() % 6);
        int64_t const hot_rows = queries * topk + static_cast<int64_t>(rng() % 4);
        std::map<int64_t, int64_t> device;  // device row -> position it holds
        int64_t next_row = 0;
        src.tail_location = next_row;
        for (int64_t p = src.tail_start; p < src.num_rows; ++p)
        {
            device[next_row++] = p;
        }
        for (int64_t page = 0; page < src.tail_start / src.page_rows; ++page)
        {
            bool const ready = rng() % 3 == 0;
            src.page_locations.push_back(ready ? next_row : -1);
            for (int64_t i = 0; ready && i < src.page_rows; ++i)
            {
                device[next_row++] = page * src.page_rows + i;
            }
        }
        src.hot_location = next_row + 1000;
        src.hot_positions.assign(static_cast<size_t>(hot_rows), -1);
        src.hot_last_use.assign(static_cast<size_t>(hot_rows), -1);
        for (int64_t step = 0; step < 20; ++step)
        {
            std::vector<int64_t> selection;
            for (int64_t i = 0; i < queries * topk; ++i)
            {
                bool const pad = rng() % 7 == 0;
                selection.push_back(pad ? -1 : static_cast<int64_t>(rng() % static_cast<uint64_t>(src.num_rows)));
            }
            std::vector<int64_t> loc, cp, cl;
            ResolveSummary const s = src.resolve(selection, step, loc, cp, cl);
            DHS_CHECK_EQ(s.status, dhisparse::kResolveOk);
            std::set<int64_t> unique(cp.begin(), cp.end());
            DHS_CHECK_EQ(unique.size(), cp.size());
            for (size_t i = 0; i < cp.size(); ++i)
            {
                DHS_CHECK(i == 0 || cp[i - 1] < cp[i]);
                DHS_CHECK(cl[i] >= src.hot_location && cl[i] < src.hot_location + hot_rows);
                device[cl[i]] = cp[i];
            }
            std::set<int64_t> selected, held;
            for (size_t i = 0; i < selection.size(); ++i)
            {
                if (selection[i] < 0)
                {
                    DHS_CHECK_EQ(loc[i], -1);
                    continue;
                }
                selected.insert(selection[i]);
                DHS_CHECK(device.count(loc[i]) == 1 && device[loc[i]] == selection[i]);
            }
            DHS_CHECK_EQ(static_cast<size_t>(s.num_union), selected.size());
            DHS_CHECK_EQ(s.counts[0] + s.counts[1] + s.counts[2], s.num_union);
            for (int64_t slot = 0; slot < hot_rows; ++slot)
            {
                int64_t const pos = src.hot_positions[static_cast<size_t>(slot)];
                if (pos >= 0)
                {
                    DHS_CHECK(held.insert(pos).second);
                    DHS_CHECK_EQ(device[src.hot_location + slot], pos);
                }
            }
        }
    }
}

} // namespace

int main()
{
    test_exact_two_queries();
    test_errors_leave_state_untouched();
    test_random_traces();
    DHS_TEST_MAIN_END();
}
