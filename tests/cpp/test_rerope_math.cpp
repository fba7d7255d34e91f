// Catch2 tests of the framework-free ReRoPE rules (csrc/include/ropescale/rerope_math.h).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "ropescale/rerope_math.h"

using namespace ropescale;

TEST_CASE("relative position: exact inside the window, clipped or leaky outside", "[rerope]") {
  CHECK(rerope_relative_position(0, 4, 0.0) == 0.0);
  CHECK(rerope_relative_position(3, 4, 0.0) == 3.0);
  CHECK(rerope_relative_position(4, 4, 0.0) == 4.0);
  CHECK(rerope_relative_position(1000, 4, 0.0) == 4.0);
  CHECK(rerope_relative_position(-7, 4, 0.0) == -7.0);  // non-causal: the future keeps its distance
  CHECK(rerope_relative_position(20, 4, 1.0 / 16) == Approx(4.0 + 16.0 / 16));
  CHECK(rerope_relative_position(4, 4, 1.0 / 16) == 4.0);
  CHECK(rerope_relative_position(9, 1, 1.0) == 9.0);  // slope 1: plain RoPE
}

TEST_CASE("far-side operand positions reproduce the rule: rot(q, a) . rot(k, b) sees a - b", "[rerope]") {
  for (const double leaky_k : {0.0, 16.0, 64.0, 1.0}) {
    for (int64_t window : {1, 7, 64}) {
      const RegionRule rule = make_region_rule(window, leaky_k, 0, 0);
      const double leaky_inv = leaky_k == 0.0 ? 0.0 : 1.0 / leaky_k;
      for (int64_t pk = 0; pk < 200; pk += 13) {
        for (int64_t pq = pk + window; pq < pk + window + 300; pq += 17) {
          REQUIRE_FALSE(rule.is_near(pq, pk));
          const double seen = rule.far_query_position(pq) - rule.far_key_position(pk);
          REQUIRE(seen == Approx(rerope_relative_position(pq - pk, window, leaky_inv)).margin(1e-9));
        }
      }
    }
  }
  const RegionRule rerope = make_region_rule(8, 0.0, 0, 0);
  CHECK(rerope.far_key_position(12345) == 0.0);  // ReRoPE: far keys are used as stored
  CHECK_FALSE(rerope.far_key_rotated());
  CHECK_FALSE(rerope.far_query_varies());
  CHECK(rerope.far_query_position(99) == 8.0);
}

// STRING (DESIGN.md): ReRoPE's far side with slope 1 starting at W: d >= S sees d - S + W, near d < S sees d;
// the far key is rotated at its own position, the far query at i - S + W (an integer: no rounding anywhere).
TEST_CASE("STRING: distances from S on are shifted down to d - S + W", "[rerope][string]") {
  CHECK(rerope_relative_position(10, 8, 1.0, 3) == 5.0);
  CHECK(rerope_relative_position(8, 8, 1.0, 3) == 3.0);
  CHECK(rerope_relative_position(7, 8, 1.0, 3) == 7.0);
  CHECK(rerope_relative_position(20, 8, 0.0, 3) == 3.0);  // far_start with plain ReRoPE: clipped at W
  CHECK(rerope_relative_position(20, 8, 0.0) == 8.0);     // -1: the window, as before
  for (int64_t shifted : {1, 7, 300}) {
    for (int64_t local : {int64_t{0}, shifted / 2, shifted}) {
      const RegionRule rule = make_region_rule(shifted, 1.0, 0, 0, local);
      CHECK(rule.far_query_varies());
      CHECK(rule.far_key_rotated());
      CHECK(rule.far_key_multiplier() == 1.0);
      for (int64_t pk = 0; pk < 500; pk += 23) {
        for (int64_t pq = pk; pq < pk + 700; pq += 11) {
          const int64_t d = pq - pk;
          REQUIRE(rule.is_near(pq, pk) == (d < shifted));
          if (d < shifted) continue;
          const double seen = rule.far_query_position(pq) - rule.far_key_position(pk);
          REQUIRE(seen == static_cast<double>(d - shifted + local));  // exact
          REQUIRE(rule.far_query_position(pq) == static_cast<double>(pq - shifted + local));
        }
      }
    }
  }
  // the largest positions: the far query stays an exact integer
  const RegionRule far = make_region_rule(43253, 1.0, 0, 0, 128);
  CHECK(far.far_query_position(2147483647) == 2147483647.0 - 43253 + 128);
}

