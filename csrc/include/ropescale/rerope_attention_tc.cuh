// Tensor-core prefill of rerope_attention for fp16 and bf16 inputs (sm_80 and newer), framework-free
// like rerope_attention.cuh, whose ReropeParams and rotate-keys pre-pass it shares. The same source
// compiles with nvcc (inline PTX through ropescale/portable.h) and, with ROPESCALE_EMULATION, runs on
// the CPU emulation, whose mma.sync / ldmatrix / cp.async follow the PTX ISA's fragment layouts.
//
// One body (rerope_prefill_tc_block) over two problems, as the SIMT kernels: TcDenseProblem (a batch
// row of rerope_attention; keys pre-rotated by rerope_rotate_keys_kernel, key-tile bounds from
// rerope_key_tiles_kernel) and TcPagedProblem (a prefill request of rerope_attention_paged, chosen by
// rerope_paged_schedule_kernel: tile bounds from the slot indices, its own table and softmax scale, the
// values read in place from the pages, and its keys either rotated through the block table by
// rerope_paged_rotate_keys_kernel into a packed workspace while they fit its budget, or, past it, read
// raw from the pages like the values and rotated tile by tile in shared memory by the body itself, so
// that no length leaves the tensor cores).
//
// The FlashAttention-2 structure, with ReRoPE's tile classification:
//   * one CTA of 4 warps per (64 queries, q head); warp w owns query rows 16w..16w+15 of the block
//     and keeps its output accumulator (16 x D, f32) and its online-softmax state in registers;
//   * the block's queries, rotated twice (near side at p, far side at w + (p - w)/k) in f32 and
//     rounded to T, stay in shared memory; the keys were rotated once by the pre-pass into T
//     buffers (near side at p; Leaky far side at p/k; plain ReRoPE's far side is the raw key);
//   * key tiles of 64 go through shared memory with cp.async: the K tile(s) of tile j+1 are fetched
//     while the warps compute P.V of tile j, and V of tile j while they compute its scores (the
//     FlashAttention-2 K/V ping-pong: one buffer each, always one load in flight);
//   * ldmatrix feeds mma.sync.m16n8k16 (f32 accumulators): S = Q K^T in 16-column steps of the head
//     dim, then O += P V with P (rounded to T) taken from the S accumulators as the A operand;
//   * every key tile is classified from its position bounds (rerope_math.h) against the block's
//     queries, which decides what is loaded, and against each warp's 16 queries, which decides what
//     the warp computes: near or far tiles one product, band tiles both (selected per element by the
//     distance rule), skipped tiles nothing (not even loaded). A per-tile table of key position bounds
//     (rerope_key_tiles_kernel) lets a warp look 32 tiles ahead with one load per lane and a ballot.
//
// Rounding (the contract for low-precision inputs, DESIGN.md): the rotated q and k and the
// probabilities are rounded to T as FlashAttention and SDPA round theirs; every product is
// accumulated in f32 (mma.sync), the softmax is f32, scale and log-n multiply the f32 scores. The
// same path runs at every problem size.
//
// Head dims 64, 80, 96 and 128 (any multiple of 16 up to 128 whose 16-byte chunk count per row
// leaves a tail of 0, 1, 2 or 4 chunks past a multiple of 8). Head dim 256 would need 128
// accumulator registers per thread for O alone plus two score fragments on band tiles: past the
// register file without spills at 4 warps, so the SIMT kernel serves D > 128 (and other dims, and
// fp32). Decode (a few query tokens) stays on the SIMT split-K kernel: it reads the whole cache once
// per token and does ~1 FLOP per byte, so it is bound by memory bandwidth, not by the FMA rate that
// tensor cores raise.
//
// The parts, in include order (each includes what it uses; ReropeParams and the key pre-passes are
// the SIMT side's: rerope_params.h, rerope_key_prepass.cuh):
//   rerope_tc_tiles.cuh     key-tile bounds, the block shape, position bounds, shared-memory tiles
//   rerope_tc_mma.cuh       the two products (S = Q K^T, O += P V) on mma.sync
//   rerope_tc_prepass.cuh   the queries' sin/cos, key-tile bounds, the paged keys' rotation
//   rerope_tc_problems.cuh  TcDenseProblem / TcPagedProblem
//   rerope_tc_kernels.cuh   the prefill body and its dense and paged kernels
//   rerope_tc_launch.cuh    host launchers
#pragma once

#include "ropescale/rerope_params.h"
#include "ropescale/rerope_key_prepass.cuh"
#include "ropescale/rerope_tc_tiles.cuh"
#include "ropescale/rerope_tc_mma.cuh"
#include "ropescale/rerope_tc_prepass.cuh"
#include "ropescale/rerope_tc_problems.cuh"
#include "ropescale/rerope_tc_kernels.cuh"
#include "ropescale/rerope_tc_launch.cuh"
#include "ropescale/rerope_simt_launch.cuh"

#include <type_traits>

namespace ropescale::rerope_cuda {

// The whole paged launch, as rerope_paged.cu and the emulation tests run it: the schedule, the SIMT rows
// and the split combine (launch_rerope_paged), then, for fp16/bf16 with p.paged_tc, the tensor-core rows
// (launch_rerope_paged_tc at p.head_dim), from ONE ReropeParams: the tensor-core kernels read the
// schedule's workspaces (p.paged_requests, p.paged_tc_tasks, ...), which the caller allocates and sets
// once for both. (The CUDA glue once launched the tensor-core rows from a copy of the params made before
// those workspaces were set: every tensor-core row read a null p.paged_requests, an illegal memory access
// found on an H200 that the emulation, running its own glue, could not see.)
template <typename T, class Shape, class Check = IgnoreLaunchStatus>
inline void launch_rerope_paged_with_tensor_cores(const ReropeParams& p, int num_splits, cudaStream_t stream,
                                                  Check&& check = {}) {
  launch_rerope_paged<T, Shape>(p, num_splits, stream, check);
  if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
    if (!p.paged_tc) return;
    switch (p.head_dim) {
      case 64: return launch_rerope_paged_tc<T, 64>(p, stream, check);
      case 80: return launch_rerope_paged_tc<T, 80>(p, stream, check);
      case 96: return launch_rerope_paged_tc<T, 96>(p, stream, check);
      case 128: return launch_rerope_paged_tc<T, 128>(p, stream, check);
      default: check(1, "the paged tensor-core prefill (head dim not 64, 80, 96 or 128)");
    }
  }
}

}  // namespace ropescale::rerope_cuda
