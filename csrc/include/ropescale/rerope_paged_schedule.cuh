// The schedule of a rerope_attention_paged launch (rerope_attention.cuh): the prepare kernel (page
// checks, key turn rates) and the schedule kernel that turns the device-side metadata into the task
// lists of the SIMT and the tensor-core kernels.
//
// No host sync: the schedule kernel turns the device-side metadata (query_start_loc, seq_lens,
// block_table) into task lists whose lengths the host bounds from the sizes alone; the grids are
// those bounds, and the blocks past the last task exit at once. Rows of requests with at most
// kPagedDecodeMaxQueries queries (decode), and every row of an fp32 launch, run the SIMT decode body
// (rows of a GQA group packed per block, keys split over the grid and rotated in shared memory tile
// by tile, only the tiles that need it), with each request's own positions (key slot j at j, query i
// at seq_len - q_len + i), rotation table and softmax scale; splits > 1 are merged by
// rerope_combine_kernel, as for dense decode. For fp16/bf16 at the tensor-core head dims, the other
// requests (prefill, chunked prefill) run on the tensor-core prefill (rerope_attention_tc.cuh,
// launch_rerope_paged_tc, after this launch), at any length: over keys its pre-pass rotates through the
// block table into a workspace while their keys fit its budget (ReropeParams::paged_tc_key_budget), the
// rest rotating their key tiles from the pages inside the kernel.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_paged_plan.h"
#include "ropescale/rerope_params.h"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

constexpr int kScheduleThreads = 256;
constexpr int kScheduleWarps = kScheduleThreads / 32;

