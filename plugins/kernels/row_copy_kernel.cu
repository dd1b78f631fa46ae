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
__global__ void __launch_bounds__(kCopyThreads) row_copy_kernel(Vec const* __restrict__ host_rows,
    Vec* __restrict__ device_rows, int64_t row_vecs, Idx const* __restrict__ src_rows,
    Idx const* __restrict__ dst_rows, int64_t num_copies)
{
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
        device_rows[dst * row_vecs + part] = host_rows[src * row_vecs + part];
    }
}

template <typename Vec, typename Idx>
cudaError_t launch_typed(void const* host_rows, void* device_rows, int64_t row_bytes, void const* src_rows,
    void const* dst_rows, int64_t num_requests, int64_t copies_per_request, cudaStream_t stream)
{
    int64_t const blocks = copy_grid_blocks(num_requests);
    row_copy_kernel<Vec, Idx><<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(
        static_cast<Vec const*>(host_rows), static_cast<Vec*>(device_rows),
        row_bytes / static_cast<int64_t>(sizeof(Vec)), static_cast<Idx const*>(src_rows),
        static_cast<Idx const*>(dst_rows), num_requests * copies_per_request);
    return cudaGetLastError();
}

template <typename Idx>
cudaError_t launch_indexed(void const* host_rows, void* device_rows, int64_t row_bytes, void const* src_rows,
    void const* dst_rows, int64_t num_requests, int64_t copies_per_request, cudaStream_t stream)
{
    // Widest access that divides the row and both base addresses.
    auto const aligned = [&](uintptr_t a) {
        return (reinterpret_cast<uintptr_t>(host_rows) % a == 0) && (reinterpret_cast<uintptr_t>(device_rows) % a == 0)
            && (static_cast<uintptr_t>(row_bytes) % a == 0);
    };
    if (aligned(16))
    {
        return launch_typed<uint4, Idx>(
            host_rows, device_rows, row_bytes, src_rows, dst_rows, num_requests, copies_per_request, stream);
    }
    if (aligned(4))
    {
        return launch_typed<uint32_t, Idx>(
            host_rows, device_rows, row_bytes, src_rows, dst_rows, num_requests, copies_per_request, stream);
    }
    return launch_typed<uint8_t, Idx>(
        host_rows, device_rows, row_bytes, src_rows, dst_rows, num_requests, copies_per_request, stream);
}

} // namespace

cudaError_t launch_row_copy(void const* host_rows, void* device_rows, int64_t row_bytes, void const* src_rows,
    void const* dst_rows, int64_t num_requests, int64_t copies_per_request, int32_t index_bytes,
    cudaStream_t stream)
{
    if (num_requests == 0 || copies_per_request == 0)
    {
        return cudaSuccess;
    }
    if (num_requests < 0 || copies_per_request < 0 || row_bytes <= 0 || (index_bytes != 4 && index_bytes != 8))
    {
        return cudaErrorInvalidValue;
    }
    if (index_bytes == 4)
    {
        return launch_indexed<int32_t>(
            host_rows, device_rows, row_bytes, src_rows, dst_rows, num_requests, copies_per_request, stream);
    }
    return launch_indexed<int64_t>(
        host_rows, device_rows, row_bytes, src_rows, dst_rows, num_requests, copies_per_request, stream);
}

} // namespace cuda
} // namespace dhisparse
