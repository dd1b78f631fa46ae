// Batched three-step resolver: one thread block per (request, source). Implements the contract of
// dhisparse/resolver.h with block-wide sorts and scans; results equal the serial CPU build bit for bit.
#include "block_ops.cuh"
#include "dhisparse/kernels.h"
#include "dhisparse/resolver.h"

namespace dhisparse
{
namespace cuda
{
namespace
{

constexpr int kResolverThreads = 256;
constexpr int64_t kInvalidKey = INT64_MAX;

enum EntryClass : int32_t
{
    kNotFirst = 0,
    kDirect = 1,
    kHot = 2,
    kMiss = 3,
};

//! Per-row slice of the workspace.
struct RowScratch
{
    int64_t* keys;        // [n2] sorted selection positions (padding = kInvalidKey)
    int64_t* victims;     // [b2] victim keys
    int32_t* cls;         // [n2] EntryClass of each sorted entry
    int32_t* miss_rank;   // [n2] exclusive prefix count of misses
    int64_t* loc;         // [n2] resolved location of each first occurrence
    int32_t* needed;      // [b]  slot hit by this step
};

__host__ __device__ int64_t align8(int64_t bytes)
{
    return (bytes + 7) & ~int64_t{7};
}

__host__ __device__ int64_t row_scratch_bytes(int64_t n_select, int64_t hot_rows)
{
    int64_t const n2 = next_pow2(n_select > 0 ? n_select : 1);
    int64_t const b2 = next_pow2(hot_rows > 0 ? hot_rows : 1);
    return n2 * (8 + 4 + 4 + 8) + b2 * 8 + align8(hot_rows * 4);
}

__device__ RowScratch row_scratch(void* workspace, int64_t r, int64_t n_select, int64_t hot_rows)
{
    int64_t const n2 = next_pow2(n_select > 0 ? n_select : 1);
    int64_t const b2 = next_pow2(hot_rows > 0 ? hot_rows : 1);
    auto* base = static_cast<unsigned char*>(workspace) + r * row_scratch_bytes(n_select, hot_rows);
    RowScratch s;
    s.keys = reinterpret_cast<int64_t*>(base);
    s.victims = s.keys + n2;
    s.loc = s.victims + b2;
    s.cls = reinterpret_cast<int32_t*>(s.loc + n2);
    s.miss_rank = s.cls + n2;
    s.needed = s.miss_rank + n2;
    return s;
}

template <typename Idx>
__global__ void __launch_bounds__(kResolverThreads) resolver_kernel(ResolverArgs args, void* workspace)
{
    __shared__ int32_t scan_shared[kResolverThreads + 1];
    __shared__ int32_t counters[6];  // out_of_range, direct, hot, misses, evictable, num_union
    int64_t const r = blockIdx.x;
    int64_t const n = args.n_select;
    int64_t const b = args.hot_rows;
    int64_t const n2 = next_pow2(n > 0 ? n : 1);
    int64_t const b2 = next_pow2(b > 0 ? b : 1);
    SourceView<Idx> const v = batch_source_view<Idx>(r, static_cast<Idx const*>(args.meta),
        static_cast<Idx const*>(args.page_locations), args.num_pages, static_cast<Idx*>(args.hot_positions),
        static_cast<Idx*>(args.hot_last_use), b, static_cast<Idx>(args.page_rows));
    Idx const* selection = static_cast<Idx const*>(args.selection) + r * n;
    Idx* locations = static_cast<Idx*>(args.locations) + r * n;
    Idx* copy_positions = static_cast<Idx*>(args.copy_positions) + r * n;
    Idx* copy_locations = static_cast<Idx*>(args.copy_locations) + r * n;
    int32_t* summary = args.summary + r * 6;
    RowScratch const s = row_scratch(workspace, r, n, b);

    if (threadIdx.x < 6)
    {
        counters[threadIdx.x] = 0;
    }
    __syncthreads();
    // Union: sort every valid position; the first of equal keys is the union entry.
    for (int64_t i = threadIdx.x; i < n2; i += blockDim.x)
    {
        int64_t key = kInvalidKey;
        if (i < n)
        {
            Idx const pos = selection[i];
            if (pos >= v.num_rows)
            {
                atomicAdd(&counters[0], 1);
            }
            key = pos >= 0 ? static_cast<int64_t>(pos) : kInvalidKey;
        }
        s.keys[i] = key;
    }
    for (int64_t i = threadIdx.x; i < b; i += blockDim.x)
    {
        s.needed[i] = 0;
    }
    __syncthreads();
    bool const out_of_range = counters[0] != 0;
    if (!out_of_range)
    {
        block_bitonic_sort(s.keys, n2);
    }

    // Steps 1 and 2 on first occurrences.
    for (int64_t i = threadIdx.x; i < n2 && !out_of_range; i += blockDim.x)
    {
        int64_t const key = s.keys[i];
        int32_t c = kNotFirst;
        int64_t loc = -1;
        if (key != kInvalidKey && (i == 0 || s.keys[i - 1] != key))
        {
            Idx const pos = static_cast<Idx>(key);
            loc = direct_location(v, pos);
            c = kDirect;
            if (loc < 0)
            {
                Idx const slot = hot_find(v, pos);
                if (slot >= 0)
                {
                    s.needed[slot] = 1;
                    loc = v.hot_location + slot;
                    c = kHot;
                }
                else
                {
                    c = kMiss;
                }
            }
            atomicAdd(&counters[c], 1);  // 1 direct, 2 hot, 3 misses
            atomicAdd(&counters[5], 1);
        }
        s.cls[i] = c;
        s.miss_rank[i] = c == kMiss ? 1 : 0;
        s.loc[i] = loc;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < b2 && !out_of_range; i += blockDim.x)
    {
        int64_t key = kInvalidKey;
        if (i < b)
        {
            bool const needed = s.needed[i] != 0;
            key = victim_key(v.hot_last_use[i], i, needed);
            if (!needed)
            {
                atomicAdd(&counters[4], 1);
            }
        }
        s.victims[i] = key;
    }
    __syncthreads();
    int32_t status = out_of_range ? kPositionOutOfRange : (counters[3] > counters[4] ? kHotCacheTooSmall : kResolveOk);
    if (status != kResolveOk)
    {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        {
            locations[i] = -1;
            copy_positions[i] = -1;
            copy_locations[i] = -1;
        }
        if (threadIdx.x == 0)
        {
            summary[0] = status;
            summary[1] = out_of_range ? 0 : counters[5];
            summary[2] = 0;
            summary[3] = out_of_range ? 0 : counters[1];
            summary[4] = out_of_range ? 0 : counters[2];
            summary[5] = 0;
        }
        return;
    }
    block_bitonic_sort(s.victims, b2);
    int32_t const num_copies = block_exclusive_scan(s.miss_rank, n2, scan_shared);

    // Step 3 and the LRU update: hit slots get the step stamp, miss i takes victim i.
    for (int64_t i = threadIdx.x; i < b; i += blockDim.x)
    {
        if (s.needed[i])
        {
            v.hot_last_use[i] = v.step;
        }
    }
    for (int64_t i = threadIdx.x; i < n2; i += blockDim.x)
    {
        if (s.cls[i] == kMiss)
        {
            int32_t const k = s.miss_rank[i];
            Idx const slot = static_cast<Idx>(victim_slot(s.victims[k]));
            Idx const pos = static_cast<Idx>(s.keys[i]);
            Idx const loc = v.hot_location + slot;
            v.hot_positions[slot] = pos;
            v.hot_last_use[slot] = v.step;
            s.loc[i] = loc;
            copy_positions[k] = pos;
            copy_locations[k] = loc;
        }
    }
    for (int64_t i = num_copies + threadIdx.x; i < n; i += blockDim.x)
    {
        copy_positions[i] = -1;
        copy_locations[i] = -1;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    {
        Idx const pos = selection[i];
        locations[i] = pos < 0 ? Idx(-1) : static_cast<Idx>(s.loc[lower_bound(s.keys, n2, static_cast<int64_t>(pos))]);
    }
    if (threadIdx.x == 0)
    {
        summary[0] = kResolveOk;
        summary[1] = counters[5];
        summary[2] = num_copies;
        summary[3] = counters[1];
        summary[4] = counters[2];
        summary[5] = num_copies;
    }
}

} // namespace

size_t resolver_workspace_bytes(int64_t num_sources, int64_t n_select, int64_t hot_rows, int32_t /*index_bytes*/)
{
    return static_cast<size_t>(num_sources * row_scratch_bytes(n_select, hot_rows));
}

cudaError_t launch_resolver(ResolverArgs const& args, void* workspace, cudaStream_t stream)
{
    if (args.num_sources == 0)
    {
        return cudaSuccess;
    }
    if (args.num_sources < 0 || args.page_rows <= 0 || args.hot_rows >= (int64_t{1} << 24)
        || (args.index_bytes != 4 && args.index_bytes != 8))
    {
        return cudaErrorInvalidValue;
    }
    dim3 const grid(static_cast<unsigned>(args.num_sources));
    if (args.index_bytes == 4)
    {
        resolver_kernel<int32_t><<<grid, kResolverThreads, 0, stream>>>(args, workspace);
    }
    else
    {
        resolver_kernel<int64_t><<<grid, kResolverThreads, 0, stream>>>(args, workspace);
    }
    return cudaGetLastError();
}

} // namespace cuda
} // namespace dhisparse
