// The launcher contract of the CUDA kernels, shared by every caller: the TensorRT plugins' enqueue, the C ABI
// that Python's launcher layer (backend/dhisparse/kernels/) calls through ctypes, and the CPU library that
// exports the same rules to the tests. Plain C++ (no CUDA headers): argument structs with a fixed layout,
// and `plan_*` functions that validate the arguments and compute the launch shape. The launchers in
// plugins/kernels/*.cu launch exactly the plan these functions return, so what the tests check on CPU is
// what runs on the GPU.
//
// Layout rule (checked by tests/native/test_launch_contract.py against Python's ctypes mirror): every struct
// is a sequence of 8-byte fields (int64, pointers, or int32 / float / bool members padded to 8), so offsets
// are the same under every x86_64 / aarch64 ABI.
#pragma once

#include "dhisparse/block_resolver.h"
#include "dhisparse/copy_grid.h"
#include "dhisparse/mla_row.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dhisparse
{

//! Status of a plan (0: launchable). Values are part of the C ABI (DHS_PLAN_* in cpu/include/dhisparse/c_api.h).
enum PlanStatus : int32_t
{
    kPlanOk = 0,
    kPlanEmpty = 1,           //!< nothing to do: the launcher returns success without launching
    kPlanBadSize = -1,        //!< a negative size, page_rows <= 0, hot_rows >= 2^24, row_bytes <= 0
    kPlanBadIndexBytes = -2,  //!< index_bytes is not 4 or 8
    kPlanBadFormat = -3,      //!< kv_format unknown or not valid for (rank, rope)
    kPlanBadPointer = -4,     //!< a required pointer is null
};

constexpr int32_t kResolverThreads = 512;
//! A resolver row's scratch lives in shared memory up to this size (every sm_80..sm_90 part opts in to 99 KB
//! per block); larger rows take a global-memory workspace of the same layout.
constexpr int64_t kResolverMaxSharedBytes = 96 * 1024;
constexpr int32_t kMlaWarps = 4;
constexpr int32_t kMlaThreads = 32 * kMlaWarps;

//! Arguments of the batched resolver: R = num_sources rows (request x source), N selection entries, M pages,
//! B hot rows; index arrays are int32 or int64 (`index_bytes`). Contract: dhisparse/resolver.h; one thread block
//! per row runs dhisparse/block_resolver.h.
//! hot_pos_out / hot_stamp_out may alias the inputs (in-place update).
struct ResolverArgs
{
    int64_t num_sources;
    int64_t n_select;
    int64_t num_pages;
    int64_t hot_rows;
    int64_t page_rows;
    int32_t index_bytes;  //!< 4 or 8
    int32_t pad0;
    void const* stamp;         //!< [1] this step's stamp (device memory, index type)
    void const* positions;     //!< [R, N]
    void const* page_table;    //!< [R, M]
    void const* hot_pos_in;    //!< [R, B]
    void const* hot_stamp_in;  //!< [R, B]
    void const* hot_loc;       //!< [R, B]
    void* locations;           //!< [R, N] out
    int8_t* steps;             //!< [R, N] out
    void* hot_pos_out;         //!< [R, B] out
    void* hot_stamp_out;       //!< [R, B] out
    void* copy_position;       //!< [R, N] out, -1 padded
    void* copy_slot;           //!< [R, N] out, -1 padded
    void* copy_location;       //!< [R, N] out, -1 padded
    int32_t* summary;          //!< [R, 6] out (dhisparse::SummaryColumn)
};

//! One KV step's resolution of an index group (G sources selected by the same positions) for the whole batch in
//! one launch: the contract of dhs_resolve_step_i64 (cpu/include/dhisparse/c_api.h) plus verification staging,
//! one thread block per (source, request) running dhisparse/block_resolver.h. All indices int64; strided tensors
//! have a contiguous last dimension. Per-step values (stamp, sources, slots) are read from device memory, so a
//! captured CUDA graph replays the launch with the next step's values.
struct StepResolveArgs
{
    int64_t batch;           //!< B requests
    int64_t n;               //!< N entries per request (all verification queries concatenated)
    int64_t groups;          //!< G sources of the group
    int64_t hot_rows;        //!< H slots per (request, source)
    int64_t page_rows;       //!< P
    int64_t num_pages;       //!< M pages of the page-table snapshot
    int64_t host_num_pages;  //!< last dimension of host_pages
    int64_t num_sources;     //!< S (every sources[g] must be below it)
    int64_t num_slots;       //!< rows of the hot state / host_pages (every slots[b] must be below it)
    int64_t staging_rows;    //!< T staging rows per (slot, staging slot); 0: none
    int64_t staging_count;   //!< staging slots per batch-state slot (every staging_slots[g] must be below it)
    int64_t table_row_stride;
    int64_t table_source_stride;   //!< of page_table [B, S, M]
    int64_t hot_slot_stride;
    int64_t hot_source_stride;     //!< of hot_pos / hot_stamp / hot_loc [slots, S, H]
    int64_t host_slot_stride;
    int64_t host_source_stride;    //!< of host_pages [slots, S, M']
    int64_t staging_slot_stride;
    int64_t staging_group_stride;  //!< of staging_loc [slots, staging slots, T]
    void const* stamp;             //!< int64 [1]: this step's stamp
    int64_t const* positions;      //!< [B, N], negative = unused
    int64_t const* lengths;        //!< [B] history length of each request (null: not checked)
    int64_t const* sources;        //!< [G]
    int64_t const* slots;          //!< [B]
    int64_t const* page_table;     //!< [B, S, M]
    int64_t* hot_pos;              //!< [slots, S, H] in/out
    int64_t* hot_stamp;            //!< [slots, S, H] in/out
    int64_t const* hot_loc;        //!< [slots, S, H]
    int64_t const* host_pages;     //!< [slots, S, M'] host page ids (-1: none), or null (no host store)
    int64_t const* staging_slots;  //!< [G] staging slot of each group member (read when T > 0)
    int64_t const* staging_loc;    //!< [slots, staging slots, T] arena rows of verification staging, or null
    int64_t* locations;            //!< [G, B, N] out: arena row of each entry, -1 where unused
    int8_t* steps;                 //!< [G, B, N] out (null: not written): 0 unused, 1 direct, 2 hot, 3 host
    int64_t* fetch_src;            //!< [G, B, N] out: host row of each copy, each request's copies first, -1 after
    int64_t* fetch_dst;            //!< [G, B, N] out: arena row each copy goes to (-1 after)
    int64_t* counts;               //!< [B, 3] in/out: direct / hot / host rows added per request
    int64_t* staged;               //!< [B] in/out: rows copied into staging (null: not counted)
    int32_t* flags;                //!< [1] in/out: |= DHS_STEP_* bits (RowFlag, plus kStepBadArgument)
};

//! Flag of a (source, request) block whose source, slot or staging slot is out of range (nothing resolved).
constexpr int32_t kStepBadArgument = 16;

//! Gather copy of rows from pinned host memory (a device-accessible address: UVA / mapped) into device rows.
//!   src_rows [R, M] host row of each copy, dst_rows [R, M] device row; entries with src < 0 are skipped.
//! The host base is `host_rows`, or, when `host_rows_address` is not null, the uint64 it points to in device
//! memory (how the TensorRT plugin receives it: an int64 [1] input tensor).
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
    int32_t pad0;
};

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
    int32_t q_bf16;  //!< 0: float32 q / out, 1: bfloat16
    int32_t index_bytes;
    float softmax_scale;
    void const* q_lat;
    void const* q_pe;
    void const* kv;
    void const* locations;
    void* out_lat;
};

