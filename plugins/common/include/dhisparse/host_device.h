// Portability macros so that one header serves g++ (CPU library, ctest) and nvcc (kernels).
#pragma once

#if defined(__CUDACC__)
#define DHS_HD __host__ __device__ __forceinline__
#else
#define DHS_HD inline
#endif

#include <cstdint>
