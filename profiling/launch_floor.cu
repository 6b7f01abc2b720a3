// The host's floor for one eager launch: cudaLaunchKernel of an empty kernel with the ring
// append's argument list (4 pointers, 4 scalars), in a tight C++ loop, no Python and no torch.
// Every eager step of the package pays at least this per launch on this host.
//
// Build and run (on the GPU machine): nvcc -O2 -o /tmp/launch_floor profiling/launch_floor.cu && /tmp/launch_floor
#include <chrono>
#include <cstdio>
#include <cuda_runtime.h>

__global__ void empty_kernel(void* a, void* b, const void* c, const void* d, long long e, long long f, int g, int h) {}

int main() {
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  void* p;
  cudaMalloc(&p, 256);
  const int kIters = 200000;
  for (int round = 0; round < 4; ++round) {  // the first round warms up
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i) empty_kernel<<<1, 32, 0, stream>>>(p, p, p, p, 1, 2, 3, 4);
    const auto t1 = std::chrono::steady_clock::now();
    cudaStreamSynchronize(stream);
    const double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / kIters;
    if (round) std::printf("cudaLaunchKernel, empty kernel, 8 arguments: %.2f us per launch (host)\n", us);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
