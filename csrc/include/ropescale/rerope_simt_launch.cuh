// Host launchers of the SIMT kernels (rerope_attention.cuh): the tile shape for a head dim and a
// device, the dense prefill and decode plans, and the paged launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_key_prepass.cuh"
#include "ropescale/rerope_paged_plan.h"
#include "ropescale/rerope_paged_schedule.cuh"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_simt_kernels.cuh"
#include "ropescale/rerope_simt_tiles.cuh"

namespace ropescale::rerope_cuda {

// Calls f.template operator()<Shape>() with the SIMT tile shape for `head_dim` on a device whose
// blocks may opt in to `smem_per_block_optin` bytes of shared memory (cudaDevAttrMaxSharedMemoryPerBlockOptin,
// static + dynamic): the wide tiles where they fit (every bucket on sm_80/87/90/100, the 64 and 128
// buckets everywhere from sm_80 on), the compact 256 tiles on the 99 KiB parts (sm_86/89/120).
// Returns 0, or the bytes the smallest shape would need when none fits (f not called).
template <class F>
inline std::size_t with_simt_shape(int head_dim, std::size_t smem_per_block_optin, F&& f) {
  const auto run = [&]<class Shape>() -> std::size_t {
    if (Shape::kSmemBytes > smem_per_block_optin) return Shape::kSmemBytes;
    f.template operator()<Shape>();
    return 0;
  };
  if (head_dim <= 64) return run.template operator()<TileShape<64>>();
  if (head_dim <= 128) return run.template operator()<TileShape<128>>();
  if (TileShape<256>::kSmemBytes <= smem_per_block_optin) return run.template operator()<TileShape<256>>();
  return run.template operator()<TileShape<256, true>>();
}

// Grid y of the prefill and of the decode plan (query blocks x head blocks): must be <= 65535.
template <class Shape>
inline int64_t rerope_prefill_grid_y(const ReropeParams& p) {
  return (static_cast<int64_t>(p.q_len) + Shape::kRows - 1) / Shape::kRows * (p.q_heads / p.kv_heads);
}
template <class Shape>
inline int64_t rerope_decode_grid_y(const ReropeParams& p) {
  return rerope_rows_plan_blocks(p.q_len, p.q_heads / p.kv_heads, Shape::kRows);
}

// Prefill plan: one block per (Shape::kRows queries of one head); keys rotated once by the pre-pass
// into p.k_near (and p.k_far for Leaky), which the caller allocates: float [B, Hkv, Lk, D] each, and
// p.key_rates: KeyRate [rotary_pairs].
template <typename T, class Shape, class Check = IgnoreLaunchStatus>
inline void launch_rerope_prefill(ReropeParams p, cudaStream_t stream, Check&& check = {}) {
  launch_rerope_key_rates(p, stream, check);
  const int64_t rotate_items = static_cast<int64_t>(p.batch) * p.k_len * (p.head_dim / 2);
  const int64_t rotate_blocks = (rotate_items + 255) / 256 < 65535 ? (rotate_items + 255) / 256 : 65535;
  if (rotate_items > 0) {
    ROPESCALE_LAUNCH_KERNEL((rerope_rotate_keys_kernel<T, float>), dim3(static_cast<unsigned>(rotate_blocks)),
                            dim3(256), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the rotate-keys kernel");
  }
  p.queries_per_block = Shape::kRows;
  p.heads_per_block = 1;
  p.num_splits = 1;
  p.keys_per_split = p.k_len;
  const int query_blocks = (p.q_len + Shape::kRows - 1) / Shape::kRows;
  const dim3 grid(1, static_cast<unsigned>(query_blocks * (p.q_heads / p.kv_heads)),
                  static_cast<unsigned>(p.batch * p.kv_heads));
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_prefill_kernel<T, Shape>), Shape::kSmemBytes),
        "the shared-memory opt-in of the prefill kernel");
  ROPESCALE_LAUNCH_KERNEL((rerope_prefill_kernel<T, Shape>), grid, dim3(kThreads), Shape::kSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the prefill kernel");
}

