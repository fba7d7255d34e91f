// CUDA kernels of rerope_attention, framework-free (raw pointers, sizes, strides) so that the same
// source compiles with nvcc and, with ROPESCALE_EMULATION, runs on the CPU emulation in CI.
//
// One tile engine, two launch plans:
//   * prefill: rerope_rotate_keys_kernel rotates every key once (near side at p, Leaky far side at
//     p/k) into float buffers; rerope_prefill_kernel then runs one block per (32 queries, head),
//     streaming 32-key tiles of the pre-rotated keys through shared memory.
//   * decode (one or a few query tokens against a long pre-RoPE cache): rerope_decode_kernel packs
//     the query rows of every head of a GQA group into one block, splits the keys over the grid
//     (flash-decoding), rotates in shared memory only the key tiles that need it (ReRoPE: the tiles
//     inside the window; Leaky: every tile, for its far side), and rerope_combine_kernel merges the
//     splits by their log-sum-exp.
// In both, every key tile is classified from its position bounds (rerope_math.h): near and far tiles
// compute one product per score, band tiles (straddling the window edge) both, skipped tiles none;
// the softmax is online (running max and sum per row, fp32 accumulation).
//
// Thread layout: 4 warps; warp w owns the query rows w, w+4, ...; lane j owns key j of a tile for
// the scores and head-dim slots lane, lane+32, ... of the output accumulators for P.V.
//
// Shared memory decides the tile shape (TileShape): the wide tiles hold both sides of a key tile at
// once and fit A100/H100-class parts at every head dim (the 256 bucket needs 135,440 B per block);
// the compact tiles (head dims up to 256 in under 99 KiB, for sm_86/89/120) hold one side at a
// time, so a band tile loads its far side after its near scores, and keep fewer query rows per
// block. with_simt_shape() picks one from the device's sharedMemPerBlockOptin.
//
// Masked keys (causal, padding) never contribute, whatever their K and V hold: their scores are
// replaced by -inf and their (row, key) pairs are skipped in P.V (no 0 * NaN). Visible keys follow
// IEEE arithmetic: a non-finite q, k or v propagates into the row. Whether a row saw a visible key
// is decided by the mask, never by the scores: a row with none gives zeros and lse = -inf.
//
// The same body serves rerope_attention_paged (requests packed along T, raw keys and values read
// through a block table; see "rerope_attention_paged" at the end): a Problem class (DenseProblem,
// PagedProblem) says where a block's rows, keys, values, positions, rotation table and scale are.
//
// These scalar-FMA kernels serve fp32 inputs, head dims the tensor-core prefill does not take, and
// every decode (dense: up to 16 queries; paged: requests of up to 4 rows, and the prefill requests
// past the tensor-core pre-pass's budget). Decode stays here on purpose: one query token against the
// cache reads every key and value once and does about one FLOP per byte read, so it is bound by
// memory bandwidth; tensor cores would raise a compute rate that is not the limit. The fp16/bf16
// prefill runs on tensor cores (rerope_attention_tc.cuh), dense and paged.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ropescale/portable.h"
#include "ropescale/element.h"
#include "ropescale/rerope_math.h"
#include "ropescale/rerope_paged_plan.h"
#include "ropescale/rotary_math.h"
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
  int64_t window = 1, logn_length = 0;
  double leaky_inv = 0.0, inv_log_train = 0.0;
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

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockK = 32;  // keys per tile: one per lane
constexpr unsigned kFullMask = 0xffffffffu;

template <int kHeadDimBucket, bool kCompactTiles = false>
struct TileShape {
  static constexpr int kMaxDim = kHeadDimBucket;
  static constexpr bool kCompact = kCompactTiles;
  static_assert(kMaxDim % 32 == 0 && kMaxDim <= 256, "head dim bucket");
  // Register budget of the accumulators; the compact tiles halve it (fewer rows in shared memory).
  static constexpr int kRowsPerWarp = (kMaxDim <= 128 ? 8 : 4) / (kCompact ? 2 : 1);
  static constexpr int kRows = kWarps * kRowsPerWarp;
  // Key tiles in shared memory: near and far side at once (wide), or one side at a time (compact).
  static constexpr int kKeyTiles = kCompact ? 1 : 2;
  static constexpr int kDimsPerLane = kMaxDim / 32;
  static constexpr int kQStride = kMaxDim;     // rows read as broadcasts
  static constexpr int kKStride = kMaxDim + 4;  // lane j reads row j as float4: +4 spreads the banks
  static constexpr int kVStride = kMaxDim;     // lanes read consecutive dims
  // Dynamic shared memory: in floats, q near/far, k near/far (or one k tile), v, per-row
  // probabilities; then the block's row table (BlockRows) and the positions of the current key tile.
  // Everything is dynamic, so the emulation poisons all of it before each block.
  static constexpr int kSmemFloats =
      2 * kRows * kQStride + kKeyTiles * kBlockK * kKStride + kBlockK * kVStride + kRows * kBlockK;
  static constexpr std::size_t kRowTableBytes = kRows * (2 * sizeof(int) + sizeof(long long) + sizeof(bool));
  static constexpr std::size_t kRowTableOffset = kSmemFloats * sizeof(float);
  static constexpr std::size_t kTilePositionsOffset = (kRowTableOffset + kRowTableBytes + 7) / 8 * 8;
  // The (page, slot) of each key of the current tile, by parity (paged problems only).
  static constexpr std::size_t kTileRowsOffset = kTilePositionsOffset + 2 * kBlockK * sizeof(long long);
  static constexpr std::size_t kSmemBytes = kTileRowsOffset + 2 * kBlockK * 2 * sizeof(int);
  // No static shared memory; the whole block must fit an A100 (163 KiB per block, opted in), and
  // the compact tiles the 99 KiB parts (101,376 B per block).
  static_assert(kSmemBytes <= (kCompact ? 101376u : 166912u), "shared memory above the per-block maximum");
  // Blocks per SM the shared memory allows on an A100 (164 KiB per SM, 1 KiB reserved per block),
  // handed to ptxas through __launch_bounds__: without it, ptxas aims at a higher occupancy than
  // the shared memory allows and spills to get there (CUDA 13: 128 registers and spills at D 128).
  static constexpr int kMinBlocksPerSm =
      167936 / (kSmemBytes + 1024) > 0 ? static_cast<int>(167936 / (kSmemBytes + 1024)) : 1;
};

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Shared-memory views of one block. With the compact tiles k_far is k_near: one side at a time.
template <class Shape>
struct SmemTiles {
  float* q_near;  // [kRows][kQStride]
  float* q_far;   // [kRows][kQStride]
  float* k_near;  // [kBlockK][kKStride]
  float* k_far;   // [kBlockK][kKStride]
  float* v;       // [kBlockK][kVStride]
  float* probs;   // [kRows][kBlockK]; kMaskedProb where the pair is masked

