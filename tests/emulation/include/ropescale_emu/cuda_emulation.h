// SIMT emulation of the CUDA device programming model for host compilers.
//
// Lets unmodified CUDA kernel source (written against portable.h) compile with
// g++/clang (C++20) and run on the CPU with real launch semantics:
//   * every CUDA thread of a block is a std::thread, so __syncthreads(), warp
//     shuffles/votes and atomics behave like real concurrent code (and can be
//     checked with ThreadSanitizer);
//   * blocks run one after another in blockIdx order (x fastest). CUDA promises
//     no inter-block concurrency, so this is a legal schedule; it is also why
//     `__shared__` can simply mean `static`. A kernel that needs blocks to run
//     at the same time (grid-wide sync, spin-waiting on another block) hangs
//     here, and it may hang on a GPU too.
//
// Restrictions (see README.md):
//   * warp collectives (__shfl*_sync, __syncwarp, __ballot/any/all_sync) are
//     emulated for masks that name every lane still running in the warp. A
//     collective whose mask leaves out a participating lane throws; one whose
//     left-out lanes are blocked elsewhere ends in the sync-timeout error.
//   * lanes that do not take part (missing lanes of a partial last warp,
//     exited lanes) are skipped by shuffles: the caller gets its own value.
//   * launches are serialised process-wide (static __shared__ storage);
//     launching from inside a kernel throws.
//   * __CUDA_ARCH__ is not defined: device-only `#if __CUDA_ARCH__` paths are
//     not compiled here.
//
// Execution details that matter to kernel authors:
//   * all threads of a block are started before any runs kernel code, so
//     their bodies really overlap (ThreadSanitizer then sees missing barriers);
//   * a thread that returns (or throws) leaves every barrier of its block, as
//     exited threads do on hardware, so the others do not wait for it;
//   * a barrier wait longer than ROPESCALE_EMU_SYNC_TIMEOUT_MS (default
//     120000; 0 = forever) throws instead of hanging CI;
//   * dynamic shared memory is filled with 0xFF bytes before each block.
//
// API (besides the CUDA names themselves):
//   ropescale_emu::launch(grid, block, dynamic_smem_bytes, kernel, args...)
//   ropescale_emu::dynamic_shared_memory()     base of the block's dynamic smem
//   ropescale_emu::ScopedSyncTimeout           override the barrier timeout
//   ropescale_emu::launch_error, device_error  exception types
//
// Include portable.h rather than this file from kernel headers.
#pragma once

#if defined(__CUDACC__)
#error "cuda_emulation.h is for host compilers; nvcc has the real CUDA built-ins"
#endif
#if __cplusplus < 202002L
#error "cuda_emulation.h needs C++20 (std::atomic_ref, std::bit_cast, __VA_OPT__)"
#endif

// CUDA's fp16/bf16 headers are host-compilable. They bring vector_types.h
// (dim3, uint3, float2, ...) and crt/host_defines.h (which defines the CUDA
// qualifiers for host compilers). Include them first so the definitions below
// override theirs; host_defines.h is include-guarded, so later includes of
// CUDA headers cannot undo them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <numbers>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __constant__
#undef __managed__
#undef __shared__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
// One block runs at a time, so one static instance per declaration is exactly
// "shared by the threads of a block". Contents persist from block to block,
// whereas on a GPU they start undefined: do not rely on either.
#define __shared__ static
// `inline` (not always_inline): keeps the ODR meaning of device functions
// defined in headers without forcing the host compiler to inline.
#define __forceinline__ inline
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif
// g++ understands __restrict__ natively; __align__ comes from host_defines.h.

// Same declaration as CUDA's driver_types.h, so including the runtime headers
// as well does not clash. Streams are ignored by the emulation.
typedef struct CUstream_st* cudaStream_t;

// ---------------------------------------------------------------------------
// Built-in variables: per emulated thread.
// ---------------------------------------------------------------------------
inline thread_local uint3 threadIdx{};
inline thread_local uint3 blockIdx{};
inline thread_local dim3 blockDim{};
inline thread_local dim3 gridDim{};
inline constexpr int warpSize = 32;

