// Tests of the CPU SIMT emulation: CUDA-style kernels from emu_test_kernels.cuh
// run through ROPESCALE_LAUNCH_KERNEL and are compared with plain host loops.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "emu_test_kernels.cuh"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace {

constexpr cudaStream_t kDefaultStream = nullptr;

// Small integers, so float sums are exact in any order.
std::vector<float> small_integer_floats(std::size_t n, unsigned seed) {
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i)
    values[i] = static_cast<float>((i * 7919u + seed) % 17) - 8.0f;
  return values;
}

}  // namespace

TEST_CASE("3D grid and 3D block index math", "[launch]") {
  const dim3 grid(3, 2, 2);
  const dim3 block(4, 3, 2);
  const unsigned threads = block.x * block.y * block.z;
  std::vector<unsigned> out(grid.x * grid.y * grid.z * threads, 0xffffffffu);
  emu_test::launch_write_coords(grid, block, out.data(), kDefaultStream);

  std::vector<unsigned> expected;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx)
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx)
              expected.push_back(emu_test::pack_coords(uint3{bx, by, bz}, uint3{tx, ty, tz}));
  CHECK(out == expected);
}

TEST_CASE("block reduction with __shared__ and __syncthreads", "[shared][syncthreads]") {
  constexpr int kBlock = 256;
  const int n = 5 * kBlock + 77;  // last block is partly out of range
  const std::vector<float> in = small_integer_floats(n, 3);
  const int blocks = (n + kBlock - 1) / kBlock;
  std::vector<float> sums(blocks, -1.0f);
  emu_test::launch_block_sum<kBlock>(in.data(), sums.data(), n, kDefaultStream);

  std::vector<float> expected(blocks, 0.0f);
  for (int i = 0; i < n; ++i) expected[i / kBlock] += in[i];
  CHECK(sums == expected);
}

TEST_CASE("warp shuffles: xor, down, up, broadcast, width, value types", "[warp]") {
  const unsigned blocks = 3, threads = 64;
  const unsigned n = blocks * threads;
  const std::vector<float> in = small_integer_floats(n, 11);
  std::vector<float> xor_sum(n), down_sum(n / 32), scan(n), broadcast(n), segment_sum(n);
  std::vector<double> double_sum(n);
  std::vector<int> int_sum(n);
  const emu_test::WarpOpsOutputs out{xor_sum.data(),     down_sum.data(),   scan.data(),
                                     broadcast.data(),   segment_sum.data(), double_sum.data(),
                                     int_sum.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::warp_ops_kernel, dim3(blocks), dim3(threads), 0, kDefaultStream,
                          in.data(), out);

  std::vector<float> e_xor(n), e_down(n / 32), e_scan(n), e_broadcast(n), e_segment(n);
  std::vector<double> e_double(n);
  std::vector<int> e_int(n);
  for (unsigned w = 0; w < n / 32; ++w) {
    float total = 0.0f;
    for (unsigned l = 0; l < 32; ++l) total += in[w * 32 + l];
    e_down[w] = total;
    float prefix = 0.0f;
    for (unsigned l = 0; l < 32; ++l) {
      const unsigned i = w * 32 + l;
      prefix += in[i];
      e_xor[i] = total;
      e_scan[i] = prefix;
      e_broadcast[i] = in[w * 32 + 5];
      e_double[i] = total;
      e_int[i] = static_cast<int>(total);
      const unsigned segment_start = i & ~7u;
      e_segment[i] = 0.0f;
      for (unsigned s = 0; s < 8; ++s) e_segment[i] += in[segment_start + s];
    }
  }
  CHECK(xor_sum == e_xor);
  CHECK(down_sum == e_down);
  CHECK(scan == e_scan);
  CHECK(broadcast == e_broadcast);
  CHECK(segment_sum == e_segment);
  CHECK(double_sum == e_double);
  CHECK(int_sum == e_int);
}

TEST_CASE("block of 48 threads: partial last warp, votes, block votes", "[warp][partial]") {
  const unsigned blocks = 2, threads = 48, warps = 2;
  std::vector<int> in(blocks * threads);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int>((i * 37) % 97);
  std::vector<int> warp_sums(blocks * warps, -1), any_all(blocks * warps * 2, -1),
      block_votes(blocks * 3, -1);
  std::vector<unsigned> ballots(blocks * warps), active(blocks * warps);
  const emu_test::PartialWarpOutputs out{warp_sums.data(), ballots.data(), active.data(),
                                         any_all.data(), block_votes.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::partial_warp_kernel, dim3(blocks), dim3(threads), 0,
                          kDefaultStream, in.data(), out);

  for (unsigned b = 0; b < blocks; ++b) {
    int odd_in_block = 0, large_in_block = 0;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned lanes = w == 0 ? 32 : threads - 32;  // 16 in the last warp
      int sum = 0, any_large = 0;
      unsigned ballot = 0;
      for (unsigned l = 0; l < lanes; ++l) {
        const int v = in[b * threads + w * 32 + l];
        sum += v;
        if (v % 2 != 0) ballot |= 1u << l;
        any_large |= v > 90;
      }
      const unsigned slot = b * warps + w;
      INFO("block " << b << " warp " << w);
      CHECK(warp_sums[slot] == sum);
      CHECK(ballots[slot] == ballot);
      CHECK(active[slot] == (lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u));
      CHECK(any_all[2 * slot] == any_large);
      CHECK(any_all[2 * slot + 1] == 1);
      odd_in_block += std::popcount(ballot);
      large_in_block |= any_large;
    }
    CHECK(block_votes[3 * b] == odd_in_block);
    CHECK(block_votes[3 * b + 1] == large_in_block);
    CHECK(block_votes[3 * b + 2] == 1);
  }
}