// How many key splits a decode launch uses: enough blocks for ~2 waves on `multiprocessors` SMs,
// at least 4 key tiles per split. Splits > 1 need p.partial_out / p.partial_lse.
template <class Shape>
inline int rerope_decode_splits(const ReropeParams& p, int multiprocessors) {
  const int64_t blocks =
      static_cast<int64_t>(p.batch) * p.kv_heads * rerope_rows_plan_blocks(p.q_len, p.q_heads / p.kv_heads, Shape::kRows);
  const int64_t max_splits = (p.k_len + 4 * kBlockK - 1) / (4 * kBlockK);
  int64_t splits = (2 * static_cast<int64_t>(multiprocessors) + blocks - 1) / blocks;
  splits = splits < max_splits ? splits : max_splits;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

// Decode plan: the query rows of every head of a GQA group share a block (and each rotated key
// tile); keys split `num_splits` ways, merged by rerope_combine_kernel when num_splits > 1. The caller
// allocates p.key_rates: KeyRate [rotary_pairs].
template <typename T, class Shape, class Check = IgnoreLaunchStatus>
inline void launch_rerope_decode(ReropeParams p, int num_splits, cudaStream_t stream, Check&& check = {}) {
  launch_rerope_key_rates(p, stream, check);
  const int group = p.q_heads / p.kv_heads;
  rerope_rows_plan(p.q_len, group, Shape::kRows, &p.queries_per_block, &p.heads_per_block);
  const int tiles = (p.k_len + kBlockK - 1) / kBlockK;
  const int tiles_per_split = (tiles + num_splits - 1) / num_splits;
  p.keys_per_split = tiles_per_split * kBlockK;
  p.num_splits = (p.k_len + p.keys_per_split - 1) / p.keys_per_split;
  const int query_blocks = (p.q_len + p.queries_per_block - 1) / p.queries_per_block;
  const int head_blocks = (group + p.heads_per_block - 1) / p.heads_per_block;
  const dim3 grid(static_cast<unsigned>(p.num_splits), static_cast<unsigned>(query_blocks * head_blocks),
                  static_cast<unsigned>(p.batch * p.kv_heads));
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_decode_kernel<T, Shape>), Shape::kSmemBytes),
        "the shared-memory opt-in of the decode kernel");
  ROPESCALE_LAUNCH_KERNEL((rerope_decode_kernel<T, Shape>), grid, dim3(kThreads), Shape::kSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the decode kernel");
  if (p.num_splits > 1) {
    const int64_t rows_total = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
    ROPESCALE_LAUNCH_KERNEL(rerope_combine_kernel<T>, dim3(static_cast<unsigned>((rows_total + kWarps - 1) / kWarps)),
                            dim3(kThreads), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the split-combine kernel");
  }
}

// Key splits of a paged launch (rerope_paged_split_count with this tile shape's rows per block).
template <class Shape>
inline int rerope_paged_splits(const ReropeParams& p, int multiprocessors) {
  return rerope_paged_split_count(p.q_len, p.requests, p.q_heads, p.kv_heads, Shape::kRows,
                                  static_cast<int64_t>(p.max_blocks) * p.block_size, multiprocessors);
}

// The paged launch. The caller sets the paged fields of p (q_len = T, batch = 1, the cache strides,
// the metadata pointers; paged_tc and the tensor-core fields when launch_rerope_paged_tc follows) and
// allocates the workspaces: p.key_rates [rerope_key_rate_rows(p), rotary_pairs], p.paged_page_flags
// [requests, rerope_paged_page_chunks(max_blocks)], p.paged_requests [requests], p.paged_task_offsets
// [requests + 1], p.paged_tasks [rerope_paged_max_tasks(T, requests,
// group, Shape::kRows)] (p.num_paged_tasks), and, when num_splits > 1, p.partial_out float [num_splits, T,
// Hq, D] and p.partial_lse [num_splits, T, Hq] (num_splits in [1, 65535]: rerope_paged_splits).
template <typename T, class Shape, class Check = IgnoreLaunchStatus>
inline void launch_rerope_paged(ReropeParams p, int num_splits, cudaStream_t stream, Check&& check = {}) {
  p.batch = 1;
  p.causal = true;
  p.num_splits = num_splits < 1 ? 1 : (num_splits > 65535 ? 65535 : num_splits);
  p.keys_per_split = 0;  // per request (PagedRequest::keys_per_split)
  p.paged_page_chunks = rerope_paged_page_chunks(p.max_blocks);
  const int64_t rate_items = rerope_key_rate_rows(p) * p.rotary_pairs;
  const int64_t rate_blocks = (rate_items + kPagedValidateThreads - 1) / kPagedValidateThreads < 1024
                                  ? (rate_items + kPagedValidateThreads - 1) / kPagedValidateThreads
                                  : 1024;
  const int64_t prepare_blocks = static_cast<int64_t>(p.requests) * p.paged_page_chunks + rate_blocks;
  if (prepare_blocks > 0) {
    ROPESCALE_LAUNCH_KERNEL(rerope_paged_prepare_kernel<kPagedValidateThreads>,
                            dim3(static_cast<unsigned>(prepare_blocks)), dim3(kPagedValidateThreads), 0, stream, p,
                            static_cast<int>(rate_blocks));
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged prepare kernel (page checks, key turn rates)");
  }
  ROPESCALE_LAUNCH_KERNEL(rerope_paged_schedule_kernel<Shape::kRows>, dim3(1), dim3(kScheduleThreads),
                          kScheduleWarps * sizeof(long long), stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged schedule kernel");
  if (p.num_paged_tasks == 0) return;
  const dim3 grid(static_cast<unsigned>(p.num_paged_tasks), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(p.kv_heads));
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_paged_kernel<T, Shape>), Shape::kSmemBytes),
        "the shared-memory opt-in of the paged kernel");
  ROPESCALE_LAUNCH_KERNEL((rerope_paged_kernel<T, Shape>), grid, dim3(kThreads), Shape::kSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged attention kernel");
  if (p.num_splits > 1) {
    const int64_t rows_total = static_cast<int64_t>(p.q_heads) * p.q_len;
    ROPESCALE_LAUNCH_KERNEL(rerope_combine_kernel<T>, dim3(static_cast<unsigned>((rows_total + kWarps - 1) / kWarps)),
                            dim3(kThreads), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the split-combine kernel");
  }
}

}  // namespace ropescale::rerope_cuda