TEST_CASE("near side: inside the window, including negative distances", "[rerope]") {
  CHECK(make_region_rule(1, 0.0, 0, 0).is_near(10, 10));
  CHECK_FALSE(make_region_rule(1, 0.0, 0, 0).is_near(11, 10));
  CHECK(make_region_rule(1, 0.0, 0, 0).is_near(3, 10));
  CHECK(make_region_rule(7, 0.0, 0, 0).is_near(16, 10));
  CHECK_FALSE(make_region_rule(7, 0.0, 0, 0).is_near(17, 10));
}

// Self-Extend (DESIGN.md): neighbour d < W at the true distance; grouped d >= W at
// floor(i/G) - floor(j/G) + W - floor(W/G), the paper's integer shift.
TEST_CASE("Self-Extend: neighbour window exact, grouped positions floored and shifted", "[rerope][self_extend]") {
  for (int64_t window : {1, 3, 8, 10}) {
    for (int64_t group : {1, 2, 3, 4, 7}) {
      const RegionRule rule = make_region_rule(window, 0.0, group, 0);
      CHECK(rule.far_key_rotated());
      CHECK(rule.far_query_varies());
      for (int64_t pk = 0; pk < 70; ++pk)
        for (int64_t pq = pk; pq < 90; ++pq) {
          const int64_t d = pq - pk;
          INFO("W " << window << " G " << group << " i " << pq << " j " << pk);
          REQUIRE(rule.is_near(pq, pk) == (d < window));
          if (d < window) continue;
          const double seen = rule.far_query_position(pq) - rule.far_key_position(pk);
          REQUIRE(seen == static_cast<double>(pq / group - pk / group + window - window / group));
          REQUIRE(seen >= static_cast<double>(window) - 1.0 + (window % group == 0 ? 1.0 : 0.0));
        }
    }
  }
  // floor, not truncation, for padding positions (rotated, never attended).
  CHECK(make_region_rule(4, 0.0, 3, 0).far_key_index(-1) == -1);
}

// Dual Chunk Attention with Qwen's chunk_size C and local_size S (DESIGN.md): the three regions
// (intra, successive, inter-chunk; every key at j mod n), against the rule's two sides.
TEST_CASE("Dual Chunk: the two-sided rule equals the three regions for every pair", "[rerope][dual_chunk]") {
  for (int64_t chunk_size = 1; chunk_size <= 13; ++chunk_size) {
    for (int64_t local = 0; local < chunk_size; ++local) {
      const RegionRule rule = make_region_rule(local, 0.0, 0, chunk_size);
      const int64_t n = chunk_size - local;
      CHECK(rule.far_key_rotated());
      CHECK_FALSE(rule.far_query_varies());
      for (int64_t pk = 0; pk < 60; ++pk)
        for (int64_t pq = pk; pq < 70; ++pq) {
          const int64_t cq = pq / n, ck = pk / n, oq = pq % n, ok = pk % n;
          int64_t expected;
          if (cq == ck)
            expected = oq - ok;
          else if (cq - ck == 1)
            expected = std::min(n + oq, chunk_size) - ok;
          else
            expected = std::min(2 * n - 1, chunk_size) - ok;
          const double seen = rule.is_near(pq, pk)
                                  ? static_cast<double>(pq - pk)
                                  : rule.far_query_position(pq) - rule.far_key_position(pk);
          INFO("C " << chunk_size << " S " << local << " i " << pq << " j " << pk);
          REQUIRE(seen == static_cast<double>(expected));
          REQUIRE(rule.near_start(pq) <= pq);  // the classification's premise
        }
    }
  }
}

TEST_CASE("log-n scale: 1 up to the training length, ln(p+1)/ln(L) after, 1 for padding", "[rerope]") {
  const int64_t train = 4096;
  const double inv = 1.0 / std::log(4096.0);
  CHECK(rerope_logn_scale(0, train, inv) == 1.0f);
  CHECK(rerope_logn_scale(4095, train, inv) == 1.0f);
  CHECK(rerope_logn_scale(8191, train, inv) == Approx(std::log(8192.0) / std::log(4096.0)));
  CHECK(rerope_logn_scale(-1, train, inv) == 1.0f);
  CHECK(rerope_logn_scale(100000, 0, 0.0) == 1.0f);  // off
}

