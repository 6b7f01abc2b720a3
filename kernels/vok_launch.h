// Host launchers of the kernels in vok_kernels.cuh (defined in vok_torch.cu), on raw pointers, for
// the torch ops (vok_torch.cu) and the Python module's eager steps (vok_python.cpp). They launch on
// the given stream and check nothing but the launch itself: callers validate first.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vok {

// What one launch can take, checked by every caller before it plans anything: the ring grid has a
// block row per metadata row (grid.y), the kernels index a row's elements in 32 bits, and a gather
// row is split into blocks of kGatherBlockBytes (vok_kernels.cuh; vok_torch.cu asserts they agree)
// along grid.y.
constexpr int64_t kMaxRingRows = 65535;
constexpr int64_t kMaxRowElems = 2147483647;
constexpr int64_t kGatherRowBlockBytes = 4096;
constexpr int64_t kGatherIntThreads = 128;  // threads of a gather block: an int job's elements per block and pass
// Blocks per float row of `width` elements (grid.y of a gather; an int job's blocks share its
// elements, kGatherIntThreads each per pass: gather_jobs.int_run_cap).
inline int64_t gather_row_blocks(int64_t width, int64_t elem_size) {
  const int64_t blocks = (width * elem_size + kGatherRowBlockBytes - 1) / kGatherRowBlockBytes;
  return blocks > 1 ? blocks : 1;
}
inline bool gather_width_fits(int64_t width, int64_t elem_size) {
  return width > 0 && gather_row_blocks(width, elem_size) <= 65535;
}

// Programmatic dependent launch: on Hopper and newer every launch below may let its blocks be
// scheduled while the kernel ahead of it in the stream finishes (the kernels wait for it before
// touching memory: vok_kernels.cuh, wait_previous_grid). In a CUDA graph this takes a launch's
// latency off each of a chain of small kernels. On by default; VLLM_OMNI_KERNELS_PDL=0 in the
// environment turns it off, and so does set_programmatic_launch(false) (for launches from then on;
// a captured graph keeps what it was captured with).
void set_programmatic_launch(bool enabled);
bool programmatic_launch();

// One block row per metadata row; `max_elems` (largest N * F of the step, <= 2**31 - 1) sizes the
// grid. A write runs at least one block per row even when nothing is copied (it publishes POS).
void launch_ring_write(void* arena, int elem_size, int64_t* state, const int64_t* meta, const void* src,
                       int64_t rows, int64_t frame_elems, bool last, int64_t max_elems, cudaStream_t stream);
void launch_ring_read(const void* arena, int elem_size, const int64_t* meta, void* out, int64_t rows,
                      int64_t frame_elems, bool last, int64_t max_elems, cudaStream_t stream);
// `grid_rows` jobs (>= the table's count) of float rows of `width` elements of `elem_size` (2 or 4);
// int words are offsets from `int_base` (the table itself for the torch op, the anchor for the
// compiled eager step: gather_jobs.py).
void launch_row_gather(void* anchor, int elem_size, void* int_base, int64_t* table, int64_t width, int64_t int_off,
                       int64_t grid_rows, bool aligned, cudaStream_t stream);

// The same launches with the metadata rows / table in the kernel's parameters (the `_p<N>` entries of
// vok_kernels.cuh): `words` (rows * 8 for the ring) at most kParamWords, read from host memory that
// holds at least kParamWords words (the launch copies the smallest entry size that fits; the memory
// is free again when it returns). The gather's int words are then addressed from `anchor` (the int
// base, gather_jobs.py), and its payload sources are flagged.
constexpr int64_t kParamWords = 4088;
void launch_ring_write_params(void* arena, int elem_size, int64_t* state, const int64_t* meta, const void* src,
                              int64_t rows, int64_t frame_elems, bool last, int64_t max_elems, cudaStream_t stream);
void launch_row_gather_params(void* anchor, int elem_size, const int64_t* table, int64_t words, int64_t width,
                              int64_t int_off, int64_t grid_rows, bool aligned, cudaStream_t stream);

}  // namespace vok
