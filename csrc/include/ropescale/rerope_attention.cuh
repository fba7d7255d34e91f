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
// through a block table; see rerope_paged_schedule.cuh): a Problem class (DenseProblem,
// PagedProblem) says where a block's rows, keys, values, positions, rotation table and scale are.
//
// These scalar-FMA kernels serve fp32 inputs, head dims the tensor-core prefill does not take, and
// every decode (dense: up to 16 queries; paged: requests of up to 4 rows, and the prefill requests
// past the tensor-core pre-pass's budget). Decode stays here on purpose: one query token against the
// cache reads every key and value once and does about one FLOP per byte read, so it is bound by
// memory bandwidth; tensor cores would raise a compute rate that is not the limit. The fp16/bf16
// prefill runs on tensor cores (rerope_attention_tc.cuh), dense and paged.
//
// The parts, in include order (each includes what it uses):
//   element.h                  element conversions (to_acc, from_acc, round_to)
//   rerope_params.h            ReropeParams, the paged records, the row plan, the block geometry
//   rerope_simt_problems.cuh   DenseProblem / PagedProblem: a block's work and where its data lie
//   rerope_simt_tiles.cuh      tile shapes, shared-memory views, the steps of a block and of a key tile
//   rerope_simt_kernels.cuh    the block body; the prefill, decode, paged and combine kernels
//   rerope_key_prepass.cuh     the keys' turn rates and rotated keys (shared with the tensor cores)
//   rerope_paged_schedule.cuh  the paged launch's prepare and schedule kernels
//   rerope_simt_launch.cuh     host launchers: the tile shape, dense prefill and decode, paged
//   rerope_cache_write.cuh     rerope_cache_write_'s kernel and launcher
#pragma once

#include "ropescale/element.h"
#include "ropescale/rerope_params.h"
#include "ropescale/rerope_simt_problems.cuh"
#include "ropescale/rerope_simt_tiles.cuh"
#include "ropescale/rerope_simt_kernels.cuh"
#include "ropescale/rerope_key_prepass.cuh"
#include "ropescale/rerope_paged_schedule.cuh"
#include "ropescale/rerope_simt_launch.cuh"
#include "ropescale/rerope_cache_write.cuh"