  __device__ explicit SmemTiles(float* base)
      : q_near(base),
        q_far(base + Shape::kRows * Shape::kQStride),
        k_near(base + 2 * Shape::kRows * Shape::kQStride),
        k_far(k_near + (Shape::kKeyTiles - 1) * kBlockK * Shape::kKStride),
        v(k_near + Shape::kKeyTiles * kBlockK * Shape::kKStride),
        probs(v + kBlockK * Shape::kVStride) {}
};

// Marks a masked (row, key) pair in SmemTiles::probs: a probability is never -inf (NaN at worst).
constexpr float kMaskedProb = -INFINITY;

// Rows of one block: which (head, query) each row is, its position, and the block's bounds.
template <class Shape>
struct BlockRows {
  int head[Shape::kRows];
  int query[Shape::kRows];
  long long position[Shape::kRows];
  bool valid[Shape::kRows];
};

// Where a key of the current tile lives in a paged cache.
struct TileRow {
  int page, slot;
};

// What a block works on, and how it addresses it. A problem is one batch row of rerope_attention
// (DenseProblem: explicit positions, [B, H, L, D] tensors, the grid decoded from blockIdx) or one
// request of rerope_attention_paged (PagedProblem: implicit positions, keys and values read through
// the block table, a per-request rotation table and scale, the block's share read from the schedule
// kernel's task list). The kernel body reads q, k, v, positions, the rotation table and the softmax
// scale only through these, so that dense and paged launches run one body.
struct BlockTask {
  int problem = 0, kv_head = 0, split = 0, query_block = 0, head_block = 0;
  int queries_per_block = 1, heads_per_block = 1, q_len = 0, k_len = 0;
  bool active = true;     // false: a paged block past the work (exits at once)
  bool poisoned = false;  // paged: the request's metadata would read outside the cache: NaN rows
};

// Grid: x = key split, y = (query block, head block), z = (batch, kv head).
struct DenseProblem {
  const ReropeParams& p;
  BlockTask task;

  __device__ DenseProblem(const ReropeParams& params, int /*rows per block*/) : p(params) {
    const int query_blocks = (p.q_len + p.queries_per_block - 1) / p.queries_per_block;
    task.split = static_cast<int>(blockIdx.x);
    task.query_block = static_cast<int>(blockIdx.y) % query_blocks;
    task.head_block = static_cast<int>(blockIdx.y) / query_blocks;
    task.problem = static_cast<int>(blockIdx.z) / p.kv_heads;
    task.kv_head = static_cast<int>(blockIdx.z) % p.kv_heads;
    task.queries_per_block = p.queries_per_block;
    task.heads_per_block = p.heads_per_block;
    task.q_len = p.q_len;
    task.k_len = p.k_len;
  }
  __device__ int64_t query_position(int query) const {
    return p.q_positions[static_cast<int64_t>(task.problem) * p.q_len + query];
  }
  __device__ int64_t key_position(int key) const { return p.k_positions[static_cast<int64_t>(task.problem) * p.k_len + key]; }
  __device__ int64_t q_offset(int head, int query) const {
    return task.problem * p.q_stride_b + head * p.q_stride_h + query * p.q_stride_l;
  }
  __device__ int64_t out_row(int head, int query) const {
    return (static_cast<int64_t>(task.problem) * p.q_heads + head) * p.q_len + query;
  }
  __device__ const float* inv_freq() const { return p.inv_freq; }
  __device__ const KeyRate* key_rates() const { return p.key_rates; }
  __device__ int keys_per_split() const { return p.keys_per_split; }
  __device__ float scale() const { return p.scale; }
  __device__ int64_t k_base() const { return task.problem * p.k_stride_b + task.kv_head * p.k_stride_h; }
  __device__ int64_t v_base() const { return task.problem * p.v_stride_b + task.kv_head * p.v_stride_h; }
  __device__ void locate_key(int, TileRow*) const {}  // rows are strided: nothing to look up
  // Element offset (from k_base / v_base) of key j0 + j of the current tile.
  __device__ int64_t k_row(const TileRow*, int j0, int j) const { return static_cast<int64_t>(j0 + j) * p.k_stride_l; }
  __device__ int64_t v_row(const TileRow*, int j0, int j) const { return static_cast<int64_t>(j0 + j) * p.v_stride_l; }
};

// Grid: x = task (rerope_paged_schedule_kernel's list), y = key split, z = kv head.
struct PagedProblem {
  const ReropeParams& p;
  BlockTask task;
  int q_begin = 0, split_keys = 0;

