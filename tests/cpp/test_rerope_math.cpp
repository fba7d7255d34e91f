// Catch2 tests of the framework-free ReRoPE rules (csrc/include/ropescale/rerope_math.h).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cmath>
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
  for (const double leaky_inv : {0.0, 1.0 / 16, 1.0 / 64, 1.0}) {
    for (int64_t window : {1, 7, 64}) {
      for (int64_t pk = 0; pk < 200; pk += 13) {
        for (int64_t pq = pk + window; pq < pk + window + 300; pq += 17) {
          const double seen = rerope_far_query_position(pq, window, leaky_inv) - rerope_far_key_position(pk, leaky_inv);
          REQUIRE(seen == Approx(rerope_relative_position(pq - pk, window, leaky_inv)).margin(1e-9));
        }
      }
    }
  }
  CHECK(rerope_far_key_position(12345, 0.0) == 0.0);  // ReRoPE: far keys are used as stored
  CHECK(rerope_far_query_position(99, 8, 0.0) == 8.0);
}

TEST_CASE("near side: inside the window, including negative distances", "[rerope]") {
  CHECK(rerope_is_near(10, 10, 1));
  CHECK_FALSE(rerope_is_near(11, 10, 1));
  CHECK(rerope_is_near(3, 10, 1));
  CHECK(rerope_is_near(16, 10, 7));
  CHECK_FALSE(rerope_is_near(17, 10, 7));
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
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t window = 1 + trial % 9;
    const bool causal = trial % 2 == 0;
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
        (rerope_is_near(pq, pk, window) ? any_near : any_far) = true;
      }
    const TileClass tc = rerope_classify_tile(qr, kr, window, causal);
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
  const int64_t w = 512;
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
