// C ABI of the CPU library `libdhisparse_cpu.so` (loaded by backend/dhisparse/native.py through ctypes).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

//! Bumped whenever a signature or a layout below changes.
#define DHS_CPU_ABI_VERSION 1

//! Columns of `summary` rows.
#define DHS_SUMMARY_STATUS 0
#define DHS_SUMMARY_NUM_UNION 1
#define DHS_SUMMARY_NUM_COPIES 2
#define DHS_SUMMARY_DIRECT 3
#define DHS_SUMMARY_HOT 4
#define DHS_SUMMARY_HOST 5
#define DHS_SUMMARY_COLUMNS 6

int32_t dhs_cpu_abi_version(void);

//! Resolves R (request, source) rows of one decode step (see plugins/common/include/dhisparse/resolver.h).
//!   selection      [R, n]  positions (Q x K flattened; negative = padding)
//!   meta           [R, 5]  num_rows, tail_start, tail_location, hot_location, step
//!   page_locations [R, P]  device row of each page's first row, -1 when the page is not ready on device
//!   hot_positions  [R, B]  in/out: position held by each hot slot, -1 = empty
//!   hot_last_use   [R, B]  in/out: LRU stamp of each slot, -1 = never used
//!   locations      [R, n]  out: device row of each selection entry, -1 for padding
//!   copy_positions [R, n]  out: host positions to copy, ascending, -1 padded
//!   copy_locations [R, n]  out: destination device row of each copy, -1 padded
//!   summary        [R, 6]  out: status, num_union, num_copies, direct, hot, host
//! Returns 0 when every row resolved, else the first non-zero row status (that row's state is untouched).
int32_t dhs_resolve_batch_i64(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int64_t page_rows, int64_t const* selection, int64_t const* meta, int64_t const* page_locations,
    int64_t* hot_positions, int64_t* hot_last_use, int64_t* locations, int64_t* copy_positions,
    int64_t* copy_locations, int32_t* summary);

//! Same with int32 indices (the layout of the TensorRT resolver plugin).
int32_t dhs_resolve_batch_i32(int64_t num_sources, int64_t n_select, int64_t num_pages, int64_t hot_rows,
    int32_t page_rows, int32_t const* selection, int32_t const* meta, int32_t const* page_locations,
    int32_t* hot_positions, int32_t* hot_last_use, int32_t* locations, int32_t* copy_positions,
    int32_t* copy_locations, int32_t* summary);

//! Thread blocks the CUDA gather copy uses for a batch of `batch` requests (4..32).
int32_t dhs_copy_grid_blocks(int64_t batch);

#ifdef __cplusplus
}
#endif