  __device__ PagedProblem(const ReropeParams& params, int rows_per_block) : p(params) {
    const PagedTask t = p.paged_tasks[blockIdx.x];
    task.split = static_cast<int>(blockIdx.y);
    task.kv_head = static_cast<int>(blockIdx.z);
    if (t.request < 0) {
      task.active = false;
      return;
    }
    const PagedRequest request = p.paged_requests[t.request];
    task.problem = t.request;
    task.query_block = t.query_block;
    task.head_block = t.head_block;
    task.q_len = request.q_len;
    task.k_len = request.seq_len;
    task.poisoned = request.poisoned != 0;
    q_begin = request.q_begin;
    split_keys = request.keys_per_split;
    rerope_rows_plan(task.q_len, p.q_heads / p.kv_heads, rows_per_block, &task.queries_per_block,
                     &task.heads_per_block);
  }
  // vLLM's rule: the request's queries are its last q_len tokens; key slot j has position j.
  __device__ int64_t query_position(int query) const { return static_cast<int64_t>(task.k_len) - task.q_len + query; }
  __device__ int64_t key_position(int key) const { return key; }
  __device__ int64_t q_offset(int head, int query) const {
    return static_cast<int64_t>(q_begin + query) * p.q_stride_l + head * p.q_stride_h;
  }
  __device__ int64_t out_row(int head, int query) const {
    return static_cast<int64_t>(q_begin + query) * p.q_heads + head;
  }
  __device__ const float* inv_freq() const { return p.inv_freq + task.problem * p.inv_freq_stride; }
  __device__ const KeyRate* key_rates() const { return p.key_rates + task.problem * p.inv_freq_stride; }
  // The request's own split length (its keys over the launch's splits): the splits past its keys are empty.
  __device__ int keys_per_split() const { return split_keys; }
  __device__ float scale() const { return p.scale_factors ? p.scale * p.scale_factors[task.problem] : p.scale; }
  __device__ int64_t k_base() const { return task.kv_head * p.k_stride_h; }
  __device__ int64_t v_base() const { return task.kv_head * p.v_stride_h; }
  // The page and slot of key `key` (< seq_len; the schedule kernel checked that its page is in the cache).
  __device__ void locate_key(int key, TileRow* row) const {
    row->page = p.block_table[static_cast<int64_t>(task.problem) * p.max_blocks + key / p.block_size];
    row->slot = key % p.block_size;
  }
  __device__ int64_t k_row(const TileRow* rows, int, int j) const {
    return rows[j].page * p.k_stride_b + rows[j].slot * p.k_stride_l;
  }
  __device__ int64_t v_row(const TileRow* rows, int, int j) const {
    return rows[j].page * p.v_stride_b + rows[j].slot * p.v_stride_l;
  }
};

// Writes the rotated (rounded like T, then scale * log-n scaled in f32) operands of the block's query
// rows: near side at p, far side at w + (p - w)/k. Rows past the problem and padded head dims are zeros.
template <typename T, class Shape, class Problem>
__device__ void load_query_rows(const ReropeParams& p, const Problem& problem, const BlockRows<Shape>& rows,
                                SmemTiles<Shape>& s, int padded_dim) {
  const T* q = static_cast<const T*>(p.q);
  const float* inv_freq = problem.inv_freq();
  const float scale = problem.scale();
  const int tid = static_cast<int>(threadIdx.x);
  // Dims past the rotary ones (copied) and the zero padding up to a multiple of 4.
  for (int idx = tid; idx < Shape::kRows * padded_dim; idx += kThreads) {
    const int r = idx / padded_dim, d = idx % padded_dim;
    if (d < 2 * p.rotary_pairs) continue;
    float x = 0.0f;
    if (rows.valid[r] && d < p.head_dim) {
      const float factor = scale * rerope_logn_scale(rows.position[r], p.logn_length, p.inv_log_train);
      x = to_acc(q[problem.q_offset(rows.head[r], rows.query[r]) + d]) * factor;
    }
    s.q_near[r * Shape::kQStride + d] = x;
    s.q_far[r * Shape::kQStride + d] = x;
  }
  // Rotation pairs.
  for (int idx = tid; idx < Shape::kRows * p.rotary_pairs; idx += kThreads) {
    const int r = idx / p.rotary_pairs, pair = idx % p.rotary_pairs;
    int first, second;
    rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
    float* near_row = s.q_near + r * Shape::kQStride;
    float* far_row = s.q_far + r * Shape::kQStride;
    if (!rows.valid[r]) {
      near_row[first] = near_row[second] = far_row[first] = far_row[second] = 0.0f;
      continue;
    }
    const int64_t pos = rows.position[r];
    const float factor = scale * rerope_logn_scale(pos, p.logn_length, p.inv_log_train);
    const T* src = q + problem.q_offset(rows.head[r], rows.query[r]);
    const float x1 = to_acc(src[first]), x2 = to_acc(src[second]);
    float sin_v, cos_v, a, c;
    rotary_sincos(static_cast<double>(pos), inv_freq[pair], &sin_v, &cos_v);
    rotate_pair(x1, x2, cos_v, sin_v, &a, &c);
    near_row[first] = round_to<T>(a) * factor;
    near_row[second] = round_to<T>(c) * factor;
    rotary_sincos(rerope_far_query_position(pos, p.window, p.leaky_inv), inv_freq[pair], &sin_v, &cos_v);
    rotate_pair(x1, x2, cos_v, sin_v, &a, &c);
    far_row[first] = round_to<T>(a) * factor;
    far_row[second] = round_to<T>(c) * factor;
  }
}

