// Small serial sorting/searching helpers usable on host and device (no std:: in device code).
#pragma once

#include "dhisparse/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <algorithm>
#endif

namespace dhisparse
{

template <typename T>
DHS_HD void sift_down(T* a, int64_t root, int64_t n)
{
    while (true)
    {
        int64_t child = 2 * root + 1;
        if (child >= n)
        {
            return;
        }
        if (child + 1 < n && a[child] < a[child + 1])
        {
            ++child;
        }
        if (!(a[root] < a[child]))
        {
            return;
        }
        T const t = a[root];
        a[root] = a[child];
        a[child] = t;
        root = child;
    }
}

//! In-place ascending sort: std::sort on the host, heap sort (O(n log n), no allocation, no recursion) in
//! device code. Keys are plain integers, so both give the same order.
template <typename T>
DHS_HD void heap_sort(T* a, int64_t n)
{
#if !defined(__CUDA_ARCH__)
    std::sort(a, a + n);
#else
    for (int64_t i = n / 2 - 1; i >= 0; --i)
    {
        sift_down(a, i, n);
    }
    for (int64_t end = n - 1; end > 0; --end)
    {
        T const t = a[0];
        a[0] = a[end];
        a[end] = t;
        sift_down(a, 0, end);
    }
#endif
}

//! Index of the first element of sorted a[0..n) that is not less than x (n if none).
template <typename T>
DHS_HD int64_t lower_bound(T const* a, int64_t n, T x)
{
    int64_t lo = 0;
    int64_t hi = n;
    while (lo < hi)
    {
        int64_t const mid = lo + (hi - lo) / 2;
        if (a[mid] < x)
        {
            lo = mid + 1;
        }
        else
        {
            hi = mid;
        }
    }
    return lo;
}

} // namespace dhisparse
