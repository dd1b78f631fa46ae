// Host-side launchers of the CUDA kernels (asynchronous on `stream`; they return the launch error only).
// Tensor layouts are those of plugins/common/include/dhisparse/resolver.h and mla_row.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dhisparse
{
namespace cuda
{

//! Arguments of the batched resolver: R = num_sources rows (request x source), N selection entries, M pages,
//! B hot rows; index arrays are int32 or int64 (`index_bytes`). Contract: dhisparse/resolver.h.
//! hot_pos_out / hot_stamp_out may alias the inputs (in-place update).
struct ResolverArgs
{
    int64_t num_sources;
    int64_t n_select;
    int64_t num_pages;
    int64_t hot_rows;
    int64_t page_rows;
    int32_t index_bytes;        //!< 4 or 8
    void const* stamp;          //!< [1] this step's stamp (device memory)
    void const* positions;      //!< [R, N]
    void const* page_table;     //!< [R, M]
    void const* hot_pos_in;     //!< [R, B]
    void const* hot_stamp_in;   //!< [R, B]
    void const* hot_loc;        //!< [R, B]
    void* locations;            //!< [R, N] out
    int8_t* steps;              //!< [R, N] out
    void* hot_pos_out;          //!< [R, B] out
    void* hot_stamp_out;        //!< [R, B] out
    void* copy_position;        //!< [R, N] out, -1 padded
    void* copy_slot;            //!< [R, N] out, -1 padded
    void* copy_location;        //!< [R, N] out, -1 padded
    int32_t* summary;           //!< [R, 6] out (dhisparse::SummaryColumn)
};

//! Device scratch the resolver needs (bytes), for `workspace` of launch_resolver.
size_t resolver_workspace_bytes(int64_t num_sources, int64_t n_select, int64_t hot_rows, int32_t index_bytes);

//! One thread block per (request, source); same results as the CPU library, bit for bit.
cudaError_t launch_resolver(ResolverArgs const& args, void* workspace, cudaStream_t stream);

//! Gather copy of rows from pinned host memory (a device-accessible address: UVA / mapped) into device rows.
//!   src_rows [R, M] host row of each copy, dst_rows [R, M] device row; entries with src < 0 are skipped.
//! The host base is `host_rows`, or, when `host_rows_address` is not null, the uint64 it points to in device
//! memory (how the TensorRT plugin receives it: an int64 [1] input tensor).
//! Grid: copy_grid_blocks(R) thread blocks (4..32) of kCopyThreads threads.
struct RowCopyArgs
{
    void const* host_rows;
    uint64_t const* host_rows_address;
    void* device_rows;
    int64_t row_bytes;
    void const* src_rows;
    void const* dst_rows;
    int64_t num_requests;
    int64_t copies_per_request;
    int32_t index_bytes;  //!< 4 or 8
};

cudaError_t launch_row_copy(RowCopyArgs const& args, cudaStream_t stream);

//! Absorbed sparse MLA decode over resolved row locations.
//!   q_lat [B, Q, H, rank], q_pe [B, Q, H, rope] (fp32 or bf16, `q_bf16`), kv [rows, row_bytes] in
//!   `kv_format` (KvFormat), locations [B, Q, K] (int32 or int64, -1 = masked), out_lat [B, Q, H, rank]
//!   in q's dtype. score_j = softmax_scale * (q_lat . row_j[:rank] + q_pe . row_j[rank:]);
//!   out = sum_j softmax(score)_j row_j[:rank]; a query with no valid location gets zeros.
struct SparseMlaArgs
{
    int64_t batch;
    int64_t queries;
    int64_t heads;
    int64_t topk;
    int32_t rank;
    int32_t rope;
    int32_t kv_format;
    bool q_bf16;
    int32_t index_bytes;
    float softmax_scale;
    void const* q_lat;
    void const* q_pe;
    void const* kv;
    void const* locations;
    void* out_lat;
};

cudaError_t launch_sparse_mla(SparseMlaArgs const& args, cudaStream_t stream);

} // namespace cuda
} // namespace dhisparse
