// vllm-omni-kernels: the CUDA C++ kernels (ring copies, fused row gather).
//
// Plain CUDA, no host or standard headers: the same text compiles with nvcc (the torch extension,
// vok_torch.cu) and at run time with NVRTC (the CuPy backend). Entry points are extern "C" and named
// by element size: copies move bits, so one kernel serves every dtype of that size (1: uint8/int8/
// bool/fp8, 2: bf16/fp16, 4: fp32/int32, 8: int64).
//
// The metadata row, the head word, the gather record and the block shapes are defined once, in
// vllm_omni_kernels/ops/layout.py, and arrive here as -DVOK_... (layout.cuda_defines()).
#pragma once

#if !defined(VOK_META_COLS) || !defined(VOK_GATHER_BLOCK_BYTES)
#error "compile with the definitions of vllm_omni_kernels/ops/layout.py (python -m vllm_omni_kernels.ops.layout)"
#endif

namespace vok {

typedef long long i64;
typedef unsigned long long u64;

template <int S> struct Bits;
template <> struct Bits<1> { typedef unsigned char T; };
template <> struct Bits<2> { typedef unsigned short T; };
template <> struct Bits<4> { typedef unsigned int T; };
template <> struct Bits<8> { typedef unsigned long long T; };

// Programmatic dependent launch (Hopper and newer; ops/pdl.py): a kernel's blocks may be scheduled
// while the kernel ahead of it finishes, so every kernel waits for it before touching memory (the
// metadata may itself come from a kernel); a ring write lets the next kernel be scheduled once it
// has issued its loads. Without the launch attribute the wait returns at once.
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
  const i64* m = meta + (i64)row * VOK_META_COLS;
  RingRow r;
  r.slot = m[VOK_SLOT]; r.lin_off = m[VOK_LIN_OFF]; r.n = m[VOK_N]; r.base = m[VOK_BASE]; r.cap = m[VOK_CAP];
  r.pos = m[VOK_POS]; r.lin_stride = m[VOK_LIN_STRIDE];
  return r;
}

// The slot's head word after a row of n frames written from ring frame pos (ticket 0).
__device__ __forceinline__ i64 next_head_word(const RingRow& r, i64 pos) {
  const i64 head = pos + r.n;
  return (head >= r.cap ? head - r.cap : head) << VOK_HEAD_SHIFT;
}

