// The resolver of one (request, source) row written for one thread block, header-only and shared by the CUDA
// kernels (plugins/kernels/resolver_kernel.cu: one block per row, the whole batch and index group in one
// launch) and the CPU library (plugins/cpu/block_resolver_cpu.cpp runs the very same code with one "thread",
// so the CPU tests execute every line the GPU runs, except the interleaving of threads).
//
// Contract: that of resolver.h / backend/dhisparse/kv/resolver.py (`resolve`), bit for bit, including
// verification staging: union of the entries (distinct valid positions, ascending); step 1 direct through the
// page table; step 2 a lookup of the B hot slots through an open-addressing hash table (slot ids, linear
// probing, 2B..4B entries: a lookup costs O(1), not a sort of the slots); step 3 misses in ascending position
// order take victims in eviction order (empty slots first, then ascending stamp, ties by slot; slots hit this
// step never), and misses past the E evictable slots take verification staging rows 0, 1, ...; more misses than
// E + T staging rows is an overflow (that row's state is left as it was, its outputs are unused).
//
// Parallel structure (every phase ends with ex.sync(); inside a phase threads touch disjoint indices except
// through ex's atomics): load and hash the hot slots -> bitonic sort of the entries -> classify each union
// position (direct / hot / miss) -> eviction keys -> (when there are misses) bitonic sort of the eviction keys
// and an exclusive scan of the misses -> LRU update, victims, copy and fetch lists -> per-entry outputs.
#pragma once

#include "dhisparse/host_device.h"
#include "dhisparse/resolver.h"

