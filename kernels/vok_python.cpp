// The Python module `_vok_ops`: the compiled backend's eager steps, one Python call each.
//
// A torch custom op spends microseconds per call turning Python arguments into the dispatcher's
// stack (about 5 us for the 12 arguments an append step needs, on an H200 host): more than the rest
// of an eager step. The steps here take Python objects directly (pybind11 with torch's tensor
// casters) and do all of their host work in C++:
//   RingStep       RingPool's fast append: checks, planning against the pool's host slot table
//                  into the launch's parameters, the launch;
//   GatherStep     RowGather's launch: the job table encoded from the recorded blocks into the
//                  launch's parameters, the launch.
// The metadata travels in the kernel's parameters (vok_launch.h: up to kParamWords words; the
// kernel reads it from the constant bank) rather than in pinned memory the kernel reads in place:
// those reads cross the bus once per warp, which cost a gather of a few hundred blocks 11 to 15 us
// of device time on the H200. Larger steps stage it in pinned memory as before (MetaRing).
// Given a CPU arena or anchor they plan or encode without launching: that is how CI tests them
// against their numpy twins (RingPool._plan_numpy, GatherJobs.encode). The kernels stay registered as
// torch ops (vok_torch.cu) for torch.compile and for every other caller.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "vok_launch.h"

namespace py = pybind11;

