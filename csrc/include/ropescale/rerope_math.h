// Framework-free ReRoPE rules shared by the CPU kernel, the CUDA kernels (and their CPU emulation)
// and the Catch2 tests: the relative-position rule, the positions at which each side of the window
// rotates its operands, log-n scaling, visibility, and the near/far/band classification of a tile.
//
// ReRoPE (Su): with window w and distance d = p_q - p_k, the relative position is r(d) = d when
// d < w, else s + (d - w)/k: ReRoPE (s = w, 1/k = 0), Leaky ReRoPE (s = w, slope 1/k), STRING (An et al.:
// shifted_offset w, local_value s, k = 1: r = d - w + s). Since rotations compose,
//   near (d < w):  <rot(q, r(d)), k> = <rot(q, p_q), rot(k, p_k)>
//   far  (d >= w): <rot(q, r(d)), k> = <rot(q, s + (p_q - w)/k), rot(k, p_k/k)>   (1/k = 0: ReRoPE)
// so each side is ordinary attention over operands rotated at their own (per-token) positions.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "ropescale/portable.h"

namespace ropescale {

// The methods of the family differ only in which pairs are near and where the far side rotates its
// operands (DESIGN.md, "Self-Extend and Dual Chunk Attention", "STRING"); everything else (tiles, GQA, masking, log-n, the merge) is
// shared, so a new rule is a kind here (or parameters of one) and its make_region_rule arguments. With window w:
//   ReRoPE / Leaky ReRoPE (slope 1/k), STRING (k = 1, far start s):
//                                       near d < w;  far q at s + (i - w)/k, k at j/k (ReRoPE: s, 0; s = w but
//                                       for STRING)
//   Self-Extend (group G):              near d < w;  far q at floor(i/G) + w - floor(w/G), k at floor(j/G)
//   Dual Chunk (chunk_size C, w = local_size S, chunk length n = C - S): near when the key is in the
//     query's chunk, or in the previous one while the query's offset i mod n <= S (then the true
//     distance is at most C - j mod n, what DCA's successive-chunk rule gives); far q at min(2n - 1, C),
//     k at j mod n. DESIGN's intra/successive/inter regions, merged: the successive region past the
//     local window and the inter-chunk region rotate the query at the same position (C when S < n;
//     when S >= n the successive region is all near).
enum class RegionKind : int { kReRoPE = 0, kSelfExtend = 1, kDualChunk = 2 };

namespace region_detail {
// Floor division of a position by a size of the rule (1 <= b <= kMaxPosition < 2^31). Positions are at
// most kMaxPosition, so one 32-bit division serves (a 64-bit one costs the tensor-core kernels registers
// they do not have); a negative position is padding, never attended but rotated anyway: floored the same
// way down to -2^31, clamped below that.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int64_t floor_div(int64_t a, int64_t b) {
  const uint32_t divisor = static_cast<uint32_t>(b);
  if (a >= 0) return static_cast<int64_t>(static_cast<uint32_t>(a) / divisor);
  const uint32_t below = a < -int64_t{0x7fffffff} ? 0x7fffffffu : static_cast<uint32_t>(-(a + 1));
  return -static_cast<int64_t>(below / divisor) - 1;
}
}  // namespace region_detail

struct RegionRule {
  RegionKind kind = RegionKind::kReRoPE;
  int64_t window = 1;      // ReRoPE, Self-Extend: w >= 1; Dual Chunk: local_size S >= 0
  double leaky_inv = 0.0;  // Leaky ReRoPE: 1/k (0: plain ReRoPE)
  int64_t group = 1;       // Self-Extend: G >= 1
  int64_t chunk = 1;       // Dual Chunk: n = C - S >= 1
  int64_t far_query = 0;   // Self-Extend: the shift w - floor(w/G); Dual Chunk: min(2n - 1, C)
  int64_t far_start = 1;   // ReRoPE family: the far side's relative position at distance w (w but for STRING)

  // Keys at positions >= near_start(q) are on the near side of a query at q (and after it: causal=False).
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int64_t near_start(int64_t q) const {
    if (kind != RegionKind::kDualChunk) return q - window + 1;
    const int64_t start = region_detail::floor_div(q, chunk) * chunk;
    return q - start <= window ? start - chunk : start;
  }
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE bool is_near(int64_t q, int64_t k) const { return k >= near_start(q); }
  // Position at which the far side rotates the query.
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double far_query_position(int64_t q) const {
    if (kind == RegionKind::kSelfExtend) return static_cast<double>(region_detail::floor_div(q, group) + far_query);
    if (kind == RegionKind::kDualChunk) return static_cast<double>(far_query);
    return static_cast<double>(far_start) + static_cast<double>(q - window) * leaky_inv;
  }
  // Whether the far query position depends on the query (else one rotation serves every row).
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE bool far_query_varies() const {
    return kind == RegionKind::kSelfExtend || (kind == RegionKind::kReRoPE && leaky_inv != 0.0);
  }
  // The far side's key is rotated at far_key_index(j) * far_key_multiplier(): an integer index times a
  // turn rate (turn_angles.h), so that the GPU's key angles stay exact integer arithmetic.
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE int64_t far_key_index(int64_t k) const {
    if (kind == RegionKind::kSelfExtend) return region_detail::floor_div(k, group);
    if (kind == RegionKind::kDualChunk) return k - region_detail::floor_div(k, chunk) * chunk;
    return k;
  }
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double far_key_multiplier() const {
    return kind == RegionKind::kReRoPE ? leaky_inv : 1.0;
  }
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double far_key_position(int64_t k) const {
    return static_cast<double>(far_key_index(k)) * far_key_multiplier();
  }
  // Whether the far side rotates keys at all (plain ReRoPE's far key is the stored key).
  ROPESCALE_HOST_DEVICE ROPESCALE_INLINE bool far_key_rotated() const {
    return kind != RegionKind::kReRoPE || leaky_inv != 0.0;
  }
};