namespace dhisparse
{

// ----------------------------------------------------------------------------------------------- hot table
constexpr int32_t kTableEmpty = -1;

//! Entries of the hot-slot hash table for B slots: the power of two >= 2B (at least 2): load factor <= 1/2.
DHS_HD int64_t hot_table_capacity(int64_t hot_rows)
{
    int64_t c = 2;
    while (c < 2 * hot_rows)
    {
        c <<= 1;
    }
    return c;
}

DHS_HD int32_t log2_pow2(int64_t pow2)
{
    int32_t bits = 0;
    while ((int64_t{1} << bits) < pow2)
    {
        ++bits;
    }
    return bits;
}

//! Home bucket of `pos` in a table of 2^bits entries (Fibonacci hashing: the top bits of pos * 2^64 / phi).
DHS_HD int64_t hot_table_home(int64_t pos, int32_t bits)
{
    return static_cast<int64_t>((static_cast<uint64_t>(pos) * 0x9E3779B97F4A7C15ull) >> (64 - bits));
}

//! Inserts slot `slot` holding `pos` (>= 0). Equal positions keep the smallest slot (what a sorted index's
//! lower bound finds; the contract has at most one slot per position). Ex provides cas / atomic_min.
template <typename Ex, typename Idx>
DHS_HD void hot_table_insert(Ex const& ex, int32_t* table, int32_t bits, Idx const* hot_pos, Idx pos, int32_t slot)
{
    int64_t const mask = (int64_t{1} << bits) - 1;
    for (int64_t h = hot_table_home(pos, bits);; h = (h + 1) & mask)
    {
        int32_t const old = ex.cas(table + h, kTableEmpty, slot);
        if (old == kTableEmpty)
        {
            return;
        }
        if (hot_pos[old] == pos)
        {
            ex.atomic_min(table + h, slot);
            return;
        }
    }
}

//! The slot holding `pos`, or -1 (the table has an empty entry, so the probe ends).
template <typename Idx>
DHS_HD int32_t hot_table_find(int32_t const* table, int32_t bits, Idx const* hot_pos, Idx pos)
{
    int64_t const mask = (int64_t{1} << bits) - 1;
    for (int64_t h = hot_table_home(pos, bits);; h = (h + 1) & mask)
    {
        int32_t const slot = table[h];
        if (slot == kTableEmpty)
        {
            return -1;
        }
        if (hot_pos[slot] == pos)
        {
            return slot;
        }
    }
}

// ----------------------------------------------------------------------------------------------- scratch
DHS_HD int64_t block_next_pow2(int64_t n)
{
    int64_t p = 1;
    while (p < n)
    {
        p <<= 1;
    }
    return p;
}

DHS_HD int64_t align8(int64_t bytes)
{
    return (bytes + 7) & ~int64_t{7};
}

//! Scratch of one row for N entries and B slots. `keys` [N2] sorted entries; `region` [max(T, 2*B2) int32]:
//! the hash table (T int32) until the lookups are done, then the eviction keys (B2 int64); `entry` [N2] hit
//! slot, victim slot or -2 - staging row of each union position; `rank` [N2] miss ranks; `cls` [N2] step code
//! of each union position (0 for repeats and unused entries); `needed` [B] slot hit this step.
struct BlockScratch
{
    int64_t* keys;
    int32_t* table;
    int64_t* victims;
    int32_t* entry;
    int32_t* rank;
    int8_t* cls;
    uint8_t* needed;
};

//! Bytes of BlockScratch for N entries and B slots (70 KB for N = 2048, B = 4096).
DHS_HD int64_t block_scratch_bytes(int64_t n, int64_t hot_rows)
{
    int64_t const n2 = block_next_pow2(n > 0 ? n : 1);
    int64_t const b2 = block_next_pow2(hot_rows > 0 ? hot_rows : 1);
    int64_t const table = hot_table_capacity(hot_rows) * 4;
    int64_t const region = table > b2 * 8 ? table : b2 * 8;
    return n2 * 8 + align8(region) + n2 * 4 + n2 * 4 + align8(n2) + align8(hot_rows);
}

//! Carves BlockScratch out of `base` (8-byte aligned, block_scratch_bytes long).
DHS_HD BlockScratch block_scratch(void* base, int64_t n, int64_t hot_rows)
{
    int64_t const n2 = block_next_pow2(n > 0 ? n : 1);
    int64_t const b2 = block_next_pow2(hot_rows > 0 ? hot_rows : 1);
    int64_t const table = hot_table_capacity(hot_rows) * 4;
    int64_t const region = table > b2 * 8 ? table : b2 * 8;
    auto* p = static_cast<unsigned char*>(base);
    BlockScratch s;
    s.keys = reinterpret_cast<int64_t*>(p);
    p += n2 * 8;
    s.table = reinterpret_cast<int32_t*>(p);
    s.victims = reinterpret_cast<int64_t*>(p);
    p += align8(region);
    s.entry = reinterpret_cast<int32_t*>(p);
    p += n2 * 4;
    s.rank = reinterpret_cast<int32_t*>(p);
    p += n2 * 4;
    s.cls = reinterpret_cast<int8_t*>(p);
    p += align8(n2);
    s.needed = p;
    return s;
}

// ----------------------------------------------------------------------------------------------- one row
//! Flags of a row (the bits of DHS_STEP_* in cpu/include/dhisparse/c_api.h).
enum RowFlag : int32_t
{
    kRowBadPosition = 1,  //!< an entry at or past the row's length: nothing resolved, state untouched
    kRowOverflow = 2,     //!< more misses than evictable slots + staging rows: state untouched
    kRowNoHostCopy = 4,   //!< a miss has no host page (its fetch entry is -1)
};

//! One (request, source) row: inputs, state and outputs. Nullable outputs are skipped. Per-entry arrays [n];
//! copy / fetch lists [n], the row's copies first (ascending position), then -1.
template <typename Idx>
struct BlockRow
{
    int64_t n;
    int64_t hot_rows;     //!< B
    Idx page_rows;        //!< P
    Idx stamp;
    int64_t length;       //!< every valid entry must be below it (INT64_MAX: not checked)
    Idx const* positions;  //!< [n], negative = unused
    Idx const* page_table; //!< [num_pages]
    int64_t num_pages;
    Idx const* hot_pos_in;   //!< [B]
    Idx const* hot_stamp_in; //!< [B]
    Idx const* hot_loc;      //!< [B]
    Idx* hot_pos_out;        //!< [B] (may alias hot_pos_in)
    Idx* hot_stamp_out;      //!< [B] (may alias hot_stamp_in)
    Idx const* staging_loc;  //!< [staging_rows] or null
    int64_t staging_rows;
    Idx const* host_pages;   //!< [host_num_pages] host page of each page (-1: none) or null (no fetch list)
    int64_t host_num_pages;
    Idx* locations;          //!< [n] (required)
    int8_t* steps;           //!< [n]
    Idx* copy_position;      //!< [n]
    Idx* copy_slot;          //!< [n] (-1 for a staged copy)
    Idx* copy_location;      //!< [n]
    Idx* fetch_src;          //!< [n] host row of each copy (-1: none)
    Idx* fetch_dst;          //!< [n] arena row it goes to
    int32_t* summary;        //!< [kSummaryColumns]
};

//! What one row resolved (valid in thread 0 after block_resolve_row returns).
struct BlockRowResult
{
    int32_t flags;
    int32_t direct;
    int32_t hot;
    int32_t host;    //!< staged included
    int32_t staged;
};

//! Counter indices of block_resolve_row's `counters` [kBlockCounters] (shared by the block).
enum BlockCounter : int32_t
{
    kCountDirect = 0,
    kCountHot = 1,
    kCountHost = 2,
    kCountNeeded = 3,
    kCountBad = 4,
    kCountNoHost = 5,
    kBlockCounters = 8,
};

//! Ascending bitonic sort of keys[0, n), n a power of two, by the block.
template <typename Ex, typename T>
DHS_HD void block_bitonic_sort(Ex const& ex, T* keys, int64_t n)
{
    for (int64_t k = 2; k <= n; k <<= 1)
    {
        for (int64_t j = k >> 1; j > 0; j >>= 1)
        {
            for (int64_t p = ex.thread(); p < n / 2; p += ex.threads())
            {
                int64_t const i = 2 * j * (p / j) + p % j;
                int64_t const partner = i + j;
                bool const ascending = (i & k) == 0;
                T const a = keys[i];
                T const b = keys[partner];
                if ((a > b) == ascending)
                {
                    keys[i] = b;
                    keys[partner] = a;
                }
            }
            ex.sync();
        }
    }
}

//! The union position at sorted index i's location (cls / entry of that union position).
template <typename Idx>
DHS_HD Idx union_location(BlockRow<Idx> const& row, SourceView<Idx> const& view, int8_t cls, int32_t entry, Idx pos)
{
    if (cls == kStepDirect)
    {
        return direct_location(view, pos);
    }
    if (entry >= 0)
    {
        return row.hot_loc[entry];
    }
    return row.staging_loc[-2 - entry];
}

//! Resolves one row by the block (see the file comment). `counters` [kBlockCounters] int32 shared by the block.
template <typename Ex, typename Idx>
DHS_HD BlockRowResult block_resolve_row(Ex const& ex, BlockRow<Idx> const& row, BlockScratch const& s,
    int32_t* counters)
{
    int64_t const n = row.n;
    int64_t const b = row.hot_rows;
    int64_t const n2 = block_next_pow2(n > 0 ? n : 1);
    int64_t const b2 = block_next_pow2(b > 0 ? b : 1);
    int64_t const capacity = hot_table_capacity(b);
    int32_t const bits = log2_pow2(capacity);
    int64_t const t = ex.thread();
    int64_t const threads = ex.threads();
    SourceView<Idx> const view{row.page_rows, row.stamp, row.page_table, row.num_pages, nullptr, nullptr,
        row.hot_loc, b};

    // Load: entries as sort keys, an empty table, counters.
    for (int64_t i = t; i < kBlockCounters; i += threads)
    {
        counters[i] = 0;
    }
    for (int64_t i = t; i < n2; i += threads)
    {
        Idx const pos = i < n ? row.positions[i] : Idx{-1};
        s.keys[i] = pos >= 0 ? static_cast<int64_t>(pos) : kEmptySlotKey;
    }
    for (int64_t i = t; i < capacity; i += threads)
    {
        s.table[i] = kTableEmpty;
    }
    for (int64_t i = t; i < b; i += threads)
    {
        s.needed[i] = 0;
    }
    ex.sync();
    for (int64_t i = t; i < b; i += threads)
    {
        Idx const pos = row.hot_pos_in[i];
        if (pos >= 0)
        {
            hot_table_insert(ex, s.table, bits, row.hot_pos_in, pos, static_cast<int32_t>(i));
        }
    }
    for (int64_t i = t; i < n; i += threads)
    {
        int64_t const pos = row.positions[i];
        ex.count(counters + kCountBad, pos >= 0 && pos >= row.length);
    }
    block_bitonic_sort(ex, s.keys, n2);
    ex.sync();  // the table and the bad-position count are complete too (a sort of one key has no sync)

    BlockRowResult result{0, 0, 0, 0, 0};
    if (counters[kCountBad] > 0)
    {
        // A position past the row's length: nothing is resolved (the state outputs keep the inputs).
        for (int64_t i = t; i < b; i += threads)
        {
            row.hot_pos_out[i] = row.hot_pos_in[i];
            row.hot_stamp_out[i] = row.hot_stamp_in[i];
        }
        for (int64_t i = t; i < n; i += threads)
        {
            row.locations[i] = -1;
            if (row.steps != nullptr)
            {
                row.steps[i] = kStepUnused;
            }
            if (row.copy_position != nullptr)
            {
                row.copy_position[i] = -1;
                row.copy_slot[i] = -1;
                row.copy_location[i] = -1;
            }
            if (row.fetch_src != nullptr)
            {
                row.fetch_src[i] = -1;
                row.fetch_dst[i] = -1;
            }
        }
        if (t == 0 && row.summary != nullptr)
        {
            for (int c = 0; c < kSummaryColumns; ++c)
            {
                row.summary[c] = 0;
            }
        }
        result.flags = kRowBadPosition;
        ex.sync();
        return result;
    }

    // Steps 1 and 2 for each union position (the first of equal sorted keys).
    for (int64_t i = t; i < n2; i += threads)
    {
        int64_t const key = s.keys[i];
        int8_t c = kStepUnused;
        int32_t e = -1;
        if (key != kEmptySlotKey && (i == 0 || s.keys[i - 1] != key))
        {
            Idx const pos = static_cast<Idx>(key);
            c = kStepDirect;
            if (direct_location(view, pos) < 0)
            {
                int32_t const slot = b > 0 ? hot_table_find(s.table, bits, row.hot_pos_in, pos) : -1;
                if (slot >= 0)
                {
                    s.needed[slot] = 1;
                    c = kStepHot;
                    e = slot;
                }
                else
                {
                    c = kStepHost;
                }
            }
        }
        ex.count(counters + kCountDirect, c == kStepDirect);
        ex.count(counters + kCountHot, c == kStepHot);
        ex.count(counters + kCountHost, c == kStepHost);
        s.cls[i] = c;
        s.entry[i] = e;
        s.rank[i] = c == kStepHost ? 1 : 0;
    }
    ex.sync();  // the table is dead from here: its memory holds the eviction keys
    for (int64_t i = t; i < b2; i += threads)
    {
        int64_t key = kNeededSlotKey;
        if (i < b)
        {
            bool const needed = s.needed[i] != 0;
            key = victim_key(row.hot_pos_in[i], row.hot_stamp_in[i], i, needed);
            ex.count(counters + kCountNeeded, needed);
        }
        s.victims[i] = key;
    }
    ex.sync();
    int32_t const misses = counters[kCountHost];
    int64_t const candidates = b - counters[kCountNeeded];
    int64_t const staging = row.staging_loc != nullptr ? row.staging_rows : 0;
    result.direct = counters[kCountDirect];
    result.hot = counters[kCountHot];
    if (misses > candidates + staging)
    {
        // Overflow: the state outputs keep the inputs, every other output is "unused".
        for (int64_t i = t; i < b; i += threads)
        {
            row.hot_pos_out[i] = row.hot_pos_in[i];
            row.hot_stamp_out[i] = row.hot_stamp_in[i];
        }
        for (int64_t i = t; i < n; i += threads)
        {
            row.locations[i] = -1;
            if (row.steps != nullptr)
            {
                row.steps[i] = kStepUnused;
            }
            if (row.copy_position != nullptr)
            {
                row.copy_position[i] = -1;
                row.copy_slot[i] = -1;
                row.copy_location[i] = -1;
            }
            if (row.fetch_src != nullptr)
            {
                row.fetch_src[i] = -1;
                row.fetch_dst[i] = -1;
            }
        }
        if (t == 0 && row.summary != nullptr)
        {
            row.summary[kSummaryStatus] = kHotCacheTooSmall;
            row.summary[kSummaryNumUnion] = result.direct + result.hot + misses;
            row.summary[kSummaryNumCopies] = 0;
            row.summary[kSummaryDirect] = result.direct;
            row.summary[kSummaryHot] = result.hot;
            row.summary[kSummaryHost] = 0;
        }
        result.flags = kRowOverflow;
        ex.sync();
        return result;
    }
    if (misses > 0)
    {
        block_bitonic_sort(ex, s.victims, b2);
        ex.exclusive_scan(s.rank, n2);
    }

    // LRU update of the slots hit this step; then misses take their victims (or staging rows).
    for (int64_t i = t; i < b; i += threads)
    {
        Idx const pos = row.hot_pos_in[i];
        Idx const stamp = s.needed[i] != 0 ? row.stamp : row.hot_stamp_in[i];
        row.hot_pos_out[i] = pos;
        row.hot_stamp_out[i] = stamp;
    }
    ex.sync();
    for (int64_t i = t; i < n2; i += threads)
    {
        if (s.cls[i] != kStepHost)
        {
            continue;
        }
        int32_t const k = s.rank[i];
        Idx const pos = static_cast<Idx>(s.keys[i]);
        Idx slot = -1;
        Idx loc;
        if (k < candidates)
        {
            slot = static_cast<Idx>(victim_slot(s.victims[k]));
            row.hot_pos_out[slot] = pos;
            row.hot_stamp_out[slot] = row.stamp;
            loc = row.hot_loc[slot];
            s.entry[i] = static_cast<int32_t>(slot);
        }
        else
        {
            int64_t const j = k - candidates;
            loc = row.staging_loc[j];
            s.entry[i] = static_cast<int32_t>(-2 - j);
        }
        if (row.copy_position != nullptr)
        {
            row.copy_position[k] = pos;
            row.copy_slot[k] = slot;
            row.copy_location[k] = loc;
        }
        if (row.fetch_src != nullptr)
        {
            int64_t const page = pos / row.page_rows;
            Idx const host_page = (row.host_pages != nullptr && page < row.host_num_pages) ? row.host_pages[page]
                                                                                          : Idx{-1};
            ex.count(counters + kCountNoHost, host_page < 0);
            row.fetch_src[k] = host_page < 0 ? Idx{-1} : static_cast<Idx>(host_page * row.page_rows + pos % row.page_rows);
            row.fetch_dst[k] = host_page < 0 ? Idx{-1} : loc;
        }
    }
    for (int64_t i = misses + t; i < n; i += threads)
    {
        if (row.copy_position != nullptr)
        {
            row.copy_position[i] = -1;
            row.copy_slot[i] = -1;
            row.copy_location[i] = -1;
        }
        if (row.fetch_src != nullptr)
        {
            row.fetch_src[i] = -1;
            row.fetch_dst[i] = -1;
        }
    }
    ex.sync();

    // Every entry takes its union position's location and step code.
    for (int64_t i = t; i < n; i += threads)
    {
        Idx const pos = row.positions[i];
        if (pos < 0)
        {
            row.locations[i] = -1;
            if (row.steps != nullptr)
            {
                row.steps[i] = kStepUnused;
            }
            continue;
        }
        int64_t const k = lower_bound(s.keys, n2, static_cast<int64_t>(pos));
        row.locations[i] = union_location(row, view, s.cls[k], s.entry[k], pos);
        if (row.steps != nullptr)
        {
            row.steps[i] = s.cls[k];
        }
    }
    int64_t const staged = misses > candidates ? misses - candidates : 0;
    if (t == 0 && row.summary != nullptr)
    {
        row.summary[kSummaryStatus] = kResolveOk;
        row.summary[kSummaryNumUnion] = result.direct + result.hot + misses;
        row.summary[kSummaryNumCopies] = misses;
        row.summary[kSummaryDirect] = result.direct;
        row.summary[kSummaryHot] = result.hot;
        row.summary[kSummaryHost] = misses;
    }
    result.host = misses;
    result.staged = static_cast<int32_t>(staged);
    result.flags = counters[kCountNoHost] > 0 ? kRowNoHostCopy : 0;
    ex.sync();  // counters and scratch may be reused by the next row
    return result;
}

// ----------------------------------------------------------------------------------------------- serial executor
//! The block of one thread: the CPU library and ctest run block_resolve_row with it.
struct SerialBlock
{
    DHS_HD int64_t thread() const
    {
        return 0;
    }
    DHS_HD int64_t threads() const
    {
        return 1;
    }
    DHS_HD void sync() const {}
    DHS_HD int32_t cas(int32_t* p, int32_t expected, int32_t desired) const
    {
        int32_t const old = *p;
        if (old == expected)
        {
            *p = desired;
        }
        return old;
    }
    DHS_HD void atomic_min(int32_t* p, int32_t v) const
    {
        *p = v < *p ? v : *p;
    }
    DHS_HD void count(int32_t* counter, bool pred) const
    {
        *counter += pred ? 1 : 0;
    }
    DHS_HD void add64(int64_t* p, int64_t v) const
    {
        *p += v;
    }
    DHS_HD void bit_or(int32_t* p, int32_t v) const
    {
        *p |= v;
    }
    DHS_HD void exclusive_scan(int32_t* values, int64_t n) const
    {
        int32_t sum = 0;
        for (int64_t i = 0; i < n; ++i)
        {
            int32_t const v = values[i];
            values[i] = sum;
            sum += v;
        }
    }
};

} // namespace dhisparse
