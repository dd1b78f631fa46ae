// The resolver kernels: one thread block per (request, source) row, the whole batch (and for the step resolver
// the whole index group) in one launch. Each block runs dhisparse::block_resolve_row (block_resolver.h) with its
// scratch in shared memory (global workspace past kResolverMaxSharedBytes): the hot slots in a hash table, a
// bitonic sort of the row's entries and, only when something misses, of the eviction keys. The CPU library runs
// the same block code serially (plugins/cpu/block_resolver_cpu.cpp), so results equal it bit for bit.
#include "dhisparse/kernels.h"
#include "dhisparse/resolver_blocks.h"

namespace dhisparse
{
namespace cuda
{
namespace
{

constexpr int kWarps = kResolverThreads / 32;
static_assert(kResolverThreads % 32 == 0 && kWarps <= 32, "the scan keeps one total per warp in one warp");

//! The executor of block_resolve_row on a thread block (see SerialBlock for the contract of each method).
struct DeviceBlock
{
    int32_t* scan;  //!< [kWarps] shared

    __device__ int64_t thread() const
    {
        return threadIdx.x;
    }
    __device__ int64_t threads() const
    {
        return blockDim.x;
    }
    __device__ void sync() const
    {
        __syncthreads();
    }
    __device__ int32_t cas(int32_t* p, int32_t expected, int32_t desired) const
    {
        return atomicCAS(p, expected, desired);
    }
    __device__ void atomic_min(int32_t* p, int32_t v) const
    {
        atomicMin(p, v);
    }
    //! Warp-aggregated count: one atomic per warp and predicate.
    __device__ void count(int32_t* counter, bool pred) const
    {
        unsigned const active = __activemask();
        unsigned const ballot = __ballot_sync(active, pred);
        if (ballot != 0 && static_cast<int>(threadIdx.x & 31) == __ffs(active) - 1)
        {
            atomicAdd(counter, __popc(ballot));
        }
    }
    __device__ void add64(int64_t* p, int64_t v) const
    {
        atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
    }
    __device__ void bit_or(int32_t* p, int32_t v) const
    {
        atomicOr(p, v);
    }
    //! Block-wide exclusive prefix sum of values[0, n) (every thread calls it): warp shuffles, one total per warp.
    __device__ void exclusive_scan(int32_t* values, int64_t n) const
    {
        int const lane = static_cast<int>(threadIdx.x & 31);
        int const warp = static_cast<int>(threadIdx.x >> 5);
        int const warps = static_cast<int>(blockDim.x >> 5);
        int32_t carry = 0;
        for (int64_t base = 0; base < n; base += blockDim.x)
        {
            int64_t const i = base + threadIdx.x;
            int32_t const own = i < n ? values[i] : 0;
            int32_t inclusive = own;
            for (int offset = 1; offset < 32; offset <<= 1)
            {
                int32_t const v = __shfl_up_sync(0xffffffffu, inclusive, offset);
                inclusive += lane >= offset ? v : 0;
            }
            if (lane == 31)
            {
                scan[warp] = inclusive;
            }
            __syncthreads();
            if (warp == 0)
            {
                int32_t total = lane < warps ? scan[lane] : 0;
                for (int offset = 1; offset < 32; offset <<= 1)
                {
                    int32_t const v = __shfl_up_sync(0xffffffffu, total, offset);
                    total += lane >= offset ? v : 0;
                }
                if (lane < warps)
                {
                    scan[lane] = total;
                }
            }
            __syncthreads();
            if (i < n)
            {
                values[i] = carry + (warp > 0 ? scan[warp - 1] : 0) + inclusive - own;
            }
            int32_t const chunk = scan[warps - 1];
            __syncthreads();
            carry += chunk;
        }
    }
};

__device__ BlockScratch scratch_of(void* workspace, int64_t row_bytes, int64_t n, int64_t hot_rows)
{
    extern __shared__ __align__(16) unsigned char dynamic_shared[];
    void* base = workspace != nullptr ? static_cast<unsigned char*>(workspace) + blockIdx.x * row_bytes
                                      : static_cast<void*>(dynamic_shared);
    return block_scratch(base, n, hot_rows);
}

template <typename Idx>
__global__ void __launch_bounds__(kResolverThreads) resolver_kernel(ResolverArgs args, void* workspace,
    int64_t row_bytes)
{
    __shared__ int32_t scan[kWarps];
    __shared__ int32_t counters[kBlockCounters];
    BlockScratch const s = scratch_of(workspace, row_bytes, args.n_select, args.hot_rows);
    resolver_block<DeviceBlock, Idx>(DeviceBlock{scan}, args, blockIdx.x, s, counters);
}

__global__ void __launch_bounds__(kResolverThreads) step_resolver_kernel(StepResolveArgs args, void* workspace,
    int64_t row_bytes)
{
    __shared__ int32_t scan[kWarps];
    __shared__ int32_t counters[kBlockCounters];
    BlockScratch const s = scratch_of(workspace, row_bytes, args.n, args.hot_rows);
    step_resolver_block(DeviceBlock{scan}, args, blockIdx.x, s, counters);
}

//! Launches `kernel` with the plan's shared memory (opting in past 48 KB) or its workspace. `opted_in` is the
//! largest dynamic shared memory already allowed for this kernel: the attribute is set only when a launch needs more,
//! so launches inside a CUDA-graph capture make no other runtime call (it only grows; a race sets it twice; one
//! device per process, as every engine rank is).
template <typename Kernel, typename Args>
cudaError_t launch_planned(Kernel kernel, Args const& args, LaunchPlan const& plan, int64_t row_bytes,
    void* workspace, cudaStream_t stream, int& opted_in)
{
    if (plan.workspace_bytes > 0 && workspace == nullptr)
    {
        return cudaErrorInvalidValue;
    }
    int const shared = static_cast<int>(plan.shared_bytes);
    if (shared > 48 * 1024 && shared > opted_in)
    {
        cudaError_t const err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
        if (err != cudaSuccess)
        {
            return err;
        }
        opted_in = shared;
    }
    void* const scratch = plan.workspace_bytes > 0 ? workspace : nullptr;
    kernel<<<static_cast<unsigned>(plan.grid_x), plan.block, static_cast<size_t>(shared), stream>>>(
        args, scratch, row_bytes);
    return cudaGetLastError();
}

} // namespace

size_t resolver_workspace_bytes(int64_t num_sources, int64_t n_select, int64_t hot_rows, int32_t /*index_bytes*/)
{
    int64_t const row = resolver_row_scratch_bytes(n_select, hot_rows);
    return row <= kResolverMaxSharedBytes ? 0 : static_cast<size_t>(num_sources * row);
}

cudaError_t launch_resolver(ResolverArgs const& args, void* workspace, cudaStream_t stream)
{
    LaunchPlan const plan = plan_resolver(args);
    if (plan.status == kPlanEmpty)
    {
        return cudaSuccess;
    }
    if (plan.status != kPlanOk)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const row_bytes = resolver_row_scratch_bytes(args.n_select, args.hot_rows);
    static int opted_in32 = 0;
    static int opted_in64 = 0;
    return args.index_bytes == 4
        ? launch_planned(resolver_kernel<int32_t>, args, plan, row_bytes, workspace, stream, opted_in32)
        : launch_planned(resolver_kernel<int64_t>, args, plan, row_bytes, workspace, stream, opted_in64);
}

cudaError_t launch_step_resolver(StepResolveArgs const& args, void* workspace, cudaStream_t stream)
{
    LaunchPlan const plan = plan_step_resolver(args);
    if (plan.status == kPlanEmpty)
    {
        return cudaSuccess;
    }
    if (plan.status != kPlanOk)
    {
        return cudaErrorInvalidValue;
    }
    int64_t const row_bytes = resolver_row_scratch_bytes(args.n, args.hot_rows);
    static int opted_in = 0;
    return launch_planned(step_resolver_kernel, args, plan, row_bytes, workspace, stream, opted_in);
}

} // namespace cuda
} // namespace dhisparse
