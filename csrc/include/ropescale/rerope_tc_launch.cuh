// Host launchers of the tensor-core prefill (rerope_attention_tc.cuh): what it serves, its shared memory
// and workspace, the dense launch and the paged one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ropescale/portable.h"
#include "ropescale/rerope_key_prepass.cuh"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_tc_kernels.cuh"
#include "ropescale/rerope_tc_prepass.cuh"
#include "ropescale/rerope_tc_tiles.cuh"

namespace ropescale::rerope_cuda {

// Whether the tensor-core prefill serves this problem: fp16/bf16 (the caller's choice of T), a
// supported head dim, and 16-byte aligned k/v rows (checked by the caller on the pointers).
constexpr bool rerope_tc_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
}

// Shared memory of the tensor-core prefill per block (69,632 B at D 128: every GPU from sm_80 on).
inline std::size_t rerope_tc_smem_bytes(int head_dim) {
  switch (head_dim) {
    case 64: return tc::Shape<64>::kSmemBytes;
    case 80: return tc::Shape<80>::kSmemBytes;
    case 96: return tc::Shape<96>::kSmemBytes;
    default: return tc::Shape<128>::kSmemBytes;
  }
}

// Shared memory of the paged tensor-core prefill per block: the same, plus its request's turn rates.
inline std::size_t rerope_paged_tc_smem_bytes(int head_dim) {
  switch (head_dim) {
    case 64: return tc::Shape<64>::kPagedSmemBytes;
    case 80: return tc::Shape<80>::kPagedSmemBytes;
    case 96: return tc::Shape<96>::kPagedSmemBytes;
    default: return tc::Shape<128>::kPagedSmemBytes;
  }
}

// Workspace of the tensor-core prefill, allocated by the caller:
//   p.k_near: T [B, Hkv, Lk, D]; p.k_far: the same, Leaky only; tiles: KeyTile [B, ceil(Lk / 64)];
//   p.q_rotation: float [B, Lq, rotary_pairs, 4] (rerope_tc_query_rotation_floats); p.key_rates:
//   KeyRate [rotary_pairs].
inline int rerope_tc_key_tiles(int k_len) { return (k_len + tc::kBlockN - 1) / tc::kBlockN; }
inline int64_t rerope_tc_query_rotation_floats(const ReropeParams& p) {
  return static_cast<int64_t>(p.batch) * p.q_len * p.rotary_pairs * 4;
}

// Launches the five kernels: the keys' turn rates, keys rotated to T, the queries' sin/cos, the key-tile
// bounds, the prefill. `check(status, what)` runs after every launch (and after the shared-memory opt-in) with
// the CUDA status (0 = ok); it must not return on an error, so that no kernel reads the output of a
// failed one.
template <typename T, int kHeadDim, class Check>
inline void launch_rerope_prefill_tc(ReropeParams p, KeyTile* tiles, cudaStream_t stream, Check&& check) {
  using S = tc::Shape<kHeadDim>;
  const auto blocks_of_256 = [](int64_t items) {
    return dim3(static_cast<unsigned>((items + 255) / 256 < 65535 ? (items + 255) / 256 : 65535));
  };
  launch_rerope_key_rates(p, stream, check);
  ROPESCALE_LAUNCH_KERNEL((rerope_rotate_keys_kernel<T, T>),
                          blocks_of_256(static_cast<int64_t>(p.batch) * p.k_len * (p.head_dim / 2)), dim3(256), 0,
                          stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the rotate-keys kernel");
  const int64_t rotation_items = static_cast<int64_t>(p.batch) * p.q_len * p.rotary_pairs;
  if (rotation_items > 0) {
    ROPESCALE_LAUNCH_KERNEL(rerope_query_rotation_kernel<4>, blocks_of_256(rotation_items), dim3(256), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the query-rotation kernel");
  }
  const int n_tiles = rerope_tc_key_tiles(p.k_len);
  ROPESCALE_LAUNCH_KERNEL(rerope_key_tiles_kernel<tc::kBlockN>,
                          dim3(static_cast<unsigned>((n_tiles + kWarps - 1) / kWarps), static_cast<unsigned>(p.batch)),
                          dim3(kThreads), 0, stream, p, tiles);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the key-tiles kernel");
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_prefill_tc_kernel<T, kHeadDim>), S::kSmemBytes),
        "the shared-memory opt-in of the tensor-core prefill");
  const dim3 grid(static_cast<unsigned>((p.q_len + tc::kBlockM - 1) / tc::kBlockM), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  ROPESCALE_LAUNCH_KERNEL((rerope_prefill_tc_kernel<T, kHeadDim>), grid, dim3(kThreads), S::kSmemBytes, stream, p,
                          static_cast<const KeyTile*>(tiles));
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the tensor-core prefill kernel");
}