// Loads a [kBlockK x padded_dim] tile of float rows, row j at base + row_offset(j) (zeros past the
// keys and past D: rows past rows_in_range are never addressed).
template <typename Src, int kStride, class RowOffset>
__device__ void load_tile(const Src* base, RowOffset row_offset, int rows_in_range, int dim, int padded_dim,
                          float* dst) {
  for (int idx = static_cast<int>(threadIdx.x); idx < kBlockK * padded_dim; idx += kThreads) {
    const int j = idx / padded_dim, d = idx % padded_dim;
    dst[j * kStride + d] = (j < rows_in_range && d < dim) ? to_acc(base[row_offset(j) + d]) : 0.0f;
  }
}

// Per-warp state of the online softmax for its rows.
template <class Shape>
struct RowAccumulators {
  static constexpr int kR = Shape::kRowsPerWarp;
  static constexpr int kDims = Shape::kDimsPerLane;
  float acc[kR][kDims];
  float row_max[kR];  // the same in every lane
  float row_sum[kR];  // sum over this lane's keys (rescaled with the common max)
  unsigned seen = 0;  // bit r: row r has had a visible key (by the mask), the same in every lane

  __device__ void init() {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
#pragma unroll
      for (int t = 0; t < kDims; ++t) acc[r][t] = 0.0f;
    }
  }
};

// scores[r] += <q_row(r), k_row(lane)> for the warp's rows (float4 over the padded head dim).
template <class Shape>
__device__ __forceinline__ void warp_scores(const float* q_tile, const float* k_tile, int padded_dim,
                                            float (&scores)[Shape::kRowsPerWarp]) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const float4* key = reinterpret_cast<const float4*>(k_tile + lane * Shape::kKStride);
#pragma unroll
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) scores[r] = 0.0f;
  for (int d4 = 0; d4 < padded_dim / 4; ++d4) {
    const float4 kv = key[d4];
#pragma unroll
    for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
      const float4 qv = reinterpret_cast<const float4*>(q_tile + (warp + kWarps * r) * Shape::kQStride)[d4];
      scores[r] += dot4(qv, kv);
    }
  }
}

// One key tile through the warp's rows, from its scores (near, far or, on band tiles, both, picked
// per pair by the distance rule): masks, online softmax, P.V (with the probabilities rounded like T).
// Masked pairs get no probability and are skipped in P.V; a row's visibility comes from the mask.
template <typename T, class Shape>
__device__ void process_tile(const ReropeParams& p, const BlockRows<Shape>& rows, const SmemTiles<Shape>& s,
                             TileClass tile, int64_t key_position, const float (&scores)[Shape::kRowsPerWarp],
                             const float (&far_scores)[Shape::kRowsPerWarp], RowAccumulators<Shape>& st) {
  constexpr int kR = Shape::kRowsPerWarp;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int row = warp + kWarps * r;
    if (!rows.valid[row]) continue;  // uniform over the warp: the row past the problem costs nothing
    const int64_t q_position = rows.position[row];
    float score = scores[r];
    if (tile.kind == TileKind::kBand && !rerope_is_near(q_position, key_position, p.window)) score = far_scores[r];
    const bool visible = !tile.needs_mask || rerope_visible(q_position, key_position, p.causal);
    if (!visible) score = -INFINITY;
    if (!tile.needs_mask || __any_sync(kFullMask, visible)) st.seen |= 1u << r;  // tile-uniform branch
    // fmaxf skips NaN: a visible NaN score reaches the row through its probability. While no
    // visible score is above -inf, exponents are taken against 0, so that NaN and -inf scores still
    // give NaN and 0.
    const float new_max = fmaxf(st.row_max[r], warp_max(score));
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float prob = visible ? expf(score - base) : 0.0f;
    const float alpha = expf(st.row_max[r] - base);
    st.row_sum[r] = st.row_sum[r] * alpha + prob;  // this lane's keys only: reduced once, at the end
    st.row_max[r] = new_max;
#pragma unroll
    for (int t = 0; t < Shape::kDimsPerLane; ++t) st.acc[r][t] *= alpha;
    s.probs[row * kBlockK + lane] = visible ? round_to<T>(prob) : kMaskedProb;
  }
  __syncwarp();
  // P.V; on tiles with masked pairs, those pairs are skipped (a warp-uniform test: every lane reads
  // the same probability), so a masked key's V never reaches the row, not even as 0 * NaN.
  const auto accumulate = [&](auto skip_masked) {
    for (int j = 0; j < kBlockK; ++j) {
      float v_slot[Shape::kDimsPerLane];
#pragma unroll
      for (int t = 0; t < Shape::kDimsPerLane; ++t) v_slot[t] = s.v[j * Shape::kVStride + lane + 32 * t];
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        if (!rows.valid[warp + kWarps * r]) continue;
        const float pj = s.probs[(warp + kWarps * r) * kBlockK + j];
        if (decltype(skip_masked)::value && pj == kMaskedProb) continue;
#pragma unroll
        for (int t = 0; t < Shape::kDimsPerLane; ++t) st.acc[r][t] += pj * v_slot[t];
      }
    }
  };
  if (tile.needs_mask)
    accumulate(std::true_type{});
  else
    accumulate(std::false_type{});
  __syncwarp();
}