namespace ropescale_emu {

// Thrown by launch() for what a CUDA launch reports as an error.
struct launch_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Thrown for misuse of a device intrinsic that CUDA would not detect (or that
// the emulation does not support), and for a barrier wait that timed out.
struct device_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr unsigned kMaxThreadsPerBlock = 1024;
inline constexpr std::size_t kMaxDynamicSharedBytes = 227 * 1024;  // sm_90 opt-in maximum

namespace detail {

// ---- barrier timeout: turns a deadlocked kernel into an exception ----------
inline std::atomic<long long>& sync_timeout_ms() {
  static std::atomic<long long> value = [] {
    const char* env = std::getenv("ROPESCALE_EMU_SYNC_TIMEOUT_MS");
    return env ? std::atoll(env) : 120'000LL;
  }();
  return value;
}

// A reusable barrier for a fixed group of threads, with two extras:
//  * a thread that leaves the group (returns from the kernel or throws) calls
//    arrive_and_drop(), so the others do not wait for it forever;
//  * data exchange: `deposit` runs under the lock on arrival, the last arriver
//    runs `on_phase_complete`, and `collect` runs under the lock once the phase
//    is over. Everything shared is touched only under the mutex, so the
//    happens-before edges are plain mutex edges (ThreadSanitizer-friendly).
class SyncPoint {
 public:
  SyncPoint(unsigned participants, std::function<void()> on_phase_complete,
            bool may_time_out = true)
      : expected_(participants),
        may_time_out_(may_time_out),
        on_phase_complete_(std::move(on_phase_complete)) {}
  SyncPoint(const SyncPoint&) = delete;
  SyncPoint& operator=(const SyncPoint&) = delete;

  template <class Deposit, class Collect>
  auto arrive_and_wait(const char* operation, Deposit&& deposit, Collect&& collect) {
    std::unique_lock lock(mutex_);
    const std::uint64_t phase = phase_;
    deposit(phase);
    if (++arrived_ == expected_) {
      complete_phase_locked();
    } else if (!wait_for_phase_end(lock, phase)) {
      --arrived_;  // withdraw; the thread's exit path will drop it from the group
      throw device_error(std::string("ropescale_emu: ") + operation +
                         " waited longer than ROPESCALE_EMU_SYNC_TIMEOUT_MS; deadlock "
                         "(divergent barrier or partial-mask warp collective)?");
    }
    return collect(phase);
  }

  void arrive_and_drop() {
    std::lock_guard lock(mutex_);
    --expected_;
    if (arrived_ != 0 && arrived_ == expected_) complete_phase_locked();
  }

 private:
  bool wait_for_phase_end(std::unique_lock<std::mutex>& lock, std::uint64_t phase) {
    const auto phase_over = [&] { return phase_ != phase; };
    const long long timeout = may_time_out_ ? sync_timeout_ms().load() : 0;
    if (timeout <= 0) {
      cv_.wait(lock, phase_over);
      return true;
    }
    return cv_.wait_for(lock, std::chrono::milliseconds(timeout), phase_over);
  }
  void complete_phase_locked() {
    on_phase_complete_();
    arrived_ = 0;
    ++phase_;
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned expected_;
  const bool may_time_out_;
  unsigned arrived_ = 0;
  std::uint64_t phase_ = 0;
  std::function<void()> on_phase_complete_;
};

// Per-warp exchange used by shuffles, votes and __syncwarp.
struct WarpState {
  explicit WarpState(unsigned lane_count)
      : live_mask(lane_count >= 32 ? ~0u : (1u << lane_count) - 1u),
        sync(lane_count, [this] { publish(); }) {}

  std::atomic<std::uint32_t> live_mask;  // lanes not yet exited: __activemask()
  SyncPoint sync;

  // Guarded by sync's mutex. Value slots are double-buffered by phase parity:
  // a fast lane may deposit for phase p+1 while slow lanes still read phase p;
  // phase p+2 cannot start before every lane has finished reading phase p.
  struct alignas(8) Slot {
    unsigned char bytes[8];
  };
  Slot slots[2][32];
  std::uint32_t pending_arrived = 0, pending_votes = 0, pending_mask_and = ~0u;
  std::uint32_t arrived = 0, votes = 0;  // result of the last completed phase
  bool mask_error = false;

 private:
  void publish() {
    arrived = pending_arrived;
    votes = pending_votes;
    mask_error = (pending_mask_and & arrived) != arrived;
    pending_arrived = pending_votes = 0;
    pending_mask_and = ~0u;
  }
};

struct BlockState {
  explicit BlockState(unsigned thread_count)
      : start_gate(thread_count, [] {}, /*may_time_out=*/false),
        barrier(thread_count, [this] {
          true_count = pending_true;
          participants = pending_participants;
          pending_true = pending_participants = 0;
        }) {
    for (unsigned first = 0; first < thread_count; first += 32)
      warps.push_back(std::make_unique<WarpState>(std::min(32u, thread_count - first)));
  }

  // All threads of the block pass this gate before running the kernel, so
  // their kernel bodies really overlap. Without it, short bodies would run one
  // after another, ordered by the worker pool's mutex, and ThreadSanitizer
  // would miss races between them.
  SyncPoint start_gate;
  SyncPoint barrier;  // __syncthreads
  unsigned pending_true = 0, pending_participants = 0;  // guarded by barrier's mutex
  unsigned true_count = 0, participants = 0;
  std::vector<std::unique_ptr<WarpState>> warps;
};

struct ThreadContext {
  BlockState* block = nullptr;
  WarpState* warp = nullptr;
  unsigned lane = 0;
  unsigned char* dynamic_smem = nullptr;
};
inline thread_local ThreadContext tls_context{};

inline ThreadContext& current_thread(const char* operation) {
  ThreadContext& ctx = tls_context;
  if (ctx.block == nullptr)
    throw device_error(std::string("ropescale_emu: ") + operation +
                       " called outside an emulated kernel");
  return ctx;
}

// ---- block barrier ----------------------------------------------------------
struct BlockVote {
  unsigned true_count, participants;
};
inline BlockVote block_sync(const char* operation, bool predicate) {
  BlockState& block = *current_thread(operation).block;
  return block.barrier.arrive_and_wait(
      operation,
      [&](std::uint64_t) {
        block.pending_true += predicate ? 1u : 0u;
        ++block.pending_participants;
      },
      [&](std::uint64_t) { return BlockVote{block.true_count, block.participants}; });
}

// ---- warp collective: every live lane deposits a value and a vote ---------
template <class T>
struct WarpResult {
  T value;              // the source lane's value, or the caller's own one
  std::uint32_t votes;  // lanes that voted true
  std::uint32_t lanes;  // lanes that took part
};

template <class T>
WarpResult<T> warp_collective(const char* operation, unsigned mask, const T& value, bool vote,
                              int source_lane) {
  static_assert(sizeof(T) <= 8 && alignof(T) <= 8, "warp shuffles move at most 8 bytes");
  static_assert(std::is_trivially_destructible_v<T> && std::is_copy_constructible_v<T>,
                "warp shuffles need a plain value type");
  ThreadContext& ctx = current_thread(operation);
  WarpState& warp = *ctx.warp;
  const unsigned lane = ctx.lane;
  return warp.sync.arrive_and_wait(
      operation,
      [&](std::uint64_t phase) {
        ::new (static_cast<void*>(warp.slots[phase & 1][lane].bytes)) T(value);
        warp.pending_arrived |= 1u << lane;
        if (vote) warp.pending_votes |= 1u << lane;
        warp.pending_mask_and &= mask;
      },
      [&](std::uint64_t phase) -> WarpResult<T> {
        if (warp.mask_error)
          throw device_error(std::string("ropescale_emu: ") + operation +
                             ": mask leaves out a participating lane; only masks naming "
                             "every running lane of the warp are emulated");
        const bool source_present =
            source_lane >= 0 && source_lane < 32 && ((warp.arrived >> source_lane) & 1u);
        if (!source_present) return {value, warp.votes, warp.arrived};
        const T* source = std::launder(
            reinterpret_cast<const T*>(warp.slots[phase & 1][source_lane].bytes));
        return {*source, warp.votes, warp.arrived};
      });
}

inline int checked_width(const char* operation, int width) {
  if (width < 1 || width > 32 || !std::has_single_bit(static_cast<unsigned>(width)))
    throw device_error(std::string("ropescale_emu: ") + operation +
                       ": width must be a power of two in [1, 32]");
  return width;
}

// ---- worker threads, reused across blocks and launches ----------------------
class WorkerPool {
 public:
  ~WorkerPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  // Runs task(i) for every i in [0, count), each on its own thread, and waits.
  void run(unsigned count, const std::function<void(unsigned)>& task) {
    std::unique_lock lock(mutex_);
    while (workers_.size() < count) {
      const auto id = static_cast<unsigned>(workers_.size());
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
    task_ = &task;
    task_threads_ = count;
    remaining_ = count;
    ++generation_;
    work_ready_.notify_all();
    all_done_.wait(lock, [&] { return remaining_ == 0; });
    task_ = nullptr;
  }

 private:
  void worker_loop(unsigned id) {
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      work_ready_.wait(lock,
                       [&] { return stopping_ || (generation_ != seen && id < task_threads_); });
      if (stopping_) return;
      seen = generation_;
      const std::function<void(unsigned)>* task = task_;
      lock.unlock();
      (*task)(id);
      lock.lock();
      if (--remaining_ == 0) all_done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_ready_, all_done_;
  std::vector<std::thread> workers_;
  const std::function<void(unsigned)>* task_ = nullptr;
  unsigned task_threads_ = 0, remaining_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
};

inline WorkerPool& worker_pool() {
  static WorkerPool pool;
  return pool;
}
inline std::mutex& launch_mutex() {
  static std::mutex mutex;
  return mutex;
}

inline void validate_launch(dim3 grid, dim3 block, std::size_t dynamic_smem_bytes) {
  const auto fail = [](const std::string& what) {
    throw launch_error("ropescale_emu: invalid configuration argument: " + what);
  };
  if (block.x == 0 || block.y == 0 || block.z == 0) fail("block dimension is 0");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) fail("grid dimension is 0");
  if (block.x > 1024 || block.y > 1024 || block.z > 64) fail("block dimension above limit");
  if (std::uint64_t{block.x} * block.y * block.z > kMaxThreadsPerBlock)
    fail("more than 1024 threads per block (" +
         std::to_string(std::uint64_t{block.x} * block.y * block.z) + ")");
  if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) fail("grid dimension above limit");
  if (dynamic_smem_bytes > kMaxDynamicSharedBytes)
    fail("dynamic shared memory above " + std::to_string(kMaxDynamicSharedBytes) + " bytes");
}

// Runs `kernel_body` once per thread of every block.
inline void run_grid(dim3 grid, dim3 block, std::size_t dynamic_smem_bytes,
                     const std::function<void()>& kernel_body) {
  validate_launch(grid, block, dynamic_smem_bytes);
  if (tls_context.block != nullptr)
    throw launch_error("ropescale_emu: kernel launch from inside a kernel is not supported");
  std::lock_guard launch_lock(launch_mutex());

  const unsigned thread_count = block.x * block.y * block.z;
  constexpr std::align_val_t kSmemAlign{128};
  const std::size_t smem_size = std::max<std::size_t>(dynamic_smem_bytes, 16);
  std::unique_ptr<unsigned char, void (*)(unsigned char*)> smem(
      static_cast<unsigned char*>(::operator new(smem_size, kSmemAlign)),
      [](unsigned char* p) { ::operator delete(p, kSmemAlign); });

  std::mutex error_mutex;
  std::exception_ptr first_error;

  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        // Shared memory is undefined at block start; 0xFF bytes read as NaN
        // floats / -1 ints, which makes a missing initialisation visible.
        std::memset(smem.get(), 0xFF, smem_size);
        BlockState block_state(thread_count);
        const std::function<void(unsigned)> thread_body = [&](unsigned tid) {
          WarpState& warp = *block_state.warps[tid / 32];
          tls_context = ThreadContext{&block_state, &warp, tid % 32, smem.get()};
          threadIdx = uint3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
          blockIdx = uint3{bx, by, bz};
          blockDim = block;
          gridDim = grid;
          try {
            block_state.start_gate.arrive_and_wait(
                "block start", [](std::uint64_t) {}, [](std::uint64_t) { return 0; });
            kernel_body();
          } catch (...) {
            std::lock_guard lock(error_mutex);
            if (!first_error) first_error = std::current_exception();
          }
          // An exited thread no longer takes part in barriers (as on hardware).
          warp.live_mask.fetch_and(~(1u << (tid % 32)));
          warp.sync.arrive_and_drop();
          block_state.barrier.arrive_and_drop();
          tls_context = ThreadContext{};
        };
        worker_pool().run(thread_count, thread_body);
        if (first_error) std::rethrow_exception(first_error);
      }
}

}  // namespace detail

// Launches `kernel` like kernel<<<grid, block, dynamic_smem_bytes>>>(args...)
// and returns when it has finished (launches are synchronous). Arguments are
// converted once to the kernel's parameter types, as CUDA does, and each
// thread gets its own copy. The first exception thrown by any kernel thread is
// rethrown here; remaining blocks are not run.
template <class... Params, class... Args>
void launch(dim3 grid, dim3 block, std::size_t dynamic_smem_bytes, void (*kernel)(Params...),
            Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  detail::run_grid(grid, block, dynamic_smem_bytes, [&] { std::apply(kernel, params); });
}

// Base of the dynamic shared memory of the running block (see
// ROPESCALE_DYNAMIC_SMEM); 128-byte aligned.
inline unsigned char* dynamic_shared_memory() {
  return detail::current_thread("dynamic shared memory").dynamic_smem;
}

// Sets the barrier timeout for the current scope (0 = wait forever).
class ScopedSyncTimeout {
 public:
  explicit ScopedSyncTimeout(std::chrono::milliseconds timeout)
      : previous_(detail::sync_timeout_ms().exchange(timeout.count())) {}
  ~ScopedSyncTimeout() { detail::sync_timeout_ms().store(previous_); }
  ScopedSyncTimeout(const ScopedSyncTimeout&) = delete;
  ScopedSyncTimeout& operator=(const ScopedSyncTimeout&) = delete;

 private:
  long long previous_;
};

}  // namespace ropescale_emu

// ---------------------------------------------------------------------------
// Synchronisation
// ---------------------------------------------------------------------------
inline void __syncthreads() { ropescale_emu::detail::block_sync("__syncthreads", false); }
inline int __syncthreads_count(int predicate) {
  return static_cast<int>(
      ropescale_emu::detail::block_sync("__syncthreads_count", predicate != 0).true_count);
}
inline int __syncthreads_and(int predicate) {
  const auto vote = ropescale_emu::detail::block_sync("__syncthreads_and", predicate != 0);
  return vote.true_count == vote.participants;
}
inline int __syncthreads_or(int predicate) {
  return ropescale_emu::detail::block_sync("__syncthreads_or", predicate != 0).true_count != 0;
}

// ---------------------------------------------------------------------------
// Warp primitives
// ---------------------------------------------------------------------------
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ropescale_emu::detail::warp_collective("__syncwarp", mask, 0, false, -1);
}
inline unsigned __activemask() {
  return ropescale_emu::detail::current_thread("__activemask").warp->live_mask.load();
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ropescale_emu::detail::warp_collective("__ballot_sync", mask, 0, predicate != 0, -1)
             .votes &
         mask;
}
inline int __any_sync(unsigned mask, int predicate) {
  return ropescale_emu::detail::warp_collective("__any_sync", mask, 0, predicate != 0, -1).votes !=
         0;
}
inline int __all_sync(unsigned mask, int predicate) {
  const auto r = ropescale_emu::detail::warp_collective("__all_sync", mask, 0, predicate != 0, -1);
  return r.votes == r.lanes;
}

