// The launch contract of dhisparse/launch.h exported by the CPU library, so that the tests can check Python's
// packing of the argument structs and the launch rules against the C++ code the CUDA launchers run.
#include "dhisparse/c_api.h"
#include "dhisparse/launch.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace
{

using dhisparse::LaunchPlan;
using dhisparse::ResolverArgs;
using dhisparse::RowCopyArgs;
using dhisparse::SparseMlaArgs;
using dhisparse::StepResolveArgs;

//! Writes values into out[0..cap) and counts them all.
class Writer
{
public:
    Writer(int64_t* out, int32_t cap)
        : mOut(out)
        , mCap(cap)
    {
    }

    Writer& operator<<(int64_t v)
    {
        if (mCount < mCap)
        {
            mOut[mCount] = v;
        }
        ++mCount;
        return *this;
    }

    Writer& operator<<(void const* p)
    {
        return *this << static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    }

    int32_t count() const
    {
        return mCount;
    }

private:
    int64_t* mOut;
    int32_t mCap;
    int32_t mCount = 0;
};

int64_t off(size_t offset)
{
    return static_cast<int64_t>(offset);
}

} // namespace

extern "C" {

int32_t dhs_launch_layout(int32_t kind, int64_t* out, int32_t cap)
{
    Writer w(out, cap);
    switch (kind)
    {
    case DHS_LAUNCH_RESOLVER:
        w << off(sizeof(ResolverArgs)) << off(offsetof(ResolverArgs, num_sources)) << off(offsetof(ResolverArgs, n_select))
          << off(offsetof(ResolverArgs, num_pages)) << off(offsetof(ResolverArgs, hot_rows))
          << off(offsetof(ResolverArgs, page_rows)) << off(offsetof(ResolverArgs, index_bytes))
          << off(offsetof(ResolverArgs, stamp)) << off(offsetof(ResolverArgs, positions))
          << off(offsetof(ResolverArgs, page_table)) << off(offsetof(ResolverArgs, hot_pos_in))
          << off(offsetof(ResolverArgs, hot_stamp_in)) << off(offsetof(ResolverArgs, hot_loc))
          << off(offsetof(ResolverArgs, locations)) << off(offsetof(ResolverArgs, steps))
          << off(offsetof(ResolverArgs, hot_pos_out)) << off(offsetof(ResolverArgs, hot_stamp_out))
          << off(offsetof(ResolverArgs, copy_position)) << off(offsetof(ResolverArgs, copy_slot))
          << off(offsetof(ResolverArgs, copy_location)) << off(offsetof(ResolverArgs, summary));
        return w.count();
    case DHS_LAUNCH_ROW_COPY:
        w << off(sizeof(RowCopyArgs)) << off(offsetof(RowCopyArgs, host_rows))
          << off(offsetof(RowCopyArgs, host_rows_address)) << off(offsetof(RowCopyArgs, device_rows))
          << off(offsetof(RowCopyArgs, row_bytes)) << off(offsetof(RowCopyArgs, src_rows))
          << off(offsetof(RowCopyArgs, dst_rows)) << off(offsetof(RowCopyArgs, num_requests))
          << off(offsetof(RowCopyArgs, copies_per_request)) << off(offsetof(RowCopyArgs, index_bytes));
        return w.count();
    case DHS_LAUNCH_SPARSE_MLA:
        w << off(sizeof(SparseMlaArgs)) << off(offsetof(SparseMlaArgs, batch)) << off(offsetof(SparseMlaArgs, queries))
          << off(offsetof(SparseMlaArgs, heads)) << off(offsetof(SparseMlaArgs, topk)) << off(offsetof(SparseMlaArgs, rank))
          << off(offsetof(SparseMlaArgs, rope)) << off(offsetof(SparseMlaArgs, kv_format))
          << off(offsetof(SparseMlaArgs, q_bf16)) << off(offsetof(SparseMlaArgs, index_bytes))
          << off(offsetof(SparseMlaArgs, softmax_scale)) << off(offsetof(SparseMlaArgs, q_lat))
          << off(offsetof(SparseMlaArgs, q_pe)) << off(offsetof(SparseMlaArgs, kv))
          << off(offsetof(SparseMlaArgs, locations)) << off(offsetof(SparseMlaArgs, out_lat));
        return w.count();
    case DHS_LAUNCH_STEP_RESOLVER:
#define DHS_STEP_FIELD(name) << off(offsetof(StepResolveArgs, name))
        w << off(sizeof(StepResolveArgs)) DHS_STEP_FIELD(batch) DHS_STEP_FIELD(n) DHS_STEP_FIELD(groups)
            DHS_STEP_FIELD(hot_rows) DHS_STEP_FIELD(page_rows) DHS_STEP_FIELD(num_pages) DHS_STEP_FIELD(host_num_pages)
            DHS_STEP_FIELD(num_sources) DHS_STEP_FIELD(num_slots) DHS_STEP_FIELD(staging_rows) DHS_STEP_FIELD(staging_count)
            DHS_STEP_FIELD(table_row_stride) DHS_STEP_FIELD(table_source_stride) DHS_STEP_FIELD(hot_slot_stride)
            DHS_STEP_FIELD(hot_source_stride) DHS_STEP_FIELD(host_slot_stride) DHS_STEP_FIELD(host_source_stride)
            DHS_STEP_FIELD(staging_slot_stride) DHS_STEP_FIELD(staging_group_stride) DHS_STEP_FIELD(stamp)
            DHS_STEP_FIELD(positions) DHS_STEP_FIELD(lengths) DHS_STEP_FIELD(sources) DHS_STEP_FIELD(slots)
            DHS_STEP_FIELD(page_table) DHS_STEP_FIELD(hot_pos) DHS_STEP_FIELD(hot_stamp) DHS_STEP_FIELD(hot_loc)
            DHS_STEP_FIELD(host_pages) DHS_STEP_FIELD(staging_slots) DHS_STEP_FIELD(staging_loc)
            DHS_STEP_FIELD(locations) DHS_STEP_FIELD(steps)
            DHS_STEP_FIELD(fetch_src) DHS_STEP_FIELD(fetch_dst) DHS_STEP_FIELD(counts) DHS_STEP_FIELD(staged)
            DHS_STEP_FIELD(flags);
#undef DHS_STEP_FIELD
        return w.count();
    case DHS_LAUNCH_PLAN:
        w << off(sizeof(LaunchPlan)) << off(offsetof(LaunchPlan, status)) << off(offsetof(LaunchPlan, grid_x))
          << off(offsetof(LaunchPlan, grid_y)) << off(offsetof(LaunchPlan, block))
          << off(offsetof(LaunchPlan, shared_bytes)) << off(offsetof(LaunchPlan, workspace_bytes))
          << off(offsetof(LaunchPlan, vector_bytes));
        return w.count();
    default: return -1;
    }
}

int32_t dhs_launch_fields(int32_t kind, void const* args, int64_t* out, int32_t cap)
{
    Writer w(out, cap);
    if (kind == DHS_LAUNCH_RESOLVER)
    {
        ResolverArgs a;
        std::memcpy(&a, args, sizeof a);
        w << a.num_sources << a.n_select << a.num_pages << a.hot_rows << a.page_rows << int64_t{a.index_bytes}
          << a.stamp << a.positions << a.page_table << a.hot_pos_in << a.hot_stamp_in << a.hot_loc << a.locations
          << static_cast<void const*>(a.steps) << a.hot_pos_out << a.hot_stamp_out << a.copy_position << a.copy_slot
          << a.copy_location << static_cast<void const*>(a.summary);
        return w.count();
    }
    if (kind == DHS_LAUNCH_ROW_COPY)
    {
        RowCopyArgs a;
        std::memcpy(&a, args, sizeof a);
        w << a.host_rows << static_cast<void const*>(a.host_rows_address) << a.device_rows << a.row_bytes << a.src_rows
          << a.dst_rows << a.num_requests << a.copies_per_request << int64_t{a.index_bytes};
        return w.count();
    }
    if (kind == DHS_LAUNCH_SPARSE_MLA)
    {
        SparseMlaArgs a;
        std::memcpy(&a, args, sizeof a);
        int32_t scale_bits = 0;
        std::memcpy(&scale_bits, &a.softmax_scale, sizeof scale_bits);
        w << a.batch << a.queries << a.heads << a.topk << int64_t{a.rank} << int64_t{a.rope} << int64_t{a.kv_format}
          << int64_t{a.q_bf16} << int64_t{a.index_bytes} << int64_t{scale_bits} << a.q_lat << a.q_pe << a.kv
          << a.locations << static_cast<void const*>(a.out_lat);
        return w.count();
    }
    if (kind == DHS_LAUNCH_STEP_RESOLVER)
    {
        StepResolveArgs a;
        std::memcpy(&a, args, sizeof a);
        w << a.batch << a.n << a.groups << a.hot_rows << a.page_rows << a.num_pages << a.host_num_pages
          << a.num_sources << a.num_slots << a.staging_rows << a.staging_count << a.table_row_stride << a.table_source_stride
          << a.hot_slot_stride << a.hot_source_stride << a.host_slot_stride << a.host_source_stride
          << a.staging_slot_stride << a.staging_group_stride << a.stamp << static_cast<void const*>(a.positions)
          << static_cast<void const*>(a.lengths) << static_cast<void const*>(a.sources)
          << static_cast<void const*>(a.slots) << static_cast<void const*>(a.page_table)
          << static_cast<void const*>(a.hot_pos) << static_cast<void const*>(a.hot_stamp)
          << static_cast<void const*>(a.hot_loc) << static_cast<void const*>(a.host_pages)
          << static_cast<void const*>(a.staging_slots) << static_cast<void const*>(a.staging_loc)
          << static_cast<void const*>(a.locations)
          << static_cast<void const*>(a.steps) << static_cast<void const*>(a.fetch_src)
          << static_cast<void const*>(a.fetch_dst) << static_cast<void const*>(a.counts)
          << static_cast<void const*>(a.staged) << static_cast<void const*>(a.flags);
        return w.count();
    }
    return -1;
}

int32_t dhs_launch_plan(int32_t kind, void const* args, void* plan)
{
    if (kind < DHS_LAUNCH_RESOLVER || kind == DHS_LAUNCH_PLAN || kind > DHS_LAUNCH_STEP_RESOLVER)
    {
        return -1;
    }
    LaunchPlan const p = dhisparse::plan_of_kind(kind, args);
    std::memcpy(plan, &p, sizeof p);
    return p.status;
}

} // extern "C"