// Writes the warp's rows: normalised output and lse, into out/lse or into the split's partials.
// A row without a visible key: zeros and -inf. A row with one whose sum is not > 0 (NaN, or every
// visible score -inf): non-finite output and lse NaN (what softmax gives), also in a split's
// partials, so that the combine propagates it.
template <typename T, class Shape, class Problem>
__device__ void store_rows(const ReropeParams& p, const Problem& problem, const BlockRows<Shape>& rows,
                           const RowAccumulators<Shape>& st) {
  const int split = problem.task.split;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int r = 0; r < Shape::kRowsPerWarp; ++r) {
    const int row = warp + kWarps * r;
    if (!rows.valid[row]) continue;
    const int64_t out_row = problem.out_row(rows.head[row], rows.query[row]);
    const float row_sum = warp_sum(st.row_sum[r]);
    const bool seen = (st.seen >> r) & 1u;
    const float inv = seen ? 1.0f / row_sum : 0.0f;
    const float lse = !seen ? -INFINITY : row_sum > 0.0f ? st.row_max[r] + logf(row_sum) : NAN;
    const int64_t rows_total = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
#pragma unroll
    for (int t = 0; t < Shape::kDimsPerLane; ++t) {
      const int d = lane + 32 * t;
      if (d >= p.head_dim) continue;
      const float value = st.acc[r][t] * inv;
      if (p.num_splits > 1)
        p.partial_out[(split * rows_total + out_row) * p.head_dim + d] = value;
      else
        static_cast<T*>(p.out)[out_row * p.head_dim + d] = from_acc<T>(value);
    }
    if (lane == 0) {
      if (p.num_splits > 1)
        p.partial_lse[split * rows_total + out_row] = lse;
      else
        p.lse[out_row] = lse;
    }
  }
}

// Fills the block's row table: rows r = (head offset r / queries_per_block, query r % queries_per_block).
template <class Shape, class Problem>
__device__ void map_block_rows(const ReropeParams& p, const Problem& problem, BlockRows<Shape>& rows) {
  const BlockTask& task = problem.task;
  const int group = p.q_heads / p.kv_heads;
  for (int r = static_cast<int>(threadIdx.x); r < Shape::kRows; r += kThreads) {
    const int head_offset = task.head_block * task.heads_per_block + r / task.queries_per_block;
    const int query = task.query_block * task.queries_per_block + r % task.queries_per_block;
    const bool valid =
        r < task.heads_per_block * task.queries_per_block && head_offset < group && query < task.q_len;
    rows.valid[r] = valid;
    rows.head[r] = valid ? task.kv_head * group + head_offset : 0;
    rows.query[r] = valid ? query : 0;
    rows.position[r] = valid ? problem.query_position(query) : -1;
  }
}