// Source lanes follow the CUDA programming guide: lanes are split into
// segments of `width`; an out-of-segment source returns the caller's value.
template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_sync").lane);
  const int source = (lane & ~(w - 1)) + (src_lane & (w - 1));
  return warp_collective("__shfl_sync", mask, var, false, source).value;
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_up_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_up_sync").lane);
  const long long source = static_cast<long long>(lane) - delta;
  const bool in_segment = source >= (lane & ~(w - 1));
  return warp_collective("__shfl_up_sync", mask, var, false,
                         in_segment ? static_cast<int>(source) : -1)
      .value;
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_down_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_down_sync").lane);
  const long long source = static_cast<long long>(lane) + delta;
  const bool in_segment = source < (lane & ~(w - 1)) + w;
  return warp_collective("__shfl_down_sync", mask, var, false,
                         in_segment ? static_cast<int>(source) : -1)
      .value;
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  using namespace ropescale_emu::detail;
  const int w = checked_width("__shfl_xor_sync", width);
  const int lane = static_cast<int>(current_thread("__shfl_xor_sync").lane);
  const int source = lane ^ (lane_mask & 31);
  const bool allowed = source < (lane & ~(w - 1)) + w;  // earlier segments are allowed
  return warp_collective("__shfl_xor_sync", mask, var, false, allowed ? source : -1).value;
}