namespace {

using i64 = int64_t;

// Metadata columns (vllm_omni_kernels/ops/layout.py); the host slot table adds the unread size.
constexpr int kSlot = 0, kLinOff = 1, kN = 2, kBase = 3, kCap = 4, kPos = 5, kLinStride = 6, kSize = 7;
constexpr int kCols = 8;
// Pinned staging depth and event spacing: staging.py's PinnedStaging (same reasoning).
constexpr i64 kDepth = 64, kEventEvery = 16;
// Rows longer than this run several programs per metadata row: the step copies its metadata to the
// device first instead of letting each program read its row over the bus (ring.py's UPLOAD_ELEMS).
constexpr i64 kUploadElems = 4096;

// Plan one append step (RingPool._plan_numpy has the same contract; slots are distinct). Every row
// is checked and staged first: 0 <= n <= axis_len and n fits in the slot's free frames. Then unread
// sizes advance and head overrides (POS) are cleared, and the largest n is returned; else -(b + 1)
// for the first row b that does not fit, with the slot table untouched (`staged` is scratch).
i64 plan_rows(i64* __restrict__ table, const i64* __restrict__ slots, const i64* __restrict__ n, i64 B,
              i64* __restrict__ staged, i64 row_elems, i64 axis_len, i64 lin_stride) {
  i64 max_n = 0;
  for (i64 b = 0; b < B; ++b) {  // one read of each slot's row: checked and staged together
    const i64 k = n[b];
    const i64* row = table + slots[b] * kCols;
    if (k < 0 || k > axis_len || k > row[kCap] - row[kSize]) return -(b + 1);
    max_n = std::max(max_n, k);
    i64* m = staged + b * kCols;
    m[kSlot] = slots[b];
    m[kLinOff] = b * row_elems;
    m[kN] = k;
    m[kBase] = row[kBase];
    m[kCap] = row[kCap];
    m[kPos] = row[kPos];
    m[kLinStride] = lin_stride;
    m[kSize] = row[kSize];
  }
  for (i64 b = 0; b < B; ++b) {
    i64* row = table + slots[b] * kCols;
    row[kSize] += n[b];
    row[kPos] = -1;
  }
  return max_n;
}

// Whether a buffer view is a 1-D array of 8-byte signed ints (numpy int64).
bool is_i64_vector(const Py_buffer& view) {
  const char f = view.format ? view.format[std::strlen(view.format) - 1] : 0;
  return view.ndim == 1 && view.itemsize == 8 && (f == 'l' || f == 'q');
}

// Copies `count` int64 values of `obj` into `out`: a 1-D buffer of 8-byte signed ints (a numpy int64
// array) or a list/tuple of ints. False, with no Python error left set, for anything else.
bool read_i64s(PyObject* obj, i64 count, std::vector<i64>& out) {
  out.resize(count);
  if (PyList_Check(obj) || PyTuple_Check(obj)) {
    if (PySequence_Fast_GET_SIZE(obj) != count) return false;
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (i64 i = 0; i < count; ++i) {
      out[i] = PyLong_AsLongLong(items[i]);
      if (out[i] == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }
  if (!PyObject_CheckBuffer(obj)) return false;
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    return false;
  }
  const bool ok = is_i64_vector(view) && view.shape[0] == count;
  if (ok) {
    const char* p = static_cast<const char*>(view.buf);
    const Py_ssize_t stride = view.strides[0];
    i64* dst = out.data();
    if (stride == 8) {
      std::memcpy(dst, p, count * 8);
    } else {
      for (i64 i = 0; i < count; ++i) std::memcpy(dst + i, p + i * stride, 8);
    }
  }
  PyBuffer_Release(&view);
  return ok;
}

// The device and current stream of a step on `t`'s device (neither for a CPU tensor).
struct DeviceScope {
  std::optional<c10::cuda::OptionalCUDAGuard> guard;
  cudaStream_t stream = nullptr;
  explicit DeviceScope(const at::Tensor& t) {
    if (t.is_cuda()) {
      guard.emplace(t.device());
      stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
    }
  }
};

const at::Tensor& tensor_of(PyObject* obj, const char* what) {
  TORCH_CHECK(THPVariable_Check(obj), what, " must be a tensor");
  return THPVariable_Unpack(obj);
}

// Where a step's metadata [rows, cols] int64 goes, for one stream: the launch's parameters when they
// hold it (in_params(): rows * cols <= kParamWords; the launch copies them, so the buffer is free
// again at once), else a ring of buffers, pinned on CUDA (the kernel reads them in place):
// PinnedStaging of staging.py, in C++. Ring buffer i is reused kDepth steps later, after the first
// event recorded at or after its last use has completed (normally long ago: no wait).
class MetaRing {
 public:
  // `twin_device`: where upload() copies to (its buffer is made with the ring's: a step must not
  // allocate); none for a ring that is only read in place.
  MetaRing(bool pinned, i64 cols, std::optional<at::Device> twin_device = std::nullopt)
      : pinned_(pinned), cols_(cols), twin_device_(pinned ? twin_device : std::nullopt) {}
  MetaRing(const MetaRing&) = delete;
  MetaRing& operator=(const MetaRing&) = delete;
  ~MetaRing() {
    // Queued kernels may still read the buffers in place: wait for them before the pinned memory
    // goes back to torch's host allocator (which may hand it out at once). Not while that stream
    // is being captured (a wait would break the capture); errors are ignored (at interpreter exit
    // the context or the stream may be gone already).
    if (pinned_ && count_ > 0) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      cudaEvent_t ev;
      if (cudaStreamIsCapturing(last_stream_, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone &&
          cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
        if (cudaEventRecord(ev, last_stream_) == cudaSuccess) cudaEventSynchronize(ev);
        cudaEventDestroy(ev);
      }
      (void)cudaGetLastError();
    }
    for (auto& e : events_) cudaEventDestroy(e.second);
  }

  // The next buffer, with at least `rows` rows; waits only if the device is far behind.
  i64* next(i64 rows, cudaStream_t stream) {
    in_params_ = rows * cols_ <= vok::kParamWords;
    if (in_params_) return params_.data();
    if (rows > rows_) grow(rows, stream);
    const i64 depth = static_cast<i64>(bufs_.size());
    if (pinned_ && count_ - depth >= done_) {
      const i64 last_use = count_ - depth;
      while (!events_.empty() && events_.front().first < last_use) pop_event(false);
      if (!events_.empty()) pop_event(true);
    }
    current_ = count_ % depth;
    return bufs_[current_].data_ptr<i64>();
  }

  // Copies the first `rows` rows of the buffer handed out by next() into a device twin (reused every
  // step: the copy and the kernels that read it are ordered on the one stream) and returns the twin.
  i64* upload(i64 rows, cudaStream_t stream) {
    TORCH_CHECK(!in_params_ && twin_.defined(), "this metadata ring has no device twin for this buffer");
    C10_CUDA_CHECK(cudaMemcpyAsync(twin_.data_ptr<i64>(), bufs_[current_].data_ptr<i64>(), rows * cols_ * sizeof(i64),
                                   cudaMemcpyHostToDevice, stream));
    return twin_.data_ptr<i64>();
  }

  // The buffer handed out by next() is now read by queued work.
  void queued(cudaStream_t stream) {
    if (in_params_) return;  // copied by the launch
    ++count_;
    last_stream_ = stream;
    if (pinned_ && count_ % kEventEvery == 0) {
      cudaEvent_t ev;
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      C10_CUDA_CHECK(cudaEventRecord(ev, stream));
      events_.emplace_back(count_ - 1, ev);
    }
  }

  // Whether the buffer handed out by next() is the launch's parameters.
  bool in_params() const { return in_params_; }

  // The buffer handed out by next() (all its rows), for tests.
  at::Tensor current() {
    if (in_params_) return at::from_blob(params_.data(), {vok::kParamWords / cols_, cols_}, at::kLong);
    return bufs_.empty() ? at::Tensor() : bufs_[current_];
  }

 private:
  void grow(i64 rows, cudaStream_t stream) {
    i64 r = 1;
    while (r < rows) r <<= 1;
    if (pinned_ && !bufs_.empty()) C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // rare: a larger step
    bufs_.clear();
    const auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(pinned_);
    for (i64 i = 0; i < (pinned_ ? kDepth : 1); ++i) bufs_.push_back(at::zeros({r, cols_}, opts));
    if (twin_device_) twin_ = at::empty({r, cols_}, at::TensorOptions().dtype(at::kLong).device(*twin_device_));
    rows_ = r;
  }

  void pop_event(bool wait) {
    auto [k, ev] = events_.front();
    events_.pop_front();
    if (wait) {
      C10_CUDA_CHECK(cudaEventSynchronize(ev));
      done_ = k + 1;
    }
    C10_CUDA_CHECK(cudaEventDestroy(ev));
  }

  bool pinned_;
  i64 cols_, rows_ = 0, count_ = 0, done_ = 0, current_ = 0;
  cudaStream_t last_stream_ = nullptr;
  std::vector<at::Tensor> bufs_;
  std::optional<at::Device> twin_device_;
  at::Tensor twin_;  // upload()'s device copy
  std::deque<std::pair<i64, cudaEvent_t>> events_;
  std::vector<i64> params_ = std::vector<i64>(vok::kParamWords);  // the launch's parameters
  bool in_params_ = false;
};

// RingPool's fast append step (ring.py): one call checks the step, plans it and launches it.
class RingStep {
 public:
  RingStep(at::Tensor arena, at::Tensor state, at::Tensor table, std::vector<i64> frame_shape, bool last)
      : arena_(std::move(arena)), state_(std::move(state)), table_(std::move(table)),
        frame_shape_(std::move(frame_shape)), last_(last), meta_(arena_.is_cuda(), kCols, arena_.device()) {
    TORCH_CHECK(table_.device().is_cpu() && table_.scalar_type() == at::kLong && table_.is_contiguous() &&
                    table_.dim() == 2 && table_.size(1) == kCols,
                "table must be the pool's contiguous int64 host table [slots, 8]");
    TORCH_CHECK(state_.device() == arena_.device() && state_.scalar_type() == at::kLong && state_.is_contiguous(),
                "state must be contiguous int64 on the arena's device");
    TORCH_CHECK(state_.numel() >= table_.size(0), "state must cover every slot");
    const i64 es = arena_.element_size();
    TORCH_CHECK(es == 2 || es == 4 || es == 8, "element size ", es, " not supported");
    frame_elems_ = 1;
    for (i64 s : frame_shape_) frame_elems_ *= s;
  }

  // Make `ids` (a tuple of request ids, distinct) with their `slots` the cached step shape of pool
  // version `version`. The pool calls this when a step returns 0.
  void set_slots(py::tuple ids, std::vector<i64> slots, i64 version) {
    TORCH_CHECK(static_cast<i64>(ids.size()) == static_cast<i64>(slots.size()), "one slot per request id");
    for (i64 s : slots) TORCH_CHECK(s >= 0 && s < table_.size(0), "slot ", s, " out of range");
    ids_ = std::move(ids);
    slots_ = std::move(slots);
    version_ = version;
  }

  // Append one step: request `ids` (list or tuple), `data` [B, n_max, *frame] (CONCAT_DIM0) or
  // [B, *frame, T_max] (CONCAT_LAST) contiguous, `lengths` B frame counts (numpy int64 or a list of
  // ints), `version` the pool's version. Returns B when launched (planned only, for a CPU arena);
  // 0 when `ids` or `version` are not the cached ones (call set_slots, then again); -1 when the step
  // is not for this path (anything off, any row that does not fit): nothing was changed.
  i64 operator()(py::handle ids, const at::Tensor& data, py::handle lengths, i64 version) {
    if (version != version_ || !same_ids(ids.ptr())) return 0;
    const i64 B = static_cast<i64>(slots_.size());
    const i64 fd = static_cast<i64>(frame_shape_.size());
    if (B == 0 || B > vok::kMaxRingRows || data.scalar_type() != arena_.scalar_type() ||
        data.device() != arena_.device() || data.dim() != fd + 2 || data.size(0) != B || !data.is_contiguous())
      return -1;
    for (i64 d = 0; d < fd; ++d)
      if (data.size(last_ ? 1 + d : 2 + d) != frame_shape_[d]) return -1;
    const i64 axis_len = last_ ? data.size(fd + 1) : data.size(1);
    const i64 row_elems = axis_len * frame_elems_;
    if (row_elems > vok::kMaxRowElems || !read_i64s(lengths.ptr(), B, n_)) return -1;

    const DeviceScope scope(arena_);
    const cudaStream_t stream = scope.stream;
    i64* staged = meta_.next(B, stream);
    const i64 max_n = plan_rows(table_.data_ptr<i64>(), slots_.data(), n_.data(), B, staged, row_elems, axis_len,
                                last_ ? axis_len : frame_elems_);
    if (max_n < 0) return -1;
    const i64 max_elems = max_n * frame_elems_;
    if (arena_.is_cuda() && meta_.in_params()) {
      vok::launch_ring_write_params(arena_.data_ptr(), arena_.element_size(), state_.data_ptr<i64>(), staged,
                                    data.data_ptr(), B, frame_elems_, last_, max_elems, stream);
    } else if (arena_.is_cuda()) {
      const i64* meta = max_elems > kUploadElems ? meta_.upload(B, stream) : staged;
      vok::launch_ring_write(arena_.data_ptr(), arena_.element_size(), state_.data_ptr<i64>(), meta, data.data_ptr(),
                             B, frame_elems_, last_, max_elems, stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    meta_.queued(stream);
    return B;
  }

  // The metadata rows the last step staged (its first B rows), for tests; `staged_in_params`: whether
  // they went in the launch's parameters (else in the pinned ring).
  at::Tensor staged() {
    const at::Tensor cur = meta_.current();
    return cur.defined() ? cur.narrow(0, 0, static_cast<i64>(slots_.size())) : cur;
  }
  bool staged_in_params() const { return meta_.in_params(); }

 private:
  bool same_ids(PyObject* ids) {
    PyObject* cached = ids_.ptr();
    if (!cached) return false;
    if (ids == cached) return true;
    const Py_ssize_t count = PyTuple_GET_SIZE(cached);
    if (!(PyList_Check(ids) || PyTuple_Check(ids)) || PySequence_Fast_GET_SIZE(ids) != count) return false;
    PyObject** a = PySequence_Fast_ITEMS(ids);
    PyObject** b = PySequence_Fast_ITEMS(cached);
    // The usual step passes the very same id objects: one memcmp of the pointers decides.
    if (std::memcmp(a, b, count * sizeof(PyObject*)) == 0) return true;
    for (Py_ssize_t i = 0; i < count; ++i) {
      if (a[i] == b[i]) continue;
      const int eq = PyObject_RichCompareBool(a[i], b[i], Py_EQ);
      if (eq != 1) {
        if (eq < 0) PyErr_Clear();
        return false;
      }
    }
    return true;
  }

  at::Tensor arena_, state_, table_;
  std::vector<i64> frame_shape_;
  bool last_;
  i64 frame_elems_ = 1;
  MetaRing meta_;
  py::object ids_;  // a tuple once set_slots ran
  std::vector<i64> slots_, n_;
  i64 version_ = -1;
};

// ---- The row gather (gather_jobs.py has the table layout; GatherJobs.encode is the numpy twin) ----

// A block's row indices as plain values, so loops over them keep everything in registers (the
// table stores cannot alias them): one row, an int64 array, or the leading rows 0, 1, ...
struct RowIndex {
  const char* ptr;  // the array's first element, or null
  i64 stride;       // bytes between elements
  i64 one;          // the single row
  bool leading;
  static i64 load(const char* p) {  // an int64 of a numpy buffer, whatever its alignment
    i64 v;
    std::memcpy(&v, p, 8);
    return v;
  }
  i64 at(i64 k) const { return leading ? k : ptr ? load(ptr + k * stride) : one; }
  // f(index) with `index(k)` a callable specialised to this kind of rows, so a loop over a block
  // compiles once per pair of kinds with no per-row branch.
  template <class F>
  void with(F&& f) const {
    if (leading) {
      f([](i64 k) { return k; });
    } else if (!ptr) {
      f([one = one](i64) { return one; });
    } else {
      f([p = ptr, s = stride](i64 k) { return load(p + k * s); });
    }
  }
};

struct Rows {  // a block's rows: one int, a 1-D int64 buffer, or None: the leading rows 0, 1, ...
  Py_buffer view{};
  bool single = true, leading = false;
  i64 one = 0;
  i64 count() const { return single ? 1 : view.shape[0]; }  // not for leading rows
  RowIndex index() const {
    return {single ? nullptr : static_cast<const char*>(view.buf), single ? 0 : static_cast<i64>(view.strides[0]), one,
            leading};
  }
  explicit Rows(PyObject* obj) {
    if (obj == Py_None) {
      leading = true;
      return;
    }
    if (PyLong_Check(obj)) {
      one = PyLong_AsLongLong(obj);
      if (one == -1 && PyErr_Occurred()) throw py::error_already_set();
      return;
    }
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) != 0) throw py::error_already_set();
    single = false;
    if (!is_i64_vector(view)) {
      PyBuffer_Release(&view);
      single = true;
      TORCH_CHECK(false, "block rows must be an int or a 1-D int64 array");
    }
  }
  ~Rows() {
    if (!single) PyBuffer_Release(&view);
  }
  Rows(const Rows&) = delete;
  Rows& operator=(const Rows&) = delete;
};

// One recorded block (a tuple, gather_jobs.py): src, src_rows, dst, dst_rows.
struct Block {
  const at::Tensor& src;
  Rows src_rows;
  const at::Tensor& dst;
  Rows dst_rows;
  explicit Block(PyObject* b)
      : src(tensor_of(PyTuple_GET_ITEM(b, 0), "block source")), src_rows(PyTuple_GET_ITEM(b, 1)),
        dst(tensor_of(PyTuple_GET_ITEM(b, 2), "block destination")), dst_rows(PyTuple_GET_ITEM(b, 3)) {}
};

// The most elements of one int record of the gather table (put_int; gather_jobs.INT_COUNT_MAX).
constexpr i64 kIntCountMax = 32767;

// An int record (gather_jobs.py): two words, the source and destination offsets in their low 48
// bits (signed: differences of addresses below 2**48, which encode_gather checks), the flags in the
// top 16 bits of the first and the element count (at most kIntCountMax) in those of the second.
constexpr uint64_t kLow48 = (uint64_t{1} << 48) - 1;
inline void put_int(i64* __restrict__ rec, i64 src, i64 dst, i64 count, i64 flags) {
  rec[0] = static_cast<i64>((static_cast<uint64_t>(src) & kLow48) | static_cast<uint64_t>(flags) << 48);
  rec[1] = static_cast<i64>((static_cast<uint64_t>(dst) & kLow48) | static_cast<uint64_t>(count) << 48);
}

// What check_each and EachBlock read of one source of a many-source block.
struct SourceNote {
  intptr_t address;  // of its first element
  i64 stride;        // elements between rows
  i64 rows;
  i64 elem_size;
  static SourceNote of(const at::Tensor& s) {
    return {reinterpret_cast<intptr_t>(s.const_data_ptr()), s.stride(0), s.size(0), static_cast<i64>(s.element_size())};
  }
};

// A many-source block's records (gather_jobs.py's rows_each/ints_each) for a table whose float and
// int offsets count from `base` (the launching RowGather's anchor, which the compiled launch uses as
// both bases). Float: (src, dst) element offsets per row; int: put_int's two words per row.
struct EachRecords {
  intptr_t base;
  bool floating;
  int fshift;  // log2 of the float element size (floats), 2 (ints)
  i64 width;   // ints: elements per row
  i64 dO, ds;  // the destination's offset and its row stride, in those units
  int dw;      // ints: int32 words per destination element
  EachRecords(const at::Tensor& dst, intptr_t base_, bool floating_) : base(base_), floating(floating_) {
    dw = floating ? 1 : static_cast<int>(dst.element_size() / 4);
    fshift = floating ? (dst.element_size() == 2 ? 1 : 2) : 2;
    width = dst.dim() == 2 ? dst.size(1) : 1;
    dO = (reinterpret_cast<intptr_t>(dst.data_ptr()) - base) >> fshift;
    ds = dst.stride(0) * dw;
  }
  // The records of the rows of source `src` to destination rows from `d0` on, written from `out` on
  // (two words a row).
  void put(i64* __restrict__ out, const SourceNote& src, i64 d0) const {
    if (floating) {
      const i64 so = (src.address - base) >> fshift;
      for (i64 j = 0; j < src.rows; ++j) {
        out[2 * j] = so + j * src.stride;
        out[2 * j + 1] = dO + (d0 + j) * ds;
      }
      return;
    }
    const i64 sw = src.elem_size >> 2, so = (src.address - base) >> 2, flags = (sw == 2) | ((dw == 2) << 1);
    for (i64 j = 0; j < src.rows; ++j)
      put_int(out + 2 * j, so + j * src.stride * sw, dO + (d0 + j) * ds, width, flags);
  }
};

// A block of many sources (gather_jobs.py's rows_each/ints_each): (sources, notes, dst, starts), every
// row of source k going to dst rows starts[k], starts[k] + 1, ...; `notes` is check_each's bytes:
// the base its records count from, then the records (EachRecords), or None.
struct EachBlock {
  PyObject* sources;
  const at::Tensor& dst;
  Rows starts;
  intptr_t base = 0;
  const i64* records = nullptr;  // check_each's, two words a row
  i64 rows = 0;                  // rows of those records
  explicit EachBlock(PyObject* b)
      : sources(PyTuple_GET_ITEM(b, 0)), dst(tensor_of(PyTuple_GET_ITEM(b, 2), "block destination")),
        starts(PyTuple_GET_ITEM(b, 3)) {
    TORCH_CHECK(!starts.single && starts.count() == PyList_GET_SIZE(sources), "one start row per source");
    PyObject* n = PyTuple_GET_ITEM(b, 1);
    if (n != Py_None) {
      const i64 bytes = PyBytes_Check(n) ? PyBytes_GET_SIZE(n) : 0;
      TORCH_CHECK(bytes >= 8 && bytes % 16 == 8, "a many-source block's notes are check_each's bytes");
      const i64* words = reinterpret_cast<const i64*>(PyBytes_AS_STRING(n));
      base = static_cast<intptr_t>(words[0]);
      records = words + 1;
      rows = (bytes - 8) / 16;
    }
  }
  i64 count() const { return PyList_GET_SIZE(sources); }

  // Write the block's records from `out` on (room for at most `room` rows) for a table whose offsets
  // count from `base_`: check_each's, copied, when they were made for that base, else made here
  // from the sources. Returns the rows written, or -1 if they do not fit.
  i64 write(i64* __restrict__ out, i64 room, intptr_t base_, bool floating) const {
    if (records && base == base_) {
      if (rows > room) return -1;
      std::memcpy(out, records, rows * 16);
      return rows;
    }
    const EachRecords rec(dst, base_, floating);
    const char* sp = static_cast<const char*>(starts.view.buf);
    const i64 sstride = starts.view.strides[0], n = count();
    i64 pos = 0;
    for (i64 k = 0; k < n; ++k) {
      const SourceNote src = SourceNote::of(tensor_of(PyList_GET_ITEM(sources, k), "block source"));
      TORCH_CHECK((static_cast<uint64_t>(src.address) >> 48) == 0, "a source address at or above 2**48");
      if (pos + src.rows > room) return -1;
      rec.put(out + 2 * pos, src, RowIndex::load(sp + k * sstride));
      pos += src.rows;
    }
    return pos;
  }
};

// rows_each/ints_each's check of their sources against `dst` in one call: each a tensor on dst's
// device; float: dst's dtype, 2-D of dst's width, contiguous rows; int: int32/int64, 1-D for a 1-D
// dst, else 2-D of its width with contiguous rows, at an address below 2**48; its rows within dst
// from its start row. Returns (rows in all, every float row 16-byte aligned, notes: the block's
// records for a table whose offsets count from `base`, after that base (EachBlock), which the
// compiled encoder copies), or (-(k + 1), False, None) for the first source k that is not plain (the
// caller then checks source by source and reports it).
py::tuple check_each(const py::list& sources, py::handle starts_obj, const at::Tensor& dst, bool floating,
                     intptr_t base) {
  const Rows starts(starts_obj.ptr());
  const i64 count = static_cast<i64>(sources.size());
  TORCH_CHECK(!starts.single && !starts.leading && starts.count() == count, "one start row per source");
  const RowIndex st = starts.index();
  const at::Device device = dst.device();
  const at::ScalarType dtype = dst.scalar_type();
  const i64 dst_rows = dst.size(0), width = dst.dim() == 2 ? dst.size(1) : 1;
  if (!floating && width > kIntCountMax) return py::make_tuple(-1, false, py::none());  // ints() raises
  bool aligned = reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0 && (dst.stride(0) * dst.element_size()) % 16 == 0;
  const EachRecords rec(dst, base, floating);
  // One record per source (a one-row hook output) unless a source has more rows: then the bytes grow.
  i64 room = count;
  PyObject* notes = PyBytes_FromStringAndSize(nullptr, 8 + 16 * room);  // fresh, so still writable
  if (!notes) throw py::error_already_set();
  py::object own = py::reinterpret_steal<py::object>(notes);
  reinterpret_cast<i64*>(PyBytes_AS_STRING(notes))[0] = static_cast<i64>(base);
  i64 rows = 0;
  for (i64 k = 0; k < count; ++k) {
    const auto decline = [k] { return py::make_tuple(-(k + 1), false, py::none()); };
    PyObject* obj = PyList_GET_ITEM(sources.ptr(), k);
    if (!THPVariable_Check(obj)) return decline();
    const at::Tensor& s = THPVariable_Unpack(obj);
    if (s.device() != device || s.dim() < 1) return decline();
    const SourceNote note = SourceNote::of(s);
    if (floating) {
      if (s.scalar_type() != dtype || s.dim() != 2 || s.size(1) != width || s.stride(1) != 1) return decline();
      aligned = aligned && note.address % 16 == 0 && (note.stride * note.elem_size) % 16 == 0;
    } else {
      const at::ScalarType t = s.scalar_type();
      if (t != at::kInt && t != at::kLong) return decline();
      if (dst.dim() == 1 ? s.dim() != 1 : (s.dim() != 2 || s.size(1) != width || s.stride(1) != 1)) return decline();
      if (static_cast<uint64_t>(note.address) >> 48) return decline();  // its record cannot hold the offset
    }
    const i64 start = st.at(k), r = note.rows;
    if (start < 0 || start + r > dst_rows) return decline();
    if (rows + r > room) {
      room = std::max(2 * room, rows + r);
      own.release();
      if (_PyBytes_Resize(&notes, 8 + 16 * room) != 0) throw py::error_already_set();
      own = py::reinterpret_steal<py::object>(notes);
    }
    rec.put(reinterpret_cast<i64*>(PyBytes_AS_STRING(notes)) + 1 + 2 * rows, note, start);
    rows += r;
  }
  if (rows < room) {
    own.release();
    if (_PyBytes_Resize(&notes, 8 + 16 * rows) != 0) throw py::error_already_set();
    own = py::reinterpret_steal<py::object>(notes);
  }
  return py::make_tuple(rows, aligned, own);
}

PyObject* block_at(const py::list& blocks, size_t i) {
  PyObject* b = PyList_GET_ITEM(blocks.ptr(), i);
  TORCH_CHECK(PyTuple_Check(b) && PyTuple_GET_SIZE(b) == 4, "a job block is (src, src_rows, dst, dst_rows)");
  return b;
}

// gather_jobs._run_records: a run of `elems` int elements from word `src` to word `dst` (both sides
// contiguous) as records of at most `cap` elements from `rec` on; returns the records written.
i64 run_records(i64* __restrict__ rec, i64 src, i64 dst, i64 elems, i64 flags, i64 cap) {
  const i64 sw = 1 + (flags & 1), dw = 1 + (flags >> 1);
  i64 n = 0;
  for (i64 first = 0; first < elems; first += cap, ++n, rec += 2)
    put_int(rec, src + first * sw, dst + first * dw, std::min(cap, elems - first), flags);
  return n;
}

// Whether a block's rows are r, r + 1, ... (leading rows are).
bool consecutive(const RowIndex& rows, i64 k) {
  if (rows.leading) return true;
  bool yes = true;
  rows.with([&](auto at) {
    const i64 first = at(0);
    for (i64 j = 1; j < k && yes; ++j) yes = at(j) == first + j;
  });
  return yes;
}

// Encode the recorded jobs into `table` (host int64, flat, `words` long): float jobs from word 2, int
// jobs from `int_off` (a block of consecutive rows as a run: run_records with `int_cap`), value jobs
// after them and their payload after those; array blocks in order, then single-row jobs, then value
// jobs, exactly as GatherJobs.encode orders them. Int words are offsets from `ibase` (GatherStep
// passes its anchor's address for both of its tables: the host cannot know where the parameters
// live, and one base lets check_each's records serve either table). Returns the words used;
// t[0] + t[1] is the launch's job count.
i64 encode_gather(const at::Tensor& anchor, i64* t, intptr_t ibase, i64 words, const py::list& float_blocks,
                  const py::list& int_blocks, const py::list& value_blocks, i64 n_float, i64 n_int, i64 int_off,
                  i64 int_cap) {
  const auto fbase = reinterpret_cast<intptr_t>(anchor.data_ptr());
  // Element offsets by shifts (floor, as the numpy twin's //), not a 64-bit division by a run-time
  // element size per source of a many-source block.
  const int fshift = anchor.element_size() == 2 ? 1 : 2;
  const auto fword = [fbase, fshift](const void* p) { return (reinterpret_cast<intptr_t>(p) - fbase) >> fshift; };
  const auto iword = [ibase](const void* p) { return (reinterpret_cast<intptr_t>(p) - ibase) >> 2; };
  t[0] = n_float;
  t[1] = n_int;
  std::vector<std::pair<i64, i64>> singles;
  i64 f = 0;
  for (size_t i = 0; i < float_blocks.size(); ++i) {
    PyObject* tup = block_at(float_blocks, i);
    if (PyList_Check(PyTuple_GET_ITEM(tup, 0))) {  // rows_each: every row of each source from its start row
      const i64 rows = EachBlock(tup).write(t + 2 + 2 * f, n_float - f, fbase, /*floating=*/true);
      TORCH_CHECK(rows >= 0, "float jobs do not match their count");
      f += rows;
      continue;
    }
    const Block b(tup);
    const i64 so = fword(b.src.const_data_ptr()), dO = fword(b.dst.data_ptr());
    const i64 ss = b.src.stride(0), ds = b.dst.stride(0), k = b.dst_rows.count();
    TORCH_CHECK((b.src_rows.leading || b.src_rows.count() == k) && f + k <= n_float,
                "float jobs do not match their count");
    const RowIndex sr = b.src_rows.index(), dr = b.dst_rows.index();
    if (b.dst_rows.single) {
      singles.emplace_back(so + sr.at(0) * ss, dO + dr.at(0) * ds);
      continue;
    }
    i64* __restrict__ out = t + 2 + 2 * f;
    sr.with([&](auto src_at) {
      dr.with([&](auto dst_at) {
        for (i64 j = 0; j < k; ++j) {
          out[2 * j] = so + src_at(j) * ss;
          out[2 * j + 1] = dO + dst_at(j) * ds;
        }
      });
    });
    f += k;
  }
  for (const auto& [s, d] : singles) {
    TORCH_CHECK(f < n_float, "float jobs do not match their count");
    t[2 + 2 * f] = s;
    t[3 + 2 * f] = d;
    ++f;
  }
  TORCH_CHECK(f == n_float, "float jobs do not match their count");

  // Int jobs: two-word records (put_int) from word int_off; a block of consecutive rows lying end to
  // end on both sides as a run of elements (run_records). Their offsets must fit in 48 bits: every
  // address they are made from is or-ed into `addresses` and checked once.
  uint64_t addresses = static_cast<uint64_t>(ibase);
  i64 n = 0;
  auto put = [&](i64 s, i64 d, i64 width, i64 flags) {
    TORCH_CHECK(n < n_int, "int jobs do not match their count");
    put_int(t + int_off + 2 * n++, s, d, width, flags);
  };
  std::vector<std::array<i64, 4>> int_singles;
  for (size_t i = 0; i < int_blocks.size(); ++i) {
    PyObject* tup = block_at(int_blocks, i);
    if (PyList_Check(PyTuple_GET_ITEM(tup, 0))) {  // ints_each
      const EachBlock b(tup);
      TORCH_CHECK_VALUE(b.dst.dim() == 1 || b.dst.size(1) <= kIntCountMax, "int rows of at most ", kIntCountMax,
                        " elements");
      addresses |= reinterpret_cast<uintptr_t>(b.dst.data_ptr());
      const i64 rows = b.write(t + int_off + 2 * n, n_int - n, ibase, /*floating=*/false);
      TORCH_CHECK(rows >= 0, "int jobs do not match their count");
      n += rows;
      continue;
    }
    const Block b(tup);
    const i64 sw = b.src.element_size() / 4, dw = b.dst.element_size() / 4;
    const i64 so = iword(b.src.const_data_ptr()), dO = iword(b.dst.data_ptr());
    const i64 ss = b.src.stride(0) * sw, ds = b.dst.stride(0) * dw, k = b.dst_rows.count();
    const i64 width = b.dst.dim() == 2 ? b.dst.size(1) : 1, flags = (sw == 2) | ((dw == 2) << 1);
    TORCH_CHECK_VALUE(width <= kIntCountMax, "int rows of at most ", kIntCountMax, " elements, got ", width);
    TORCH_CHECK(b.src_rows.leading || b.src_rows.count() == k, "int jobs do not match their count");
    addresses |= reinterpret_cast<uintptr_t>(b.src.const_data_ptr()) | reinterpret_cast<uintptr_t>(b.dst.data_ptr());
    const RowIndex sr = b.src_rows.index(), dr = b.dst_rows.index();
    if (b.dst_rows.single) {
      int_singles.push_back({so + sr.at(0) * ss, dO + dr.at(0) * ds, width, flags});
      continue;
    }
    TORCH_CHECK(n + k <= n_int, "int jobs do not match their count");
    if (ss == width * sw && ds == width * dw && consecutive(dr, k) && consecutive(sr, k)) {  // one run
      n += run_records(t + int_off + 2 * n, so + sr.at(0) * ss, dO + dr.at(0) * ds, k * width, flags, int_cap);
      continue;
    }
    i64* __restrict__ rec = t + int_off + 2 * n;
    sr.with([&](auto src_at) {
      dr.with([&](auto dst_at) {
        for (i64 j = 0; j < k; ++j) put_int(rec + 2 * j, so + src_at(j) * ss, dO + dst_at(j) * ds, width, flags);
      });
    });
    n += k;
  }
  for (const auto& r : int_singles) put(r[0], r[1], r[2], r[3]);
  // Value jobs follow the int records, their payload follows them.
  const i64 value_jobs = static_cast<i64>(value_blocks.size());
  TORCH_CHECK(n + value_jobs <= n_int, "int jobs do not match their count");
  const i64 payload_off = int_off + 2 * (n + value_jobs);
  t[1] = n + value_jobs;
  int32_t* payload = reinterpret_cast<int32_t*>(t + payload_off);
  const i64 payload_cap = 2 * (words - payload_off);
  i64 p = 0;
  for (size_t i = 0; i < value_blocks.size(); ++i) {
    PyObject* vb = PyList_GET_ITEM(value_blocks.ptr(), i);
    TORCH_CHECK(PyTuple_Check(vb) && PyTuple_GET_SIZE(vb) == 2, "a value block is (dst, values)");
    const at::Tensor& dst = tensor_of(PyTuple_GET_ITEM(vb, 0), "value destination");
    addresses |= reinterpret_cast<uintptr_t>(dst.data_ptr());
    Py_buffer view;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(vb, 1), &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
      throw py::error_already_set();
    const i64 count = view.len / 4;
    const bool ok = view.itemsize == 4 && p + count <= payload_cap && count <= kIntCountMax;
    if (ok) std::memcpy(payload + p, view.buf, count * 4);
    PyBuffer_Release(&view);
    TORCH_CHECK(ok, "values must be int32, at most ", kIntCountMax, " per block, and fit in the payload");
    put(2 * payload_off + p, iword(dst.data_ptr()), count, ((dst.element_size() == 8) << 1) | 4);
    p += count;
  }
  TORCH_CHECK((addresses >> 48) == 0, "an int address at or above 2**48: its offsets do not fit the job table");
  if (p & 1) payload[p] = 0;  // the rest of the last word, as the numpy twin
  return payload_off + (p + 1) / 2;
}

// RowGather's compiled launch (gather.py): the job table encoded from the recorded blocks into the
// launch's parameters (a larger one into a pinned buffer the kernel reads in place), and the launch
// on the current stream; one call per step.
class GatherStep {
 public:
  // `anchor`: a tensor of the float rows' dtype on the launch's device (float offsets are relative
  // to it); `width`: elements per float row; the capacities of the launching RowGather (float rows,
  // int jobs, int32 values), checked before anything is encoded.
  GatherStep(at::Tensor anchor, i64 width, i64 float_cap, i64 int_cap, i64 payload_cap)
      : anchor_(std::move(anchor)),
        width_(width),
        float_cap_(float_cap),
        int_cap_(int_cap),
        payload_cap_(payload_cap),
        table_(anchor_.is_cuda(), 1) {
    const i64 es = anchor_.element_size();
    TORCH_CHECK((es == 2 || es == 4) && vok::gather_width_fits(width, es),
                "float rows of 2 or 4 bytes and a width of 1 to 65535 * 4096 bytes");
    int_run_cap_ = std::min(vok::kGatherIntThreads * vok::gather_row_blocks(width, es),
                            kIntCountMax / vok::kGatherIntThreads * vok::kGatherIntThreads);
  }

  // Encode and launch the jobs of a GatherJobs (its blocks and counts; `aligned`: every float row
  // starts on a 16-byte boundary). Returns the launches (0 without jobs). Given a CPU anchor it
  // encodes only (`table` holds the result).
  i64 operator()(const py::list& float_blocks, const py::list& int_blocks, const py::list& value_blocks, i64 n_float,
                 i64 n_int, i64 n_values, bool aligned) {
    if (n_float + n_int == 0) return 0;
    TORCH_CHECK(n_float >= 0 && n_int >= 0 && n_values >= 0, "negative job counts");
    TORCH_CHECK_VALUE(n_float <= float_cap_ && n_int <= int_cap_ && n_values <= payload_cap_, n_float,
                      " float rows / ", n_int, " int jobs / ", n_values, " values exceed this gather's capacity (",
                      float_cap_, " / ", int_cap_, " / ", payload_cap_, ")");
    const i64 int_off = 2 + 2 * n_float;
    const i64 most = int_off + 2 * n_int + (n_values + 1) / 2;  // runs of int rows may take fewer words
    const DeviceScope scope(anchor_);
    const cudaStream_t stream = scope.stream;
    i64* t = table_.next(most, stream);
    const auto anchor = reinterpret_cast<intptr_t>(anchor_.data_ptr());
    words_ = encode_gather(anchor_, t, anchor, most, float_blocks, int_blocks, value_blocks, n_float, n_int, int_off,
                           int_run_cap_);
    const i64 jobs = n_float + t[1];
    if (anchor_.is_cuda() && table_.in_params()) {
      vok::launch_row_gather_params(anchor_.data_ptr(), anchor_.element_size(), t, words_, width_, int_off, jobs,
                                    aligned, stream);
    } else if (anchor_.is_cuda()) {
      vok::launch_row_gather(anchor_.data_ptr(), anchor_.element_size(), anchor_.data_ptr(), t, width_, int_off, jobs,
                             aligned, stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    table_.queued(stream);
    return 1;
  }

  // The table the last call encoded (flat int64), for tests; whether it traveled in the launch's
  // parameters. Its int words count from the anchor either way: the host cannot know where the
  // parameters live, and so one base serves both (the records check_each made for this anchor
  // then fit either table).
  at::Tensor table() {
    const at::Tensor cur = table_.current();
    return cur.defined() ? cur.view(-1).narrow(0, 0, words_) : cur;
  }
  bool in_params() const { return table_.in_params(); }

 private:
  at::Tensor anchor_;
  i64 width_, float_cap_, int_cap_, payload_cap_;
  MetaRing table_;
  i64 int_run_cap_ = 0;  // gather_jobs.int_run_cap: the most elements of a run's record
  i64 words_ = 0;
};

// ---- Plain CPython callables for the per-step calls ----
//
// A pybind11 method call spends about a microsecond before the method runs: `__call__` looked up
// on the type, a bound method and an argument tuple made, overloads tried, each argument cast. That
// is as much as a step's own host work. A `StepCall` (a step's `call` property) is a callable of its
// own type with a vectorcall entry that reads its arguments in place and calls the step directly;
// it holds a reference to the step object, so the step lives as long as it does.
using StepEntry = PyObject* (*)(void* step, PyObject* const* args, Py_ssize_t nargs);

struct StepCallObject {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* owner;  // the pybind11 step object
  void* step;       // its C++ object
  StepEntry entry;
  const char* signature;  // for the argument-count error
};

PyObject* step_call_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* o = reinterpret_cast<StepCallObject*>(self);
  if (kwnames && PyTuple_GET_SIZE(kwnames) > 0) {
    PyErr_Format(PyExc_TypeError, "%s takes positional arguments only", o->signature);
    return nullptr;
  }
  return o->entry(o->step, args, PyVectorcall_NARGS(nargsf));
}

void step_call_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<StepCallObject*>(self)->owner);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject StepCallType = {PyVarObject_HEAD_INIT(nullptr, 0)};

py::object make_step_call(const py::object& owner, void* step, StepEntry entry, const char* signature) {
  if (!(StepCallType.tp_flags & Py_TPFLAGS_READY)) {
    StepCallType.tp_name = "_vok_ops.StepCall";
    StepCallType.tp_doc = "A step's call without pybind11's dispatch (positional arguments only).";
    StepCallType.tp_basicsize = sizeof(StepCallObject);
    StepCallType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
    StepCallType.tp_vectorcall_offset = offsetof(StepCallObject, vectorcall);
    StepCallType.tp_call = PyVectorcall_Call;
    StepCallType.tp_dealloc = step_call_dealloc;
    if (PyType_Ready(&StepCallType) < 0) throw py::error_already_set();
  }
  auto* o = PyObject_New(StepCallObject, &StepCallType);
  if (!o) throw py::error_already_set();
  o->vectorcall = step_call_vectorcall;
  o->owner = owner.inc_ref().ptr();
  o->step = step;
  o->entry = entry;
  o->signature = signature;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(o));
}

bool wrong_count(Py_ssize_t nargs, Py_ssize_t want, const char* signature) {
  if (nargs == want) return false;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", signature, want, nargs);
  return true;
}

// args[i] as an int64; false with a Python error set when it is not an int.
bool arg_i64(PyObject* obj, i64* out) {
  *out = PyLong_AsLongLong(obj);
  return !(*out == -1 && PyErr_Occurred());
}

constexpr const char* kRingCall = "RingStep.call(ids, data, lengths, version)";
constexpr const char* kGatherCall =
    "GatherStep.call(float_blocks, int_blocks, value_blocks, n_float, n_int, n_values, aligned)";

PyObject* ring_step_entry(void* step, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (wrong_count(nargs, 4, kRingCall)) return nullptr;
  if (!THPVariable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "RingStep.call: data must be a tensor");
    return nullptr;
  }
  i64 version;
  if (!arg_i64(args[3], &version)) return nullptr;
  return PyLong_FromLongLong((*static_cast<RingStep*>(step))(args[0], THPVariable_Unpack(args[1]), args[2], version));
  END_HANDLE_TH_ERRORS
}

