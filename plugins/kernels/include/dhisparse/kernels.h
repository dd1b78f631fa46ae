// Host-side launchers of the CUDA kernels (asynchronous on `stream`; they return the launch error only).
// Each launches exactly the plan_* of dhisparse/launch.h; the TensorRT plugins and the C ABI both call them.
// Tensor layouts are those of plugins/common/include/dhisparse/resolver.h and mla_row.h.
#pragma once

#include "dhisparse/launch.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dhisparse
{
namespace cuda
{

// Argument structs and launch rules live in dhisparse/launch.h (shared with the C ABI and the CPU tests).
using dhisparse::ResolverArgs;
using dhisparse::RowCopyArgs;
using dhisparse::SparseMlaArgs;
using dhisparse::StepResolveArgs;

//! Device scratch the resolver needs (bytes), for `workspace` of launch_resolver (0 when the rows' scratch fits in
//! shared memory, as at N = 2048, B = 4096).
size_t resolver_workspace_bytes(int64_t num_sources, int64_t n_select, int64_t hot_rows, int32_t index_bytes);

//! One thread block per (request, source); same results as the CPU library, bit for bit.
cudaError_t launch_resolver(ResolverArgs const& args, void* workspace, cudaStream_t stream);

//! One KV step's index group for the whole batch in one launch (grid G * B, plan_step_resolver); `workspace`
//! as plan.workspace_bytes says (null when the scratch fits in shared memory).
cudaError_t launch_step_resolver(StepResolveArgs const& args, void* workspace, cudaStream_t stream);

//! Gather copy (grid plan_row_copy: copy_grid_blocks(R) blocks of kCopyThreads); contract in launch.h.
cudaError_t launch_row_copy(RowCopyArgs const& args, cudaStream_t stream);

//! Absorbed sparse MLA decode (grid plan_sparse_mla); contract in launch.h.
cudaError_t launch_sparse_mla(SparseMlaArgs const& args, cudaStream_t stream);

} // namespace cuda
} // namespace dhisparse
