// Batched three-step resolver: one thread block per (request, source). Implements the contract of
// dhisparse/resolver.h with block-wide sorts and scans in a global-memory workspace; results equal the
// serial CPU build bit for bit.
#include "block_ops.cuh"
#include "dhisparse/kernels.h"
#include "dhisparse/resolver.h"

namespace dhisparse
{
namespace cuda
{
namespace
{

constexpr int64_t kInvalidKey = INT64_MAX;
constexpr int32_t kNotFirst = kStepUnused;  // entry classes reuse the step codes 1..3

//! Per-row slice of the workspace.
struct RowScratch
{
    int64_t* keys;        // [n2] sorted selection positions (unused = kInvalidKey)
    int64_t* victims;     // [b2] eviction keys
    int64_t* hot_keys;    // [b2] sorted hot-cache index
    int64_t* loc;         // [n2] location of each first occurrence
    int32_t* cls;         // [n2] step code of each first occurrence, kNotFirst otherwise
    int32_t* miss_rank;   // [n2] exclusive prefix count of misses
    int32_t* needed;      // [b]  slot hit by this step
};

// Same formula as resolver_row_scratch_bytes (launch.h), callable on the device.
__host__ __device__ int64_t row_scratch_bytes(int64_t n_select, int64_t hot_rows)
{
    int64_t const n2 = next_pow2(n_select > 0 ? n_select : 1);
    int64_t const b2 = next_pow2(hot_rows > 0 ? hot_rows : 1);
    return n2 * (8 + 8 + 4 + 4) + b2 * 16 + ((hot_rows * 4 + 7) & ~int64_t{7});
}

__device__ RowScratch row_scratch(void* workspace, int64_t r, int64_t n_select, int64_t hot_rows)
{
    int64_t const n2 = next_pow2(n_select > 0 ? n_select : 1);
    int64_t const b2 = next_pow2(hot_rows > 0 ? hot_rows : 1);
    auto* base = static_cast<unsigned char*>(workspace) + r * row_scratch_bytes(n_select, hot_rows);
    RowScratch s;
    s.keys = reinterpret_cast<int64_t*>(base);
    s.victims = s.keys + n2;
    s.hot_keys = s.victims + b2;
    s.loc = s.hot_keys + b2;
    s.cls = reinterpret_cast<int32_t*>(s.loc + n2);
    s.miss_rank = s.cls + n2;
    s.needed = s.miss_rank + n2;
    return s;
}

template <typename Idx>
__global__ void __launch_bounds__(kResolverThreads) resolver_kernel(ResolverArgs args, void* workspace)
{
    __shared__ int32_t scan_shared[kResolverThreads + 1];
    __shared__ int32_t counters[6];  // unused, direct, hot, misses, candidates, num_union
    int64_t const r = blockIdx.x;
    int64_t const n = args.n_select;
    int64_t const b = args.hot_rows;
    int64_t const n2 = next_pow2(n > 0 ? n : 1);
    int64_t const b2 = next_pow2(b > 0 ? b : 1);
    Idx const stamp = *static_cast<Idx const*>(args.stamp);
    Idx* hot_pos = static_cast<Idx*>(args.hot_pos_out) + r * b;
    Idx* hot_stamp = static_cast<Idx*>(args.hot_stamp_out) + r * b;
    Idx const* hot_pos_in = static_cast<Idx const*>(args.hot_pos_in) + r * b;
    Idx const* hot_stamp_in = static_cast<Idx const*>(args.hot_stamp_in) + r * b;
    SourceView<Idx> const v = batch_source_view<Idx>(r, static_cast<Idx>(args.page_rows), stamp,
        static_cast<Idx const*>(args.page_table), args.num_pages, static_cast<Idx*>(args.hot_pos_out),
        static_cast<Idx*>(args.hot_stamp_out), static_cast<Idx const*>(args.hot_loc), b);
    Idx const* positions = static_cast<Idx const*>(args.positions) + r * n;
    Idx* locations = static_cast<Idx*>(args.locations) + r * n;
    int8_t* steps = args.steps + r * n;
    Idx* copy_position = static_cast<Idx*>(args.copy_position) + r * n;
    Idx* copy_slot = static_cast<Idx*>(args.copy_slot) + r * n;
    Idx* copy_location = static_cast<Idx*>(args.copy_location) + r * n;
    int32_t* summary = args.summary + r * kSummaryColumns;
    RowScratch const s = row_scratch(workspace, r, n, b);

    if (threadIdx.x < 6)
    {
        counters[threadIdx.x] = 0;
    }
    for (int64_t i = threadIdx.x; i < b; i += blockDim.x)
    {
        hot_pos[i] = hot_pos_in[i];  // same value when aliased
        hot_stamp[i] = hot_stamp_in[i];
        s.needed[i] = 0;
    }
    // Union: sort every valid position; the first of equal keys is the union entry.
    for (int64_t i = threadIdx.x; i < n2; i += blockDim.x)
    {
        s.keys[i] = (i < n && positions[i] >= 0) ? static_cast<int64_t>(positions[i]) : kInvalidKey;
    }
    for (int64_t i = threadIdx.x; i < b2; i += blockDim.x)
    {
        s.hot_keys[i] = i < b ? hot_index_key(hot_pos_in[i], i) : kEmptySlotKey;
    }
    __syncthreads();
    block_bitonic_sort(s.keys, n2);
    block_bitonic_sort(s.hot_keys, b2);

    // Steps 1 and 2 on first occurrences.
    for (int64_t i = threadIdx.x; i < n2; i += blockDim.x)
    {
        int64_t const key = s.keys[i];
        int32_t c = kNotFirst;
        int64_t loc = -1;
        if (key != kInvalidKey && (i == 0 || s.keys[i - 1] != key))
        {
            Idx const pos = static_cast<Idx>(key);
            loc = direct_location(v, pos);
            c = kStepDirect;
            if (loc < 0)
            {
                int64_t const slot = hot_index_find(s.hot_keys, b, pos);
                if (slot >= 0)
                {
                    s.needed[slot] = 1;
                    loc = v.hot_loc[slot];
                    c = kStepHot;
                }
                else
                {
                    c = kStepHost;
                }
            }
            atomicAdd(&counters[c], 1);
            atomicAdd(&counters[5], 1);
        }
        s.cls[i] = c;
        s.miss_rank[i] = c == kStepHost ? 1 : 0;
        s.loc[i] = loc;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < b2; i += blockDim.x)
    {
        int64_t key = kInvalidKey;
        if (i < b)
        {
            bool const needed = s.needed[i] != 0;
            key = victim_key(hot_pos[i], hot_stamp[i], i, needed);
            if (!needed)
            {
                atomicAdd(&counters[4], 1);
            }
        }
        s.victims[i] = key;
    }
    __syncthreads();
    if (threadIdx.x == 0)
    {
        summary[kSummaryNumUnion] = counters[5];
        summary[kSummaryDirect] = counters[kStepDirect];
        summary[kSummaryHot] = counters[kStepHot];
    }
    if (counters[kStepHost] > counters[4])
    {
        // Overflow: the state outputs keep the inputs, every other output is "unused".
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        {
            locations[i] = -1;
            steps[i] = kStepUnused;
            copy_position[i] = -1;
            copy_slot[i] = -1;
            copy_location[i] = -1;
        }
        if (threadIdx.x == 0)
        {
            summary[kSummaryStatus] = kHotCacheTooSmall;
            summary[kSummaryNumCopies] = 0;
            summary[kSummaryHost] = 0;
        }
        return;
    }
    block_bitonic_sort(s.victims, b2);
    int32_t const num_copies = block_exclusive_scan(s.miss_rank, n2, scan_shared);

    // Step 3 and the LRU update: hit slots take the stamp, miss k takes victim k.
    for (int64_t i = threadIdx.x; i < b; i += blockDim.x)
    {
        if (s.needed[i])
        {
            hot_stamp[i] = stamp;
        }
    }
    for (int64_t i = threadIdx.x; i < n2; i += blockDim.x)
    {
        if (s.cls[i] == kStepHost)
        {
            int32_t const k = s.miss_rank[i];
            int64_t const slot = victim_slot(s.victims[k]);
            Idx const pos = static_cast<Idx>(s.keys[i]);
            Idx const loc = v.hot_loc[slot];
            hot_pos[slot] = pos;
            hot_stamp[slot] = stamp;
            s.loc[i] = loc;
            copy_position[k] = pos;
            copy_slot[k] = static_cast<Idx>(slot);
            copy_location[k] = loc;
        }
    }
    for (int64_t i = num_copies + threadIdx.x; i < n; i += blockDim.x)
    {
        copy_position[i] = -1;
        copy_slot[i] = -1;
        copy_location[i] = -1;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    {
        Idx const pos = positions[i];
        if (pos < 0)
        {
            locations[i] = -1;
            steps[i] = kStepUnused;
            continue;
        }
        int64_t const k = lower_bound(s.keys, n2, static_cast<int64_t>(pos));
        locations[i] = static_cast<Idx>(s.loc[k]);
        steps[i] = static_cast<int8_t>(s.cls[k]);
    }
    if (threadIdx.x == 0)
    {
        summary[kSummaryStatus] = kResolveOk;
        summary[kSummaryNumCopies] = num_copies;
        summary[kSummaryHost] = num_copies;
    }
}

} // namespace

size_t resolver_workspace_bytes(int64_t num_sources, int64_t n_select, int64_t hot_rows, int32_t /*index_bytes*/)
{
    return static_cast<size_t>(num_sources * resolver_row_scratch_bytes(n_select, hot_rows));
}

cudaError_t launch_resolver(ResolverArgs const& args, void* workspace, cudaStream_t stream)
{
    LaunchPlan const plan = plan_resolver(args);
    if (plan.status == kPlanEmpty)
    {
        return cudaSuccess;
    }
    if (plan.status != kPlanOk || (plan.workspace_bytes > 0 && workspace == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    dim3 const grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y));
    if (args.index_bytes == 4)
    {
        resolver_kernel<int32_t><<<grid, plan.block, 0, stream>>>(args, workspace);
    }
    else
    {
        resolver_kernel<int64_t><<<grid, plan.block, 0, stream>>>(args, workspace);
    }
    return cudaGetLastError();
}

} // namespace cuda
} // namespace dhisparse