// ---------------------------------------------------------------------------
// Atomics (all sequentially consistent) and fences
// ---------------------------------------------------------------------------
namespace ropescale_emu::detail {
template <class T, class Update>
T atomic_update(T* address, Update update) {  // CAS loop; returns the old value
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (!ref.compare_exchange_weak(old, update(old))) {
  }
  return old;
}
}  // namespace ropescale_emu::detail

#define ROPESCALE_EMU_ATOMIC_RMW(T)                                                          \
  inline T atomicAdd(T* a, T v) { return std::atomic_ref<T>(*a).fetch_add(v); }              \
  inline T atomicExch(T* a, T v) { return std::atomic_ref<T>(*a).exchange(v); }
#define ROPESCALE_EMU_ATOMIC_INT(T)                                                          \
  ROPESCALE_EMU_ATOMIC_RMW(T)                                                                \
  inline T atomicSub(T* a, T v) { return std::atomic_ref<T>(*a).fetch_sub(v); }              \
  inline T atomicAnd(T* a, T v) { return std::atomic_ref<T>(*a).fetch_and(v); }              \
  inline T atomicOr(T* a, T v) { return std::atomic_ref<T>(*a).fetch_or(v); }                \
  inline T atomicXor(T* a, T v) { return std::atomic_ref<T>(*a).fetch_xor(v); }              \
  inline T atomicMax(T* a, T v) {                                                            \
    return ropescale_emu::detail::atomic_update(a, [v](T old) { return old < v ? v : old; }); \
  }                                                                                          \
  inline T atomicMin(T* a, T v) {                                                            \
    return ropescale_emu::detail::atomic_update(a, [v](T old) { return v < old ? v : old; }); \
  }                                                                                          \
  inline T atomicCAS(T* a, T compare, T v) {                                                 \
    std::atomic_ref<T>(*a).compare_exchange_strong(compare, v);                              \
    return compare; /* the old value, whether or not the swap happened */                    \
  }
