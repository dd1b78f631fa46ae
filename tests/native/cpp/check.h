// Minimal assertion helpers for the ctest executables (no test framework is installed on CI machines).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace dhs_test
{
inline int& failures()
{
    static int count = 0;
    return count;
}
} // namespace dhs_test

#define DHS_CHECK(cond)                                                                                           \
    do                                                                                                             \
    {                                                                                                              \
        if (!(cond))                                                                                               \
        {                                                                                                          \
            std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);                          \
            ++dhs_test::failures();                                                                                \
        }                                                                                                          \
    } while (0)

#define DHS_CHECK_EQ(a, b)                                                                                        \
    do                                                                                                             \
    {                                                                                                              \
        auto const dhs_a = (a);                                                                                    \
        auto const dhs_b = (b);                                                                                    \
        if (!(dhs_a == dhs_b))                                                                                     \
        {                                                                                                          \
            std::fprintf(stderr, "%s:%d: %s == %s failed: %lld vs %lld\n", __FILE__, __LINE__, #a, #b,             \
                static_cast<long long>(dhs_a), static_cast<long long>(dhs_b));                                      \
            ++dhs_test::failures();                                                                                \
        }                                                                                                          \
    } while (0)

#define DHS_TEST_MAIN_END()                                                                                       \
    do                                                                                                             \
    {                                                                                                              \
        if (dhs_test::failures() != 0)                                                                             \
        {                                                                                                          \
            std::fprintf(stderr, "%d check(s) failed\n", dhs_test::failures());                                    \
            return EXIT_FAILURE;                                                                                   \
        }                                                                                                          \
        std::printf("all checks passed\n");                                                                        \
        return EXIT_SUCCESS;                                                                                       \
    } while (0)