TEST_CASE("dynamic shared memory sized at launch", "[shared][dynamic]") {
  const unsigned misaligned_sentinel = 0;
  SECTION("float, 96 threads") {
    const unsigned blocks = 4, threads = 96;
    std::vector<float> in = small_integer_floats(blocks * threads, 5), out(in.size(), -100.0f);
    unsigned misaligned = misaligned_sentinel;
    emu_test::launch_reverse_in_block(in.data(), out.data(), &misaligned, blocks, threads,
                                      kDefaultStream);
    std::vector<float> expected(in.size());
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t)
        expected[b * threads + t] = in[b * threads + threads - 1 - t];
    CHECK(out == expected);
    CHECK(misaligned == 0);
  }
  SECTION("double, 1024 threads (8 KiB)") {
    const unsigned blocks = 2, threads = 1024;
    std::vector<double> in(blocks * threads), out(in.size(), -1.0);
    std::iota(in.begin(), in.end(), 0.5);
    unsigned misaligned = misaligned_sentinel;
    emu_test::launch_reverse_in_block(in.data(), out.data(), &misaligned, blocks, threads,
                                      kDefaultStream);
    bool all_reversed = true;
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t)
        all_reversed &= out[b * threads + t] == in[b * threads + threads - 1 - t];
    CHECK(all_reversed);
    CHECK(misaligned == 0);
  }
}

TEST_CASE("atomics across blocks", "[atomic]") {
  const int n = 1000, num_bins = 7;
  std::vector<int> values(n);
  for (int i = 0; i < n; ++i) values[i] = (i * 131) % 1009;
  std::vector<int> bins(num_bins, 0);
  float float_total = 0.0f;
  double double_total = 0.0;
  unsigned count = 0, claims = 0;
  int max_value = -1, owner = -1;
  const emu_test::AtomicOutputs out{bins.data(), &float_total, &double_total, &count,
                                    &max_value,  &owner,       &claims};
  // 8 blocks of 128 threads: the last 24 threads return early.
  ROPESCALE_LAUNCH_KERNEL(emu_test::atomics_kernel, dim3(8), dim3(128), 0, kDefaultStream,
                          values.data(), n, num_bins, out);

  std::vector<int> e_bins(num_bins, 0);
  double e_total = 0.0;
  for (int v : values) {
    ++e_bins[v % num_bins];
    e_total += v;
  }
  CHECK(bins == e_bins);
  CHECK(float_total == static_cast<float>(e_total));  // < 2^24: exact in any order
  CHECK(double_total == 0.5 * e_total);
  CHECK(count == static_cast<unsigned>(n));
  CHECK(max_value == *std::max_element(values.begin(), values.end()));
  CHECK(claims == 1);
  CHECK(owner >= 0);
  CHECK(owner < n);

  unsigned counter = 0;
  float float_counter = 0.0f;
  const int iterations = 200;
  ROPESCALE_LAUNCH_KERNEL(emu_test::contended_counter_kernel, dim3(3), dim3(256), 0,
                          kDefaultStream, &counter, &float_counter, iterations);
  CHECK(counter == 3u * 256u * iterations);
  CHECK(float_counter == static_cast<float>(3 * 256 * iterations));  // < 2^24: exact
}

TEST_CASE("__half and __nv_bfloat16 conversions, arithmetic and shuffles", "[half]") {
  const unsigned n = 64;
  std::vector<float> in(n);
  for (unsigned i = 0; i < n; ++i)
    in[i] = i < 32 ? static_cast<float>(i) * 0.25f - 4.0f   // exactly representable in both
                   : std::sin(static_cast<float>(i)) * 200.0f;  // needs rounding; x*x < 65504
  std::vector<float> half_rt(n), bf16_rt(n), half_sq(n), half_nb(n), bf16_nb(n);
  const emu_test::HalfOutputs out{half_rt.data(), bf16_rt.data(), half_sq.data(), half_nb.data(),
                                  bf16_nb.data()};
  ROPESCALE_LAUNCH_KERNEL(emu_test::half_kernel, dim3(2), dim3(32), 0, kDefaultStream, in.data(),
                          out);

  for (unsigned i = 0; i < n; ++i) {
    INFO("i = " << i << ", x = " << in[i]);
    const float x = in[i];
    if (i < 32) {
      CHECK(half_rt[i] == x);
      CHECK(bf16_rt[i] == x);
    }
    // Round-to-nearest: relative error at most half an ulp (2^-11 half, 2^-8 bf16).
    CHECK(std::fabs(half_rt[i] - x) <= std::ldexp(std::fabs(x), -11));
    CHECK(std::fabs(bf16_rt[i] - x) <= std::ldexp(std::fabs(x), -8));
    const float rounded = half_rt[i];
    CHECK(std::fabs(half_sq[i] - rounded * rounded) <= std::ldexp(rounded * rounded, -11));
    CHECK(half_nb[i] == half_rt[i ^ 1]);
    CHECK(bf16_nb[i] == bf16_rt[i ^ 1]);
  }
}

