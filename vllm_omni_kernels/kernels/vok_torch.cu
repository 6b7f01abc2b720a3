// The kernels of vok_kernels.cuh as torch custom ops: grid, checks and launch on the current stream,
// registered with TORCH_LIBRARY (def + impl, as vLLM's csrc/torch_bindings.cpp does). Each schema
// says what the op writes. The planning (metadata rows, gather tables) is the Python planner's
// (vllm_omni_kernels/ring/planner.py, gather/jobs.py); nothing here allocates or syncs.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "vok_kernels.cuh"

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Programmatic dependent launch (ops/pdl.py): -1 not read yet (VLLM_OMNI_KERNELS_PDL, default on).
std::atomic<int> g_programmatic{-1};

bool programmatic_here(int device) {
  int on = g_programmatic.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* env = std::getenv("VLLM_OMNI_KERNELS_PDL");
    on = !(env && env[0] == '0' && env[1] == '\0');
    g_programmatic.store(on, std::memory_order_relaxed);
  }
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return on == 1 && major >= 9;
}

void launch(const void* kernel, dim3 grid, int threads, void** args, const at::Tensor& on) {
  const c10::cuda::OptionalCUDAGuard guard(on.device());
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  if (programmatic_here(on.get_device())) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, args));
}

void check_ring(const at::Tensor& arena, const at::Tensor& meta, const at::Tensor& linear, int64_t rows,
                int64_t max_elems) {
  TORCH_CHECK(arena.is_cuda() && linear.is_cuda() && linear.scalar_type() == arena.scalar_type(),
              "ring ops take a CUDA arena and a CUDA source/output of its dtype");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous() && (meta.is_cuda() || meta.is_pinned()),
              "meta must be contiguous int64, on the device or pinned");
  TORCH_CHECK(rows <= 65535, "at most 65535 rows per launch");
  TORCH_CHECK(max_elems <= 2147483647, "a row of at most 2**31 - 1 elements per launch");
  const int64_t es = arena.element_size();
  TORCH_CHECK(es == 1 || es == 2 || es == 4 || es == 8, "element size ", es, " not supported");
}

dim3 ring_grid(int64_t rows, int64_t max_elems) {
  return dim3(std::max<int64_t>(1, ceil_div(max_elems, VOK_RING_THREADS * VOK_RING_PER_THREAD)), rows);
}

const void* ring_entry(int64_t es, bool write) {
  if (es == 1) return write ? (const void*)&vok_ring_write_e1 : (const void*)&vok_ring_read_e1;
  if (es == 2) return write ? (const void*)&vok_ring_write_e2 : (const void*)&vok_ring_read_e2;
  if (es == 4) return write ? (const void*)&vok_ring_write_e4 : (const void*)&vok_ring_read_e4;
  return write ? (const void*)&vok_ring_write_e8 : (const void*)&vok_ring_read_e8;
}

void ring_write(at::Tensor& arena, at::Tensor& state, const at::Tensor& meta, const at::Tensor& src, int64_t rows,
                int64_t frame_elems, bool last, int64_t max_elems) {
  check_ring(arena, meta, src, rows, max_elems);
  TORCH_CHECK(state.scalar_type() == at::kLong && state.is_contiguous() && state.is_cuda(), "state must be CUDA int64");
  if (rows == 0) return;  // with rows, a write runs even when nothing is copied: it publishes POS
  void* a = arena.data_ptr();
  void* st = state.data_ptr();
  const void* m = meta.data_ptr();
  void* s = const_cast<void*>(src.data_ptr());
  long long F = frame_elems;
  int l = last;
  void* args[] = {&a, &st, &m, &s, &F, &l};
  launch(ring_entry(arena.element_size(), true), ring_grid(rows, max_elems), VOK_RING_THREADS, args, arena);
}

void ring_read(const at::Tensor& arena, const at::Tensor& meta, at::Tensor& out, int64_t rows, int64_t frame_elems,
               bool last, int64_t max_elems) {
  check_ring(arena, meta, out, rows, max_elems);
  if (rows == 0 || max_elems == 0) return;
  const void* a = arena.data_ptr();
  const void* m = meta.data_ptr();
  void* o = out.data_ptr();
  long long F = frame_elems;
  int l = last;
  void* args[] = {&a, &m, &o, &F, &l};
  launch(ring_entry(arena.element_size(), false), ring_grid(rows, max_elems), VOK_RING_THREADS, args, arena);
}

void row_gather(const at::Tensor& base, const at::Tensor& table, at::TensorList outputs, int64_t width,
                int64_t grid_rows, bool aligned) {
  TORCH_CHECK(base.is_cuda() && (table.is_cuda() || table.is_pinned()),
              "row_gather takes a CUDA base and a CUDA or pinned table");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous(), "table must be contiguous int64");
  const int64_t es = base.element_size();
  TORCH_CHECK(es == 2 || es == 4, "float rows of 2 or 4 bytes");
  const int64_t row_blocks = std::max<int64_t>(1, ceil_div(width * es, VOK_GATHER_BLOCK_BYTES));
  TORCH_CHECK(width > 0 && row_blocks <= 65535, "row too wide");
  for (const auto& t : outputs) TORCH_CHECK(t.device() == base.device(), "every output on the base's device");
  if (grid_rows == 0) return;
  const void* b = base.data_ptr();
  const void* t = table.data_ptr();
  long long W = width;
  void* args[] = {&b, &t, &W};
  const void* kernel = es == 2 ? (aligned ? (const void*)&vok_row_gather_e2_a1 : (const void*)&vok_row_gather_e2_a0)
                               : (aligned ? (const void*)&vok_row_gather_e4_a1 : (const void*)&vok_row_gather_e4_a0);
  launch(kernel, dim3(grid_rows, row_blocks), VOK_GATHER_THREADS, args, base);
}

void set_programmatic_launch(bool enabled) { g_programmatic.store(enabled ? 1 : 0); }

}  // namespace

TORCH_LIBRARY(vllm_omni_kernels, m) {
  m.def("ring_write(Tensor(a!) arena, Tensor(b!) state, Tensor meta, Tensor src, int rows, int frame_elems, "
        "bool last, int max_elems) -> ()");
  m.def("ring_read(Tensor arena, Tensor meta, Tensor(a!) out, int rows, int frame_elems, bool last, "
        "int max_elems) -> ()");
  // `outputs`: the tensors the table's blocks write (addressed by offsets from `base`), named so the
  // schema says what the op writes.
  m.def("row_gather(Tensor base, Tensor table, Tensor(a!)[] outputs, int width, int grid_rows, bool aligned) -> ()");
  m.def("set_programmatic_launch(bool enabled) -> ()", &set_programmatic_launch);
}

TORCH_LIBRARY_IMPL(vllm_omni_kernels, CUDA, m) {
  m.impl("ring_write", &ring_write);
  m.impl("ring_read", &ring_read);
  m.impl("row_gather", &row_gather);
}