// The kernel body shared by prefill (keys pre-rotated in global memory; dense problems only) and
// decode (keys rotated here, tile by tile, only where needed), over a dense batch row or a paged
// request (Problem).
template <typename T, class Shape, bool kKeysPreRotated, class Problem>
__device__ void rerope_attention_block(const ReropeParams& p) {
  static_assert(!kKeysPreRotated || std::is_same_v<Problem, DenseProblem>, "pre-rotated keys: dense problems only");
  constexpr int kR = Shape::kRowsPerWarp;
  const Problem problem(p, Shape::kRows);
  if (!problem.task.active) return;  // uniform over the block, before any barrier
  ROPESCALE_DYNAMIC_SMEM(float, smem);
  SmemTiles<Shape> s(smem);
  unsigned char* const smem_bytes = reinterpret_cast<unsigned char*>(smem);
  BlockRows<Shape>& rows = *reinterpret_cast<BlockRows<Shape>*>(smem_bytes + Shape::kRowTableOffset);
  // By tile parity: a skipped tile may run ahead.
  long long (*tile_positions)[kBlockK] = reinterpret_cast<long long (*)[kBlockK]>(smem_bytes + Shape::kTilePositionsOffset);
  TileRow (*tile_rows)[kBlockK] = reinterpret_cast<TileRow (*)[kBlockK]>(smem_bytes + Shape::kTileRowsOffset);

  const int b = problem.task.problem, kv_head = problem.task.kv_head;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int padded_dim = (p.head_dim + 3) / 4 * 4;
  const bool leaky = p.leaky_inv != 0.0;
  const KeyRate* const key_rates = problem.key_rates();

  map_block_rows<Shape>(p, problem, rows);
  __syncthreads();
  RowAccumulators<Shape> st;
  st.init();
  // A paged request whose metadata would read outside the cache (rerope_paged_schedule_kernel): NaN
  // rows, no key read.
  if (problem.task.poisoned) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      st.row_max[r] = st.row_sum[r] = NAN;
#pragma unroll
      for (int t = 0; t < Shape::kDimsPerLane; ++t) st.acc[r][t] = NAN;
    }
    st.seen = ~0u;
    store_rows<T, Shape>(p, problem, rows, st);
    return;
  }
  const int keys_per_split = problem.keys_per_split();
  const int key_begin = problem.task.split * keys_per_split;
  const int key_end =
      key_begin + keys_per_split < problem.task.k_len ? key_begin + keys_per_split : problem.task.k_len;
  // Bounds of the block's query positions, computed by every thread (no shuffles, no barrier).
  PositionRange query_range;
  for (int r = 0; r < Shape::kRows; ++r)
    if (rows.valid[r]) query_range.add(rows.position[r]);
  // (A split past the problem's keys stores its empty rows, -inf, for the combine.)
  if (key_begin < key_end) load_query_rows<T, Shape>(p, problem, rows, s, padded_dim);

  const T* k = static_cast<const T*>(p.k) + problem.k_base();
  const T* v = static_cast<const T*>(p.v) + problem.v_base();
  const int64_t rotated_offset = (static_cast<int64_t>(b) * p.kv_heads + kv_head) * p.k_len * p.head_dim;

  for (int j0 = key_begin, parity = 0; j0 < key_end; j0 += kBlockK, parity ^= 1) {
    const int keys_in_tile = key_end - j0 < kBlockK ? key_end - j0 : kBlockK;
    if (tid < kBlockK) {
      tile_positions[parity][tid] = tid < keys_in_tile ? problem.key_position(j0 + tid) : -1;
      if (tid < keys_in_tile) problem.locate_key(j0 + tid, &tile_rows[parity][tid]);
    }
    __syncthreads();  // positions published; the previous tile is consumed (and the query rows written)
    const TileRow* const key_rows = tile_rows[parity];
    const auto k_row = [&](int j) { return problem.k_row(key_rows, j0, j); };
    const auto v_row = [&](int j) { return problem.v_row(key_rows, j0, j); };
    // Every thread classifies the same positions, so the whole block agrees on the tile's class.
    PositionRange key_range;
    for (int j = 0; j < keys_in_tile; ++j) key_range.add(tile_positions[parity][j]);
    TileClass tile = rerope_classify_tile(query_range, key_range, p.window, p.causal);
    if (tile.kind == TileKind::kSkip) continue;
    tile.needs_mask |= keys_in_tile < kBlockK;  // lanes past the last key (position -1: never visible)
    const int64_t key_position = tile_positions[parity][lane];
    const bool need_near = tile.kind != TileKind::kFar, need_far = tile.kind != TileKind::kNear;

    // One side of the key tile into `dst` (zeros past the keys and past D). Prefill: the
    // pre-rotated keys (far side: p.k_far for Leaky, the raw keys for ReRoPE). Decode: the raw keys,
    // then, per rotation pair, rotated in place (near at p, Leaky far at p/k, from the pair's turn rates:
    // no FP64 per key; ReRoPE's far side is the raw key); one thread reads and writes each pair. Ends
    // before the barrier that publishes it.
    const auto stage_keys = [&](bool far_side, float* dst) {
      if constexpr (kKeysPreRotated) {
        if (!far_side || leaky)
          load_tile<float, Shape::kKStride>(
              static_cast<const float*>(far_side ? p.k_far : p.k_near) + rotated_offset +
                  static_cast<int64_t>(j0) * p.head_dim,
              [&](int j) { return static_cast<int64_t>(j) * p.head_dim; }, keys_in_tile, p.head_dim, padded_dim, dst);
        else
          load_tile<T, Shape::kKStride>(k, k_row, keys_in_tile, p.head_dim, padded_dim, dst);
      } else {
        load_tile<T, Shape::kKStride>(k, k_row, keys_in_tile, p.head_dim, padded_dim, dst);
        if (far_side && !leaky) return;
        __syncthreads();
        for (int idx = tid; idx < kBlockK * p.rotary_pairs; idx += kThreads) {
          const int j = idx / p.rotary_pairs, pair = idx % p.rotary_pairs;
          int first, second;
          rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
          float* row = dst + j * Shape::kKStride;
          const int64_t pos = j < keys_in_tile ? tile_positions[parity][j] : 0;
          const KeyRate rate = key_rates[pair];
          float sin_v, cos_v, a, c;
          position_sincos(pos, far_side ? rate.far : rate.near, &sin_v, &cos_v);
          rotate_key_pair_fma(row[first], row[second], cos_v, sin_v, &a, &c);
          row[first] = round_to<T>(a);
          row[second] = round_to<T>(c);
        }
      }
    };

    load_tile<T, Shape::kVStride>(v, v_row, keys_in_tile, p.head_dim, padded_dim, s.v);
    // Scores from operands picked by pointer, never a score array picked at run time (that would
    // demote both arrays to local memory): far tiles score from the far operands, band tiles fill
    // far_scores as well.
    float scores[kR], far_scores[kR];
    const bool far = tile.kind == TileKind::kFar;
    if constexpr (Shape::kKeyTiles == 2) {
      if (need_near) stage_keys(false, s.k_near);
      if (need_far) stage_keys(true, s.k_far);
      __syncthreads();
      warp_scores<Shape>(far ? s.q_far : s.q_near, far ? s.k_far : s.k_near, padded_dim, scores);
      if (tile.kind == TileKind::kBand) warp_scores<Shape>(s.q_far, s.k_far, padded_dim, far_scores);
    } else {  // one key tile: a band tile's far side after its near scores
      stage_keys(far, s.k_near);
      __syncthreads();
      warp_scores<Shape>(far ? s.q_far : s.q_near, s.k_near, padded_dim, scores);
      if (tile.kind == TileKind::kBand) {
        __syncthreads();  // every warp is done with the near keys
        stage_keys(true, s.k_near);
        __syncthreads();
        warp_scores<Shape>(s.q_far, s.k_near, padded_dim, far_scores);
      }
    }
    process_tile<T, Shape>(p, rows, s, tile, key_position, scores, far_scores, st);
  }
  store_rows<T, Shape>(p, problem, rows, st);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_prefill_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, true, DenseProblem>(p);
}

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_decode_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, false, DenseProblem>(p);
}

