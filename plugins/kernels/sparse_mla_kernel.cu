// Absorbed sparse MLA decode attention over resolved row locations.
// Grid (B*Q, ceil(H / kWarps)); one warp per head walks the K selected rows with an online softmax, so
// every row is read once per block from L2 and shared by the block's heads. Accumulators live in shared
// memory (any rank); lanes stride over the row's values.
#include "dhisparse/kernels.h"
#include "dhisparse/mla_row.h"

#include <cuda_bf16.h>

namespace dhisparse
{
namespace cuda
{
namespace
{

constexpr int kWarps = kMlaWarps;
constexpr int kThreads = kMlaThreads;

__device__ __forceinline__ float load_q(float const* p, int64_t i)
{
    return p[i];
}

__device__ __forceinline__ float load_q(__nv_bfloat16 const* p, int64_t i)
{
    return __bfloat162float(p[i]);
}

__device__ __forceinline__ void store_out(float* p, int64_t i, float x)
{
    p[i] = x;
}

__device__ __forceinline__ void store_out(__nv_bfloat16* p, int64_t i, float x)
{
    p[i] = __float2bfloat16_rn(x);
}

template <int kFormat>
__device__ __forceinline__ float row_value(unsigned char const* row, int32_t rank, int32_t d)
{
    if constexpr (kFormat == kKvFloat32)
    {
        return reinterpret_cast<float const*>(row)[d];
    }
    else if constexpr (kFormat == kKvBFloat16)
    {
        return __bfloat162float(reinterpret_cast<__nv_bfloat16 const*>(row)[d]);
    }
    else
    {
        return d < rank ? fp8_row_latent(row, d) : fp8_row_rope(row, d - rank);
    }
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int offset = 16; offset > 0; offset >>= 1)
    {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

template <typename QT, int kFormat, typename Idx>
__global__ void __launch_bounds__(kThreads) sparse_mla_kernel(SparseMlaArgs args)
{
    extern __shared__ float shared[];
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int64_t const bq = blockIdx.x;
    int64_t const head = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
    int32_t const rank = args.rank;
    int32_t const width = args.rank + args.rope;
    float* q = shared + warp * (width + rank);  // [width] query (latent then rope), then [rank] accumulator
    float* acc = q + width;
    if (head >= args.heads)
    {
        return;  // whole warp leaves; no block-wide barrier follows
    }
    int64_t const qh = bq * args.heads + head;
    QT const* q_lat = static_cast<QT const*>(args.q_lat) + qh * rank;
    QT const* q_pe = static_cast<QT const*>(args.q_pe) + qh * args.rope;
    for (int32_t d = lane; d < width; d += 32)
    {
        q[d] = d < rank ? load_q(q_lat, d) : load_q(q_pe, d - rank);
    }
    for (int32_t d = lane; d < rank; d += 32)
    {
        acc[d] = 0.0f;
    }
    __syncwarp();
    int64_t const row_bytes = kv_row_bytes(kFormat, rank, args.rope);
    auto const* kv = static_cast<unsigned char const*>(args.kv);
    Idx const* locations = static_cast<Idx const*>(args.locations) + bq * args.topk;
    float running_max = -INFINITY;
    float running_sum = 0.0f;
    for (int64_t j = 0; j < args.topk; ++j)
    {
        int64_t const loc = locations[j];
        if (loc < 0)
        {
            continue;
        }
        unsigned char const* row = kv + loc * row_bytes;
        float partial = 0.0f;
        for (int32_t d = lane; d < width; d += 32)
        {
            partial += q[d] * row_value<kFormat>(row, rank, d);
        }
        float const score = warp_sum(partial) * args.softmax_scale;
        float const new_max = fmaxf(running_max, score);
        float const correction = __expf(running_max - new_max);
        float const p = __expf(score - new_max);
        running_sum = running_sum * correction + p;
        running_max = new_max;
        for (int32_t d = lane; d < rank; d += 32)
        {
            acc[d] = acc[d] * correction + p * row_value<kFormat>(row, rank, d);
        }
    }
    float const inv = running_sum > 0.0f ? 1.0f / running_sum : 0.0f;
    QT* out = static_cast<QT*>(args.out_lat) + qh * rank;
    for (int32_t d = lane; d < rank; d += 32)
    {
        store_out(out, d, acc[d] * inv);
    }
}

template <typename QT, int kFormat>
cudaError_t launch_format(SparseMlaArgs const& args, LaunchPlan const& plan, cudaStream_t stream)
{
    dim3 const grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y));
    size_t const shared_bytes = static_cast<size_t>(plan.shared_bytes);
    if (args.index_bytes == 4)
    {
        auto* kernel = sparse_mla_kernel<QT, kFormat, int32_t>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
        kernel<<<grid, plan.block, shared_bytes, stream>>>(args);
    }
    else
    {
        auto* kernel = sparse_mla_kernel<QT, kFormat, int64_t>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
        kernel<<<grid, plan.block, shared_bytes, stream>>>(args);
    }
    return cudaGetLastError();
}

template <typename QT>
cudaError_t launch_q(SparseMlaArgs const& args, LaunchPlan const& plan, cudaStream_t stream)
{
    switch (args.kv_format)
    {
    case kKvFloat32: return launch_format<QT, kKvFloat32>(args, plan, stream);
    case kKvBFloat16: return launch_format<QT, kKvBFloat16>(args, plan, stream);
    case kKvFp8Ds32: return launch_format<QT, kKvFp8Ds32>(args, plan, stream);
    default: return cudaErrorInvalidValue;
    }
}

} // namespace

cudaError_t launch_sparse_mla(SparseMlaArgs const& args, cudaStream_t stream)
{
    LaunchPlan const plan = plan_sparse_mla(args);
    if (plan.status == kPlanEmpty)
    {
        return cudaSuccess;
    }
    if (plan.status != kPlanOk)
    {
        return cudaErrorInvalidValue;
    }
    return args.q_bf16 != 0 ? launch_q<__nv_bfloat16>(args, plan, stream) : launch_q<float>(args, plan, stream);
}

} // namespace cuda
} // namespace dhisparse
