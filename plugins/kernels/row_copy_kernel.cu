// Host->device gather copy of missing rows. The grid (4..32 blocks, copy_grid_blocks) grows with the batch;
// each block walks (copy, 16-byte chunk) pairs with a grid-stride loop, so consecutive threads read
// consecutive bytes of one row from pinned host memory.
#include "dhisparse/copy_grid.h"
#include "dhisparse/kernels.h"

namespace dhisparse
{
namespace cuda
{
namespace
{

template <typename Vec, typename Idx>
__global__ void __launch_bounds__(kCopyThreads) row_copy_kernel(Vec const* host_rows,
    uint64_t const* host_rows_address, Vec* __restrict__ device_rows, int64_t row_vecs,
    Idx const* __restrict__ src_rows, Idx const* __restrict__ dst_rows, int64_t num_copies)
{
    Vec const* host = host_rows_address != nullptr ? reinterpret_cast<Vec const*>(*host_rows_address) : host_rows;
    int64_t const total = num_copies * row_vecs;
    int64_t const stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    {
        int64_t const copy = i / row_vecs;
        int64_t const part = i - copy * row_vecs;
        int64_t const src = src_rows[copy];
        if (src < 0)
        {
            continue;
        }
        int64_t const dst = dst_rows[copy];
        device_rows[dst * row_vecs + part] = host[src * row_vecs + part];
    }
}

template <typename Vec, typename Idx>
cudaError_t launch_typed(RowCopyArgs const& a, cudaStream_t stream)
{
    int64_t const blocks = copy_grid_blocks(a.num_requests);
    row_copy_kernel<Vec, Idx><<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
        static_cast<Vec const*>(a.host_rows), a.host_rows_address, static_cast<Vec*>(a.device_rows),
        a.row_bytes / static_cast<int64_t>(sizeof(Vec)), static_cast<Idx const*>(a.src_rows),
        static_cast<Idx const*>(a.dst_rows), a.num_requests * a.copies_per_request);
    return cudaGetLastError();
}

template <typename Idx>
cudaError_t launch_indexed(RowCopyArgs const& a, cudaStream_t stream)
{
    // Widest access that divides the row and the base addresses (a host base read on the device is only
    // known to be 16-byte aligned when the caller says so by passing it directly).
    auto const aligned = [&a](uintptr_t n) {
        bool const host_ok = a.host_rows_address != nullptr || reinterpret_cast<uintptr_t>(a.host_rows) % n == 0;
        return host_ok && reinterpret_cast<uintptr_t>(a.device_rows) % n == 0
            && static_cast<uintptr_t>(a.row_bytes) % n == 0;
    };
    if (aligned(16))
    {
        return launch_typed<uint4, Idx>(a, stream);
    }
    if (aligned(4))
    {
        return launch_typed<uint32_t, Idx>(a, stream);
    }
    return launch_typed<uint8_t, Idx>(a, stream);
}

} // namespace

cudaError_t launch_row_copy(RowCopyArgs const& args, cudaStream_t stream)
{
    if (args.num_requests == 0 || args.copies_per_request == 0)
    {
        return cudaSuccess;
    }
    if (args.num_requests < 0 || args.copies_per_request < 0 || args.row_bytes <= 0
        || (args.index_bytes != 4 && args.index_bytes != 8))
    {
        return cudaErrorInvalidValue;
    }
    return args.index_bytes == 4 ? launch_indexed<int32_t>(args, stream) : launch_indexed<int64_t>(args, stream);
}

} // namespace cuda
} // namespace dhisparse