// One rotation pair of one key (position `pos`, the table's turn rates `rates`) for every kv head, from
// one sin/cos: the near side at p into p.k_near and, where p.k_far is set, the far side into p.k_far
// (Leaky: at p/k; plain ReRoPE: the raw key, for the paged tensor-core prefill), rounded like T, as Out;
// a pair past the rotary ones copies two un-rotated dims. The head's source row is src_row(h), its
// destination row offset dst_row(h). The angles come from turn rates (turn_angles.h), the same
// arithmetic as the key tiles the SIMT body and the paged tensor-core prefill rotate themselves.
template <typename T, typename Out, class SrcRow, class DstRow>
__device__ __forceinline__ void rotate_key_pair(const ReropeParams& p, const KeyRate* rates, int64_t pos, int pair,
                                                SrcRow&& src_row, DstRow&& dst_row) {
  Out* const k_near = static_cast<Out*>(p.k_near);
  Out* const k_far = static_cast<Out*>(p.k_far);
  const bool leaky = p.leaky_inv != 0.0;
  const bool rotated = pair < p.rotary_pairs;
  int first = 2 * pair, second = 2 * pair + 1;
  float near_sin = 0.0f, near_cos = 1.0f, far_sin = 0.0f, far_cos = 1.0f;
  if (rotated) {
    rotary_pair_dims(pair, p.rotary_pairs, p.interleaved, &first, &second);
    const KeyRate rate = rates[pair];
    const int sides = k_far && leaky ? 2 : 1;
#pragma unroll 1
    for (int side = 0; side < sides; ++side) {  // one copy of the sin/cos code (two spill 4 bytes on sm_90)
      float sin_v, cos_v;
      position_sincos(pos, side == 0 ? rate.near : rate.far, &sin_v, &cos_v);
      if (side == 0)
        near_sin = sin_v, near_cos = cos_v;
      else
        far_sin = sin_v, far_cos = cos_v;
    }
  }
  for (int h = 0; h < p.kv_heads; ++h) {
    const T* src = src_row(h);
    const float x1 = to_acc(src[first]), x2 = to_acc(src[second]);
    const int64_t dst = dst_row(h);
    float a, c;  // rounded like T (a no-op for fp32; for Out = T, the one rounding to T)
    rotate_key_pair_fma(x1, x2, near_cos, near_sin, &a, &c);
    k_near[dst + first] = from_acc<Out>(round_to<T>(a));
    k_near[dst + second] = from_acc<Out>(round_to<T>(c));
    if (k_far) {
      if (leaky)
        rotate_key_pair_fma(x1, x2, far_cos, far_sin, &a, &c);
      else
        a = x1, c = x2;
      k_far[dst + first] = from_acc<Out>(round_to<T>(a));
      k_far[dst + second] = from_acc<Out>(round_to<T>(c));
    }
  }
}

// Prefill pre-pass: every key rotated once (rotate_key_pair), near side at p into k_near, and for Leaky
// ReRoPE the far side at p/k into k_far, [B, Hkv, Lk, D] as Out (float for the SIMT prefill, T for the
// tensor-core one: rounded to the input dtype). One thread per (batch, key, pair).
template <typename T, typename Out>
__global__ void __launch_bounds__(256) rerope_rotate_keys_kernel(const ReropeParams p) {
  const int half_dim = p.head_dim / 2;
  const int64_t total = static_cast<int64_t>(p.batch) * p.k_len * half_dim;
  const T* k = static_cast<const T*>(p.k);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int pair = static_cast<int>(idx % half_dim);
    const int j = static_cast<int>((idx / half_dim) % p.k_len);
    const int b = static_cast<int>(idx / (static_cast<int64_t>(half_dim) * p.k_len));
    const T* src = k + b * p.k_stride_b + j * p.k_stride_l;
    rotate_key_pair<T, Out>(p, p.key_rates, p.k_positions[static_cast<int64_t>(b) * p.k_len + j], pair,
                            [&](int h) { return src + h * p.k_stride_h; },
                            [&](int h) {
                              return ((static_cast<int64_t>(b) * p.kv_heads + h) * p.k_len + j) * p.head_dim;
                            });
  }
}

// Merges the decode splits of each row by their log-sum-exp. One warp per row, lanes over D.
// Memory-bound: 8 resident blocks per SM asked for (64 registers; it needs about 40). A split
// without a visible key has lse -inf and is left out; one with a non-finite row (lse NaN, or a
// non-finite column) makes the merged row non-finite, never zeros.
template <typename T>
__global__ void __launch_bounds__(kThreads, 8) rerope_combine_kernel(const ReropeParams p) {
  const int64_t rows_total = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (row >= rows_total) return;
  float max_lse = -INFINITY;
  bool seen = false;
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse = p.partial_lse[s * rows_total + row];
    max_lse = fmaxf(max_lse, lse);
    seen |= lse != -INFINITY;
  }
  float total = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse = p.partial_lse[s * rows_total + row];
    total += lse == -INFINITY ? 0.0f : expf(lse - max_lse);
  }
  for (int d = lane; d < p.head_dim; d += 32) {
    float value = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float lse = p.partial_lse[s * rows_total + row];
      if (lse != -INFINITY) value += expf(lse - max_lse) * p.partial_out[(s * rows_total + row) * p.head_dim + d];
    }
    static_cast<T*>(p.out)[row * p.head_dim + d] = from_acc<T>(seen ? value / total : 0.0f);
  }
  if (lane == 0) p.lse[row] = seen ? max_lse + logf(total) : -INFINITY;
}

// The turn rates (turn_angles.h) of every rotation pair of the launch's table(s) into p.key_rates:
// row r's pair i at r * inv_freq_stride + i, with one row per request when inv_freq_stride != 0 (a paged
// launch with a table per request), else one row. FP64 once per (table, pair) here, so that the kernels
// that rotate keys need none per key. One thread per (row, pair). (A template only so that the header may
// be included by several translation units of one program.)
template <int kThreadsPerBlock>
__global__ void __launch_bounds__(kThreadsPerBlock) rerope_key_rates_kernel(const ReropeParams p, int rows) {
  const int64_t total = static_cast<int64_t>(rows) * p.rotary_pairs;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / p.rotary_pairs;
    const int pair = static_cast<int>(idx % p.rotary_pairs);
    p.key_rates[idx] = key_rate(p.inv_freq[row * p.inv_freq_stride + pair], p.leaky_inv);
  }
}

// ---- host launchers -------------------------------------------------------------------------

// A launcher calls check(status, what) after every launch and after every shared-memory opt-in, with
// the CUDA status (0 = ok). The caller's check must not return on an error (it throws), so that no
// kernel reads the output of a failed one. The emulation throws from the launch itself.
struct IgnoreLaunchStatus {
  void operator()(int, const char*) const {}
};