ROPESCALE_EMU_ATOMIC_INT(int)
ROPESCALE_EMU_ATOMIC_INT(unsigned)
ROPESCALE_EMU_ATOMIC_INT(unsigned long long)
ROPESCALE_EMU_ATOMIC_RMW(float)
ROPESCALE_EMU_ATOMIC_RMW(double)
#undef ROPESCALE_EMU_ATOMIC_INT
#undef ROPESCALE_EMU_ATOMIC_RMW
inline long long atomicMax(long long* a, long long v) {
  return ropescale_emu::detail::atomic_update(a, [v](long long old) { return old < v ? v : old; });
}
inline long long atomicMin(long long* a, long long v) {
  return ropescale_emu::detail::atomic_update(a, [v](long long old) { return v < old ? v : old; });
}
inline unsigned atomicInc(unsigned* a, unsigned limit) {  // wraps to 0 past `limit`
  return ropescale_emu::detail::atomic_update(
      a, [limit](unsigned old) { return old >= limit ? 0u : old + 1u; });
}
inline unsigned atomicDec(unsigned* a, unsigned limit) {  // wraps to `limit` below 0
  return ropescale_emu::detail::atomic_update(
      a, [limit](unsigned old) { return (old == 0 || old > limit) ? limit : old - 1u; });
}
inline __half atomicAdd(__half* a, __half v) {
  return ropescale_emu::detail::atomic_update(a, [v](__half old) { return __hadd(old, v); });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* a, __nv_bfloat16 v) {
  return ropescale_emu::detail::atomic_update(a,
                                              [v](__nv_bfloat16 old) { return __hadd(old, v); });
}

