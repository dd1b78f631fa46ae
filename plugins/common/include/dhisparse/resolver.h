// The three-step resolver of one (request, KV source) for one decode step, header-only and shared by the
// CPU library (g++), the ctest unit tests and the CUDA kernels (nvcc).
//
// The contract is that of the Python specification backend/dhisparse/kv/resolver.py (`resolve`), bit for bit
// (locations, step codes, LRU state, copy list); tests/native/test_resolver_agreement.py checks it:
//   * A row's selection holds N entries (the selections of all its queries in this step, concatenated:
//     Q = 1 without speculation, gamma + 1 verification queries with it); negative entries are unused. The
//     entries share one *union*: the distinct valid positions, ascending. Each union position is resolved
//     once, so a row missing for several queries is copied once.
//   * Step 1, direct: p with page_table[p / P] >= 0 (the tail or a ready optional page; pages >= M are not
//     direct) is at page_table[p / P] * P + p % P. The hot cache is not touched for such rows.
//   * Step 2, hot cache: a search of the B slots only (bounded by B, however much optional history is
//     resident): a sorted (position, slot) index and binary search, O(log B) per lookup. Slot j with hot_pos[j] == p is a hit, at hot_loc[j]; hot_stamp[j] becomes `stamp`.
//   * Step 3, host copy: misses, ascending, take victim slots in eviction order: the slots not hit in step 2
//     (a slot the step needs is never evicted), empty slots (hot_pos < 0, stamp ignored) first, then by
//     ascending hot_stamp, ties by ascending slot index. Miss k takes victim k: hot_pos = p, hot_stamp =
//     stamp, location hot_loc[slot], copy-list entry (p, slot, hot_loc[slot]).
//   * Step 4, verification staging (overflow): with E candidate slots and T staging rows, misses m_E, m_E+1, ...
//     (the largest positions) do not enter the hot cache: miss m_{E+j} is at staging_loc[j], copy-list entry
//     (p, -1, staging_loc[j]); slots are not changed for them. More misses than E + T is kHotCacheTooSmall and the
//     state is left untouched.
//   * Every entry equal to p gets p's location and step code (0 unused, 1 direct, 2 hot, 3 host); unused
//     entries get location -1. Counts are over union positions: [direct, hot, host].
// Limits of this port: positions and stamps in [0, 2^39), B < 2^24 (packed into sortable 64-bit keys).
#pragma once

#include "dhisparse/host_device.h"
#include "dhisparse/sort.h"

