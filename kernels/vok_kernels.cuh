// vllm-omni-kernels: the CUDA C++ kernels of every op (ring copies, fused row gather).
//
// Plain CUDA, no host or standard headers, so the same text compiles with nvcc (the torch
// extension, kernels/vok_torch.cu) and at run time with NVRTC (CuPy backend). Entry points are
// extern "C" and named by element size: copies move bits, so one kernel serves every dtype of
// that size (2: bf16/fp16, 4: fp32/int32, 8: int64).
//
// Ring metadata (vllm_omni_kernels/ops/layout.py): int64 rows of 8 columns
//   0 SLOT, 1 LIN_OFF, 2 N, 3 BASE, 4 CAP, 5 POS (-1: the device head), 6 LIN_STRIDE.
// state: int64 [slots], one word per slot: head << kHeadShift | ticket (layout.py says how the ticket
// protects the head). Gather table: vllm_omni_kernels/ops/gather_jobs.py.
//
// Every copy kernel reads its metadata through a pointer (device memory, or pinned host memory read
// in place). The ring write and the gather also come with the metadata in their parameters
// (`_p<N>`: N int64 words, the parameter declared __grid_constant__ so it is read in place from the
// constant bank). The compiled eager steps launch those: pinned memory read in place costs a bus
// round trip per warp, which for a gather of a few hundred blocks was 11 to 15 us of device time on
// the H200; from the parameters the kernels take 1.5 to 3.5 us.
#pragma once