#if defined(__SANITIZE_THREAD__)  // g++
#define ROPESCALE_EMU_TSAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(thread_sanitizer)
#define ROPESCALE_EMU_TSAN 1
#endif
#endif
inline void __threadfence() {
#if defined(ROPESCALE_EMU_TSAN)
  // TSan does not model fences. A seq_cst RMW on a shared atomic is what it
  // does understand; with blocks never running concurrently, that suffices.
  static std::atomic<int> fence_token{0};
  fence_token.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
inline void __threadfence_block() { __threadfence(); }
inline void __threadfence_system() { __threadfence(); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
[[noreturn]] inline void __trap() { throw ropescale_emu::device_error("ropescale_emu: __trap()"); }

// ---------------------------------------------------------------------------
// Math and bit intrinsics missing from host <cmath>. Fast-math intrinsics map
// to the accurate functions; compare results with GPU-like tolerances.
// ---------------------------------------------------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x), *c = std::cos(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline double __fma_rn(double x, double y, double z) { return std::fma(x, y, z); }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
#if !defined(__GLIBC__) || __GLIBC__ < 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ < 41)
// glibc >= 2.41 declares the C23 sinpi/cospi functions itself.
// fmod is exact, so reducing to (-2, 2) before multiplying by pi loses nothing.
inline float sinpif(float x) {
  return static_cast<float>(std::sin(std::numbers::pi * std::fmod(double{x}, 2.0)));
}
inline float cospif(float x) {
  return static_cast<float>(std::cos(std::numbers::pi * std::fmod(double{x}, 2.0)));
}
#endif
inline void sincospif(float x, float* s, float* c) { *s = sinpif(x), *c = cospif(x); }
#if !defined(__USE_GNU)  // glibc declares these as GNU extensions
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x), *c = std::cos(x); }
inline void sincos(double x, double* s, double* c) { *s = std::sin(x), *c = std::cos(x); }
#endif