TEST_CASE("template kernel with a comma in its name", "[launch]") {
  const int n = 300;
  std::vector<float> in = small_integer_floats(n, 1), out(n, 0.0f), expected(n);
  for (int i = 0; i < n; ++i) expected[i] = 3.0f * in[i];
  emu_test::launch_scale_by_3(in.data(), out.data(), n, kDefaultStream);
  CHECK(out == expected);
}

TEST_CASE("launch errors and device errors propagate as exceptions", "[errors]") {
  SECTION("more than 1024 threads per block") {
    std::vector<unsigned> out(1025);
    CHECK_THROWS_AS(emu_test::launch_write_coords(dim3(1), dim3(1025), out.data(), kDefaultStream),
                    ropescale_emu::launch_error);
    CHECK_THROWS_WITH(
        emu_test::launch_write_coords(dim3(1), dim3(32, 32, 2), out.data(), kDefaultStream),
        Catch::Contains("1024"));
    CHECK_THROWS_AS(emu_test::launch_write_coords(dim3(0), dim3(32), out.data(), kDefaultStream),
                    ropescale_emu::launch_error);
    // Exactly 1024 is allowed.
    std::vector<unsigned> ok(1024, 0xffffffffu);
    CHECK_NOTHROW(emu_test::launch_write_coords(dim3(1), dim3(1024), ok.data(), kDefaultStream));
    CHECK(ok[1023] == emu_test::pack_coords(uint3{0, 0, 0}, uint3{1023, 0, 0}));
  }
  SECTION("a trapping thread does not hang the others at the barrier") {
    int passed_barrier = 0;
    CHECK_THROWS_AS(ROPESCALE_LAUNCH_KERNEL(emu_test::trap_in_one_thread_kernel, dim3(1),
                                            dim3(64), 0, kDefaultStream, &passed_barrier),
                    ropescale_emu::device_error);
    CHECK(passed_barrier == 63);
  }
  SECTION("partial-mask warp collectives are reported") {
    std::vector<int> out(32);
    CHECK_THROWS_WITH(ROPESCALE_LAUNCH_KERNEL(emu_test::split_mask_shuffle_kernel, dim3(1),
                                              dim3(32), 0, kDefaultStream, out.data()),
                      Catch::Contains("mask"));
  }
  SECTION("a deadlock becomes a timeout error") {
    const ropescale_emu::ScopedSyncTimeout short_timeout(std::chrono::milliseconds(300));
    CHECK_THROWS_WITH(ROPESCALE_LAUNCH_KERNEL(emu_test::divergent_barrier_kernel, dim3(1),
                                              dim3(32), 0, kDefaultStream),
                      Catch::Contains("deadlock"));
  }
  SECTION("device intrinsics outside a kernel") {
    CHECK_THROWS_AS(__syncthreads(), ropescale_emu::device_error);
    CHECK_THROWS_AS(__shfl_sync(0xffffffffu, 1, 0), ropescale_emu::device_error);
  }
  SECTION("the emulation still works after errors") {
    std::vector<unsigned> out(64, 0xffffffffu);
    emu_test::launch_write_coords(dim3(2), dim3(32), out.data(), kDefaultStream);
    CHECK(out[63] == emu_test::pack_coords(uint3{1, 0, 0}, uint3{31, 0, 0}));
  }
}

TEST_CASE("host fallbacks of device math intrinsics", "[math]") {
  float s = 0.0f, c = 0.0f;
  sincosf(0.5f, &s, &c);
  CHECK(s == Approx(std::sin(0.5f)));
  CHECK(c == Approx(std::cos(0.5f)));
  sincospif(0.5f, &s, &c);
  CHECK(s == Approx(1.0f));
  CHECK(c == Approx(0.0f).margin(1e-7));
  CHECK(rsqrtf(4.0f) == 0.5f);
  CHECK(__expf(1.0f) == Approx(2.7182818f));
  CHECK(__fdividef(1.0f, 4.0f) == 0.25f);
  CHECK(__float_as_int(1.0f) == 0x3f800000);
  CHECK(__int_as_float(0x40000000) == 2.0f);
  CHECK(__float2int_rn(2.5f) == 2);  // round half to even
  CHECK(__float2int_rn(1e20f) == 2147483647);
  CHECK(min(3, 5u) == 3u);
  CHECK(max(-1.0f, 2.0f) == 2.0f);
  CHECK(__popc(0xf0f0u) == 8);
  CHECK(__ffs(8) == 4);
  const float value = 7.0f;
  CHECK(__ldg(&value) == 7.0f);
}