namespace vok {

typedef long long i64;
typedef unsigned long long u64;

// Ring block shape (profiling/sweep_ring_cuda.py compiles variants with -D overrides; the launchers
// in vok_torch.cu and cupy_nvrtc.py size grids from the defaults).
#ifndef VOK_RING_THREADS
#define VOK_RING_THREADS 256
#endif
#ifndef VOK_RING_PER_THREAD
#define VOK_RING_PER_THREAD 8
#endif
constexpr int kRingThreads = VOK_RING_THREADS;
constexpr int kRingPerThread = VOK_RING_PER_THREAD;  // elements in flight per thread
// Gather block shape (profiling/sweep_gather_cuda.py compiles variants with -D overrides; the
// launchers in vok_torch.cu and cupy_nvrtc.py size grids from the defaults).
#ifndef VOK_GATHER_THREADS
#define VOK_GATHER_THREADS 128
#endif
#ifndef VOK_GATHER_BLOCK_BYTES
#define VOK_GATHER_BLOCK_BYTES 4096
#endif
constexpr int kGatherThreads = VOK_GATHER_THREADS;
constexpr int kGatherBlockBytes = VOK_GATHER_BLOCK_BYTES;  // bytes of a float row per block (2 x 16 B per thread)
// Metadata carried in the parameters, in one of VOK_PARAM_WORDS' sizes (int64 words). A launch takes
// at most 32764 bytes of parameters; 4088 words leave room for every entry's other arguments.
template <int N> struct Words {
  i64 w[N];
};
constexpr int kHeadShift = 24;  // layout.py HEAD_SHIFT

template <int S> struct Bits;
template <> struct Bits<2> { typedef unsigned short T; };
template <> struct Bits<4> { typedef unsigned int T; };
template <> struct Bits<8> { typedef unsigned long long T; };

// Programmatic dependent launch (Hopper and newer). The compiled launchers may let a kernel's blocks
// be scheduled before the kernel ahead of it in the stream has finished (vok_launch.h:
// set_programmatic_launch); every kernel here then waits for it before touching memory at all
// (wait_previous_grid), so nothing is read early: the metadata may itself come from a kernel. So a
// chain of appends and gathers in a CUDA graph overlaps each launch with the tail of the kernel
// before it. A ring write also lets the next such kernel be scheduled once it has issued its loads
// (let_next_grid_start); the gather does not, and so lets it start as its blocks exit. Measured on
// the H200 in a graph (profiling/RESULTS.md, eighth session): for the ring the early start is worth
// 0.3 us at 8 x 48000; in the gather it cost up to 2 us at B = 1024 (more blocks than fit at once),
// and 0.8 us there even without PDL. Without the launch attribute (CuPy, older GPUs, the setting off)
// the wait returns at once.
__device__ __forceinline__ void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct RingRow {
  i64 slot, lin_off, n, base, cap, pos, lin_stride;
};

__device__ __forceinline__ RingRow load_row(const i64* __restrict__ meta, int row) {
  const i64* m = meta + (i64)row * 8;
  RingRow r;
  r.slot = m[0]; r.lin_off = m[1]; r.n = m[2]; r.base = m[3]; r.cap = m[4]; r.pos = m[5];
  r.lin_stride = m[6];
  return r;
}

// Element e (0 <= e < n * F <= 2**31 - 1, checked on the host) of a row as (outer, inner): the lead
// row and the position along the append axis (CONCAT_LAST), or the frame and the element in it
// (CONCAT_DIM0). 32-bit: the per-element math is the kernel's instruction cost.
template <bool LAST, bool MONO>
__device__ __forceinline__ void split(int e, int n, int F, int* outer, int* inner) {
  if (LAST) {
    *outer = MONO ? 0 : e / n;
    *inner = e - *outer * n;
  } else {
    *outer = e / F;
    *inner = e - *outer * F;
  }
}

__device__ __forceinline__ i64 lin_offset(const RingRow& r, int outer, int inner) {
  return r.lin_off + (i64)outer * r.lin_stride + inner;
}

// The slot's head word after a row of n frames written from ring frame pos (ticket 0).
__device__ __forceinline__ i64 next_head_word(const RingRow& r, i64 pos) {
  const i64 head = pos + r.n;
  return (head >= r.cap ? head - r.cap : head) << kHeadShift;
}

template <bool LAST>
__device__ __forceinline__ i64 ring_offset(const RingRow& r, i64 pos, i64 F, int outer, int inner) {
  i64 t = pos + (LAST ? inner : outer);
  if (t >= r.cap) t -= r.cap;
  return LAST ? r.base + (i64)outer * r.cap + t : r.base + t * F + inner;
}

// Grid (blocks, rows): block x copies elements [x * 2048, (x + 1) * 2048) of row y. WRITE: linear
// src -> ring, and publish the new head; else ring -> linear out. A write issues its source loads
// before it reads the device head, so the two memory round trips overlap. With one block per row
// the block reads the head and stores the new one after every thread has used it; with several,
// thread 0 takes the block's ticket and reads the head in one atomic (layout.py: the head word),
// and the block with the last ticket publishes the new head at once.
// MONO: CONCAT_LAST with one channel (audio [T]); the index math is then an add per element.
template <int S, bool LAST, bool WRITE, bool MONO>
__device__ __forceinline__ void ring_copy(typename Bits<S>::T* __restrict__ arena, i64* __restrict__ state,
                                          const i64* __restrict__ meta, typename Bits<S>::T* __restrict__ lin_ptr,
                                          i64 F64) {
  typedef typename Bits<S>::T T;
  wait_previous_grid();
  const RingRow r = load_row(meta, blockIdx.y);
  const int F = (int)F64, n = (int)r.n, total = n * F;
  const int start = blockIdx.x * (kRingThreads * kRingPerThread);
  T vals[kRingPerThread];
  int outer[kRingPerThread], inner[kRingPerThread];
#pragma unroll
  for (int k = 0; k < kRingPerThread; ++k) {
    const int e = start + k * kRingThreads + threadIdx.x;
    if (e < total) {
      split<LAST, MONO>(e, n, F, &outer[k], &inner[k]);
      vals[k] = WRITE ? lin_ptr[lin_offset(r, outer[k], inner[k])]
                      : arena[ring_offset<LAST>(r, r.pos, F64, outer[k], inner[k])];
    }
  }
  let_next_grid_start();
  if (!WRITE) {
#pragma unroll
    for (int k = 0; k < kRingPerThread; ++k) {
      if (start + k * kRingThreads + (int)threadIdx.x < total) lin_ptr[lin_offset(r, outer[k], inner[k])] = vals[k];
    }
    return;
  }
  i64 pos = r.pos;
  const bool single = gridDim.x == 1;
  if (single) {
    if (pos < 0) pos = state[r.slot] >> kHeadShift;
  } else {
    __shared__ i64 shared_pos;
    if (threadIdx.x == 0) {
      const i64 word = (i64)atomicAdd(reinterpret_cast<u64*>(state + r.slot), 1ULL);
      if (pos < 0) pos = word >> kHeadShift;
      if ((word & ((1LL << kHeadShift) - 1)) == gridDim.x - 1) state[r.slot] = next_head_word(r, pos);
      shared_pos = pos;
    }
    __syncthreads();
    pos = shared_pos;
  }
#pragma unroll
  for (int k = 0; k < kRingPerThread; ++k) {
    if (start + k * kRingThreads + (int)threadIdx.x < total) arena[ring_offset<LAST>(r, pos, F64, outer[k], inner[k])] = vals[k];
  }
  if (single) {
    __syncthreads();  // every thread has used the head (its stores' addresses) before it moves
    if (threadIdx.x == 0) state[r.slot] = next_head_word(r, pos);
  }
}

// A ring write entry's body (MONO chosen at run time: CONCAT_LAST with one channel).
template <int S, bool LAST>
__device__ __forceinline__ void ring_write(void* arena, i64* state, const i64* meta, void* src, i64 F, int mono) {
  typedef typename Bits<S>::T T;
  if (LAST && mono) ring_copy<S, LAST, true, true>(static_cast<T*>(arena), state, meta, static_cast<T*>(src), F);
  else ring_copy<S, LAST, true, false>(static_cast<T*>(arena), state, meta, static_cast<T*>(src), F);
}

// Fused row gather over a job table (see gather_jobs.py). Grid (jobs, blocks).
template <int S, bool ALIGNED>
__device__ __forceinline__ void row_gather(char* __restrict__ fbase, int* __restrict__ ibase,
                                           const i64* __restrict__ table, i64 W, i64 i_off) {
  typedef typename Bits<S>::T T;
  wait_previous_grid();
  const i64 job = blockIdx.x;
  const i64 n_float = table[0], n_int = table[1];
  if (job < n_float) {
    const i64 src = table[2 + 2 * job], dst = table[3 + 2 * job];
    if (ALIGNED) {  // rows start on 16-byte boundaries and W * S is a multiple of 16
      const uint4* s = reinterpret_cast<const uint4*>(fbase + src * S);
      uint4* d = reinterpret_cast<uint4*>(fbase + dst * S);
      const i64 nvec = W * S / 16;
      const i64 v0 = (i64)blockIdx.y * (kGatherBlockBytes / 16);
      const i64 v1 = v0 + kGatherBlockBytes / 16 < nvec ? v0 + kGatherBlockBytes / 16 : nvec;
      uint4 buf[kGatherBlockBytes / 16 / kGatherThreads];
#pragma unroll
      for (int k = 0; k < kGatherBlockBytes / 16 / kGatherThreads; ++k) {
        const i64 v = v0 + k * kGatherThreads + threadIdx.x;
        if (v < v1) buf[k] = s[v];
      }
#pragma unroll
      for (int k = 0; k < kGatherBlockBytes / 16 / kGatherThreads; ++k) {
        const i64 v = v0 + k * kGatherThreads + threadIdx.x;
        if (v < v1) d[v] = buf[k];
      }
    } else {
      const T* s = reinterpret_cast<const T*>(fbase) + src;
      T* d = reinterpret_cast<T*>(fbase) + dst;
      const i64 c0 = (i64)blockIdx.y * (kGatherBlockBytes / S);
      const i64 c1 = c0 + kGatherBlockBytes / S < W ? c0 + kGatherBlockBytes / S : W;
      for (i64 c = c0 + threadIdx.x; c < c1; c += kGatherThreads) d[c] = s[c];
    }
  } else if (job < n_float + n_int) {
    // Two words: the offsets in their low 48 bits (signed), the flags and the count in the top 16.
    const i64* rec = table + i_off + 2 * (job - n_float);
    const i64 src = (i64)((u64)rec[0] << 16) >> 16, dst = (i64)((u64)rec[1] << 16) >> 16;
    const int flags = (int)((u64)rec[0] >> 48);
    const i64 n = (i64)((u64)rec[1] >> 48);
    const bool s_wide = flags & 1, d_wide = flags & 2;
    const int* sbase = (flags & 4) ? reinterpret_cast<const int*>(table) : ibase;  // 4: a payload in the table
    for (i64 e = (i64)blockIdx.y * kGatherThreads + threadIdx.x; e < n; e += (i64)gridDim.y * kGatherThreads) {
      const int lo = sbase[src + (s_wide ? 2 * e : e)];
      const int hi = s_wide ? sbase[src + 2 * e + 1] : (lo < 0 ? -1 : 0);
      ibase[dst + (d_wide ? 2 * e : e)] = lo;
      if (d_wide) ibase[dst + 2 * e + 1] = hi;
    }
  }
}

}  // namespace vok

