// The sizing rules of rerope_attention_paged's CUDA launch, free of kernels and of torch: shared by the
// kernels (rerope_attention.cuh, rerope_attention_tc.cuh), the ATen glue and checks (cuda/rerope_paged.cu,
// rerope_paged.cpp: the workspace the op takes and the bytes an engine reserves for it), and the Catch2
// tests (tests/cpp/test_rerope_paged_plan.cpp). No host sync anywhere: each rule reads sizes the host
// has (tokens T, requests R, heads, head dim, the block table's capacity, the SM count); what depends on
// the metadata values (each request's length and rows) is decided on the device by the schedule kernel.
#pragma once

#include <cstdint>

#include "ropescale/portable.h"

namespace ropescale::rerope_cuda {

// A request with up to this many query rows is a decode request: the SIMT split-K body (memory-bound;
// the CPU kernel's decode plan takes the same requests). The others run on the tensor-core prefill where
// it serves the dtype and head dim.
constexpr int kPagedDecodeMaxQueries = 4;
// Query rows per block of the tensor-core prefill (tc::kBlockM).
constexpr int kPagedTcQueries = 64;
// Keys per SIMT key tile (rerope_cuda::kBlockK), and the fewest tiles a SIMT key split takes.
constexpr int kPagedTileKeys = 32;
constexpr int kPagedMinSplitTiles = 4;

// The keys of each key split of a request with seq_len keys on the SIMT body of a launch with num_splits
// splits, computed on the device by the schedule kernel so that the splits follow each request's own
// length, not the block table's width: its tiles spread evenly over as many splits as leave each at least
// kPagedMinSplitTiles tiles. The splits past its keys are empty (their blocks store empty rows).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int rerope_paged_keys_per_split(int seq_len, int num_splits) {
  const int tiles = seq_len > 0 ? (seq_len - 1) / kPagedTileKeys + 1 : 0;
  int splits = tiles / kPagedMinSplitTiles;
  splits = splits < num_splits ? splits : num_splits;
  splits = splits > 1 ? splits : 1;
  return (tiles + splits - 1) / splits * kPagedTileKeys;
}
// The splits that request uses (the others are empty).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int rerope_paged_live_splits(int seq_len, int num_splits) {
  const int keys = rerope_paged_keys_per_split(seq_len, num_splits);
  return keys > 0 ? (seq_len + keys - 1) / keys : 0;
}

