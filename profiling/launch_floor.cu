// The host's floor for one eager launch, in a tight C++ loop with no Python and no torch: what every
// eager step of the package pays at least per launch on this host, and what the parts of the
// compiled launch path cost.
//
//   <<<>>> 8 args      cudaLaunchKernel of an empty kernel with the ring append's argument list
//   ExC small          cudaLaunchKernelExC with the programmatic-launch attribute (the package's
//                      launch, vok_torch.cu), 5 small arguments
//   ExC p<N>           the same with an N-word (int64) __grid_constant__ parameter, as the `_p<N>`
//                      gather entries take their table: the cost of the parameter copy per KB
//   cuLaunchKernelEx   the driver call itself on a CUfunction looked up once (cudaGetFuncBySymbol),
//                      small and p<N>: what the runtime adds on top
//
// Each variant is timed in interleaved rounds (one host's speed drifts) and reported as the median
// round, in us per launch.
//
// Build and run (on the GPU machine):
//   nvcc -O2 -std=c++17 -o /tmp/launch_floor profiling/launch_floor.cu -lcuda && /tmp/launch_floor
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

template <int N>
struct Words {
  long long w[N];
};

__global__ void empty_kernel(void* a, void* b, const void* c, const void* d, long long e, long long f, int g, int h) {}
__global__ void small_kernel(void* a, void* b, void* c, long long d, long long e) {}
template <int N>
__global__ void words_kernel(void* a, const __grid_constant__ Words<N> t, long long w, long long o) {}

#define CHECK(x)                                                          \
  do {                                                                    \
    cudaError_t err_ = (x);                                               \
    if (err_ != cudaSuccess) {                                            \
      std::printf("CUDA error %s at %s\n", cudaGetErrorString(err_), #x); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

static cudaStream_t g_stream;
static void* g_ptr;
static std::vector<long long> g_table(4096, 7);

static cudaLaunchAttribute pdl_attr() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

static void runtime_ex(const void* kernel, void** args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1);
  config.blockDim = dim3(32);
  config.stream = g_stream;
  cudaLaunchAttribute attr[1] = {pdl_attr()};
  config.attrs = attr;
  config.numAttrs = 1;
  cudaLaunchKernelExC(&config, kernel, args);
}

static void driver_ex(CUfunction f, void** args) {
  CUlaunchConfig config = {};
  config.gridDimX = config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = 32;
  config.blockDimY = config.blockDimZ = 1;
  config.hStream = reinterpret_cast<CUstream>(g_stream);
  CUlaunchAttribute attr[1] = {};
  attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr[0].value.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  cuLaunchKernelEx(&config, f, args, nullptr);
}

static CUfunction function_of(const void* kernel) {
  cudaFunction_t f;
  CHECK(cudaGetFuncBySymbol(&f, kernel));
  return reinterpret_cast<CUfunction>(f);
}

struct Variant {
  std::string name;
  std::function<void()> launch;
  std::vector<double> rounds;
};

template <int N>
static void add_words(std::vector<Variant>& v) {
  static long long W = 4096, O = 2;
  static void* args[] = {&g_ptr, g_table.data(), &W, &O};
  const void* k = reinterpret_cast<const void*>(&words_kernel<N>);
  v.push_back({"ExC p" + std::to_string(N) + " (" + std::to_string(N * 8 / 1024) + " KB)",
               [k] { runtime_ex(k, args); }, {}});
  if (N == 1024 || N == 2048 || N == 4088) {
    CUfunction f = function_of(k);
    v.push_back({"cuLaunchKernelEx p" + std::to_string(N), [f] { driver_ex(f, args); }, {}});
  }
}

int main() {
  CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  CHECK(cudaMalloc(&g_ptr, 256));
  std::vector<Variant> v;
  v.push_back({"<<<>>> 8 args", [] { empty_kernel<<<1, 32, 0, g_stream>>>(g_ptr, g_ptr, g_ptr, g_ptr, 1, 2, 3, 4); }, {}});
  static long long D = 1, E = 2;
  static void* small_args[] = {&g_ptr, &g_ptr, &g_ptr, &D, &E};
  const void* sk = reinterpret_cast<const void*>(&small_kernel);
  v.push_back({"ExC small", [sk] { runtime_ex(sk, small_args); }, {}});
  CUfunction sf = function_of(sk);
  v.push_back({"cuLaunchKernelEx small", [sf] { driver_ex(sf, small_args); }, {}});
  add_words<128>(v);
  add_words<512>(v);
  add_words<1024>(v);
  add_words<1536>(v);
  add_words<2048>(v);
  add_words<2560>(v);
  add_words<3072>(v);
  add_words<4088>(v);
  const int kIters = 20000, kRounds = 7;
  for (int round = 0; round <= kRounds; ++round) {  // round 0 warms up
    for (auto& x : v) {
      CHECK(cudaStreamSynchronize(g_stream));
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kIters; ++i) x.launch();
      const auto t1 = std::chrono::steady_clock::now();
      if (round) x.rounds.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kIters);
    }
  }
  CHECK(cudaStreamSynchronize(g_stream));
  CHECK(cudaGetLastError());
  for (auto& x : v) {
    std::sort(x.rounds.begin(), x.rounds.end());
    std::printf("%-28s %6.2f us per launch (median of %d rounds, %.2f to %.2f)\n", x.name.c_str(),
                x.rounds[x.rounds.size() / 2], kRounds, x.rounds.front(), x.rounds.back());
  }
  return 0;
}