#define VOK_RING(S, NAME, LAST)                                                                        \
  extern "C" __global__ void __launch_bounds__(vok::kRingThreads)                                      \
      vok_ring_write_e##S##_##NAME(void* arena, long long* state, const long long* meta, void* src,    \
                                   long long F, int mono) {                                             \
    vok::ring_write<S, LAST>(arena, state, meta, src, F, mono);                                         \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(vok::kRingThreads)                                      \
      vok_ring_read_e##S##_##NAME(void* arena, const long long* meta, void* out, long long F, int mono) { \
    typedef vok::Bits<S>::T T;                                                                          \
    if (LAST && mono) vok::ring_copy<S, LAST, false, true>(static_cast<T*>(arena), nullptr, meta, static_cast<T*>(out), F); \
    else vok::ring_copy<S, LAST, false, false>(static_cast<T*>(arena), nullptr, meta, static_cast<T*>(out), F); \
  }

VOK_RING(2, dim0, false)
VOK_RING(2, last, true)
VOK_RING(4, dim0, false)
VOK_RING(4, last, true)
VOK_RING(8, dim0, false)
VOK_RING(8, last, true)

// The parameter sizes of the `_p<N>` entries (int64 words; vok_torch.cu picks the smallest that fits).
// The launch copies all N words whatever the step uses (profiling/launch_floor.cu: 2.7 us for a
// launch of 1 KB, 3.6 us for 16 KB and 4.6 us for 32 KB on an H200's host), so the sizes are close:
// a 256-row ring step (2048 words) or an MTP step of 64 rows (about 900) pay for little more than
// they use.
#define VOK_PARAM_WORDS(X, ...) \
  X(128, __VA_ARGS__) X(256, __VA_ARGS__) X(512, __VA_ARGS__) X(1024, __VA_ARGS__) X(1536, __VA_ARGS__) \
  X(2048, __VA_ARGS__) X(3072, __VA_ARGS__) X(4088, __VA_ARGS__)