namespace dhisparse
{

enum ResolveStatus : int32_t
{
    kResolveOk = 0,
    kHotCacheTooSmall = 1,  //!< more misses than slots that this step does not need
};

//! Per-entry step codes (int8 in the outputs), equal to dhisparse.kv.resolver.STEP_*.
enum StepCode : int8_t
{
    kStepUnused = 0,
    kStepDirect = 1,
    kStepHot = 2,
    kStepHost = 3,
};

//! Columns of the int32 summary row of one (request, source).
enum SummaryColumn : int32_t
{
    kSummaryStatus = 0,
    kSummaryNumUnion = 1,
    kSummaryNumCopies = 2,
    kSummaryDirect = 3,  //!< distinct positions resolved at step 1
    kSummaryHot = 4,     //!< ... at step 2
    kSummaryHost = 5,    //!< ... at step 3 (= num_copies)
    kSummaryColumns = 6,
};

//! View of one (request, source): its page table and its hot cache. hot_pos / hot_stamp are updated in
//! place by resolve_source (callers that need the old state keep a copy).
template <typename Idx>
struct SourceView
{
    Idx page_rows;           //!< P
    Idx stamp;               //!< this step's stamp, larger than every stamp in hot_stamp
    Idx const* page_table;   //!< [num_pages] arena page of each page (tail or ready optional), or -1
    int64_t num_pages;       //!< M
    Idx* hot_pos;            //!< [hot_rows] position held by each slot, -1 = empty
    Idx* hot_stamp;          //!< [hot_rows] stamp of each slot's last use (ignored for empty slots)
    Idx const* hot_loc;      //!< [hot_rows] arena row of each slot
    int64_t hot_rows;        //!< B
    Idx const* staging_loc = nullptr;  //!< [staging_rows] arena rows of verification staging (step 4)
    int64_t staging_rows = 0;          //!< T (0: no staging; misses past the evictable slots overflow)
};

//! View of row r of the batch layout: page_table [R, M], hot_pos / hot_stamp / hot_loc [R, B].
template <typename Idx>
DHS_HD SourceView<Idx> batch_source_view(int64_t r, Idx page_rows, Idx stamp, Idx const* page_table,
    int64_t num_pages, Idx* hot_pos, Idx* hot_stamp, Idx const* hot_loc, int64_t hot_rows)
{
    return SourceView<Idx>{page_rows, stamp, page_table + r * num_pages, num_pages, hot_pos + r * hot_rows,
        hot_stamp + r * hot_rows, hot_loc + r * hot_rows, hot_rows};
}

//! Step 1: arena row of `pos` in the tail or a ready optional page, or -1.
template <typename Idx>
DHS_HD Idx direct_location(SourceView<Idx> const& v, Idx pos)
{
    Idx const page = pos / v.page_rows;
    if (page < v.num_pages)
    {
        Idx const arena_page = v.page_table[page];
        if (arena_page >= 0)
        {
            return arena_page * v.page_rows + pos % v.page_rows;
        }
    }
    return -1;
}

constexpr int kSlotBits = 24;  //!< slot index bits of the packed 64-bit keys (B < 2^24)
constexpr int64_t kSlotMask = (int64_t{1} << kSlotBits) - 1;
constexpr int64_t kEmptySlotKey = INT64_MAX;

//! Step 2 index: key of slot s in the sorted hot-cache index (position major, slot minor; empty slots last).
template <typename Idx>
DHS_HD int64_t hot_index_key(Idx pos, int64_t slot)
{
    return pos < 0 ? kEmptySlotKey : (static_cast<int64_t>(pos) << kSlotBits) | slot;
}

//! Step 2: the slot holding `pos` in the sorted index of the B slots (binary search), or -1.
template <typename Idx>
DHS_HD int64_t hot_index_find(int64_t const* sorted_keys, int64_t hot_rows, Idx pos)
{
    int64_t const k = lower_bound(sorted_keys, hot_rows, static_cast<int64_t>(pos) << kSlotBits);
    if (k < hot_rows && sorted_keys[k] != kEmptySlotKey && (sorted_keys[k] >> kSlotBits) == pos)
    {
        return sorted_keys[k] & kSlotMask;
    }
    return -1;
}

constexpr int64_t kNeededSlotKey = INT64_MAX;

//! Eviction-order key of a slot: slots hit this step sort last (never chosen); then empty slots, then
//! ascending stamp; ties by ascending slot index.
template <typename Idx>
DHS_HD int64_t victim_key(Idx pos, Idx stamp, int64_t slot, bool needed)
{
    if (needed)
    {
        return kNeededSlotKey;
    }
    int64_t const order = pos < 0 ? 0 : static_cast<int64_t>(stamp) + 1;
    return (order << kSlotBits) | slot;
}

DHS_HD int64_t victim_slot(int64_t key)
{
    return key & kSlotMask;
}

//! Scratch memory of resolve_source for N entries and B hot rows.
template <typename Idx>
struct ResolveScratch
{
    Idx* union_positions;   //!< [N] sorted distinct positions
    Idx* union_locations;   //!< [N] arena row of each union position
    int8_t* union_steps;    //!< [N] step code of each union position
    int64_t* hot_keys;      //!< [B] sorted hot-cache index
    int64_t* victim_keys;   //!< [B]
    uint8_t* slot_needed;   //!< [B]
};

//! Outputs of resolve_source for one row; copy arrays receive num_copies entries (ascending position).
template <typename Idx>
struct ResolveOutputs
{
    Idx* locations;      //!< [N]
    int8_t* steps;       //!< [N]
    Idx* copy_position;  //!< [N]
    Idx* copy_slot;      //!< [N]
    Idx* copy_location;  //!< [N]
    int32_t* summary;    //!< [kSummaryColumns]
};

//! Serial implementation of the contract above (CPU library, ctest).
template <typename Idx>
DHS_HD int32_t resolve_source(SourceView<Idx> const& v, Idx const* selection, int64_t n,
    ResolveScratch<Idx> const& scratch, ResolveOutputs<Idx> const& out)
{
    for (int c = 0; c < kSummaryColumns; ++c)
    {
        out.summary[c] = 0;
    }
    // Union of the queries' selections: sort the valid entries, keep distinct ones.
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
    {
        if (selection[i] >= 0)
        {
            scratch.union_positions[m++] = selection[i];
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

    // Steps 1 and 2; misses keep location -1 for now.
    for (int64_t s = 0; s < v.hot_rows; ++s)
    {
        scratch.slot_needed[s] = 0;
        scratch.hot_keys[s] = hot_index_key(v.hot_pos[s], s);
    }
    heap_sort(scratch.hot_keys, v.hot_rows);
    int64_t misses = 0;
    int32_t counts[3] = {0, 0, 0};
    for (int64_t i = 0; i < u; ++i)
    {
        Idx const pos = scratch.union_positions[i];
        Idx loc = direct_location(v, pos);
        int8_t step = kStepDirect;
        if (loc < 0)
        {
            int64_t const slot = hot_index_find(scratch.hot_keys, v.hot_rows, pos);
            if (slot >= 0)
            {
                scratch.slot_needed[slot] = 1;
                loc = v.hot_loc[slot];
                step = kStepHot;
            }
            else
            {
                step = kStepHost;
                ++misses;
            }
        }
        ++counts[step - 1];
        scratch.union_locations[i] = loc;
        scratch.union_steps[i] = step;
    }

    // Step 3: victims in eviction order among the slots this step does not need.
    int64_t candidates = 0;
    for (int64_t s = 0; s < v.hot_rows; ++s)
    {
        bool const needed = scratch.slot_needed[s] != 0;
        candidates += needed ? 0 : 1;
        scratch.victim_keys[s] = victim_key(v.hot_pos[s], v.hot_stamp[s], s, needed);
    }
    out.summary[kSummaryNumUnion] = static_cast<int32_t>(u);
    out.summary[kSummaryDirect] = counts[0];
    out.summary[kSummaryHot] = counts[1];
    int64_t const staging = v.staging_loc != nullptr ? v.staging_rows : 0;
    if (misses > candidates + staging)
    {
        out.summary[kSummaryStatus] = kHotCacheTooSmall;
        return kHotCacheTooSmall;
    }
    heap_sort(scratch.victim_keys, v.hot_rows);
    for (int64_t s = 0; s < v.hot_rows; ++s)
    {
        if (scratch.slot_needed[s])
        {
            v.hot_stamp[s] = v.stamp;
        }
    }
    int64_t copies = 0;
    for (int64_t i = 0; i < u; ++i)
    {
        if (scratch.union_steps[i] != kStepHost)
        {
            continue;
        }
        Idx const pos = scratch.union_positions[i];
        Idx loc;
        Idx slot_out = -1;
        if (copies < candidates)
        {
            int64_t const slot = victim_slot(scratch.victim_keys[copies]);
            v.hot_pos[slot] = pos;
            v.hot_stamp[slot] = v.stamp;
            loc = v.hot_loc[slot];
            slot_out = static_cast<Idx>(slot);
        }
        else  // step 4: past the evictable slots, into verification staging (the hot cache is not changed)
        {
            loc = v.staging_loc[copies - candidates];
        }
        scratch.union_locations[i] = loc;
        out.copy_position[copies] = pos;
        out.copy_slot[copies] = slot_out;
        out.copy_location[copies] = loc;
        ++copies;
    }
    out.summary[kSummaryNumCopies] = static_cast<int32_t>(copies);
    out.summary[kSummaryHost] = static_cast<int32_t>(copies);

    // Every entry takes its union position's location and step code.
    for (int64_t i = 0; i < n; ++i)
    {
        Idx const pos = selection[i];
        if (pos < 0)
        {
            out.locations[i] = -1;
            out.steps[i] = kStepUnused;
            continue;
        }
        int64_t const k = lower_bound(scratch.union_positions, u, pos);
        out.locations[i] = scratch.union_locations[k];
        out.steps[i] = scratch.union_steps[k];
    }
    return kResolveOk;
}

} // namespace dhisparse
