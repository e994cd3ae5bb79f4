// cuda_shim.h - compile unchanged CUDA C kernels with g++ -std=c++20 and run them on the CPU.
//
// Why: the development and CI machines have no GPU, yet the kernels must be executed and checked.
// Every CUDA thread of a block is a fiber on the calling OS thread (a 6-instruction x86-64 stack
// switch); blocks run one after another, so `__shared__` can be a function-local `static`.
// Fibers are never pre-empted: they switch only at barriers and shuffles, which makes a missing
// __syncthreads show deterministically; running the fibers in reverse order is a second probe.
// Asynchronous copies (the pipeline primitives behind cp.async) land only at the wait that must
// see them, the latest moment a GPU may deliver them, so reading a buffer before waiting shows;
// with kEagerCopies they land at once, the earliest moment, so overwriting a buffer that other
// threads still read (a missing barrier after the reads) shows.
// Included with `-include` by pagedinfer/attention/cuda_on_cpu.py. Static shared memory only (no
// `extern __shared__`).
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // blocks are serialised: all fibers of a block see one copy

struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
constexpr int warpSize = 32;

// x86-64 SysV context switch: push callee-saved registers, swap stack pointers, pop, return.
asm(R"(.text
.weak pagedinfer_shim_switch
.type pagedinfer_shim_switch,@function
pagedinfer_shim_switch:
  pushq %rbp; pushq %rbx; pushq %r12; pushq %r13; pushq %r14; pushq %r15
  movq %rsp, (%rdi); movq %rsi, %rsp
  popq %r15; popq %r14; popq %r13; popq %r12; popq %rbx; popq %rbp
  ret
)");
extern "C" void pagedinfer_shim_switch(void** save_sp, void* load_sp);

namespace shim {
// Cooperative barrier: waiters yield to the scheduler; exited threads stop being expected.
struct Barrier {
  unsigned expected = 0, arrived = 0, phase = 0;
  void wait();
  void leave();
};
struct AsyncCopy {
  void* dst;
  const void* src;
  size_t bytes, zfill;
  unsigned batch;
};
struct Fiber {
  void* sp;
  std::vector<AsyncCopy> copies;  // issued, not yet landed
  unsigned committed;             // batches committed so far
  std::unique_ptr<char[]> stack;
  dim3 idx;
  unsigned tid, parity;
  bool done;
};
struct Launch {
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<uint64_t> exchange;  // shuffles: 2 parities x 32 lanes x 16 B per warp
  std::vector<Fiber> fibers;
  void* scheduler_sp;
  Fiber* current;
  void (*body)(void*);
  void* arg;
  unsigned long progress = 0;
  bool eager_copies;
};
inline thread_local Launch* L;
constexpr int kReverse = 1, kEagerCopies = 2;  // launch flags
constexpr size_t kStackBytes = 256 << 10;

inline unsigned tid() { return L->current->tid; }
inline void yield() { pagedinfer_shim_switch(&L->current->sp, L->scheduler_sp); }
inline void Barrier::wait() {
  const unsigned p = phase;
  ++L->progress;
  if (++arrived == expected) {
    arrived = 0;
    ++phase;
  } else {
    while (phase == p) yield();
  }
}
inline void Barrier::leave() {
  ++L->progress;
  if (--expected == arrived && arrived) {
    arrived = 0;
    ++phase;
  }
}
[[noreturn]] inline void fiber_entry() {
  L->body(L->arg);
  L->warps[tid() / 32].leave();
  L->block.leave();
  L->current->done = true;
  yield();
  __builtin_unreachable();
}
template <class... A, size_t... I>
std::tuple<A...> unpack(void** params, std::index_sequence<I...>) {
  return {*static_cast<A*>(params[I])...};  // same convention as cuLaunchKernel's kernelParams
}

// Runs kernel `k` over the grid; returns 0, or -1 when a scheduler pass makes no progress.
// flags: kReverse runs each block's threads last to first, kEagerCopies lands async copies at issue.
template <class... A>
int launch(void (*k)(A...), const unsigned* grid, const unsigned* block, void** params, int flags) {
  const bool reverse = flags & kReverse;
  struct Call {
    void (*k)(A...);
    std::tuple<A...> args;
  } call{k, unpack<A...>(params, std::index_sequence_for<A...>{})};
  const dim3 G{grid[0], grid[1], grid[2]}, B{block[0], block[1], block[2]};
  const unsigned nthreads = B.x * B.y * B.z, nblocks = G.x * G.y * G.z, nwarps = (nthreads + 31) / 32;
  Launch st;
  st.eager_copies = flags & kEagerCopies;
  L = &st;
  blockDim = B;
  gridDim = G;
  st.body = [](void* c) { std::apply(static_cast<Call*>(c)->k, static_cast<Call*>(c)->args); };
  st.arg = &call;
  st.exchange.resize(nwarps * 2 * 32 * 2);
  st.fibers.resize(nthreads);
  for (auto& f : st.fibers) f.stack.reset(new char[kStackBytes]);
  for (unsigned b = 0; b < nblocks; ++b) {
    blockIdx = {b % G.x, (b / G.x) % G.y, b / (G.x * G.y)};
    st.block = Barrier{nthreads};
    st.warps.assign(nwarps, Barrier{});
    for (unsigned t = 0; t < nthreads; ++t) {
      Fiber& f = st.fibers[t];
      f.tid = t;
      f.parity = 0;
      f.done = false;
      f.copies.clear();
      f.committed = 0;
      f.idx = {t % B.x, (t / B.x) % B.y, t / (B.x * B.y)};
      st.warps[t / 32].expected++;
      auto top = reinterpret_cast<void**>((uintptr_t(f.stack.get()) + kStackBytes) & ~uintptr_t(15));
      top[-1] = nullptr;                                     // keeps the entry frame 16-B aligned
      top[-2] = reinterpret_cast<void*>(&fiber_entry);       // 'ret' target of the first switch
      std::fill(top - 8, top - 2, nullptr);                  // six callee-saved registers
      f.sp = top - 8;
    }
    for (unsigned live = nthreads; live;) {
      const unsigned long before = st.progress;
      for (unsigned j = 0; j < nthreads; ++j) {
        Fiber& f = st.fibers[reverse ? nthreads - 1 - j : j];
        if (f.done) continue;
        st.current = &f;
        threadIdx = f.idx;
        pagedinfer_shim_switch(&st.scheduler_sp, f.sp);
        if (f.done) --live, ++st.progress;
      }
      if (st.progress == before) {
        fprintf(stderr, "cuda_shim: deadlock in block %u (divergent barrier or partial-warp shuffle)\n", b);
        return -1;  // the stuck fibers' stacks are simply freed
      }
    }
  }
  return 0;
}
}  // namespace shim