// Whether the caches' rows suit the tensor-core prefill's 16-byte cp.async (the values, and the keys
// of the requests that rotate their key tiles in the kernel, are read in place): base addresses and every
// stride (elements) multiples of 16 bytes.
inline bool rerope_paged_tc_aligned(const ReropeParams& p, std::size_t element_bytes) {
  const int64_t per_chunk = static_cast<int64_t>(16 / element_bytes);
  return reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && p.v_stride_b % per_chunk == 0 &&
         p.v_stride_h % per_chunk == 0 && p.v_stride_l % per_chunk == 0 && reinterpret_cast<uintptr_t>(p.k) % 16 == 0 &&
         p.k_stride_b % per_chunk == 0 && p.k_stride_h % per_chunk == 0 && p.k_stride_l % per_chunk == 0;
}

// The tensor-core rows of a paged launch: after launch_rerope_paged (and its split combine, which
// leaves these rows to this launch), whose schedule kernel, run with p.paged_tc, chose the requests (and,
// within p.paged_tc_key_budget, those whose keys the pre-pass rotates) and wrote p.paged_tc_key_offsets
// and p.paged_tc_tasks (p.num_paged_tc_tasks of them, rerope_paged_max_tc_tasks), and whose first kernel
// wrote p.key_rates. Workspaces, allocated by the caller: p.q_rotation float [T, rotary_pairs, 4]; with a
// budget, p.k_near and p.k_far, T [paged_tc_key_budget, Hkv, D] each (rerope_paged_workspace_layout).
// The value cache (and the key cache, read in place by the requests past the budget) must pass
// rerope_paged_tc_aligned; q_heads <= 65535.
template <typename T, int kHeadDim, class Check>
inline void launch_rerope_paged_tc(ReropeParams p, cudaStream_t stream, Check&& check) {
  using S = tc::Shape<kHeadDim>;
  p.batch = 1;
  p.causal = true;
  if (!p.paged_tc || p.num_paged_tc_tasks == 0) return;
  if (p.paged_tc_key_budget > 0) {
    // Grid-stride over the rows in use (known on the device only): up to 1024 blocks of 256, so that a
    // launch whose tensor-core rows all rotate in the kernel (or that has none) costs little.
    const int64_t rotate_items = p.paged_tc_key_budget * (p.head_dim / 2);
    const int64_t rotate_blocks = (rotate_items + 255) / 256 < 1024 ? (rotate_items + 255) / 256 : 1024;
    ROPESCALE_LAUNCH_KERNEL(rerope_paged_rotate_keys_kernel<T>, dim3(static_cast<unsigned>(rotate_blocks)), dim3(256),
                            0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged rotate-keys kernel");
  }
  if (p.rotary_pairs > 0) {
    ROPESCALE_LAUNCH_KERNEL(rerope_paged_query_rotation_kernel<tc::kBlockM>,
                            dim3(static_cast<unsigned>(p.num_paged_tc_tasks)), dim3(256), 0, stream, p);
    check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged query-rotation kernel");
  }
  static device::SmemOptIn opt_in;  // once per device
  check(opt_in.ensure((rerope_paged_tc_kernel<T, kHeadDim>), S::kPagedSmemBytes),
        "the shared-memory opt-in of the paged tensor-core prefill");
  const dim3 grid(static_cast<unsigned>(p.num_paged_tc_tasks), static_cast<unsigned>(p.q_heads));
  ROPESCALE_LAUNCH_KERNEL((rerope_paged_tc_kernel<T, kHeadDim>), grid, dim3(kThreads), S::kPagedSmemBytes, stream, p);
  check(ROPESCALE_LAST_LAUNCH_ERROR(), "the paged tensor-core prefill kernel");
}

}  // namespace ropescale::rerope_cuda
