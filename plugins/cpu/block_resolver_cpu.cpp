// The resolver kernels' block code run on the CPU: every block of a launch's grid in turn, with one "thread"
// (dhisparse::SerialBlock) and the plan's scratch layout, over host memory. The tests compare it with the Python
// specification and with the CPU library's serial resolver, so the code the GPU runs is exercised without one.
#include "dhisparse/c_api.h"
#include "dhisparse/resolver_blocks.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace
{

template <typename Block>
int32_t run_grid(dhisparse::LaunchPlan const& plan, int64_t n, int64_t hot_rows, Block block)
{
    if (plan.status == dhisparse::kPlanEmpty)
    {
        return dhisparse::kPlanOk;
    }
    if (plan.status != dhisparse::kPlanOk)
    {
        return plan.status;
    }
    int64_t const bytes = dhisparse::resolver_row_scratch_bytes(n, hot_rows);
    std::vector<int64_t> scratch(static_cast<size_t>((bytes + 7) / 8));
    int32_t counters[dhisparse::kBlockCounters] = {};
    dhisparse::BlockScratch const s = dhisparse::block_scratch(scratch.data(), n, hot_rows);
    for (int64_t x = 0; x < plan.grid_x; ++x)
    {
        block(x, s, counters);
    }
    return dhisparse::kPlanOk;
}

} // namespace

extern "C" {

int32_t dhs_emulate_launch(int32_t kind, void const* args)
{
    dhisparse::SerialBlock const ex;
    if (kind == DHS_LAUNCH_RESOLVER)
    {
        dhisparse::ResolverArgs a;
        std::memcpy(&a, args, sizeof a);
        return run_grid(dhisparse::plan_resolver(a), a.n_select, a.hot_rows,
            [&](int64_t x, dhisparse::BlockScratch const& s, int32_t* counters) {
                if (a.index_bytes == 4)
                {
                    dhisparse::resolver_block<dhisparse::SerialBlock, int32_t>(ex, a, x, s, counters);
                }
                else
                {
                    dhisparse::resolver_block<dhisparse::SerialBlock, int64_t>(ex, a, x, s, counters);
                }
            });
    }
    if (kind == DHS_LAUNCH_STEP_RESOLVER)
    {
        dhisparse::StepResolveArgs a;
        std::memcpy(&a, args, sizeof a);
        return run_grid(dhisparse::plan_step_resolver(a), a.n, a.hot_rows,
            [&](int64_t x, dhisparse::BlockScratch const& s, int32_t* counters) {
                dhisparse::step_resolver_block(ex, a, x, s, counters);
            });
    }
    return dhisparse::kPlanBadSize;
}

} // extern "C"