inline void __syncthreads() { shim::L->block.wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { shim::L->warps[shim::tid() / 32].wait(); }

// Warp shuffles (full warp only): publish, warp barrier, read the partner's slot. Slots are
// double-buffered by a per-thread parity, so a lane can run one shuffle ahead safely.
template <class T>
T shim_shuffle(T v, int src_lane) {
  static_assert(sizeof(T) <= 16);
  const unsigned parity = shim::L->current->parity ^= 1, t = shim::tid();
  uint64_t* slots = &shim::L->exchange[((t / 32) * 2 + parity) * 64];
  std::memcpy(slots + 2 * (t % 32), &v, sizeof(T));
  __syncwarp();
  T r;
  std::memcpy(&r, slots + 2 * src_lane, sizeof(T));
  return r;
}
inline int shim_lane() { return shim::tid() % 32; }
template <class T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  return shim_shuffle(v, (shim_lane() / width) * width + src % width);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  const int l = shim_lane(), s = l ^ mask;
  return shim_shuffle(v, s / width == l / width ? s : l);
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int l = shim_lane(), s = l + int(delta);
  return shim_shuffle(v, s / width == l / width ? s : l);
}

// ---- math intrinsics (the GPU's __expf is approximate and flushes denormals: compare with tolerances)
inline float __expf(float x) { return expf(x); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
using std::max;
using std::min;

// ---- fp16: GCC's _Float16 is IEEE binary16 rounded to nearest even after every operation, as on the GPU
using __half = _Float16;
inline float __half2float(__half h) { return float(h); }
inline __half __float2half_rn(float f) { return __half(f); }

// ---- bf16: a 16-bit struct; float -> bf16 rounds to nearest even (bit-exact with torch), NaN stays quiet
struct __nv_bfloat16 {
  uint16_t x;
  __nv_bfloat16() = default;
  explicit __nv_bfloat16(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    x = std::isnan(f) ? uint16_t((u >> 16) | 0x40) : uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
  }
  explicit operator float() const { return std::bit_cast<float>(uint32_t(x) << 16); }
};
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }

// ---- pipeline primitives (cuda_pipeline_primitives.h): copies queue per thread in commit batches
inline void shim_land(const shim::AsyncCopy& c) {
  std::memcpy(c.dst, c.src, c.bytes - c.zfill);
  std::memset(static_cast<char*>(c.dst) + c.bytes - c.zfill, 0, c.zfill);
}
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes, size_t zfill = 0) {
  const shim::AsyncCopy c{dst, src, bytes, zfill, shim::L->current->committed};
  if (shim::L->eager_copies)
    shim_land(c);
  else
    shim::L->current->copies.push_back(c);
}
inline void __pipeline_commit() { ++shim::L->current->committed; }
inline void __pipeline_wait_prior(size_t prior) {  // lands every batch but the newest `prior`
  auto& f = *shim::L->current;
  std::erase_if(f.copies, [&](const shim::AsyncCopy& c) {
    if (c.batch + prior >= f.committed) return false;
    shim_land(c);
    return true;
  });
}