PyObject* gather_step_entry(void* step, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (wrong_count(nargs, 7, kGatherCall)) return nullptr;
  for (int i = 0; i < 3; ++i) {
    if (!PyList_Check(args[i])) {
      PyErr_SetString(PyExc_TypeError, "GatherStep.call: the blocks must be lists");
      return nullptr;
    }
  }
  i64 counts[3];
  for (int i = 0; i < 3; ++i)
    if (!arg_i64(args[3 + i], &counts[i])) return nullptr;
  const int aligned = PyObject_IsTrue(args[6]);
  if (aligned < 0) return nullptr;
  const auto blocks = [&](int i) { return py::reinterpret_borrow<py::list>(args[i]); };
  return PyLong_FromLongLong((*static_cast<GatherStep*>(step))(blocks(0), blocks(1), blocks(2), counts[0], counts[1],
                                                               counts[2], aligned != 0));
  END_HANDLE_TH_ERRORS
}

}  // namespace

PYBIND11_MODULE(_vok_ops, m) {
  m.doc() = "vllm-omni-kernels compiled eager steps (kernels/vok_python.cpp); the kernels are torch ops too";
  m.def("check_each", &check_each, py::arg("sources"), py::arg("starts"), py::arg("dst"), py::arg("floating"),
        py::arg("base"),
        "GatherJobs.rows_each/ints_each: check every source against dst in one call");
  m.def("set_programmatic_launch", &vok::set_programmatic_launch, py::arg("enabled"),
        "Programmatic dependent launch of every kernel launched from now on (Hopper and newer; default "
        "on unless VLLM_OMNI_KERNELS_PDL=0)");
  m.def("programmatic_launch", &vok::programmatic_launch, "Whether launches use programmatic dependent launch");
  py::class_<RingStep>(m, "RingStep")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, std::vector<i64>, bool>(), py::arg("arena"),
           py::arg("state"), py::arg("table"), py::arg("frame_shape"), py::arg("last"))
      .def("set_slots", &RingStep::set_slots, py::arg("ids"), py::arg("slots"), py::arg("version"))
      .def("__call__", &RingStep::operator(), py::arg("ids"), py::arg("data"), py::arg("lengths"),
           py::arg("version"))
      .def_property_readonly("staged", &RingStep::staged)
      .def_property_readonly("staged_in_params", &RingStep::staged_in_params)
      .def_property_readonly(
          "call",
          [](py::object self) { return make_step_call(self, self.cast<RingStep*>(), ring_step_entry, kRingCall); },
          "__call__ without pybind11's dispatch: the per-step entry");
  py::class_<GatherStep>(m, "GatherStep")
      .def(py::init<at::Tensor, i64, i64, i64, i64>(), py::arg("anchor"), py::arg("width"), py::arg("float_cap"),
           py::arg("int_cap"), py::arg("payload_cap"))
      .def("__call__", &GatherStep::operator(), py::arg("float_blocks"), py::arg("int_blocks"),
           py::arg("value_blocks"), py::arg("n_float"), py::arg("n_int"), py::arg("n_values"), py::arg("aligned"))
      .def_property_readonly("table", &GatherStep::table)
      .def_property_readonly("in_params", &GatherStep::in_params)
      .def_property_readonly(
          "call",
          [](py::object self) {
            return make_step_call(self, self.cast<GatherStep*>(), gather_step_entry, kGatherCall);
          },
          "__call__ without pybind11's dispatch: the per-step entry");
}
