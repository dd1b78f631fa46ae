// The three-step resolver of one (request, KV source) for one decode step, header-only and shared by the
// CPU library (g++), the ctest unit tests and the CUDA kernels (nvcc).
//
// Semantics (the contract every build implements bit for bit):
//   * The selection is Q queries x K positions (Q = 1 without speculation, gamma + 1 verification queries
//     with it); negative entries are padding. The queries share one *union*: the distinct valid positions,
//     in ascending order. Each union row is resolved once, so a row missing for several queries is copied once.
//   * Step 1, direct: a position in the tail (tail_start <= pos < num_rows) is at tail_location + (pos -
//     tail_start); a position in a ready optional page p (page_locations[p] >= 0) is at page_locations[p] +
//     pos % page_rows.
//   * Step 2, hot cache: a scan of the B slots (bounded by B, however much optional history is resident).
//     A slot that holds the position is a hit, at hot_location + slot; its LRU stamp becomes `step`.
//   * Step 3, host copy: misses, in ascending position order, take victim slots in LRU order: the slots not
//     hit by this step, ordered by (last_use, slot) ascending (an empty slot has last_use = -1, so empty
//     slots go first, lowest index first). Miss i goes to victim i; the slot then holds the position with
//     last_use = step, and the copy list gets (position, hot_location + slot). A slot hit by this step is
//     never evicted. More misses than evictable slots is an error (kHotCacheTooSmall), with state untouched.
//   * Every selection entry gets the location of its union row; padding gets -1.
//   * Counts are over union rows: [direct, hot, host].
#pragma once

#include "dhisparse/host_device.h"
#include "dhisparse/sort.h"