// The rule of the ops' arguments (validated by the caller: check_region_arguments): group > 0 is
// Self-Extend, chunk_size > 0 Dual Chunk with window = local_size, else (Leaky) ReRoPE or STRING, whose
// far side starts at far_start (-1: the window).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE RegionRule make_region_rule(int64_t window, double leaky_k, int64_t group,
                                                                   int64_t chunk_size, int64_t far_start = -1) {
  RegionRule rule;
  rule.window = window;
  rule.far_start = far_start < 0 ? window : far_start;
  if (group > 0) {
    rule.kind = RegionKind::kSelfExtend;
    rule.group = group;
    rule.far_query = window - window / group;
  } else if (chunk_size > 0) {
    rule.kind = RegionKind::kDualChunk;
    rule.chunk = chunk_size - window;
    rule.far_query = 2 * rule.chunk - 1 < chunk_size ? 2 * rule.chunk - 1 : chunk_size;
  } else {
    rule.leaky_inv = leaky_k == 0.0 ? 0.0 : 1.0 / leaky_k;
  }
  return rule;
}

// Relative position of ReRoPE seen by a query at distance `dist` from a key (the reference formula of
// the Catch2 tests; the kernels never evaluate it per pair). `leaky_inv` is 1/k, 0 for plain ReRoPE;
// `far_start` the far side's first position (-1: the window; STRING's local_value).
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE double rerope_relative_position(int64_t dist, int64_t window,
                                                                       double leaky_inv, int64_t far_start = -1) {
  if (dist < window) return static_cast<double>(dist);
  return static_cast<double>(far_start < 0 ? window : far_start) + static_cast<double>(dist - window) * leaky_inv;
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

// A block of queries as the tile classification reads it: the bounds of its valid positions and the
// near starts of both (near_start never decreases), worked out once per block rather than per tile. In
// 32 bits: positions are at most kMaxPosition < 2^31 (the tensor-core kernels have no register to spare).
struct QueryBounds {
  int32_t min = 0, max = -1, near_start_of_min = 0, near_start_of_max = 0;
  bool any = false;  // some position is valid (a flag: predicates cost no register)
  bool any_padding = false;
};

ROPESCALE_HOST_DEVICE ROPESCALE_INLINE QueryBounds query_bounds(const PositionRange& queries, const RegionRule& rule) {
  QueryBounds b;
  b.any = queries.count > 0;
  b.any_padding = queries.any_padding;
  if (!b.any) return b;
  // Each fits: q - w + 1 >= -2^31 + 2, and a chunk start minus a chunk >= -(2^31 - 1).
  b.min = static_cast<int32_t>(queries.min);
  b.max = static_cast<int32_t>(queries.max);
  b.near_start_of_min = static_cast<int32_t>(rule.near_start(queries.min));
  b.near_start_of_max = static_cast<int32_t>(rule.near_start(queries.max));
  return b;
}

// Classifies the tile (query block x key block) from the position bounds alone, which is exact for
// any position ids since near_start never decreases: near when every visible pair is near, far when
// every one is far, band otherwise; skipped when no pair can be visible.
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE TileClass rerope_classify_tile(const QueryBounds& queries,
                                                                      const PositionRange& keys, bool causal) {
  if (!queries.any || keys.count == 0 || (causal && keys.min > queries.max))
    return {TileKind::kSkip, false};
  const bool needs_mask = queries.any_padding || keys.any_padding || (causal && keys.max > queries.min);
  if (keys.min >= queries.near_start_of_max) return {TileKind::kNear, needs_mask};
  // Every near_start(q) <= q, so a causal key after the query (invisible) never makes a tile band.
  if (keys.max < queries.near_start_of_min) return {TileKind::kFar, needs_mask};
  return {TileKind::kBand, needs_mask};
}
ROPESCALE_HOST_DEVICE ROPESCALE_INLINE TileClass rerope_classify_tile(const PositionRange& queries,
                                                                      const PositionRange& keys,
                                                                      const RegionRule& rule, bool causal) {
  return rerope_classify_tile(query_bounds(queries, rule), keys, causal);
}

}  // namespace ropescale