TEST_CASE("visibility: causal by position, negative positions are padding", "[rerope]") {
  CHECK(rerope_visible(5, 5, true));
  CHECK_FALSE(rerope_visible(5, 6, true));
  CHECK(rerope_visible(5, 6, false));
  CHECK_FALSE(rerope_visible(5, -1, false));
  CHECK_FALSE(rerope_visible(-1, 0, false));
}

TEST_CASE("rotation pairs: rotate_half and interleaved layouts, partial rotary", "[rerope]") {
  int a, b;
  rotary_pair_dims(3, 8, false, &a, &b);
  CHECK((a == 3 && b == 11));
  rotary_pair_dims(3, 8, true, &a, &b);
  CHECK((a == 6 && b == 7));
  rotary_pair_dims(0, 4, false, &a, &b);  // rotary_dim 8 of a larger head: dims 0..7 only
  CHECK((a == 0 && b == 4));
}

// Brute force over the pairs of a tile: the classification must agree with every pair.
TEST_CASE("tile classification is exact for arbitrary positions", "[rerope][tiles]") {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> pos(-3, 60), len(1, 6);
  for (int trial = 0; trial < 60000; ++trial) {
    const int64_t window = 1 + trial % 9;
    const int kind = (trial / 9) % 3;  // ReRoPE, Self-Extend, Dual Chunk
    const bool causal = kind == 2 || trial % 2 == 0;
    const RegionRule rule = kind == 0   ? make_region_rule(window, 0.0, 0, 0)
                            : kind == 1 ? make_region_rule(window, 0.0, 1 + trial % 5, 0)
                                        : make_region_rule(window - 1, 0.0, 0, window + trial % 4);
    std::vector<int64_t> qs(len(gen)), ks(len(gen));
    PositionRange qr, kr;
    for (auto& p : qs) qr.add(p = pos(gen));
    for (auto& p : ks) kr.add(p = pos(gen));
    bool any_visible = false, any_near = false, any_far = false, any_masked = false;
    for (int64_t pq : qs)
      for (int64_t pk : ks) {
        const bool visible = rerope_visible(pq, pk, causal);
        any_masked |= !visible;
        if (!visible) continue;
        any_visible = true;
        (rule.is_near(pq, pk) ? any_near : any_far) = true;
      }
    const TileClass tc = rerope_classify_tile(qr, kr, rule, causal);
    INFO("trial " << trial);
    if (tc.kind == TileKind::kSkip) {
      REQUIRE_FALSE(any_visible);
      continue;
    }
    // Never wrong about a visible pair; at most conservative (band) when bounds overlap.
    if (any_near) REQUIRE(tc.kind != TileKind::kFar);
    if (any_far) REQUIRE(tc.kind != TileKind::kNear);
    if (any_masked) REQUIRE(tc.needs_mask);
    if (!any_visible) REQUIRE(tc.needs_mask);
  }
}

TEST_CASE("tile classification of sorted blocks: skip above the diagonal, band at the window edge",
          "[rerope][tiles]") {
  auto block = [](int64_t first, int64_t count) {
    PositionRange r;
    for (int64_t p = first; p < first + count; ++p) r.add(p);
    return r;
  };
  const RegionRule w = make_region_rule(512, 0.0, 0, 0);
  CHECK(rerope_classify_tile(block(0, 64), block(128, 128), w, true).kind == TileKind::kSkip);
  const TileClass diagonal = rerope_classify_tile(block(128, 64), block(128, 128), w, true);
  CHECK((diagonal.kind == TileKind::kNear && diagonal.needs_mask));
  const TileClass far = rerope_classify_tile(block(4096, 64), block(0, 128), w, true);
  CHECK((far.kind == TileKind::kFar && !far.needs_mask));
  CHECK(rerope_classify_tile(block(600, 64), block(0, 128), w, true).kind == TileKind::kBand);
  CHECK(rerope_classify_tile(block(0, 64), block(128, 128), w, false).kind == TileKind::kNear);
  PositionRange padded = block(0, 10);
  padded.add(-1);
  CHECK(rerope_classify_tile(block(20, 4), padded, w, true).needs_mask);
  CHECK(rerope_classify_tile(PositionRange{}, block(0, 4), w, true).kind == TileKind::kSkip);
}
