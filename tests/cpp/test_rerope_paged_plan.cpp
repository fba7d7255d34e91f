// Catch2 tests of rerope_attention_paged's CUDA sizing rules (csrc/include/ropescale/rerope_paged_plan.h):
// the key splits the schedule kernel computes per request, the launch's split count, the tensor-core gate
// and budget, and the workspace layout an engine reserves (rerope_paged_workspace_bytes).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cstdint>

#include "ropescale/rerope_paged_plan.h"

using namespace ropescale::rerope_cuda;

TEST_CASE("paged key splits follow each request's length", "[paged_plan]") {
  // Issue 26: one 4k request with a 128k block table (block size 16) on 132 SMs, 8 kv heads, GQA 4 (32
  // rows per block): the grid has 33 splits; the request's keys spread over 32 of them (4 tiles each),
  // where splits sized from the table's width (32 tiles each) kept 4 busy.
  const int splits = rerope_paged_split_count(1, 1, 32, 8, 32, 131072, 132);
  CHECK(splits == 33);
  CHECK(rerope_paged_keys_per_split(4096, splits) == 128);
  CHECK(rerope_paged_live_splits(4096, splits) == 32);
  CHECK(rerope_paged_live_splits(131072, splits) == 33);
  CHECK(rerope_paged_keys_per_split(0, splits) == 0);
  CHECK(rerope_paged_live_splits(0, splits) == 0);
  CHECK(rerope_paged_keys_per_split(1, splits) == 32);
  // Every length and split count: the live splits cover the keys exactly once, each of whole tiles and
  // (but for a request shorter than that) at least kPagedMinSplitTiles of them, never past the grid.
  for (int num_splits = 1; num_splits <= 70; ++num_splits)
    for (int seq_len = 0; seq_len <= 6000; seq_len += seq_len < 300 ? 1 : 37) {
      const int keys = rerope_paged_keys_per_split(seq_len, num_splits);
      const int live = rerope_paged_live_splits(seq_len, num_splits);
      INFO("seq_len " << seq_len << " splits " << num_splits);
      REQUIRE(keys % kPagedTileKeys == 0);
      REQUIRE(live <= num_splits);
      if (seq_len == 0) continue;
      REQUIRE(static_cast<int64_t>(live) * keys >= seq_len);
      REQUIRE(static_cast<int64_t>(live - 1) * keys < seq_len);
      if (live > 1) REQUIRE(keys >= kPagedMinSplitTiles * kPagedTileKeys);
    }
}

TEST_CASE("paged split count: two waves of the live blocks, within the table's capacity", "[paged_plan]") {
  CHECK(rerope_paged_split_count(256, 256, 32, 8, 32, 131072, 132) == 1);    // a full decode batch
  CHECK(rerope_paged_split_count(1, 1, 32, 8, 32, 256, 132) == 2);           // capped: 256 keys, 4 tiles a split
  CHECK(rerope_paged_split_count(8192, 4, 32, 8, 32, 131072, 132) == 1);     // a prefill chunk
  CHECK(rerope_paged_split_count(1, 1, 1, 1, 32, int64_t{1} << 30, 100000) == 65535);
}

TEST_CASE("paged tensor cores: gated by the sizes, budget and workspace", "[paged_plan]") {
  // A decode batch (one row per request) or speculative rows below 5: no tensor-core row, nothing allocated.
  CHECK_FALSE(rerope_paged_tc_possible(256, 256));
  CHECK_FALSE(rerope_paged_tc_possible(3, 1));
  CHECK_FALSE(rerope_paged_tc_possible(259, 256));
  CHECK(rerope_paged_tc_possible(260, 256));  // one request of 5 rows among 255 decode rows
  CHECK(rerope_paged_tc_possible(5, 1));
  CHECK(rerope_paged_default_key_budget(100) == 65536);
  CHECK(rerope_paged_default_key_budget(32768) == 131072);
  CHECK(rerope_paged_tc_key_budget(100, 2, 1000) == 2000);

  // The layout: the queries' sin/cos, then both key sides, 256-byte aligned, plus the base's slack.
  const PagedTcWorkspace w = rerope_paged_workspace_layout(8192, 8, 128, 2, 65536);
  CHECK(w.q_rotation == 0);
  CHECK(w.k_near == 8192 * 64 * 16);
  CHECK(w.k_far == w.k_near + 65536 * 8 * 128 * 2);
  CHECK(w.bytes == 256 + w.k_far + 65536 * 8 * 128 * 2);
  // What a reservation of that many bytes holds: the same budget (never less); fewer bytes, fewer keys;
  // below the queries' part, nothing (-1).
  for (const int64_t keys : {int64_t{0}, int64_t{1}, int64_t{77}, int64_t{65536}, int64_t{1000003}}) {
    const PagedTcWorkspace want = rerope_paged_workspace_layout(3000, 2, 80, 2, keys);
    const PagedTcWorkspace got = rerope_paged_workspace_within(want.bytes, 3000, 2, 80, 2);
    INFO("keys " << keys);
    CHECK(got.keys >= keys);
    CHECK(got.bytes <= want.bytes);
    CHECK(rerope_paged_workspace_within(want.bytes - 1, 3000, 2, 80, 2).keys < (keys > 0 ? keys + 1 : 1));
  }
  const PagedTcWorkspace queries_only = rerope_paged_workspace_layout(3000, 2, 80, 2, 0);
  CHECK(rerope_paged_workspace_within(queries_only.bytes, 3000, 2, 80, 2).keys == 0);
  CHECK(rerope_paged_workspace_within(queries_only.bytes - 1, 3000, 2, 80, 2).keys == -1);
}
