// Torch custom ops over the kernels of vok_kernels.cuh, registered with TORCH_LIBRARY (def + impl,
// the dispatcher's direct path, as vLLM registers its ops). Fake implementations for torch.compile
// are registered from Python (vllm_omni_kernels/ops/cuda_ext.py); every op mutates its outputs and
// returns nothing. Launches go on the current stream; no host sync, no allocation.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "vok_kernels.cuh"

namespace {

using vok::i64;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename Write, typename Read>
void ring_launch(bool write, const at::Tensor& arena, const at::Tensor& meta, int64_t rows, int64_t frame_elems,
                 bool last, int64_t max_elems, Write w, Read r) {
  TORCH_CHECK(arena.is_cuda() && (meta.is_cuda() || meta.is_pinned()), "ring ops take a CUDA arena and CUDA or pinned metadata");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous(), "meta must be contiguous int64");
  TORCH_CHECK(rows <= 65535, "at most 65535 rows per launch");
  TORCH_CHECK(max_elems <= INT32_MAX, "a row of at most 2**31 - 1 elements per launch");
  // A write with nothing to copy still runs one block per row: it publishes head overrides (POS).
  if (rows == 0 || (!write && max_elems == 0)) return;
  const c10::cuda::OptionalCUDAGuard guard(arena.device());
  const dim3 grid(std::max<int64_t>(1, ceil_div(max_elems, vok::kRingThreads * vok::kRingPerThread)), rows);
  const int mono = last && frame_elems == 1;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int es = arena.element_size();
  TORCH_CHECK(es == 2 || es == 4 || es == 8, "element size ", es, " not supported");
  if (write) w(es, grid, stream, mono); else r(es, grid, stream, mono);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ring_write(at::Tensor& arena, at::Tensor& state, const at::Tensor& meta, const at::Tensor& src, int64_t rows,
                int64_t frame_elems, bool last, int64_t max_elems) {
  TORCH_CHECK(src.scalar_type() == arena.scalar_type() && src.is_cuda(), "src must match the arena");
  TORCH_CHECK(state.scalar_type() == at::kLong && state.is_contiguous(), "state must be contiguous int64");
  ring_launch(true, arena, meta, rows, frame_elems, last, max_elems,
      [&](int es, dim3 grid, cudaStream_t s, int mono) {
        void* a = arena.data_ptr();
        void* x = const_cast<void*>(src.data_ptr());
        i64* st = reinterpret_cast<i64*>(state.data_ptr());
        const i64* m = reinterpret_cast<const i64*>(meta.data_ptr());
#define VOK_W(S)                                                                                   \
  if (es == S) {                                                                                   \
    if (last) vok_ring_write_e##S##_last<<<grid, vok::kRingThreads, 0, s>>>(a, st, m, x, frame_elems, mono); \
    else vok_ring_write_e##S##_dim0<<<grid, vok::kRingThreads, 0, s>>>(a, st, m, x, frame_elems, mono);      \
  }
        VOK_W(2) VOK_W(4) VOK_W(8)
#undef VOK_W
      },
      [](int, dim3, cudaStream_t, int) {});
}

void ring_read(const at::Tensor& arena, const at::Tensor& meta, at::Tensor& out, int64_t rows, int64_t frame_elems,
               bool last, int64_t max_elems) {
  TORCH_CHECK(out.scalar_type() == arena.scalar_type() && out.is_cuda(), "out must match the arena");
  ring_launch(false, arena, meta, rows, frame_elems, last, max_elems,
      [](int, dim3, cudaStream_t, int) {},
      [&](int es, dim3 grid, cudaStream_t s, int mono) {
        void* a = const_cast<void*>(arena.data_ptr());
        void* o = out.data_ptr();
        const i64* m = reinterpret_cast<const i64*>(meta.data_ptr());
#define VOK_R(S)                                                                                   \
  if (es == S) {                                                                                   \
    if (last) vok_ring_read_e##S##_last<<<grid, vok::kRingThreads, 0, s>>>(a, m, o, frame_elems, mono); \
    else vok_ring_read_e##S##_dim0<<<grid, vok::kRingThreads, 0, s>>>(a, m, o, frame_elems, mono);      \
  }
        VOK_R(2) VOK_R(4) VOK_R(8)
#undef VOK_R
      });
}

void row_gather(at::Tensor& anchor, at::Tensor& table, int64_t width, int64_t int_off, int64_t grid_rows,
                bool aligned) {
  TORCH_CHECK(anchor.is_cuda() && (table.is_cuda() || table.is_pinned()),
              "row_gather takes a CUDA anchor and a CUDA or pinned host table");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous(), "table must be contiguous int64");
  if (grid_rows == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(anchor.device());
  const int es = anchor.element_size();
  TORCH_CHECK(es == 2 || es == 4, "float rows of 2 or 4 bytes");
  const dim3 grid(grid_rows, std::max<int64_t>(1, ceil_div(width * es, vok::kGatherBlockBytes)));
  TORCH_CHECK(grid.y <= 65535, "row too wide");
  auto s = c10::cuda::getCurrentCUDAStream();
  void* f = anchor.data_ptr();
  int* ib = reinterpret_cast<int*>(table.data_ptr());
  const i64* t = reinterpret_cast<const i64*>(table.data_ptr());
  if (es == 2) {
    if (aligned) vok_row_gather_e2_a1<<<grid, vok::kGatherThreads, 0, s>>>(f, ib, t, width, int_off);
    else vok_row_gather_e2_a0<<<grid, vok::kGatherThreads, 0, s>>>(f, ib, t, width, int_off);
  } else {
    if (aligned) vok_row_gather_e4_a1<<<grid, vok::kGatherThreads, 0, s>>>(f, ib, t, width, int_off);
    else vok_row_gather_e4_a0<<<grid, vok::kGatherThreads, 0, s>>>(f, ib, t, width, int_off);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- Host planning of one ring append step (the compiled fast path of RingPool.append) -------------
//
// `table` is the pool's host slot table (int64 [slots, 8], laid out like a metadata row with the
// unread size in column 7); `slots` and `n` are the step's B distinct slots and frame counts (int64,
// host; n may be longer, its first B entries count); `staged` receives the B metadata rows (host, pinned when a kernel reads it in place).
// Every row is checked before anything is written: 0 <= n <= axis_len and n fits in the slot's free
// frames. On success the rows are staged, each slot's unread size advances by n and its head
// override (POS) is cleared, and the largest n is returned; else -(b + 1) for the first row b that
// does not fit, with nothing written. Same contract as RingPool._plan_numpy.
constexpr int kSlot = 0, kLinOff = 1, kN = 2, kBase = 3, kCap = 4, kPos = 5, kLinStride = 6, kSize = 7;

void check_host_i64(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), what,
              " must be a contiguous int64 host tensor");
}

int64_t ring_plan(at::Tensor& table, const at::Tensor& slots, const at::Tensor& n, at::Tensor& staged,
                  int64_t row_elems, int64_t axis_len, int64_t lin_stride) {
  check_host_i64(table, "table");
  check_host_i64(slots, "slots");
  check_host_i64(n, "n");
  check_host_i64(staged, "staged");
  const int64_t B = slots.numel();
  TORCH_CHECK(table.dim() == 2 && table.size(1) == 8, "table must be [slots, 8]");
  TORCH_CHECK(n.numel() >= B && staged.numel() >= B * 8, "n and staged must cover every slot");
  i64* t = reinterpret_cast<i64*>(table.data_ptr());
  const i64* sl = reinterpret_cast<const i64*>(slots.data_ptr());
  const i64* nn = reinterpret_cast<const i64*>(n.data_ptr());
  i64* st = reinterpret_cast<i64*>(staged.data_ptr());
  const int64_t num_slots = table.size(0);
  int64_t max_n = 0;
  for (int64_t b = 0; b < B; ++b) {
    const i64 s = sl[b], k = nn[b];
    if (s < 0 || s >= num_slots || k < 0 || k > axis_len) return -(b + 1);
    const i64* row = t + s * 8;
    if (k > row[kCap] - row[kSize]) return -(b + 1);
    max_n = std::max<int64_t>(max_n, k);
  }
  for (int64_t b = 0; b < B; ++b) {
    i64* row = t + sl[b] * 8;
    i64* m = st + b * 8;
    m[kSlot] = sl[b];
    m[kLinOff] = b * row_elems;
    m[kN] = nn[b];
    m[kBase] = row[kBase];
    m[kCap] = row[kCap];
    m[kPos] = row[kPos];
    m[kLinStride] = lin_stride;
    m[kSize] = row[kSize];
    row[kSize] += nn[b];
    row[kPos] = -1;
  }
  return max_n;
}

// ---- Host encoding of a row gather's job table (the compiled path of RowGather.launch) -----------
//
// `desc` lists the launch's blocks of jobs, 8 ints each (GatherJobs.describe):
//   is_int, src_off, src_stride, dst_off, dst_stride, count, rows_at, width_flags
// Job k of a block copies row s_k of the source to row d_k of the destination, at
// src_off + s_k * src_stride and dst_off + d_k * dst_stride (float jobs in elements from the float
// base, int jobs in int32 words from the table), where s_k = rowbuf[rows_at + k] and
// d_k = rowbuf[rows_at + count + k], or s_k = d_k = 0 when rows_at < 0 (a single job with its rows
// folded into the offsets). Int jobs also carry width_flags = width | flags << 32. Float jobs fill
// the table from entry 2 in desc order, int jobs from int_off: the same table GatherJobs.encode
// writes (gather_jobs.py has the layout).
void gather_encode(at::Tensor& table, at::IntArrayRef desc, const at::Tensor& rowbuf, int64_t n_float, int64_t n_int,
                   int64_t int_off) {
  check_host_i64(table, "table");
  check_host_i64(rowbuf, "rowbuf");
  TORCH_CHECK(desc.size() % 8 == 0, "desc holds 8 ints per block");
  TORCH_CHECK(table.numel() >= int_off + 4 * n_int && int_off >= 2 + 2 * n_float, "table too small for the jobs");
  i64* t = reinterpret_cast<i64*>(table.data_ptr());
  const i64* rb = reinterpret_cast<const i64*>(rowbuf.data_ptr());
  const int64_t rb_n = rowbuf.numel();
  t[0] = n_float;
  t[1] = n_int;
  int64_t f = 0, i = 0;
  for (size_t b = 0; b < desc.size(); b += 8) {
    const int64_t* d = desc.data() + b;
    const int64_t count = d[5], at = d[6];
    TORCH_CHECK(count >= 0 && (at < 0 ? count == 1 : at + 2 * count <= rb_n), "block rows out of the row buffer");
    TORCH_CHECK(d[0] ? i + count <= n_int : f + count <= n_float, "more jobs than declared");
    for (int64_t k = 0; k < count; ++k) {
      const i64 s = at < 0 ? 0 : rb[at + k], dr = at < 0 ? 0 : rb[at + count + k];
      if (d[0]) {
        i64* rec = t + int_off + 4 * i++;
        rec[0] = d[1] + s * d[2];
        rec[1] = d[3] + dr * d[4];
        rec[2] = d[7] & 0xffffffffLL;
        rec[3] = d[7] >> 32;
      } else {
        t[2 + 2 * f] = d[1] + s * d[2];
        t[3 + 2 * f] = d[3] + dr * d[4];
        ++f;
      }
    }
  }
  TORCH_CHECK(f == n_float && i == n_int, "fewer jobs than declared");
}

// Encode (above) into a pinned table and launch the gather kernel that reads it in place.
void gather_launch(at::Tensor& anchor, at::Tensor& table, at::IntArrayRef desc, const at::Tensor& rowbuf,
                   int64_t n_float, int64_t n_int, int64_t int_off, int64_t width, bool aligned) {
  TORCH_CHECK(table.is_pinned(), "the table must be pinned (the kernel reads it in place)");
  gather_encode(table, desc, rowbuf, n_float, n_int, int_off);
  row_gather(anchor, table, width, int_off, n_float + n_int, aligned);
}

// Plan (above) and launch the write kernel reading the staged rows in place: one host call per step.
int64_t ring_append(at::Tensor& arena, at::Tensor& state, at::Tensor& table, const at::Tensor& slots,
                    const at::Tensor& n, at::Tensor& staged, const at::Tensor& src, int64_t row_elems,
                    int64_t axis_len, int64_t lin_stride, int64_t frame_elems, bool last) {
  TORCH_CHECK(staged.is_pinned(), "staged metadata must be pinned (the kernel reads it in place)");
  const int64_t max_n = ring_plan(table, slots, n, staged, row_elems, axis_len, lin_stride);
  if (max_n >= 0) ring_write(arena, state, staged, src, slots.numel(), frame_elems, last, max_n * frame_elems);
  return max_n;
}

}  // namespace