//! What a launcher will launch: grid (x, y), block threads, dynamic shared memory, device workspace, and
//! for the copy the access width in bytes.
struct LaunchPlan
{
    int32_t status;
    int32_t grid_x;
    int32_t grid_y;
    int32_t block;
    int64_t shared_bytes;
    int64_t workspace_bytes;
    int32_t vector_bytes;
    int32_t pad0;
};

inline int64_t plan_next_pow2(int64_t n)
{
    int64_t p = 1;
    while (p < n)
    {
        p <<= 1;
    }
    return p;
}

//! Scratch bytes of one resolver row (request x source): dhisparse::block_scratch_bytes.
inline int64_t resolver_row_scratch_bytes(int64_t n_select, int64_t hot_rows)
{
    return block_scratch_bytes(n_select, hot_rows);
}

inline bool valid_index_bytes(int32_t index_bytes)
{
    return index_bytes == 4 || index_bytes == 8;
}

//! The scratch of rows of N entries and B slots: in shared memory (shared_bytes) when it fits
//! kResolverMaxSharedBytes, else `rows` slices of a global workspace (workspace_bytes).
inline void plan_resolver_scratch(LaunchPlan& p, int64_t rows, int64_t n, int64_t hot_rows)
{
    int64_t const bytes = resolver_row_scratch_bytes(n, hot_rows);
    if (bytes <= kResolverMaxSharedBytes)
    {
        p.shared_bytes = bytes;
    }
    else
    {
        p.workspace_bytes = rows * bytes;
    }
}