// Key splits of a launch (the grid's y): ~2 waves of blocks on `multiprocessors` SMs for the row blocks
// the sizes bound (at least one per request and kv head, or one per `rows` rows of a GQA group), at most
// one per kPagedMinSplitTiles tiles of the block table's capacity (the longest a sequence may be), and
// 65535. Each request spreads its own keys over them (rerope_paged_keys_per_split).
inline int rerope_paged_split_count(int64_t tokens, int64_t requests, int64_t q_heads, int64_t kv_heads, int rows,
                                    int64_t capacity, int multiprocessors) {
  const int64_t group = q_heads / kv_heads;
  const int64_t row_blocks = (tokens * group + rows - 1) / rows;
  const int64_t blocks = kv_heads * (row_blocks > requests ? row_blocks : requests);
  const int64_t max_splits = (capacity + kPagedMinSplitTiles * kPagedTileKeys - 1) / (kPagedMinSplitTiles * kPagedTileKeys);
  int64_t splits = blocks > 0 ? (2 * static_cast<int64_t>(multiprocessors) + blocks - 1) / blocks : 1;
  splits = splits < max_splits ? splits : max_splits;
  splits = splits < 65535 ? splits : 65535;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

// Upper bound of the SIMT tasks of a launch over `tokens` rows of `requests` requests: a request of q_len
// rows has at most 2 * q_len * group / rows + 1 row blocks (rerope_rows_plan: for q_len >= rows,
// ceil(q_len / rows) * group <= 2 q_len group / rows; below, ceil(group / floor(rows / q_len)) with
// floor(x) >= x / 2), so the sum is at most 2 * tokens * group / rows + requests.
inline int64_t rerope_paged_max_tasks(int64_t tokens, int64_t requests, int group, int rows) {
  return (2 * tokens * group + rows - 1) / rows + requests;
}
// Upper bound of the tensor-core tasks (request, 64 queries): sum of ceil(q_len / 64) over requests of
// more than kPagedDecodeMaxQueries rows, at most (tokens + 63 * min(requests, tokens / 5)) / 64.
inline int64_t rerope_paged_max_tc_tasks(int64_t tokens, int64_t requests) {
  const int64_t prefill = tokens / (kPagedDecodeMaxQueries + 1) < requests ? tokens / (kPagedDecodeMaxQueries + 1)
                                                                            : requests;
  return (tokens + (kPagedTcQueries - 1) * prefill + kPagedTcQueries - 1) / kPagedTcQueries;
}

// Whether a launch of these sizes can have tensor-core rows, from the sizes alone (before anything is
// allocated or launched for them): a request of more than kPagedDecodeMaxQueries rows needs, when no
// request is empty (vLLM's batches), tokens >= requests + kPagedDecodeMaxQueries. Below that (a decode
// step: one row per request; speculative decoding with few rows) every row runs on the SIMT body and
// the launch allocates nothing for the tensor cores; a request of more rows in such a launch (possible
// only beside empty requests) runs on the SIMT body too, with the same results.
inline bool rerope_paged_tc_possible(int64_t tokens, int64_t requests) {
  return tokens >= requests + kPagedDecodeMaxQueries;
}

// Head dims of the tensor-core prefill (rerope_tc_head_dim).
constexpr bool rerope_paged_tc_head_dim(int64_t head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
}

// The pre-rotation budget when the op allocates its own workspace: max(4 T, 65536) keys, never more
// than the block table can name, nor 2^30. Requests whose keys (in order) fit it have their keys rotated
// once by a pre-pass; the others rotate key tiles in the tensor-core kernel (no cliff: both are on the
// tensor cores; the pre-pass saves the in-kernel rotation of near tiles and Leaky far tiles).
inline int64_t rerope_paged_default_key_budget(int64_t tokens) {
  const int64_t want = 4 * tokens > 65536 ? 4 * tokens : 65536;
  return want < (int64_t{1} << 30) ? want : (int64_t{1} << 30);
}
inline int64_t rerope_paged_tc_key_budget(int64_t tokens, int64_t requests, int64_t capacity) {
  const int64_t want = rerope_paged_default_key_budget(tokens);
  const int64_t most = requests * capacity;
  return want < most ? want : most;
}

// The tensor-core workspace of a launch, in one block of bytes (the op's `workspace` argument, or its own
// allocation): the queries' sin/cos (float [T, D/2, 4]: rerope_paged_query_rotation_kernel), then the
// pre-rotated keys' two sides (T-typed [keys, Hkv, D] each: near at p; far at p/k for Leaky, the raw key
// for ReRoPE), each part 256-byte aligned, plus 256 bytes for aligning the base.
struct PagedTcWorkspace {
  int64_t q_rotation = 0, k_near = 0, k_far = 0;  // offsets from the 256-byte aligned base
  int64_t keys = 0;                               // the pre-rotation budget the key parts hold
  int64_t bytes = 0;                              // the whole, with the alignment slack
};
constexpr int64_t kPagedWorkspaceAlign = 256;
inline int64_t rerope_paged_align(int64_t bytes) {
  return (bytes + kPagedWorkspaceAlign - 1) / kPagedWorkspaceAlign * kPagedWorkspaceAlign;
}
// The layout for a budget of `keys` pre-rotated keys (0: the queries' part alone).
inline PagedTcWorkspace rerope_paged_workspace_layout(int64_t tokens, int64_t kv_heads, int64_t head_dim,
                                                      int64_t element_bytes, int64_t keys) {
  PagedTcWorkspace w;
  const int64_t q_bytes = rerope_paged_align(tokens * (head_dim / 2) * 4 * 4);
  const int64_t side = rerope_paged_align(keys * kv_heads * head_dim * element_bytes);
  w.q_rotation = 0;
  w.k_near = q_bytes;
  w.k_far = q_bytes + side;
  w.keys = keys;
  w.bytes = kPagedWorkspaceAlign + q_bytes + 2 * side;
  return w;
}
// The layout with the largest budget that `bytes` holds (keys -1: not even the queries' part fits).
inline PagedTcWorkspace rerope_paged_workspace_within(int64_t bytes, int64_t tokens, int64_t kv_heads,
                                                      int64_t head_dim, int64_t element_bytes) {
  PagedTcWorkspace w = rerope_paged_workspace_layout(tokens, kv_heads, head_dim, element_bytes, 0);
  if (bytes < w.bytes) {
    w.keys = -1;
    return w;
  }
  const int64_t row = kv_heads * head_dim * element_bytes;
  const int64_t side = (bytes - w.bytes) / 2 / kPagedWorkspaceAlign * kPagedWorkspaceAlign;
  int64_t keys = row > 0 ? side / row : 0;
  keys = keys < (int64_t{1} << 30) ? keys : (int64_t{1} << 30);
  return rerope_paged_workspace_layout(tokens, kv_heads, head_dim, element_bytes, keys);
}

}  // namespace ropescale::rerope_cuda