TORCH_LIBRARY(vllm_omni_kernels, m) {
  m.def("ring_write(Tensor(a!) arena, Tensor(b!) state, Tensor meta, Tensor src, int rows, int frame_elems, "
        "bool last, int max_elems) -> ()");
  m.def("ring_read(Tensor arena, Tensor meta, Tensor(a!) out, int rows, int frame_elems, bool last, "
        "int max_elems) -> ()");
  m.def("row_gather(Tensor(a!) anchor, Tensor(b!) table, int width, int int_off, int grid_rows, bool aligned) -> ()");
  // Host-side planning ops (they read and advance host slot tables, so torch.compile cannot trace them).
  m.def("ring_plan(Tensor(a!) table, Tensor slots, Tensor n, Tensor(b!) staged, int row_elems, int axis_len, "
        "int lin_stride) -> int");
  m.def("ring_append(Tensor(a!) arena, Tensor(b!) state, Tensor(c!) table, Tensor slots, Tensor n, Tensor(d!) staged, "
        "Tensor src, int row_elems, int axis_len, int lin_stride, int frame_elems, bool last) -> int");
  m.def("gather_encode(Tensor(a!) table, int[] desc, Tensor rowbuf, int n_float, int n_int, int int_off) -> ()");
  m.def("gather_launch(Tensor(a!) anchor, Tensor(b!) table, int[] desc, Tensor rowbuf, int n_float, int n_int, "
        "int int_off, int width, bool aligned) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_omni_kernels, CUDA, m) {
  m.impl("ring_write", &ring_write);
  m.impl("ring_read", &ring_read);
  m.impl("row_gather", &row_gather);
  m.impl("ring_append", &ring_append);
  m.impl("gather_launch", &gather_launch);
}

TORCH_LIBRARY_IMPL(vllm_omni_kernels, CPU, m) {
  m.impl("ring_plan", &ring_plan);
  m.impl("gather_encode", &gather_encode);
}