namespace ropescale_emu::detail {
template <class Int>
Int saturating_cast(double x) {  // CUDA's float->int conversions saturate, NaN -> 0
  using limits = std::numeric_limits<Int>;
  if (std::isnan(x)) return 0;
  if (x <= static_cast<double>(limits::min())) return limits::min();
  if (x >= static_cast<double>(limits::max())) return limits::max();
  return static_cast<Int>(x);
}
}  // namespace ropescale_emu::detail
// nearbyint rounds half to even in the default rounding mode, like _rn.
inline int __float2int_rn(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::nearbyint(x));
}
inline int __float2int_rz(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::trunc(x));
}
inline int __float2int_rd(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::floor(x));
}
inline int __float2int_ru(float x) {
  return ropescale_emu::detail::saturating_cast<int>(std::ceil(x));
}
inline unsigned __float2uint_rn(float x) {
  return ropescale_emu::detail::saturating_cast<unsigned>(std::nearbyint(x));
}
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }

inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }

inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1; }
inline int __ffsll(long long x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned long long>(x)) + 1;
}

template <class T>
inline T __ldg(const T* address) {  // read-only cache load: a plain load on the host
  return *address;
}

// CUDA's global min/max overloads (same-type and signed/unsigned mixes).
#define ROPESCALE_EMU_MIN_MAX(A, B, R)                       \
  inline R min(A a, B b) {                                   \
    const R x = static_cast<R>(a), y = static_cast<R>(b);    \
    return y < x ? y : x;                                    \
  }                                                          \
  inline R max(A a, B b) {                                   \
    const R x = static_cast<R>(a), y = static_cast<R>(b);    \
    return x < y ? y : x;                                    \
  }
ROPESCALE_EMU_MIN_MAX(int, int, int)
ROPESCALE_EMU_MIN_MAX(unsigned, unsigned, unsigned)
ROPESCALE_EMU_MIN_MAX(int, unsigned, unsigned)
ROPESCALE_EMU_MIN_MAX(unsigned, int, unsigned)
ROPESCALE_EMU_MIN_MAX(long, long, long)
ROPESCALE_EMU_MIN_MAX(unsigned long, unsigned long, unsigned long)
ROPESCALE_EMU_MIN_MAX(long long, long long, long long)
ROPESCALE_EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
ROPESCALE_EMU_MIN_MAX(long long, unsigned long long, unsigned long long)
ROPESCALE_EMU_MIN_MAX(unsigned long long, long long, unsigned long long)
#undef ROPESCALE_EMU_MIN_MAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(float a, double b) { return std::fmin(double{a}, b); }
inline double max(float a, double b) { return std::fmax(double{a}, b); }
inline double min(double a, float b) { return std::fmin(a, double{b}); }
inline double max(double a, float b) { return std::fmax(a, double{b}); }
