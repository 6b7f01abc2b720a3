// The kernels of vok_kernels.cuh as host launchers on raw pointers (vok_launch.h), and as torch
// custom ops registered with TORCH_LIBRARY (def + impl, the dispatcher's direct path, as vLLM
// registers its ops). Fake implementations for torch.compile are registered from Python
// (vllm_omni_kernels/ops/cuda_ext.py); every op mutates its outputs and returns nothing. Launches go
// on the current stream; no host sync, no allocation.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "vok_kernels.cuh"
#include "vok_launch.h"

namespace vok {

static_assert(kGatherRowBlockBytes == kGatherBlockBytes && kGatherIntThreads == kGatherThreads,
              "vok_launch.h and vok_kernels.cuh disagree on gather blocks");
static_assert(sizeof(Words<kParamWords>) + 48 <= 32764, "a launch's parameters fit in 32764 bytes");

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// -1: not read yet (VLLM_OMNI_KERNELS_PDL, default on); else 0 or 1.
std::atomic<int> g_programmatic{-1};
// Per device: 0 not known yet, 1 older than Hopper, 2 Hopper or newer (what the launch attribute is for).
std::atomic<int> g_device_kind[64];

bool programmatic_here() {
  if (!programmatic_launch()) return false;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return false;
  int kind = g_device_kind[dev].load(std::memory_order_relaxed);
  if (kind == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    kind = major >= 9 ? 2 : 1;
    g_device_kind[dev].store(kind, std::memory_order_relaxed);
  }
  return kind == 2;
}

// Every launch of this file: `args` point at the kernel's arguments, in order.
void launch(const void* kernel, dim3 grid, int threads, void** args, cudaStream_t s) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.stream = s;
  cudaLaunchAttribute attr[1];
  if (programmatic_here()) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, args));
}

dim3 ring_grid(int64_t rows, int64_t max_elems) {
  return dim3(std::max<int64_t>(1, ceil_div(max_elems, kRingThreads * kRingPerThread)), rows);
}

dim3 gather_grid(int64_t grid_rows, int64_t width, int es) {
  return dim3(grid_rows, gather_row_blocks(width, es));
}

const void* ring_entry(int es, bool last, bool write) {
#define VOK_E(S)                                                                                                 \
  if (es == S) {                                                                                                 \
    if (write) return last ? (const void*)&vok_ring_write_e##S##_last : (const void*)&vok_ring_write_e##S##_dim0; \
    return last ? (const void*)&vok_ring_read_e##S##_last : (const void*)&vok_ring_read_e##S##_dim0;             \
  }
  VOK_E(2) VOK_E(4) VOK_E(8)
#undef VOK_E
  return nullptr;
}
}  // namespace

void set_programmatic_launch(bool enabled) { g_programmatic.store(enabled ? 1 : 0); }

bool programmatic_launch() {
  int on = g_programmatic.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* env = std::getenv("VLLM_OMNI_KERNELS_PDL");
    on = !(env && env[0] == '0' && env[1] == '\0');
    g_programmatic.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

void launch_ring_write(void* a, int es, int64_t* state, const int64_t* meta, const void* src, int64_t rows,
                       int64_t frame_elems, bool last, int64_t max_elems, cudaStream_t s) {
  int mono = last && frame_elems == 1;
  long long F = frame_elems;
  void* x = const_cast<void*>(src);
  const void* m = meta;
  void* args[] = {&a, &state, &m, &x, &F, &mono};
  launch(ring_entry(es, last, /*write=*/true), ring_grid(rows, max_elems), kRingThreads, args, s);
}

void launch_ring_read(const void* arena, int es, const int64_t* meta, void* o, int64_t rows, int64_t frame_elems,
                      bool last, int64_t max_elems, cudaStream_t s) {
  int mono = last && frame_elems == 1;
  long long F = frame_elems;
  const void* a = arena;
  const void* m = meta;
  void* args[] = {&a, &m, &o, &F, &mono};
  launch(ring_entry(es, last, /*write=*/false), ring_grid(rows, max_elems), kRingThreads, args, s);
}

void launch_row_gather(void* f, int es, void* ibase, int64_t* table, int64_t width, int64_t int_off,
                       int64_t grid_rows, bool aligned, cudaStream_t s) {
  long long W = width, off = int_off;
  void* args[] = {&f, &ibase, &table, &W, &off};
  const void* kernel = es == 2 ? (aligned ? (const void*)&vok_row_gather_e2_a1 : (const void*)&vok_row_gather_e2_a0)
                               : (aligned ? (const void*)&vok_row_gather_e4_a1 : (const void*)&vok_row_gather_e4_a0);
  launch(kernel, gather_grid(grid_rows, width, es), kGatherThreads, args, s);
}

// The `_p<N>` entry of the smallest size N that holds `words` (callers check words <= kParamWords).
#define VOK_SIZE_PICK(N, PREFIX, SUFFIX) \
  if (words <= N) return reinterpret_cast<const void*>(&PREFIX##SUFFIX##_p##N);

namespace {
const void* ring_write_params_entry(int es, bool last, int64_t words) {
  if (es == 2 && !last) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_ring_write_e2_, dim0) }
  if (es == 2 && last) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_ring_write_e2_, last) }
  if (es == 4 && !last) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_ring_write_e4_, dim0) }
  if (es == 4 && last) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_ring_write_e4_, last) }
  if (es == 8 && !last) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_ring_write_e8_, dim0) }
  if (es == 8 && last) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_ring_write_e8_, last) }
  return nullptr;
}

