// The problems of the SIMT body (rerope_attention.cuh): what a block works on and where its rows, keys,
// values, positions, rotation table and softmax scale lie, for a dense batch row or a paged request.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_params.h"
#include "ropescale/turn_angles.h"

namespace ropescale::rerope_cuda {

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

}  // namespace ropescale::rerope_cuda
