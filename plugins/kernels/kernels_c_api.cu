// C ABI over the kernel launchers, for scripts/gpu_check.py (ctypes with torch CUDA tensors' data_ptr()).
#include "dhisparse/copy_grid.h"
#include "dhisparse/kernels.h"

#include <cstdint>

using dhisparse::cuda::ResolverArgs;
using dhisparse::cuda::SparseMlaArgs;

extern "C" {

size_t dhs_cuda_resolver_workspace_bytes(int64_t num_sources, int64_t n_select, int64_t hot_rows)
{
    return dhisparse::cuda::resolver_workspace_bytes(num_sources, n_select, hot_rows, 8);
}

int32_t dhs_cuda_resolve(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int64_t page_rows, int32_t index_bytes, void const* stamp, void const* positions, void const* page_table,
    void const* hot_pos_in, void const* hot_stamp_in, void const* hot_loc, void* locations, int8_t* steps,
    void* hot_pos_out, void* hot_stamp_out, void* copy_position, void* copy_slot, void* copy_location,
    int32_t* summary, void* workspace, void* stream)
{
    ResolverArgs const args{num_sources, n_select, num_pages, hot_rows, page_rows, index_bytes, stamp, positions,
        page_table, hot_pos_in, hot_stamp_in, hot_loc, locations, steps, hot_pos_out, hot_stamp_out, copy_position,
        copy_slot, copy_location, summary};
    return static_cast<int32_t>(
        dhisparse::cuda::launch_resolver(args, workspace, static_cast<cudaStream_t>(stream)));
}

int32_t dhs_cuda_row_copy(void const* host_rows, void* device_rows, int64_t row_bytes, void const* src_rows,
    void const* dst_rows, int64_t num_requests, int64_t copies_per_request, int32_t index_bytes, void* stream)
{
    dhisparse::cuda::RowCopyArgs const args{host_rows, nullptr, device_rows, row_bytes, src_rows, dst_rows,
        num_requests, copies_per_request, index_bytes};
    return static_cast<int32_t>(dhisparse::cuda::launch_row_copy(args, static_cast<cudaStream_t>(stream)));
}

int32_t dhs_cuda_sparse_mla(int64_t batch, int64_t queries, int64_t heads, int64_t topk, int32_t rank,
    int32_t rope, int32_t kv_format, int32_t q_bf16, int32_t index_bytes, float softmax_scale, void const* q_lat,
    void const* q_pe, void const* kv, void const* locations, void* out_lat, void* stream)
{
    SparseMlaArgs const args{batch, queries, heads, topk, rank, rope, kv_format, q_bf16 != 0, index_bytes,
        softmax_scale, q_lat, q_pe, kv, locations, out_lat};
    return static_cast<int32_t>(dhisparse::cuda::launch_sparse_mla(args, static_cast<cudaStream_t>(stream)));
}

int32_t dhs_cuda_copy_grid_blocks(int64_t batch)
{
    return dhisparse::copy_grid_blocks(batch);
}

} // extern "C"