namespace dhisparse
{

enum ResolveStatus : int32_t
{
    kResolveOk = 0,
    kHotCacheTooSmall = 1,    //!< more misses than slots that this step does not need
    kPositionOutOfRange = 2,  //!< a selected position >= num_rows
};

enum ResolveStep : int32_t
{
    kStepDirect = 0,
    kStepHot = 1,
    kStepHost = 2,
    kNumResolveSteps = 3,
};

//! Columns of the per-source metadata row `meta[r, :]` shared by the C API, the kernels and the plugins.
enum MetaColumn : int32_t
{
    kMetaNumRows = 0,       //!< rows that exist for this source (positions 0 .. num_rows - 1)
    kMetaTailStart = 1,     //!< first position held by the mutable tail page
    kMetaTailLocation = 2,  //!< device row of position tail_start
    kMetaHotLocation = 3,   //!< device row of hot-cache slot 0
    kMetaStep = 4,          //!< LRU stamp of this decode step (strictly increasing per source)
    kMetaColumns = 5,
};

//! View of one (request, source): metadata, the ready-optional-page map and the (mutable) hot cache.
template <typename Idx>
struct SourceView
{
    Idx num_rows;
    Idx page_rows;
    Idx tail_start;
    Idx tail_location;
    Idx hot_location;
    Idx step;
    Idx const* page_locations;  //!< [num_pages] device row of page p's first row, or -1 when not ready
    Idx num_pages;
    Idx* hot_positions;  //!< [hot_rows] position held by each slot, -1 when empty
    Idx* hot_last_use;   //!< [hot_rows] LRU stamp of each slot, -1 when never used
    Idx hot_rows;        //!< B
};

//! Builds the view of row r of the flat batch layout: meta [R, kMetaColumns], page_locations [R, P],
//! hot_positions / hot_last_use [R, B].
template <typename Idx>
DHS_HD SourceView<Idx> batch_source_view(int64_t r, Idx const* meta, Idx const* page_locations, int64_t num_pages,
    Idx* hot_positions, Idx* hot_last_use, int64_t hot_rows, Idx page_rows)
{
    Idx const* m = meta + r * kMetaColumns;
    SourceView<Idx> v;
    v.num_rows = m[kMetaNumRows];
    v.page_rows = page_rows;
    v.tail_start = m[kMetaTailStart];
    v.tail_location = m[kMetaTailLocation];
    v.hot_location = m[kMetaHotLocation];
    v.step = m[kMetaStep];
    v.page_locations = page_locations + r * num_pages;
    v.num_pages = static_cast<Idx>(num_pages);
    v.hot_positions = hot_positions + r * hot_rows;
    v.hot_last_use = hot_last_use + r * hot_rows;
    v.hot_rows = static_cast<Idx>(hot_rows);
    return v;
}

//! Step 1: device row of `pos` in the tail or a ready optional page, or -1.
template <typename Idx>
DHS_HD Idx direct_location(SourceView<Idx> const& v, Idx pos)
{
    if (pos >= v.tail_start && pos < v.num_rows)
    {
        return v.tail_location + (pos - v.tail_start);
    }
    Idx const page = pos / v.page_rows;
    if (page < v.num_pages)
    {
        Idx const base = v.page_locations[page];
        if (base >= 0)
        {
            return base + pos % v.page_rows;
        }
    }
    return -1;
}

//! Step 2: the hot-cache slot holding `pos` (scan bounded by B), or -1.
template <typename Idx>
DHS_HD Idx hot_find(SourceView<Idx> const& v, Idx pos)
{
    for (Idx s = 0; s < v.hot_rows; ++s)
    {
        if (v.hot_positions[s] == pos)
        {
            return s;
        }
    }
    return -1;
}

//! Eviction order key of a slot: needed slots sort last (never chosen), then (last_use, slot) ascending.
DHS_HD int64_t victim_key(int64_t last_use, int64_t slot, bool needed)
{
    constexpr int64_t kNeeded = INT64_MAX;
    return needed ? kNeeded : ((last_use + 1) << 24) | slot;
}

DHS_HD int64_t victim_slot(int64_t key)
{
    return key & ((int64_t{1} << 24) - 1);
}

//! Scratch memory of resolve_source for a selection of n entries and B hot rows.
template <typename Idx>
struct ResolveScratch
{
    Idx* union_positions;   //!< [n] sorted distinct positions, then padding
    Idx* union_locations;   //!< [n] resolved device row of each union entry
    int64_t* victim_keys;   //!< [B]
    uint8_t* slot_needed;   //!< [B]
};

//! Result of resolving one source; copy lists are written by the caller-provided arrays.
struct ResolveSummary
{
    int32_t status;
    int32_t num_union;
    int32_t num_copies;
    int32_t counts[kNumResolveSteps];
};

//! Serial reference implementation of the contract above (CPU library, ctest). `selection` holds n entries
//! (Q x K flattened); `locations` [n] receives each entry's device row; `copy_positions` / `copy_locations`
//! [n] receive the copy list (ascending position order). On error nothing in `v` is modified.
template <typename Idx>
DHS_HD ResolveSummary resolve_source(SourceView<Idx> const& v, Idx const* selection, int64_t n,
    ResolveScratch<Idx> const& scratch, Idx* locations, Idx* copy_positions, Idx* copy_locations)
{
    ResolveSummary out{kResolveOk, 0, 0, {0, 0, 0}};
    // Union of the queries' selections: sort all valid entries, keep distinct ones.
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
    {
        Idx const pos = selection[i];
        if (pos >= v.num_rows)
        {
            out.status = kPositionOutOfRange;
            return out;
        }
        if (pos >= 0)
        {
            scratch.union_positions[m++] = pos;
        }
    }
    heap_sort(scratch.union_positions, m);
    int64_t u = 0;
    for (int64_t i = 0; i < m; ++i)
    {
        if (i == 0 || scratch.union_positions[i] != scratch.union_positions[i - 1])
        {
            scratch.union_positions[u++] = scratch.union_positions[i];
        }
    }
    out.num_union = static_cast<int32_t>(u);

    // Steps 1 and 2; misses are marked with location -1 and counted.
    for (Idx s = 0; s < v.hot_rows; ++s)
    {
        scratch.slot_needed[s] = 0;
    }
    int64_t misses = 0;
    for (int64_t i = 0; i < u; ++i)
    {
        Idx const pos = scratch.union_positions[i];
        Idx loc = direct_location(v, pos);
        if (loc >= 0)
        {
            ++out.counts[kStepDirect];
        }
        else
        {
            Idx const slot = hot_find(v, pos);
            if (slot >= 0)
            {
                scratch.slot_needed[slot] = 1;
                loc = v.hot_location + slot;
                ++out.counts[kStepHot];
            }
            else
            {
                ++misses;
            }
        }
        scratch.union_locations[i] = loc;
    }

    // Step 3: victims in LRU order among slots this step does not need.
    int64_t evictable = 0;
    for (Idx s = 0; s < v.hot_rows; ++s)
    {
        bool const needed = scratch.slot_needed[s] != 0;
        evictable += needed ? 0 : 1;
        scratch.victim_keys[s] = victim_key(v.hot_last_use[s], s, needed);
    }
    if (misses > evictable)
    {
        out.status = kHotCacheTooSmall;
        return out;
    }
    heap_sort(scratch.victim_keys, static_cast<int64_t>(v.hot_rows));
    for (Idx s = 0; s < v.hot_rows; ++s)
    {
        if (scratch.slot_needed[s])
        {
            v.hot_last_use[s] = v.step;
        }
    }
    int64_t next_victim = 0;
    for (int64_t i = 0; i < u; ++i)
    {
        if (scratch.union_locations[i] >= 0)
        {
            continue;
        }
        Idx const slot = static_cast<Idx>(victim_slot(scratch.victim_keys[next_victim++]));
        Idx const pos = scratch.union_positions[i];
        v.hot_positions[slot] = pos;
        v.hot_last_use[slot] = v.step;
        scratch.union_locations[i] = v.hot_location + slot;
        copy_positions[out.num_copies] = pos;
        copy_locations[out.num_copies] = v.hot_location + slot;
        ++out.num_copies;
    }
    out.counts[kStepHost] = out.num_copies;

    // Scatter union locations back to every selection entry.
    for (int64_t i = 0; i < n; ++i)
    {
        Idx const pos = selection[i];
        locations[i] = pos < 0 ? Idx(-1) : scratch.union_locations[lower_bound(scratch.union_positions, u, pos)];
    }
    return out;
}

} // namespace dhisparse