// Exclusive scan over the requests of count(r) by one block of kScheduleThreads: store(r, offset) for
// each, returns the total. `warp_totals`: kScheduleWarps int64 of shared memory.
template <class Count, class Store>
__device__ int64_t schedule_scan(int requests, long long* warp_totals, Count&& count, Store&& store) {
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  long long carry = 0;
  for (int base = 0; base < requests; base += kScheduleThreads) {
    const int r = base + tid;
    const long long value = r < requests ? static_cast<long long>(count(r)) : 0;
    long long inclusive = value;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const long long other = __shfl_up_sync(kFullMask, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    long long warp_base = 0, chunk_total = 0;
    for (int w = 0; w < kScheduleWarps; ++w) {
      warp_base += w < warp ? warp_totals[w] : 0;
      chunk_total += warp_totals[w];
    }
    if (r < requests) store(r, carry + warp_base + inclusive - value);
    carry += chunk_total;
    __syncthreads();  // warp_totals is rewritten by the next chunk
  }
  return carry;
}

// Block-table entries one block of the prepare kernel checks, and the chunks of a row of max_blocks.
constexpr int kPagedValidateThreads = 256;
constexpr int kPagedValidatePages = 4 * kPagedValidateThreads;
inline int rerope_paged_page_chunks(int max_blocks) {
  return (max_blocks + kPagedValidatePages - 1) / kPagedValidatePages;
}

// The first kernel of a paged launch, two jobs over one grid (one launch less per layer):
//  * blocks [0, requests * paged_page_chunks): block (r, c) checks chunk c of request r's block-table row,
//    the entries of the pages its keys occupy (ceil(seq_len / block_size), clamped to the row), against
//    [0, num_blocks), and stores 1 in paged_page_flags[r * chunks + c] when one is outside, else 0. Spread
//    over the GPU, the check of the whole table costs one read of it at memory bandwidth, where the single
//    schedule block reading it entry by entry took ~1 ms at 256 requests x 8k pages, at every layer.
//  * the other `rate_blocks` blocks: the keys' turn rates, as rerope_key_rates_kernel.
template <int kThreadsPerBlock>
__global__ void __launch_bounds__(kThreadsPerBlock) rerope_paged_prepare_kernel(const ReropeParams p, int rate_blocks) {
  static_assert(kThreadsPerBlock == kPagedValidateThreads, "4 entries per thread");
  const int64_t validate_blocks = static_cast<int64_t>(p.requests) * p.paged_page_chunks;
  const int64_t block = blockIdx.x;
  if (block < validate_blocks) {  // uniform over the block
    const int r = static_cast<int>(block / p.paged_page_chunks), chunk = static_cast<int>(block % p.paged_page_chunks);
    const int seq_len = p.seq_lens[r];
    const int64_t pages_all = seq_len > 0 ? (static_cast<int64_t>(seq_len) + p.block_size - 1) / p.block_size : 0;
    const int pages = static_cast<int>(pages_all < p.max_blocks ? pages_all : p.max_blocks);
    const int first = chunk * kPagedValidatePages;
    const int last = pages < first + kPagedValidatePages ? pages : first + kPagedValidatePages;
    const int* table = p.block_table + static_cast<int64_t>(r) * p.max_blocks;
    bool outside = false;
    for (int i = first + static_cast<int>(threadIdx.x); i < last; i += kThreadsPerBlock)
      outside |= table[i] < 0 || table[i] >= p.num_blocks;
    const int any = __syncthreads_or(outside ? 1 : 0);
    if (threadIdx.x == 0) p.paged_page_flags[block] = any != 0 ? 1 : 0;
    return;
  }
  const int64_t rows = p.inv_freq_stride != 0 ? p.requests : 1;
  const int64_t total = rows * p.rotary_pairs;
  for (int64_t idx = (block - validate_blocks) * kThreadsPerBlock + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(rate_blocks) * kThreadsPerBlock) {
    const int64_t row = idx / p.rotary_pairs;
    const int pair = static_cast<int>(idx % p.rotary_pairs);
    p.key_rates[idx] = key_rate(p.inv_freq[row * p.inv_freq_stride + pair], p.rule.far_key_rotated(),
                                 p.rule.far_key_multiplier());
  }
}

// The schedule of a paged launch: one block, before the attention kernels.
//  1. Each request (a warp each) is validated against what the kernels will read: its query rows inside
//     [0, T), 0 <= q_len <= seq_len <= max_blocks * block_size, and the page of every key slot
//     (block_table[r, 0 .. ceil(seq_len / block_size))) inside [0, num_blocks), which the prepare kernel
//     checked over the whole GPU (this block reads its per-chunk flags). A request that fails
//     is poisoned: its rows (clamped to [0, T)) become NaN (on the SIMT body) and none of its keys is
//     read. This is the CUDA side of the op's value checks, which the CPU kernel makes with an error (a
//     check here would cost a host sync per call). Rows that no request covers (query_start_loc not
//     covering [0, T)) are left unwritten, and so are the tasks past the bounds when bad metadata
//     overlaps requests.
//     Each request's SIMT key-split length follows its own seq_len (rerope_paged_keys_per_split).
//  2. With paged_tc: every valid request of more than kPagedDecodeMaxQueries rows takes the tensor-core
//     prefill: those whose keys, summed in request order over these requests, fit paged_tc_key_budget
//     over keys the pre-pass rotates (kPagedTcPreRotated; their offsets scanned into
//     paged_tc_key_offsets), the others rotating their key tiles from the pages in the kernel
//     (kPagedTcRotating: any length, no workspace); their (request, query block) tasks are written,
//     heaviest block first (paged_tc_tasks, -1 past the last).
//  3. The SIMT row blocks of the other requests (rerope_rows_plan) are counted and scanned into offsets,
//     and the SIMT task list is written: entry e is (request, query block, head block), -1 past the last.
// The per-request tensor_core field is also what the tests read to assert the path each request took.
template <int kRows>
__global__ void __launch_bounds__(kScheduleThreads) rerope_paged_schedule_kernel(const ReropeParams p) {
  ROPESCALE_DYNAMIC_SMEM(long long, warp_totals);  // [kScheduleWarps]
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int group = p.q_heads / p.kv_heads, tokens = p.q_len;
  const int64_t capacity = static_cast<int64_t>(p.max_blocks) * p.block_size;
  for (int r = warp; r < p.requests; r += kScheduleWarps) {
    const int q_begin = p.query_start_loc[r], q_end = p.query_start_loc[r + 1], seq_len = p.seq_lens[r];
    bool poisoned = q_begin < 0 || q_end > tokens || q_end < q_begin || seq_len < 0 || seq_len > capacity ||
                    q_end - q_begin > seq_len;
    if (!poisoned) {  // warp-uniform
      const int pages = static_cast<int>((static_cast<int64_t>(seq_len) + p.block_size - 1) / p.block_size);
      const int chunks = (pages + kPagedValidatePages - 1) / kPagedValidatePages;
      const int* flags = p.paged_page_flags + static_cast<int64_t>(r) * p.paged_page_chunks;
      bool outside = false;
      for (int c = lane; c < chunks; c += 32) outside |= flags[c] != 0;
      poisoned = __any_sync(kFullMask, outside);
    }
    if (lane == 0) {
      const int lo = q_begin < 0 ? 0 : (q_begin > tokens ? tokens : q_begin);
      const int hi = q_end < lo ? lo : (q_end > tokens ? tokens : q_end);
      const int keys_per_split = poisoned ? 0 : rerope_paged_keys_per_split(seq_len, p.num_splits);
      p.paged_requests[r] = PagedRequest{lo, hi - lo, seq_len, poisoned ? 1 : 0, kPagedSimt, keys_per_split};
    }
  }
  __syncthreads();
  if (p.paged_tc) {
    // The candidates' keys in request order: a candidate's keys are pre-rotated while the running sum is
    // within budget; past it, the kernel rotates them itself.
    const auto candidate = [&](int r) {
      const PagedRequest& q = p.paged_requests[r];
      return !q.poisoned && q.q_len > kPagedDecodeMaxQueries;
    };
    schedule_scan(p.requests, warp_totals, [&](int r) { return candidate(r) ? p.paged_requests[r].seq_len : 0; },
                  [&](int r, long long before) {
                    if (!candidate(r)) return;
                    p.paged_requests[r].tensor_core =
                        before + p.paged_requests[r].seq_len <= p.paged_tc_key_budget ? kPagedTcPreRotated
                                                                                       : kPagedTcRotating;
                  });
    __syncthreads();
    const auto tc_keys = [&](int r) {
      return p.paged_requests[r].tensor_core == kPagedTcPreRotated ? p.paged_requests[r].seq_len : 0;
    };
    const int64_t keys_total = schedule_scan(p.requests, warp_totals, tc_keys, [&](int r, long long before) {
      p.paged_tc_key_offsets[r] = static_cast<int>(before);
    });
    if (tid == 0) p.paged_tc_key_offsets[p.requests] = static_cast<int>(keys_total);
    // Each request writes its own tasks (its last query block first: it sees the most keys).
    const auto tc_blocks = [&](int r) {
      const PagedRequest& q = p.paged_requests[r];
      return q.tensor_core != kPagedSimt ? (q.q_len + kPagedTcQueries - 1) / kPagedTcQueries : 0;
    };
    const int64_t tc_total = schedule_scan(p.requests, warp_totals, tc_blocks, [&](int r, long long before) {
      const int blocks = tc_blocks(r);
      for (int i = 0; i < blocks && before + i < p.num_paged_tc_tasks; ++i)
        p.paged_tc_tasks[before + i] = PagedTask{r, blocks - 1 - i, 0, 0};
    });
    for (int64_t e = tc_total + tid; e < p.num_paged_tc_tasks; e += kScheduleThreads)
      p.paged_tc_tasks[e] = PagedTask{-1, 0, 0, 0};
  }
  // The SIMT row blocks of the other requests.
  const int64_t simt_total =
      schedule_scan(p.requests, warp_totals,
                    [&](int r) {
                      const PagedRequest& q = p.paged_requests[r];
                      return q.tensor_core != kPagedSimt ? int64_t{0} : rerope_rows_plan_blocks(q.q_len, group, kRows);
                    },
                    [&](int r, long long before) {
                      p.paged_task_offsets[r] =
                          static_cast<int>(before < p.num_paged_tasks ? before : p.num_paged_tasks);
                    });
  const int total = static_cast<int>(simt_total < p.num_paged_tasks ? simt_total : p.num_paged_tasks);
  if (tid == 0) p.paged_task_offsets[p.requests] = total;
  __syncthreads();
  for (int e = tid; e < p.num_paged_tasks; e += kScheduleThreads) {
    PagedTask task{-1, 0, 0, 0};
    if (e < total) {  // the last request whose offset is <= e (requests without rows share the next one's)
      int lo = 0, hi = p.requests - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (p.paged_task_offsets[mid] <= e) lo = mid;
        else hi = mid - 1;
      }
      int queries_per_block, heads_per_block;
      const int q_len = p.paged_requests[lo].q_len;
      rerope_rows_plan(q_len, group, kRows, &queries_per_block, &heads_per_block);
      const int query_blocks = (q_len + queries_per_block - 1) / queries_per_block;
      const int local = e - p.paged_task_offsets[lo];
      task = PagedTask{lo, local % query_blocks, local / query_blocks, 0};
    }
    p.paged_tasks[e] = task;
  }
}

}  // namespace ropescale::rerope_cuda
