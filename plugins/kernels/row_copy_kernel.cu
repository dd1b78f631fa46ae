// Host->device gather copy of missing rows. The grid (4..32 blocks, plan_row_copy in launch.h) grows with the batch;
// each block walks (copy, 16-byte chunk) pairs with a grid-stride loop, so consecutive threads read
// consecutive bytes of one row from pinned host memory, several rounds of the loop in flight per thread.
#include "dhisparse/copy_grid.h"
#include "dhisparse/kernels.h"

namespace dhisparse
{
namespace cuda
{
namespace
{

//! Accesses a thread keeps in flight: all its loads of one round are issued before any store, so a block has
//! kCopyThreads * kUnroll reads of host memory outstanding (a zero-copy read waits a bus round trip, ~1-2 us;
//! one access per thread at a time left the link mostly idle: 37 GB/s at batch 128 on an H200).
template <typename Vec, typename Idx>
__global__ void __launch_bounds__(kCopyThreads) row_copy_kernel(Vec const* host_rows,
    uint64_t const* host_rows_address, Vec* __restrict__ device_rows, int64_t row_vecs,
    Idx const* __restrict__ src_rows, Idx const* __restrict__ dst_rows, int64_t num_copies)
{
    constexpr int kUnroll = sizeof(Vec) == 16 ? 8 : 4;
    Vec const* host = host_rows_address != nullptr ? reinterpret_cast<Vec const*>(*host_rows_address) : host_rows;
    int64_t const total = num_copies * row_vecs;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
         base += stride * kUnroll)
    {
        Vec values[kUnroll];
        int64_t target[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
        {
            int64_t const i = base + u * stride;
            target[u] = -1;
            if (i < total)
            {
                int64_t const copy = i / row_vecs;
                int64_t const part = i - copy * row_vecs;
                int64_t const src = src_rows[copy];
                if (src >= 0)
                {
                    values[u] = host[src * row_vecs + part];
                    target[u] = static_cast<int64_t>(dst_rows[copy]) * row_vecs + part;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
        {
            if (target[u] >= 0)
            {
                device_rows[target[u]] = values[u];
            }
        }
    }
}

template <typename Vec, typename Idx>
cudaError_t launch_typed(RowCopyArgs const& a, LaunchPlan const& plan, cudaStream_t stream)
{
    row_copy_kernel<Vec, Idx><<<static_cast<unsigned>(plan.grid_x), plan.block, 0, stream>>>(
        static_cast<Vec const*>(a.host_rows), a.host_rows_address, static_cast<Vec*>(a.device_rows),
        a.row_bytes / static_cast<int64_t>(sizeof(Vec)), static_cast<Idx const*>(a.src_rows),
        static_cast<Idx const*>(a.dst_rows), a.num_requests * a.copies_per_request);
    return cudaGetLastError();
}

template <typename Idx>
cudaError_t launch_indexed(RowCopyArgs const& a, LaunchPlan const& plan, cudaStream_t stream)
{
    switch (plan.vector_bytes)
    {
    case 16: return launch_typed<uint4, Idx>(a, plan, stream);
    case 4: return launch_typed<uint32_t, Idx>(a, plan, stream);
    default: return launch_typed<uint8_t, Idx>(a, plan, stream);
    }
}

} // namespace

cudaError_t launch_row_copy(RowCopyArgs const& args, cudaStream_t stream)
{
    LaunchPlan const plan = plan_row_copy(args);
    if (plan.status == kPlanEmpty)
    {
        return cudaSuccess;
    }
    if (plan.status != kPlanOk)
    {
        return cudaErrorInvalidValue;
    }
    return args.index_bytes == 4 ? launch_indexed<int32_t>(args, plan, stream)
                                 : launch_indexed<int64_t>(args, plan, stream);
}

} // namespace cuda
} // namespace dhisparse