// Grid (blocks, rows): block x copies elements [x * E, (x + 1) * E) of row y, E = threads * per
// thread. Element e (< n * F <= 2**31 - 1, checked on the host) is (outer, inner): the lead row and
// the position along the append axis (LAST: CONCAT_LAST), or the frame and its element (CONCAT_DIM0).
// WRITE: linear -> ring, and publish the new head (its source loads go out before the head is read,
// so the two round trips overlap); else ring -> linear. With one block per row the block reads the
// head and stores the new one after every thread has used it; with several, thread 0 takes the
// block's ticket and reads the head in one atomic, and the block with the last ticket publishes.
template <int S, bool WRITE>
__device__ __forceinline__ void ring_copy(typename Bits<S>::T* __restrict__ arena, i64* __restrict__ state,
                                          const i64* __restrict__ meta, typename Bits<S>::T* __restrict__ lin,
                                          i64 F64, int last) {
  typedef typename Bits<S>::T T;
  constexpr int kPer = VOK_RING_PER_THREAD;
  wait_previous_grid();
  const RingRow r = load_row(meta, blockIdx.y);
  const int F = (int)F64, n = (int)r.n, total = n * F;
  const int start = blockIdx.x * (VOK_RING_THREADS * kPer);
  T vals[kPer];
  int outer[kPer], inner[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int e = start + k * VOK_RING_THREADS + threadIdx.x;
    if (e < total) {
      outer[k] = last ? (F == 1 ? 0 : e / n) : e / F;
      inner[k] = e - outer[k] * (last ? n : F);
      const i64 lin_at = r.lin_off + (i64)outer[k] * r.lin_stride + inner[k];
      if (WRITE) vals[k] = lin[lin_at];
      else {
        i64 t = r.pos + (last ? inner[k] : outer[k]);
        if (t >= r.cap) t -= r.cap;
        vals[k] = arena[last ? r.base + (i64)outer[k] * r.cap + t : r.base + t * F64 + inner[k]];
      }
    }
  }
  let_next_grid_start();
  if (!WRITE) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (start + k * VOK_RING_THREADS + (int)threadIdx.x < total)
        lin[r.lin_off + (i64)outer[k] * r.lin_stride + inner[k]] = vals[k];
    }
    return;
  }
  i64 pos = r.pos;
  const bool single = gridDim.x == 1;
  if (single) {
    if (pos < 0) pos = state[r.slot] >> VOK_HEAD_SHIFT;
  } else {
    __shared__ i64 shared_pos;
    if (threadIdx.x == 0) {
      const i64 word = (i64)atomicAdd(reinterpret_cast<u64*>(state + r.slot), 1ULL);
      if (pos < 0) pos = word >> VOK_HEAD_SHIFT;
      if ((word & ((1LL << VOK_HEAD_SHIFT) - 1)) == gridDim.x - 1) state[r.slot] = next_head_word(r, pos);
      shared_pos = pos;
    }
    __syncthreads();
    pos = shared_pos;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (start + k * VOK_RING_THREADS + (int)threadIdx.x < total) {
      i64 t = pos + (last ? inner[k] : outer[k]);
      if (t >= r.cap) t -= r.cap;
      arena[last ? r.base + (i64)outer[k] * r.cap + t : r.base + t * F64 + inner[k]] = vals[k];
    }
  }
  if (single) {
    __syncthreads();  // every thread has used the head (its stores' addresses) before it moves
    if (threadIdx.x == 0) state[r.slot] = next_head_word(r, pos);
  }
}

