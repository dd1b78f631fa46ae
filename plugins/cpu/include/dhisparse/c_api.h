// C ABI of the CPU library `libdhisparse_cpu.so` (loaded by backend/dhisparse/native.py through ctypes).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

//! Bumped whenever a signature or a layout below changes.
#define DHS_CPU_ABI_VERSION 5

//! Columns of `summary` rows (dhisparse::SummaryColumn).
#define DHS_SUMMARY_STATUS 0
#define DHS_SUMMARY_NUM_UNION 1
#define DHS_SUMMARY_NUM_COPIES 2
#define DHS_SUMMARY_DIRECT 3
#define DHS_SUMMARY_HOT 4
#define DHS_SUMMARY_HOST 5
#define DHS_SUMMARY_COLUMNS 6

int32_t dhs_cpu_abi_version(void);

//! Resolves R (request, source) rows of one decode step with the contract of
//! backend/dhisparse/kv/resolver.py (see plugins/common/include/dhisparse/resolver.h).
//!   positions     [R, N]  selected positions (all queries concatenated); negative = unused
//!   page_table    [R, M]  arena page of each page (tail or ready optional page), -1 otherwise
//!   hot_pos       [R, B]  in/out: position held by each slot, -1 = empty
//!   hot_stamp     [R, B]  in/out: stamp of each slot's last use
//!   hot_loc       [R, B]  arena row of each slot
//!   locations     [R, N]  out: arena row of each entry, -1 where unused
//!   steps         [R, N]  out (int8): 0 unused, 1 direct, 2 hot, 3 host copy
//!   copy_position [R, N]  out: positions to copy from host, ascending, -1 padded
//!   copy_slot     [R, N]  out: hot slot of each copy, -1 padded
//!   copy_location [R, N]  out: arena row of each copy, -1 padded
//!   summary       [R, 6]  out (int32): status, num_union, num_copies, direct, hot, host
//! Returns 0 when every row resolved, -1 for bad sizes, else the first non-zero row status (that row's
//! hot_pos / hot_stamp are untouched; other rows are resolved).
int32_t dhs_resolve_batch_i64(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int64_t page_rows, int64_t stamp, int64_t const* positions, int64_t const* page_table, int64_t* hot_pos,
    int64_t* hot_stamp, int64_t const* hot_loc, int64_t* locations, int8_t* steps, int64_t* copy_position,
    int64_t* copy_slot, int64_t* copy_location, int32_t* summary);

//! Same with int32 indices (the layout of the TensorRT resolver plugin).
int32_t dhs_resolve_batch_i32(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int32_t page_rows, int32_t stamp, int32_t const* positions, int32_t const* page_table, int32_t* hot_pos,
    int32_t* hot_stamp, int32_t const* hot_loc, int32_t* locations, int8_t* steps, int32_t* copy_position,
    int32_t* copy_slot, int32_t* copy_location, int32_t* summary);

//! Arguments of dhs_resolve_step_i64: one KV step's resolution of G sources selected by the same positions
//! (an index group, or one source), reading and updating the step's state where it lives. All int64; the last
//! dimension of every strided [rows, sources, width] tensor is contiguous.
typedef struct DhsStepArgs
{
    int64_t batch;          //!< B requests
    int64_t n;              //!< N selections per request (all queries concatenated)
    int64_t groups;         //!< G sources
    int64_t hot_rows;       //!< H hot-cache slots per (request, source)
    int64_t page_rows;      //!< P rows per page (arena and host store)
    int64_t stamp;          //!< this step's stamp
    int64_t num_pages;      //!< M pages of the page-table snapshot
    int64_t host_num_pages; //!< pages of host_pages' last dimension
    int64_t num_sources;    //!< S (every sources[g] must be below it)
    int64_t num_slots;      //!< rows of the hot state and host_pages (every slots[b] must be below it)
    int64_t direct_only;    //!< 1: page-table lookups only (a step whose whole history is direct), hot state untouched
    int64_t table_row_stride, table_source_stride;  //!< of page_table (rows: the step's requests)
    int64_t hot_slot_stride, hot_source_stride;     //!< of hot_pos / hot_stamp / hot_loc (rows: slots)
    int64_t host_slot_stride, host_source_stride;   //!< of host_pages (rows: slots)
    int64_t counts_row_stride;                      //!< of counts
    int64_t const* positions;   //!< [B, N] selected positions, negative = unused
    int64_t const* lengths;     //!< [B] history length of each request (every position must be below it)
    int64_t const* sources;     //!< [G] source index of each group member
    int64_t const* slots;       //!< [B] batch-state row (slot) of each request
    int64_t const* page_table;  //!< [B, S, M] the step's page-table snapshot
    int64_t* hot_pos;           //!< [slots, S, H] in/out
    int64_t* hot_stamp;         //!< [slots, S, H] in/out
    int64_t const* hot_loc;     //!< [slots, S, H]
    int64_t const* host_pages;  //!< [slots, S, host_num_pages] host page ids (-1: none), or NULL (no host store)
    int64_t* locations;         //!< [G, B, N] out: arena row of each entry, -1 where unused
    int64_t* fetch_src;         //!< [G, B * N] out: host rows to copy, compacted per source
    int64_t* fetch_dst;         //!< [G, B * N] out: arena rows they go to
    int64_t* fetch_count;       //!< [G] out: copies of each source
    int64_t* counts;            //!< [B, 3] in/out: direct / hot / host rows added per request
    int64_t staging_rows;       //!< T verification staging rows per (slot, staging slot); 0: no staging
    int64_t staging_count;      //!< staging slots per batch-state slot (every staging_slots[g] must be below it)
    int64_t staging_slot_stride, staging_group_stride;  //!< of staging_loc (rows: slots)
    int64_t const* staging_slots;  //!< [G] staging slot of each group member (ignored when T is 0)
    int64_t const* staging_loc;    //!< [slots, staging slots, T] arena rows of verification staging, or NULL
    int64_t* staged;               //!< [B] in/out: rows copied into staging added per request (NULL when T is 0)
} DhsStepArgs;

