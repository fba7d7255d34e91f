// What the host glue and every rerope kernel (SIMT and tensor-core, dense and paged) share: the launch
// parameters (ReropeParams), the paged launch's per-request and per-block records, the row plan, the
// block geometry and the launchers' status convention. Free of kernels and of torch.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_math.h"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

// One request of a paged launch, as the schedule kernel validated it: its query rows
// [q_begin, q_begin + q_len) of the packed T, its keys 0 .. seq_len - 1, whether its metadata
// would make the kernel read outside the cache or q (then its rows are NaN; see
// rerope_paged_schedule_kernel), where its rows run (tensor_core: kPagedSimt, kPagedTcPreRotated or
// kPagedTcRotating), and, on the SIMT body, the keys of each of its key splits (a multiple of
// kBlockK: its own length over the launch's splits, rerope_paged_keys_per_split).
struct PagedRequest {
  int q_begin, q_len, seq_len, poisoned, tensor_core, keys_per_split;
};
// PagedRequest::tensor_core: the SIMT body; the tensor-core prefill over keys the pre-pass rotated into
// the workspace; the tensor-core prefill rotating its key tiles from the pages in shared memory.
constexpr int kPagedSimt = 0, kPagedTcPreRotated = 1, kPagedTcRotating = 2;
// One block's share of a paged launch: rows block (query_block, head_block) of request `request`
// (-1: past the launch's work, the block exits). Tensor-core tasks: (request, query block of 64).
struct PagedTask {
  int request, query_block, head_block, unused;
};

// Everything a launch needs. Strides are in elements, last dim unit-stride.
struct ReropeParams {
  const void* q = nullptr;  // [B, Hq, Lq, D]
  const void* k = nullptr;  // [B, Hkv, Lk, D]
  const void* v = nullptr;  // [B, Hkv, Lk, D]
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_l = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_l = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_l = 0;
  const int64_t* q_positions = nullptr;  // [B, Lq], contiguous
  const int64_t* k_positions = nullptr;  // [B, Lk], contiguous
  const float* inv_freq = nullptr;       // [rotary_pairs]
  // The keys' turn rates (turn_angles.h), [rows, rotary_pairs] with rows = requests when inv_freq_stride
  // != 0 (paged: a table per request), else 1: written by rerope_key_rates_kernel at the start of every
  // launch that rotates keys, so that no key angle needs FP64.
  KeyRate* key_rates = nullptr;
  void* k_near = nullptr;  // prefill: keys rotated at p, [B, Hkv, Lk, D] (float; T for the tensor-core prefill)
  void* k_far = nullptr;   // prefill, Leaky: keys rotated at p/k, the same layout and type
  float* q_rotation = nullptr;  // tensor-core prefill: [B, Lq, rotary_pairs] x (sin, cos near; sin, cos far)
  void* out = nullptr;                   // [B, Hq, Lq, D], contiguous
  float* lse = nullptr;                  // [B, Hq, Lq]
  float* partial_out = nullptr;          // decode splits: float [splits, B, Hq, Lq, D]
  float* partial_lse = nullptr;          // decode splits: [splits, B, Hq, Lq]
  int batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, k_len = 0, head_dim = 0, rotary_pairs = 0;
  RegionRule rule;  // ReRoPE / Leaky ReRoPE, Self-Extend or Dual Chunk (rerope_math.h)
  int64_t logn_length = 0;
  double inv_log_train = 0.0;
  float scale = 1.0f;
  bool causal = true, interleaved = false;
  // Launch plan (set by the launchers).
  int queries_per_block = 0, heads_per_block = 0, num_splits = 1, keys_per_split = 0;
  // rerope_attention_paged (PagedProblem): q [T, Hq, D] with q_stride_l the token stride and q_len = T,
  // batch = 1 (so the output rows [T, Hq] are the dense rows of one batch row); k / v are the caches
  // [num_blocks, Hkv, block_size, D] with k_stride_b the page stride and k_stride_l the slot stride.
  const int* block_table = nullptr;      // [requests, max_blocks], contiguous
  const int* seq_lens = nullptr;         // [requests]
  const int* query_start_loc = nullptr;  // [requests + 1]
  const float* scale_factors = nullptr;  // [requests] or null (1)
  int64_t inv_freq_stride = 0;           // rotary_pairs when inv_freq has a row per request, else 0
  int requests = 0, num_blocks = 0, block_size = 0, max_blocks = 0;
  PagedRequest* paged_requests = nullptr;  // workspace [requests], written by the schedule kernel
  // Workspace [requests, paged_page_chunks]: 1 where a chunk of kPagedValidatePages entries of a request's
  // block-table row names a page outside the cache (rerope_paged_prepare_kernel), read by the schedule.
  int* paged_page_flags = nullptr;
  int paged_page_chunks = 0;
  PagedTask* paged_tasks = nullptr;        // workspace [num_paged_tasks], written by the schedule kernel
  int* paged_task_offsets = nullptr;              // workspace [requests + 1]
  int num_paged_tasks = 0;                        // the grid's upper bound of (request, row block) tasks
  // The tensor-core prefill of paged requests (fp16/bf16; rerope_attention_tc.cuh): with paged_tc, every
  // valid request with more than kPagedDecodeMaxQueries rows runs there; those whose keys, in order, fit
  // the pre-pass budget over keys it rotated into k_near / k_far, the others rotating their key tiles
  // from the pages inside the kernel (no workspace, any length).
  bool paged_tc = false;               // the tensor-core rows exist (else every row on the SIMT body)
  int64_t paged_tc_key_budget = 0;     // keys the pre-pass may rotate (0: every tensor-core row rotates in-kernel)
  int* paged_tc_key_offsets = nullptr;  // workspace [requests + 1]: request r's rotated keys start at row offset[r]
  PagedTask* paged_tc_tasks = nullptr;  // workspace [num_paged_tc_tasks]: (request, query block of 64)
  int num_paged_tc_tasks = 0;           // the tensor-core grid's upper bound of tasks
};

// Rows of a block for a problem with q_len query rows and a GQA group of `group` q heads per kv head
// on `rows` rows per block: the query rows of as many heads of the group as fit (decode packs the
// heads of a group into one block so that they share each rotated key tile), else rows of one head.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rerope_rows_plan(int q_len, int group, int rows, int* queries_per_block,
                                                             int* heads_per_block) {
  *queries_per_block = q_len < rows ? (q_len > 0 ? q_len : 1) : rows;
  const int heads = rows / *queries_per_block;
  *heads_per_block = group < heads ? group : heads;
}
// Blocks of that plan: query blocks x head blocks.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int64_t rerope_rows_plan_blocks(int q_len, int group, int rows) {
  if (q_len <= 0) return 0;
  int queries_per_block, heads_per_block;
  rerope_rows_plan(q_len, group, rows, &queries_per_block, &heads_per_block);
  return (static_cast<int64_t>(q_len) + queries_per_block - 1) / queries_per_block *
         ((group + heads_per_block - 1) / heads_per_block);
}

// Every attention kernel, SIMT and tensor-core, runs blocks of kWarps warps.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;

// A launcher calls check(status, what) after every launch and after every shared-memory opt-in, with
// the CUDA status (0 = ok). The caller's check must not return on an error (it throws), so that no
// kernel reads the output of a failed one. The emulation throws from the launch itself.
struct IgnoreLaunchStatus {
  void operator()(int, const char*) const {}
};

}  // namespace ropescale::rerope_cuda