#define VOK_RING_P(N, S, NAME, LAST)                                                                   \
  extern "C" __global__ void __launch_bounds__(vok::kRingThreads) vok_ring_write_e##S##_##NAME##_p##N( \
      void* arena, long long* state, const __grid_constant__ vok::Words<N> meta, void* src, long long F,   \
      int mono) {                                                                                       \
    vok::ring_write<S, LAST>(arena, state, meta.w, src, F, mono);                                       \
  }

VOK_PARAM_WORDS(VOK_RING_P, 2, dim0, false)
VOK_PARAM_WORDS(VOK_RING_P, 2, last, true)
VOK_PARAM_WORDS(VOK_RING_P, 4, dim0, false)
VOK_PARAM_WORDS(VOK_RING_P, 4, last, true)
VOK_PARAM_WORDS(VOK_RING_P, 8, dim0, false)
VOK_PARAM_WORDS(VOK_RING_P, 8, last, true)

#define VOK_GATHER(S, A, ALIGNED)                                                                       \
  extern "C" __global__ void __launch_bounds__(vok::kGatherThreads)                                     \
      vok_row_gather_e##S##_a##A(void* fbase, int* ibase, const long long* table, long long W,          \
                                 long long i_off) {                                                     \
    vok::row_gather<S, ALIGNED>(static_cast<char*>(fbase), ibase, table, W, i_off);                     \
  }

VOK_GATHER(2, 0, false)
VOK_GATHER(2, 1, true)
VOK_GATHER(4, 0, false)
VOK_GATHER(4, 1, true)

// With the table in the parameters, int words are addressed from the float base (`fbase`, 4-byte
// aligned): the host cannot know where the parameters live, so a payload is flagged (4) instead.
// (The two bases are then one pointer; a block touches only float rows or only int words.)
#define VOK_GATHER_P(N, S, A, ALIGNED)                                                                 \
  extern "C" __global__ void __launch_bounds__(vok::kGatherThreads) vok_row_gather_e##S##_a##A##_p##N( \
      void* fbase, const __grid_constant__ vok::Words<N> table, long long W, long long i_off) {        \
    vok::row_gather<S, ALIGNED>(static_cast<char*>(fbase), static_cast<int*>(fbase), table.w, W, i_off); \
  }

VOK_PARAM_WORDS(VOK_GATHER_P, 2, 0, false)
VOK_PARAM_WORDS(VOK_GATHER_P, 2, 1, true)
VOK_PARAM_WORDS(VOK_GATHER_P, 4, 0, false)
VOK_PARAM_WORDS(VOK_GATHER_P, 4, 1, true)