//! Flags returned by dhs_resolve_step_i64 (or -1 for bad sizes, a source or a slot out of range).
#define DHS_STEP_BAD_POSITION 1       //!< a position at or past its length: nothing resolved, locations -1
#define DHS_STEP_HOT_CACHE_OVERFLOW 2 //!< a row missed more than its hot cache can take: its state untouched
#define DHS_STEP_NO_HOST_COPY 4       //!< a missed row has no host page (not copied)
#define DHS_STEP_UNMAPPED 8           //!< direct_only: a selected position's page is not mapped (location -1)

//! Resolves the sources args->sources of one step with the contract of resolve_source (resolver.h) per
//! (request, source), hot state updated in place, copy lists as host -> arena rows. With direct_only, step 1
//! alone: each entry's page-table location, the distinct valid positions counted as direct, no copies.
int32_t dhs_resolve_step_i64(DhsStepArgs const* args);

//! Arguments of dhs_step_setup_i64: the per-step values of one KV step computed from the batch state (all int64;
//! strided [slots, X, width] tensors with a contiguous last dimension).
typedef struct DhsSetupArgs
{
    int64_t batch;            //!< B requests
    int64_t query_len;        //!< Q new tokens each
    int64_t num_sources;      //!< S
    int64_t indexers;         //!< L indexer layers
    int64_t page_rows;        //!< P
    int64_t keys_per_page;    //!< keys per key page (>= 1)
    int64_t width;            //!< pages per request in the snapshot (<= table_pages)
    int64_t num_slots;        //!< rows of the batch state
    int64_t table_pages;      //!< page_table's last dimension
    int64_t key_blocks;       //!< key_pages' last dimension
    int64_t table_slot_stride, table_source_stride;  //!< of page_table
    int64_t key_slot_stride, key_layer_stride;       //!< of key_pages
    int64_t const* starts;    //!< [B] position of each request's first new token
    int64_t const* slots;     //!< [B] batch-state row of each request
    int64_t const* page_table;  //!< [slots, S, table_pages]
    int64_t const* key_pages;   //!< [slots, L, key_blocks] (may be NULL when L == 0)
    int64_t* out;             //!< 2B + B*S*width + S*B*Q + L*B*Q + B*Q values, in this order: starts, lengths,
                              //!< the page-table snapshot [B, S, width], the new tokens' arena rows [S, B, Q]
                              //!< (0 where unmapped), their key pages [L, B, Q] and offsets in the page [B, Q]
} DhsSetupArgs;

//! Fills args->out (see DhsSetupArgs). Returns 0, DHS_STEP_UNMAPPED when a new token's page is not mapped in the
//! snapshot, or -1 for bad sizes (a slot, page or key block out of range).
int32_t dhs_step_setup_i64(DhsSetupArgs const* args);

//! Thread blocks the CUDA gather copy uses for a batch of `batch` requests (4..32).
int32_t dhs_copy_grid_blocks(int64_t batch);

//! Launch contract of plugins/common/include/dhisparse/launch.h (the structs the CUDA launchers take).
#define DHS_LAUNCH_RESOLVER 0
#define DHS_LAUNCH_ROW_COPY 1
#define DHS_LAUNCH_SPARSE_MLA 2
#define DHS_LAUNCH_PLAN 3
#define DHS_LAUNCH_STEP_RESOLVER 4

//! Writes sizeof(struct) then the offset of every named field (declaration order) into out[0..cap); returns
//! how many values there are (-1: unknown kind).
int32_t dhs_launch_layout(int32_t kind, int64_t* out, int32_t cap);
//! Reads the struct at `args` as the C++ launcher does and writes every named field as int64 (pointers as
//! addresses, softmax_scale as its float bits); returns how many values there are.
int32_t dhs_launch_fields(int32_t kind, void const* args, int64_t* out, int32_t cap);
//! The launch plan (dhisparse::LaunchPlan, 40 bytes) of the struct at `args`; returns plan.status.
int32_t dhs_launch_plan(int32_t kind, void const* args, void* plan);
//! Runs the CUDA kernel of a resolver launch (DHS_LAUNCH_RESOLVER or DHS_LAUNCH_STEP_RESOLVER) on the CPU: every
//! block of the plan's grid in turn with one thread (dhisparse::SerialBlock), over host memory at the struct's
//! pointers. Returns the plan's status (0 also for an empty launch).
int32_t dhs_emulate_launch(int32_t kind, void const* args);

#ifdef __cplusplus
}
#endif