const void* row_gather_params_entry(int es, bool aligned, int64_t words) {
  if (es == 2 && !aligned) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_row_gather_e2_, a0) }
  if (es == 2 && aligned) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_row_gather_e2_, a1) }
  if (es == 4 && !aligned) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_row_gather_e4_, a0) }
  if (es == 4 && aligned) { VOK_PARAM_WORDS(VOK_SIZE_PICK, vok_row_gather_e4_, a1) }
  return nullptr;
}
}  // namespace
#undef VOK_SIZE_PICK

// cudaLaunchKernel reads each argument through a pointer: the metadata's is the caller's buffer
// itself, so nothing is copied before the driver copies the parameters.
void launch_ring_write_params(void* a, int es, int64_t* state, const int64_t* meta, const void* src, int64_t rows,
                              int64_t frame_elems, bool last, int64_t max_elems, cudaStream_t s) {
  int mono = last && frame_elems == 1;
  long long F = frame_elems;
  void* x = const_cast<void*>(src);
  void* args[] = {&a, &state, const_cast<int64_t*>(meta), &x, &F, &mono};
  launch(ring_write_params_entry(es, last, rows * 8), ring_grid(rows, max_elems), kRingThreads, args, s);
}

void launch_row_gather_params(void* f, int es, const int64_t* table, int64_t words, int64_t width, int64_t int_off,
                              int64_t grid_rows, bool aligned, cudaStream_t s) {
  long long W = width, off = int_off;
  void* args[] = {&f, const_cast<int64_t*>(table), &W, &off};
  launch(row_gather_params_entry(es, aligned, words), gather_grid(grid_rows, width, es), kGatherThreads, args, s);
}

}  // namespace vok

namespace {

void check_ring(const at::Tensor& arena, const at::Tensor& meta, const at::Tensor& other, int64_t rows,
                int64_t max_elems) {
  TORCH_CHECK(arena.is_cuda() && (meta.is_cuda() || meta.is_pinned()), "ring ops take a CUDA arena and CUDA or pinned metadata");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous(), "meta must be contiguous int64");
  TORCH_CHECK(other.scalar_type() == arena.scalar_type() && other.is_cuda(), "source/output must match the arena");
  TORCH_CHECK(rows <= vok::kMaxRingRows, "at most ", vok::kMaxRingRows, " rows per launch");
  TORCH_CHECK(max_elems <= vok::kMaxRowElems, "a row of at most 2**31 - 1 elements per launch");
  const int64_t es = arena.element_size();
  TORCH_CHECK(es == 2 || es == 4 || es == 8, "element size ", es, " not supported");
}

void ring_write(at::Tensor& arena, at::Tensor& state, const at::Tensor& meta, const at::Tensor& src, int64_t rows,
                int64_t frame_elems, bool last, int64_t max_elems) {
  check_ring(arena, meta, src, rows, max_elems);
  TORCH_CHECK(state.scalar_type() == at::kLong && state.is_contiguous(), "state must be contiguous int64");
  if (rows == 0) return;  // with rows, a write runs even when nothing is copied: it publishes POS
  const c10::cuda::OptionalCUDAGuard guard(arena.device());
  vok::launch_ring_write(arena.data_ptr(), arena.element_size(), state.data_ptr<int64_t>(), meta.data_ptr<int64_t>(),
                         src.data_ptr(), rows, frame_elems, last, max_elems, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ring_read(const at::Tensor& arena, const at::Tensor& meta, at::Tensor& out, int64_t rows, int64_t frame_elems,
               bool last, int64_t max_elems) {
  check_ring(arena, meta, out, rows, max_elems);
  if (rows == 0 || max_elems == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(arena.device());
  vok::launch_ring_read(arena.data_ptr(), arena.element_size(), meta.data_ptr<int64_t>(), out.data_ptr(), rows,
                        frame_elems, last, max_elems, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void row_gather(at::Tensor& anchor, at::Tensor& table, int64_t width, int64_t int_off, int64_t grid_rows,
                bool aligned) {
  TORCH_CHECK(anchor.is_cuda() && (table.is_cuda() || table.is_pinned()),
              "row_gather takes a CUDA anchor and a CUDA or pinned host table");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous(), "table must be contiguous int64");
  const int64_t es = anchor.element_size();
  TORCH_CHECK(es == 2 || es == 4, "float rows of 2 or 4 bytes");
  TORCH_CHECK(vok::gather_width_fits(width, es), "row too wide");
  if (grid_rows == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(anchor.device());
  vok::launch_row_gather(anchor.data_ptr(), es, table.data_ptr(), table.data_ptr<int64_t>(), width, int_off, grid_rows,
                         aligned, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(vllm_omni_kernels, m) {
  m.def("ring_write(Tensor(a!) arena, Tensor(b!) state, Tensor meta, Tensor src, int rows, int frame_elems, "
        "bool last, int max_elems) -> ()");
  m.def("ring_read(Tensor arena, Tensor meta, Tensor(a!) out, int rows, int frame_elems, bool last, "
        "int max_elems) -> ()");
  m.def("row_gather(Tensor(a!) anchor, Tensor(b!) table, int width, int int_off, int grid_rows, bool aligned) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_omni_kernels, CUDA, m) {
  m.impl("ring_write", &ring_write);
  m.impl("ring_read", &ring_read);
  m.impl("row_gather", &row_gather);
}
