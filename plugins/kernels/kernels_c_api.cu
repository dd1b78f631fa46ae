// C ABI of libdhisparse_cuda.so: the kernel launchers behind the argument structs of dhisparse/launch.h, for
// Python's launcher layer (backend/dhisparse/kernels/, ctypes with torch tensors' data_ptr() and torch's
// current stream). The TensorRT plugins' enqueue calls the same dhisparse::cuda::launch_* functions.
#include "dhisparse/kernels.h"
#include "dhisparse/launch.h"

#include <cstdint>

extern "C" {

//! Bumped whenever a signature or an argument struct changes (same number as the CPU library's contract).
int32_t dhs_cuda_abi_version(void)
{
    return 3;
}

int32_t dhs_cuda_launch_resolver(dhisparse::ResolverArgs const* args, void* workspace, void* stream)
{
    return static_cast<int32_t>(
        dhisparse::cuda::launch_resolver(*args, workspace, static_cast<cudaStream_t>(stream)));
}

int32_t dhs_cuda_launch_step_resolver(dhisparse::StepResolveArgs const* args, void* workspace, void* stream)
{
    return static_cast<int32_t>(
        dhisparse::cuda::launch_step_resolver(*args, workspace, static_cast<cudaStream_t>(stream)));
}

int32_t dhs_cuda_launch_row_copy(dhisparse::RowCopyArgs const* args, void* stream)
{
    return static_cast<int32_t>(dhisparse::cuda::launch_row_copy(*args, static_cast<cudaStream_t>(stream)));
}

int32_t dhs_cuda_launch_sparse_mla(dhisparse::SparseMlaArgs const* args, void* stream)
{
    return static_cast<int32_t>(dhisparse::cuda::launch_sparse_mla(*args, static_cast<cudaStream_t>(stream)));
}

//! The launch plan the launchers use (same code as the CPU library's dhs_launch_plan); returns plan.status.
int32_t dhs_cuda_launch_plan(int32_t kind, void const* args, dhisparse::LaunchPlan* plan)
{
    *plan = dhisparse::plan_of_kind(kind, args);
    return plan->status;
}

//! Name of a cudaError_t (static string).
char const* dhs_cuda_error_name(int32_t error)
{
    return cudaGetErrorName(static_cast<cudaError_t>(error));
}

} // extern "C"
