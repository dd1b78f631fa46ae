// Block-wide helpers for kernels whose one thread block owns one problem (sort, scan, reduce).
#pragma once

#include <cstdint>

namespace dhisparse
{
namespace cuda
{

//! Ascending bitonic sort of keys[0, n) by one thread block; n is a power of two. `keys` may live in global
//! memory: __syncthreads() makes a block's global writes visible to the block.
template <typename T>
__device__ void block_bitonic_sort(T* keys, int64_t n)
{
    for (int64_t k = 2; k <= n; k <<= 1)
    {
        for (int64_t j = k >> 1; j > 0; j >>= 1)
        {
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
            {
                int64_t const partner = i ^ j;
                if (partner > i)
                {
                    bool const ascending = (i & k) == 0;
                    T const a = keys[i];
                    T const b = keys[partner];
                    if ((a > b) == ascending)
                    {
                        keys[i] = b;
                        keys[partner] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

//! In-place exclusive prefix sum of values[0, n) by one thread block; `shared` holds blockDim.x + 1 ints.
//! Returns the total to every thread.
__device__ inline int32_t block_exclusive_scan(int32_t* values, int64_t n, int32_t* shared)
{
    int32_t carry = 0;
    for (int64_t base = 0; base < n; base += blockDim.x)
    {
        int64_t const i = base + threadIdx.x;
        int32_t const own = i < n ? values[i] : 0;
        shared[threadIdx.x] = own;
        __syncthreads();
        for (unsigned offset = 1; offset < blockDim.x; offset <<= 1)
        {
            int32_t const add = threadIdx.x >= offset ? shared[threadIdx.x - offset] : 0;
            __syncthreads();
            shared[threadIdx.x] += add;
            __syncthreads();
        }
        if (i < n)
        {
            values[i] = carry + shared[threadIdx.x] - own;
        }
        int32_t const chunk_total = shared[blockDim.x - 1];
        __syncthreads();
        carry += chunk_total;
    }
    return carry;
}

__host__ __device__ inline int64_t next_pow2(int64_t n)
{
    int64_t p = 1;
    while (p < n)
    {
        p <<= 1;
    }
    return p;
}

} // namespace cuda
} // namespace dhisparse