//! One block of kResolverThreads per (request, source) row; scratch per plan_resolver_scratch.
inline LaunchPlan plan_resolver(ResolverArgs const& a)
{
    LaunchPlan p{kPlanOk, 0, 1, kResolverThreads, 0, 0, 0, 0};
    if (a.num_sources < 0 || a.n_select < 0 || a.num_pages < 0 || a.page_rows <= 0 || a.hot_rows < 0
        || a.hot_rows >= (int64_t{1} << 24) || a.num_sources > INT32_MAX || a.n_select > INT32_MAX)
    {
        p.status = kPlanBadSize;
        return p;
    }
    if (!valid_index_bytes(a.index_bytes))
    {
        p.status = kPlanBadIndexBytes;
        return p;
    }
    plan_resolver_scratch(p, a.num_sources, a.n_select, a.hot_rows);
    if (a.num_sources == 0)
    {
        p.status = kPlanEmpty;
        return p;
    }
    if (a.stamp == nullptr || a.positions == nullptr || a.hot_pos_in == nullptr || a.locations == nullptr
        || a.steps == nullptr || a.summary == nullptr || (a.num_pages > 0 && a.page_table == nullptr)
        || (a.hot_rows > 0 && (a.hot_stamp_in == nullptr || a.hot_loc == nullptr || a.hot_pos_out == nullptr
                                  || a.hot_stamp_out == nullptr))
        || a.copy_position == nullptr || a.copy_slot == nullptr || a.copy_location == nullptr)
    {
        p.status = kPlanBadPointer;
        return p;
    }
    p.grid_x = static_cast<int32_t>(a.num_sources);
    return p;
}

//! One block of kResolverThreads per (source, request): grid G * B (source major); scratch per
//! plan_resolver_scratch.
inline LaunchPlan plan_step_resolver(StepResolveArgs const& a)
{
    LaunchPlan p{kPlanOk, 0, 1, kResolverThreads, 0, 0, 0, 0};
    if (a.batch < 0 || a.n < 0 || a.groups < 0 || a.hot_rows < 0 || a.hot_rows >= (int64_t{1} << 24)
        || a.page_rows <= 0 || a.num_pages < 0 || a.host_num_pages < 0 || a.num_sources < 0 || a.num_slots < 0
        || a.staging_rows < 0 || a.staging_count < 0 || a.n > INT32_MAX || a.batch * a.groups > INT32_MAX)
    {
        p.status = kPlanBadSize;
        return p;
    }
    plan_resolver_scratch(p, a.batch * a.groups, a.n, a.hot_rows);
    if (a.batch * a.groups == 0)
    {
        p.status = kPlanEmpty;
        return p;
    }
    if (a.stamp == nullptr || a.positions == nullptr || a.sources == nullptr || a.slots == nullptr
        || (a.num_pages > 0 && a.page_table == nullptr) || a.hot_pos == nullptr || a.hot_stamp == nullptr
        || a.hot_loc == nullptr || a.locations == nullptr || a.fetch_src == nullptr || a.fetch_dst == nullptr
        || a.counts == nullptr || a.flags == nullptr || (a.staging_rows > 0 && (a.staging_loc == nullptr || a.staging_slots == nullptr)))
    {
        p.status = kPlanBadPointer;
        return p;
    }
    p.grid_x = static_cast<int32_t>(a.batch * a.groups);
    return p;
}

//! copy_grid_blocks(R) blocks (4..32) of kCopyThreads; 16-, 4- or 1-byte accesses, the widest that divides
//! the row and both base addresses (a base read from device memory counts as 16-byte aligned).
inline LaunchPlan plan_row_copy(RowCopyArgs const& a)
{
    LaunchPlan p{kPlanOk, 0, 1, kCopyThreads, 0, 0, 0, 0};
    if (a.num_requests < 0 || a.copies_per_request < 0 || a.row_bytes <= 0)
    {
        p.status = kPlanBadSize;
        return p;
    }
    if (!valid_index_bytes(a.index_bytes))
    {
        p.status = kPlanBadIndexBytes;
        return p;
    }
    if (a.num_requests == 0 || a.copies_per_request == 0)
    {
        p.status = kPlanEmpty;
        return p;
    }
    if ((a.host_rows == nullptr && a.host_rows_address == nullptr) || a.device_rows == nullptr
        || a.src_rows == nullptr || a.dst_rows == nullptr)
    {
        p.status = kPlanBadPointer;
        return p;
    }
    auto const aligned = [&a](uintptr_t n) {
        bool const host_ok = a.host_rows_address != nullptr || reinterpret_cast<uintptr_t>(a.host_rows) % n == 0;
        return host_ok && reinterpret_cast<uintptr_t>(a.device_rows) % n == 0
            && static_cast<uintptr_t>(a.row_bytes) % n == 0;
    };
    p.vector_bytes = aligned(16) ? 16 : (aligned(4) ? 4 : 1);
    p.grid_x = copy_grid_blocks(a.num_requests);
    return p;
}