// Rows of p.key_rates a launch needs (KeyRate [rows, rotary_pairs], allocated by the caller): one per
// request for a paged launch with a table per request, else one.
inline int64_t rerope_key_rate_rows(const ReropeParams& p) { return p.inv_freq_stride != 0 ? p.requests : 1; }

// The first kernel of every launch that rotates keys: p.key_rates from p.inv_freq.
template <class Check>
inline void launch_rerope_key_rates(const ReropeParams& p, cudaStream_t stream, Check&& check) {
  const int64_t rows = rerope_key_rate_rows(p);
  const int64_t items = rows * p.rotary_pairs;
  if (items == 0) return;
  const int64_t blocks = (items + 255) / 256 < 1024 ? (items + 255) / 256 : 1024;
  ROPESCALE_LAUNCH_KERNEL(rerope_key_rates_kernel<256>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, p,
                          static_cast<int>(rows));
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the key turn-rates kernel");
}

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


// ---- rerope_attention_paged: requests packed along T, keys and values read through the block table --
//
// No host sync: the schedule kernel turns the device-side metadata (query_start_loc, seq_lens,
// block_table) into task lists whose lengths the host bounds from the sizes alone; the grids are
// those bounds, and the blocks past the last task exit at once. Rows of requests with at most
// kPagedDecodeMaxQueries queries (decode), and every row of an fp32 launch, run the decode body above
// (rows of a GQA group packed per block, keys split over the grid and rotated in shared memory tile
// by tile, only the tiles that need it), with each request's own positions (key slot j at j, query i
// at seq_len - q_len + i), rotation table and softmax scale; splits > 1 are merged by
// rerope_combine_kernel, as for dense decode. For fp16/bf16 at the tensor-core head dims, the other
// requests (prefill, chunked prefill) run on the tensor-core prefill (rerope_attention_tc.cuh,
// launch_rerope_paged_tc, after this launch), at any length: over keys its pre-pass rotates through the
// block table into a workspace while their keys fit its budget (ReropeParams::paged_tc_key_budget), the
// rest rotating their key tiles from the pages inside the kernel.

constexpr int kScheduleThreads = 256;
constexpr int kScheduleWarps = kScheduleThreads / 32;
// The sizing rules (kPagedDecodeMaxQueries, the key splits, the task bounds, the tensor-core budget and
// workspace) are in rerope_paged_plan.h, free of kernels for the host glue and the Catch2 tests.
static_assert(kPagedTileKeys == kBlockK, "the SIMT key tile of the paged split rule");

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
    p.key_rates[idx] = key_rate(p.inv_freq[row * p.inv_freq_stride + pair], p.leaky_inv);
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

template <typename T, class Shape>
__global__ void __launch_bounds__(kThreads, Shape::kMinBlocksPerSm) rerope_paged_kernel(const ReropeParams p) {
  rerope_attention_block<T, Shape, false, PagedProblem>(p);
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

// rerope_cache_write_: key / value [T, Hkv, D] (row strides in elements, unit last stride) stored at
// slot_mapping[t] = page * block_size + offset of the caches [num_blocks, Hkv, block_size, D]; a
// negative slot is skipped, as vLLM pads, and so is a slot past the cache (the CPU op refuses it; on
// CUDA a check would cost a host sync). One thread per element: consecutive threads write
// consecutive dims of one (token, head) row, coalesced on both sides.
struct CacheWriteParams {
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  const void* key = nullptr;
  const void* value = nullptr;
  const int64_t* slot_mapping = nullptr;
  int64_t key_stride_t = 0, key_stride_h = 0, value_stride_t = 0, value_stride_h = 0;
  int64_t cache_stride_block = 0, cache_stride_h = 0, cache_stride_slot = 0;  // key cache
  int64_t vcache_stride_block = 0, vcache_stride_h = 0, vcache_stride_slot = 0;  // value cache
  int64_t tokens = 0, slots = 0;
  int kv_heads = 0, head_dim = 0, block_size = 1;
};

template <typename T>
__global__ void __launch_bounds__(256) rerope_cache_write_kernel(const CacheWriteParams p) {
  const int64_t total = p.tokens * p.kv_heads * p.head_dim;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(idx % p.head_dim);
    const int h = static_cast<int>((idx / p.head_dim) % p.kv_heads);
    const int64_t t = idx / (static_cast<int64_t>(p.head_dim) * p.kv_heads);
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.slots) continue;
    const int64_t page = slot / p.block_size, offset = slot % p.block_size;
    static_cast<T*>(p.key_cache)[page * p.cache_stride_block + h * p.cache_stride_h + offset * p.cache_stride_slot + d] =
        static_cast<const T*>(p.key)[t * p.key_stride_t + h * p.key_stride_h + d];
    static_cast<T*>(p.value_cache)[page * p.vcache_stride_block + h * p.vcache_stride_h + offset * p.vcache_stride_slot +
                                   d] = static_cast<const T*>(p.value)[t * p.value_stride_t + h * p.value_stride_h + d];
  }
}

template <typename T, class Check = IgnoreLaunchStatus>
inline void launch_rerope_cache_write(const CacheWriteParams& p, cudaStream_t stream, Check&& check = {}) {
  const int64_t total = p.tokens * p.kv_heads * p.head_dim;
  if (total == 0) return;
  const int64_t blocks = (total + 255) / 256 < 65535 ? (total + 255) / 256 : 65535;
  ROPESCALE_LAUNCH_KERNEL(rerope_cache_write_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the cache-write kernel");
}

}  // namespace ropescale::rerope_cuda
