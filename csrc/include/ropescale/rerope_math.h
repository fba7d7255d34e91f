// Framework-free ReRoPE rules shared by the CPU kernel, the CUDA kernels (and their CPU emulation)
// and the Catch2 tests: the relative-position rule, the positions at which each side of the window
// rotates its operands, log-n scaling, visibility, and the near/far/band classification of a tile.
//
// ReRoPE (Su): with window w and distance d = p_q - p_k, the relative position is r(d) = d when
// d < w, else w (ReRoPE) or w + (d - w)/k (Leaky ReRoPE, slope 1/k). Since rotations compose,
//   near (d < w):  <rot(q, r(d)), k> = <rot(q, p_q), rot(k, p_k)>
//   far  (d >= w): <rot(q, r(d)), k> = <rot(q, w + (p_q - w)/k), rot(k, p_k/k)>   (1/k = 0: ReRoPE)
// so each side is ordinary attention over operands rotated at their own (per-token) positions.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "ropescale/portable.h"

namespace ropescale {

// Relative position seen by a query at distance `dist` from a key (reference formula; the kernels
// never evaluate it per pair). `leaky_inv` is 1/k, 0 for plain ReRoPE.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double rerope_relative_position(int64_t dist, int64_t window,
                                                                       double leaky_inv) {
  if (dist < window) return static_cast<double>(dist);
  return static_cast<double>(window) + static_cast<double>(dist - window) * leaky_inv;
}

// Whether a (query, key) pair is on the near side of the window.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE bool rerope_is_near(int64_t q_position, int64_t k_position,
                                                           int64_t window) {
  return q_position - k_position < window;
}

// Position at which the far side rotates the query: w + (p - w)/k (ReRoPE: w).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double rerope_far_query_position(int64_t q_position, int64_t window,
                                                                        double leaky_inv) {
  return static_cast<double>(window) + static_cast<double>(q_position - window) * leaky_inv;
}

// Position at which the far side rotates the key: p/k (ReRoPE: 0, the key is used as stored).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double rerope_far_key_position(int64_t k_position, double leaky_inv) {
  return static_cast<double>(k_position) * leaky_inv;
}

// Log-n query scaling max(1, ln(p+1)/ln(L_train)); `inv_log_train` = 1/ln(L_train), 0 disables it.
// Positions up to L_train - 1 (and padding, p < 0) get exactly 1.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE float rerope_logn_scale(int64_t q_position, int64_t logn_length,
                                                               double inv_log_train) {
  if (logn_length <= 0 || q_position + 1 <= logn_length) return 1.0f;
  return static_cast<float>(std::log(static_cast<double>(q_position + 1)) * inv_log_train);
}

// A negative position marks padding: such a key is never attended and such a query attends nothing.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE bool rerope_visible(int64_t q_position, int64_t k_position, bool causal) {
  return q_position >= 0 && k_position >= 0 && (!causal || k_position <= q_position);
}

// Rotation pairs: interleaved (GPT-J) pairs (2i, 2i+1); otherwise (GPT-NeoX, transformers'
// rotate_half) pairs (i, i + rotary_dim/2). Dimensions from rotary_dim on are not rotated.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void rotary_pair_dims(int pair, int rotary_pairs, bool interleaved,
                                                             int* first, int* second) {
  *first = interleaved ? 2 * pair : pair;
  *second = interleaved ? 2 * pair + 1 : pair + rotary_pairs;
}

// What a tile of (query, key) pairs needs.
enum class TileKind : int { kSkip = 0, kNear = 1, kFar = 2, kBand = 3 };

struct TileClass {
  TileKind kind;
  bool needs_mask;  // some pair in the tile is not visible (causal edge or padding)
};

// Bounds of the valid (>= 0) positions of a block of tokens; `count` = 0 when none is valid.
struct PositionRange {
  int64_t min = std::numeric_limits<int64_t>::max();
  int64_t max = std::numeric_limits<int64_t>::min();
  int count = 0;      // valid positions
  bool any_padding = false;  // some token of the block is padding (position < 0)

  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE void add(int64_t position) {
    if (position < 0) {
      any_padding = true;
      return;
    }
    min = position < min ? position : min;
    max = position > max ? position : max;
    ++count;
  }
};

// Classifies the tile (query block x key block) from the position bounds alone, which is exact for
// any position ids: near when every distance is < w, far when every one is >= w, band otherwise;
// skipped when no pair can be visible.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE TileClass rerope_classify_tile(const PositionRange& queries,
                                                                      const PositionRange& keys, int64_t window,
                                                                      bool causal) {
  if (queries.count == 0 || keys.count == 0 || (causal && keys.min > queries.max))
    return {TileKind::kSkip, false};
  const bool needs_mask = queries.any_padding || keys.any_padding || (causal && keys.max > queries.min);
  const int64_t max_dist = queries.max - keys.min;
  // Visible pairs only: with causal masking no visible distance is below 0.
  int64_t min_dist = queries.min - keys.max;
  if (causal && min_dist < 0) min_dist = 0;
  if (max_dist < window) return {TileKind::kNear, needs_mask};
  if (min_dist >= window) return {TileKind::kFar, needs_mask};
  return {TileKind::kBand, needs_mask};
}

}  // namespace ropescale