//! Grid (B*Q, ceil(H / kMlaWarps)) of kMlaThreads; shared memory for kMlaWarps accumulators + queries.
inline LaunchPlan plan_sparse_mla(SparseMlaArgs const& a)
{
    LaunchPlan p{kPlanOk, 0, 0, kMlaThreads, 0, 0, 0, 0};
    if (a.batch < 0 || a.queries < 0 || a.heads < 0 || a.topk < 0 || a.rank <= 0 || a.rope < 0
        || a.batch * a.queries > INT32_MAX)
    {
        p.status = kPlanBadSize;
        return p;
    }
    if (!valid_index_bytes(a.index_bytes))
    {
        p.status = kPlanBadIndexBytes;
        return p;
    }
    if (kv_row_bytes(a.kv_format, a.rank, a.rope) == 0 || (a.q_bf16 != 0 && a.q_bf16 != 1))
    {
        p.status = kPlanBadFormat;
        return p;
    }
    if (a.batch * a.queries == 0 || a.heads == 0)
    {
        p.status = kPlanEmpty;
        return p;
    }
    if (a.q_lat == nullptr || a.q_pe == nullptr || a.kv == nullptr || a.locations == nullptr
        || a.out_lat == nullptr)
    {
        p.status = kPlanBadPointer;
        return p;
    }
    p.grid_x = static_cast<int32_t>(a.batch * a.queries);
    p.grid_y = static_cast<int32_t>((a.heads + kMlaWarps - 1) / kMlaWarps);
    p.shared_bytes = static_cast<int64_t>(sizeof(float)) * kMlaWarps * (2 * int64_t{a.rank} + a.rope);
    return p;
}

//! Kinds of argument structs in the C ABIs (DHS_LAUNCH_* in cpu/include/dhisparse/c_api.h).
enum LaunchKind : int32_t
{
    kLaunchResolver = 0,
    kLaunchRowCopy = 1,
    kLaunchSparseMla = 2,
    kLaunchStepResolver = 4,  //!< 3 is LaunchPlan itself in the layout queries of the C ABIs
};

//! plan_* of the struct of `kind` at `args` (copied out first: `args` need not be aligned). Unknown kind:
//! status kPlanBadSize.
inline LaunchPlan plan_of_kind(int32_t kind, void const* args)
{
    switch (kind)
    {
    case kLaunchResolver:
    {
        ResolverArgs a;
        std::memcpy(&a, args, sizeof a);
        return plan_resolver(a);
    }
    case kLaunchRowCopy:
    {
        RowCopyArgs a;
        std::memcpy(&a, args, sizeof a);
        return plan_row_copy(a);
    }
    case kLaunchSparseMla:
    {
        SparseMlaArgs a;
        std::memcpy(&a, args, sizeof a);
        return plan_sparse_mla(a);
    }
    case kLaunchStepResolver:
    {
        StepResolveArgs a;
        std::memcpy(&a, args, sizeof a);
        return plan_step_resolver(a);
    }
    default: return LaunchPlan{kPlanBadSize, 0, 0, 0, 0, 0, 0, 0};
    }
}

static_assert(sizeof(ResolverArgs) == 20 * 8, "ResolverArgs layout is part of the C ABI");
static_assert(sizeof(RowCopyArgs) == 9 * 8, "RowCopyArgs layout is part of the C ABI");
static_assert(sizeof(SparseMlaArgs) == 12 * 8, "SparseMlaArgs layout is part of the C ABI");
static_assert(sizeof(StepResolveArgs) == 38 * 8, "StepResolveArgs layout is part of the C ABI");
static_assert(sizeof(LaunchPlan) == 5 * 8, "LaunchPlan layout is part of the C ABI");

} // namespace dhisparse