// The fused row gather over a record table (layout.py). Grid (records, blocks). Record j < the table's
// count copies its source row into its destination row (offset + row * stride on each side): a float
// row its columns [y * B, (y + 1) * B) (B = VOK_GATHER_BLOCK_BYTES / S elements), with 16-byte
// accesses when ALIGNED (the host checked every row start); an int row (or a run of rows) a strided
// share of its elements. Records past the count (a captured grid replayed with fewer) exit.
template <int S, bool ALIGNED>
__device__ __forceinline__ void row_gather(char* __restrict__ base, const i64* __restrict__ table, i64 W) {
  typedef typename Bits<S>::T T;
  wait_previous_grid();
  const i64 job = blockIdx.x;
  if (job >= table[0]) return;
  const i64* rec = table + 1 + job * VOK_ROW_WORDS;
  const i64 src = rec[VOK_R_SRC] + rec[VOK_R_SRC_ROW] * rec[VOK_R_SRC_STRIDE];
  const i64 dst = rec[VOK_R_DST] + rec[VOK_R_DST_ROW] * rec[VOK_R_DST_STRIDE];
  const int count = (int)(rec[VOK_R_WORD] & 0xFFFFFFFF), kind = (int)(rec[VOK_R_WORD] >> 32);
  if (!(kind & VOK_JOB_INT)) {
    constexpr int kBlock = VOK_GATHER_BLOCK_BYTES;
    if (ALIGNED) {
      const uint4* s = reinterpret_cast<const uint4*>(base + src * S);
      uint4* d = reinterpret_cast<uint4*>(base + dst * S);
      const i64 nvec = W * S / 16, v0 = (i64)blockIdx.y * (kBlock / 16);
      const i64 v1 = v0 + kBlock / 16 < nvec ? v0 + kBlock / 16 : nvec;
      uint4 buf[kBlock / 16 / VOK_GATHER_THREADS];
#pragma unroll
      for (int k = 0; k < kBlock / 16 / VOK_GATHER_THREADS; ++k) {
        const i64 v = v0 + k * VOK_GATHER_THREADS + threadIdx.x;
        if (v < v1) buf[k] = s[v];
      }
#pragma unroll
      for (int k = 0; k < kBlock / 16 / VOK_GATHER_THREADS; ++k) {
        const i64 v = v0 + k * VOK_GATHER_THREADS + threadIdx.x;
        if (v < v1) d[v] = buf[k];
      }
    } else {
      const T* s = reinterpret_cast<const T*>(base) + src;
      T* d = reinterpret_cast<T*>(base) + dst;
      const i64 c0 = (i64)blockIdx.y * (kBlock / S), c1 = c0 + kBlock / S < W ? c0 + kBlock / S : W;
      for (i64 c = c0 + threadIdx.x; c < c1; c += VOK_GATHER_THREADS) d[c] = s[c];
    }
    return;
  }
  // An int record: each thread loads up to VOK_GATHER_INT_PER_THREAD elements before it stores any, so
  // a run record (layout.RUN_ELEMS: that many per thread of a block) costs one memory round trip, not
  // one per element of a thread; a record of more elements than its blocks cover at once loops.
  constexpr int kInts = VOK_GATHER_INT_PER_THREAD;
  const bool s_wide = kind & VOK_INT_SRC64, d_wide = kind & VOK_INT_DST64;
  int* ibase = reinterpret_cast<int*>(base);
  const i64 step = (i64)gridDim.y * VOK_GATHER_THREADS;
  for (i64 e0 = (i64)blockIdx.y * VOK_GATHER_THREADS + threadIdx.x; e0 < count; e0 += step * kInts) {
    int lo[kInts], hi[kInts];
#pragma unroll
    for (int k = 0; k < kInts; ++k) {
      const i64 e = e0 + k * step;
      if (e < count) {
        lo[k] = ibase[src + (s_wide ? 2 * e : e)];
        if (s_wide) hi[k] = ibase[src + 2 * e + 1];
      }
    }
#pragma unroll
    for (int k = 0; k < kInts; ++k) {
      const i64 e = e0 + k * step;
      if (e < count) {
        ibase[dst + (d_wide ? 2 * e : e)] = lo[k];
        if (d_wide) ibase[dst + 2 * e + 1] = s_wide ? hi[k] : (lo[k] < 0 ? -1 : 0);  // int32: sign-extended
      }
    }
  }
}

}  // namespace vok

#define VOK_RING(S)                                                                                     \
  extern "C" __global__ void __launch_bounds__(VOK_RING_THREADS)                                        \
      vok_ring_write_e##S(void* arena, long long* state, const long long* meta, void* src, long long F, \
                          int last) {                                                                   \
    typedef vok::Bits<S>::T T;                                                                          \
    vok::ring_copy<S, true>(static_cast<T*>(arena), state, meta, static_cast<T*>(src), F, last);       \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(VOK_RING_THREADS)                                        \
      vok_ring_read_e##S(void* arena, const long long* meta, void* out, long long F, int last) {         \
    typedef vok::Bits<S>::T T;                                                                          \
    vok::ring_copy<S, false>(static_cast<T*>(arena), nullptr, meta, static_cast<T*>(out), F, last);    \
  }

VOK_RING(1)
VOK_RING(2)
VOK_RING(4)
VOK_RING(8)

#define VOK_GATHER(S, A, ALIGNED)                                                                   \
  extern "C" __global__ void __launch_bounds__(VOK_GATHER_THREADS)                                  \
      vok_row_gather_e##S##_a##A(void* base, const long long* table, long long W) {                 \
    vok::row_gather<S, ALIGNED>(static_cast<char*>(base), table, W);                                \
  }

VOK_GATHER(2, 0, false)
VOK_GATHER(2, 1, true)
VOK_GATHER(4, 0, false)
VOK_GATHER(4, 1, true)
