#include "cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "mok/core/bf16.h"
#include "mok/core/compare.h"
#include "mok/core/error.h"
#include "mok/core/planner.h"
#include "mok/core/symmetric_layout.h"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "mok/cuda/megakernel.h"
#include "mok/cuda/routing.h"

namespace mok::cli {
namespace {

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error("backend cuda: " + what + ": " + cudaGetErrorString(e));
}

// An owned device allocation (at least one element, so a 0-row buffer is still a valid pointer).
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(size_t count, const std::string& what) : count_(count) {
    const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes),
          "cudaMalloc of " + format_bytes(static_cast<double>(bytes)) + " for " + what);
    ptr_ = static_cast<T*>(p);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    return *this;
  }
  ~DeviceArray() { cudaFree(ptr_); }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  void upload(const std::vector<T>& v, size_t offset = 0) {
    if (!v.empty())
      check(cudaMemcpy(ptr_ + offset, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> v(count_);
    if (!v.empty()) check(cudaMemcpy(v.data(), ptr_, v.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return v;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

std::vector<uint16_t> to_bf16_bits(const float* v, size_t n) {
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(v[i]).bits;
  return out;
}
std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) { return to_bf16_bits(v.data(), v.size()); }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Non-null, 256-byte aligned stand-ins: can_implement's shape checks without allocating.
template <class T>
T* placeholder() {
  return reinterpret_cast<T*>(uintptr_t{256});
}

cuda::ExpertsForwardArgs experts_shape(int64_t rows, int64_t H, int64_t I, int64_t experts,
                                       const std::optional<float>& limit) {
  cuda::ExpertsForwardArgs a;
  a.row_capacity = rows;
  a.hidden = H;
  a.intermediate = I;
  a.local_experts = experts;
  a.swiglu_limit = limit;
  return a;
}

cuda::RoutingShape routing_shape(const MoeDesc& d) {
  return {d.ranks, d.tokens_per_rank, d.topk, d.num_experts};
}

// e4m3 codes with their fp32 scales (mok/cuda/fp8.h).
struct Fp8Matrix {
  DeviceArray<uint8_t> codes;
  DeviceArray<float> scales;
  Fp8Matrix() = default;
  Fp8Matrix(size_t values, size_t scale_count, const std::string& what)
      : codes(values, what + " (e4m3)"), scales(scale_count, what + " (scales)") {}
};

// A weight [planes, rows, cols] (bf16 on the device) quantized in 128 x 128 blocks.
Fp8Matrix quantized_weight(const DeviceArray<uint16_t>& w, int64_t planes, int64_t rows, int64_t cols,
                           const std::string& what, cudaStream_t stream) {
  Fp8Matrix q(static_cast<size_t>(planes * rows * cols), static_cast<size_t>(planes * (rows / 128) * (cols / 128)), what);
  cuda::quantize_blocks_e4m3(w.get(), planes, rows, cols, q.codes.get(), q.scales.get(), stream);
  return q;
}

// The weights' e4m3 transposes the fp8 dgrad reads (Precision::fp8_dgrad): W_down^T [planes, I, H]
// and [W_gate^T | W_up^T] [planes, H, 2I] (quantize_dgrad_weights: the forward's codes, moved).
struct Fp8Transposes {
  Fp8Matrix down_t, gate_up_t;
};

Fp8Transposes transposed_weights(const DeviceArray<uint16_t>& wg, const DeviceArray<uint16_t>& wu,
                                 const DeviceArray<uint16_t>& wd, int64_t planes, int64_t H, int64_t I,
                                 const std::string& what, cudaStream_t stream) {
  Fp8Transposes t;
  t.down_t = Fp8Matrix(static_cast<size_t>(planes * I * H), static_cast<size_t>(planes * (I / 128) * (H / 128)),
                       "W_down^T" + what);
  t.gate_up_t = Fp8Matrix(static_cast<size_t>(planes * H * 2 * I),
                          static_cast<size_t>(planes * (H / 128) * (2 * I / 128)), "[W_gate^T | W_up^T]" + what);
  cuda::quantize_dgrad_weights(wg.get(), wu.get(), wd.get(), planes, H, I, t.down_t.codes.get(),
                               t.down_t.scales.get(), t.gate_up_t.codes.get(), t.gate_up_t.scales.get(), stream);
  return t;
}

// The expert backward e at the layer's precision: bf16 (experts_backward), or with t (fp8_dgrad)
// its data gradients on e4m3 with the scratch of fp8_dgrad_scratch_bytes (experts_backward_fp8_dgrad).
void staged_experts_backward(const cuda::ExpertsBackwardArgs& e, const Fp8Transposes* t, void* scratch,
                             cudaStream_t stream) {
  if (t == nullptr) return cuda::experts_backward(e, stream);
  cuda::experts_backward_fp8_dgrad(cuda::fp8_dgrad_args(e, t->down_t.codes.get(), t->down_t.scales.get(),
                                                       t->gate_up_t.codes.get(), t->gate_up_t.scales.get(), scratch),
                                   stream);
}

// The experts' fp8 forward of `rows` rows (x quantized first, only rows before offsets[El]); h,
// g|u and y as experts_forward writes them.
void staged_experts_fp8(int64_t rows, int64_t H, int64_t I, int64_t experts, const std::optional<float>& limit,
                         const int32_t* offsets, const void* x, Fp8Matrix& x8, const Fp8Matrix& wg,
                         const Fp8Matrix& wu, const Fp8Matrix& wd, void* gu, void* h, Fp8Matrix& h8, void* y,
                         int32_t* status, cudaStream_t stream) {
  cuda::quantize_rows_e4m3_k_major(x, rows, H, x8.codes.get(), x8.scales.get(), offsets + experts, stream);
  cuda::ExpertsForwardFp8Args e;
  e.row_capacity = rows;
  e.hidden = H;
  e.intermediate = I;
  e.local_experts = experts;
  e.expert_offsets = offsets;
  e.x = x8.codes.get();
  e.x_scales = x8.scales.get();
  e.w_gate = wg.codes.get();
  e.w_gate_scales = wg.scales.get();
  e.w_up = wu.codes.get();
  e.w_up_scales = wu.scales.get();
  e.w_down = wd.codes.get();
  e.w_down_scales = wd.scales.get();
  e.gu = gu;
  e.h = h;
  e.h_codes = h8.codes.get();
  e.h_scales = h8.scales.get();
  e.y = y;
  e.swiglu_limit = limit;
  e.status = status;
  cuda::experts_forward_fp8(e, stream);
}

// The experts' bf16 forward of `rows` rows (the routed experts, or the shared expert as one
// expert of every token): h, g|u and y.
void staged_experts(int64_t rows, int64_t H, int64_t I, int64_t experts, const std::optional<float>& limit,
                    const int32_t* offsets, const void* x, const void* w_gate, const void* w_up, const void* w_down,
                    void* gu, void* h, void* y, int32_t* status, cudaStream_t stream) {
  cuda::ExpertsForwardArgs e = experts_shape(rows, H, I, experts, limit);
  e.expert_offsets = offsets;
  e.x = x;
  e.w_gate = w_gate;
  e.w_up = w_up;
  e.w_down = w_down;
  e.gu = gu;
  e.h = h;
  e.y = y;
  e.status = status;
  cuda::experts_forward(e, stream);
}

// One emulated rank: what it owns as a source (x, routing, combine slots, y, shared expert) and as
// a destination (its experts, schedule and row buffers).
struct RankBuffers {
  DeviceArray<uint16_t> x;        // [Tpad, H], rows [T, Tpad) zero (the shared expert's row padding)
  DeviceArray<int32_t> topk_idx;  // [T*k]
  DeviceArray<float> topk_w;      // [T*k]
  DeviceArray<uint16_t> slots;    // [T*k, H] combine slots
  DeviceArray<uint16_t> y;        // [T, H]
  DeviceArray<uint16_t> w_gate, w_up, w_down;  // this rank's El experts
  DeviceArray<int32_t> offsets, rows, src_rank, src_slot;
  DeviceArray<uint8_t> workspace;
  DeviceArray<cuda::RoutingStatus> routing_status;
  DeviceArray<uint16_t> x_rows, gu, h, y_rows;  // [cap, H], [cap, 2I], [cap, I], [cap, H]
  DeviceArray<int32_t> experts_status;
  DeviceArray<int32_t> shared_offsets;                  // {0, Tpad}
  DeviceArray<uint16_t> shared_gu, shared_h, y_shared;  // [Tpad, 2Is], [Tpad, Is], [Tpad, H]
  DeviceArray<int32_t> shared_status;
  // The backward. As a source rank:
  DeviceArray<uint16_t> dy;        // [Tpad, H], rows [T, Tpad) zero (the shared expert's row padding)
  DeviceArray<uint16_t> dx_slots;  // [T*k, H] dispatch-gradient slots
  DeviceArray<float> d_topk_w;     // [T*k]
  DeviceArray<uint16_t> dx;        // [T, H]
  DeviceArray<uint16_t> dx_shared;                      // [Tpad, H]
  DeviceArray<float> shared_d_gate, shared_d_up, shared_d_down;  // [Is, H], [Is, H], [H, Is] fp32
  DeviceArray<int32_t> shared_backward_status;
  // As a destination rank:
  DeviceArray<uint16_t> dy_rows, dx_rows;  // [cap, H]
  DeviceArray<float> row_weights, d_row_weight;  // [cap]
  DeviceArray<float> d_gate, d_up, d_down;  // [El, I, H], [El, I, H], [El, H, I] fp32
  DeviceArray<int32_t> backward_status;
  // fp8 (Precision::fp8_block): e4m3 codes and scales of the experts' weights (quantize_blocks_e4m3)
  // and of the rows the fp8 forward reads (x rows, then h; quantize_rows_e4m3_k_major), routed and
  // shared. The backward runs in bf16 from the bf16 x rows, g|u and h the fp8 forward saved (at
  // fp8_dgrad its data gradients on e4m3, with w_t8 below).
  Fp8Matrix w_gate8, w_up8, w_down8, x_rows8, h8, shared_x8, shared_h8;
  // fp8_dgrad: the weights' transposes the backward's data gradients read.
  Fp8Transposes w_t8;
};

struct Events {
  std::vector<cudaEvent_t> e;
  explicit Events(size_t n) : e(n, nullptr) {
    for (auto& ev : e) check(cudaEventCreate(&ev), "cudaEventCreate");
  }
  ~Events() {
    for (auto ev : e) cudaEventDestroy(ev);
  }
};

// The stages of one pass, timed with an event after each: per run the pass's total and every
// stage's time, and at the end each stage's median.
class StageTimer {
 public:
  explicit StageTimer(std::vector<std::string> names)
      : names_(std::move(names)), events_(names_.size() + 1), ms_(names_.size()) {}

  // Event i opens stage i (the last one closes the pass); nothing is recorded when untimed.
  void mark(size_t i, bool timed, cudaStream_t stream) {
    if (timed) check(cudaEventRecord(events_.e[i], stream), "cudaEventRecord");
  }
  // After the pass has finished: keeps each stage's time and returns the pass's.
  double collect() {
    float ms = 0;
    for (size_t i = 0; i < names_.size(); ++i) {
      check(cudaEventElapsedTime(&ms, events_.e[i], events_.e[i + 1]), "cudaEventElapsedTime");
      ms_[i].push_back(ms);
    }
    check(cudaEventElapsedTime(&ms, events_.e.front(), events_.e.back()), "cudaEventElapsedTime");
    return ms;
  }
  std::vector<std::pair<std::string, double>> medians() const {
    std::vector<std::pair<std::string, double>> m;
    for (size_t i = 0; i < names_.size(); ++i) {
      std::vector<double> v = ms_[i];
      std::sort(v.begin(), v.end());
      m.emplace_back(names_[i], v[v.size() / 2]);
    }
    return m;
  }

 private:
  std::vector<std::string> names_;
  Events events_;
  std::vector<std::vector<double>> ms_;
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
};

}  // namespace

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it
    return std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")";
  }
  if (count == 0) return "no CUDA device";
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return "cannot query CUDA device attributes";
  }
  if (major != 9 || minor != 0) {
    return "device " + std::to_string(device) + " is sm_" + std::to_string(major) + std::to_string(minor) +
           "; the kernels are built for sm_90a (Hopper) only";
  }
  return "";
}

std::string cuda_cannot_run(const MoeDesc& d) {
  std::string why;
  auto add = [&why](const std::string& what, const std::string& reason) {
    if (!reason.empty()) why += (why.empty() ? "" : "; ") + what + ": " + reason;
  };
  const bool fp8 = fp8_forward(d.precision);
  if (fp8) {
    auto fp8_shape = [](int64_t rows, int64_t H, int64_t I, int64_t experts, const std::optional<float>& limit) {
      cuda::ExpertsForwardFp8Args a;
      a.row_capacity = round_up(rows, 4);
      a.hidden = H;
      a.intermediate = I;
      a.local_experts = experts;
      a.swiglu_limit = limit;
      a.expert_offsets = placeholder<const int32_t>();
      a.x = a.w_gate = a.w_up = a.w_down = placeholder<const uint8_t>();
      a.x_scales = a.w_gate_scales = a.w_up_scales = a.w_down_scales = placeholder<const float>();
      a.h = a.y = placeholder<void>();
      a.h_codes = placeholder<uint8_t>();
      a.h_scales = placeholder<float>();
      return a;
    };
    add("routed experts (fp8)", cuda::can_implement(fp8_shape(cuda::routed_row_capacity(routing_shape(d)), d.hidden,
                                                              d.intermediate, d.local_experts(), d.swiglu_limit)));
    if (d.has_shared())
      add("shared expert (fp8)", cuda::can_implement(fp8_shape(round_up(d.tokens_per_rank, cuda::kRowAlign), d.hidden,
                                                               d.shared_intermediate, 1, d.swiglu_limit)));
  }
  const cuda::RoutingShape shape = routing_shape(d);
  const int64_t cap = cuda::routed_row_capacity(shape);
  std::vector<const int32_t*> idx(static_cast<size_t>(std::min<int64_t>(d.ranks, cuda::kMaxRanks)),
                                  placeholder<const int32_t>());
  cuda::ScheduleArgs s;
  s.shape = shape;
  s.topk_idx = idx.data();
  s.expert_offsets = s.expert_rows = s.src_rank = s.src_slot = placeholder<int32_t>();
  s.row_capacity = cap;
  s.workspace = placeholder<void>();
  s.status = placeholder<cuda::RoutingStatus>();
  add("schedule", cuda::can_implement(s));
  if (!why.empty()) return why;  // the shapes below assume a valid routing shape

  auto with_pointers = [](cuda::ExpertsForwardArgs a) {
    a.expert_offsets = placeholder<const int32_t>();
    a.x = a.w_gate = a.w_up = a.w_down = placeholder<const void>();
    a.gu = a.h = a.y = placeholder<void>();
    a.status = placeholder<int32_t>();
    return a;
  };
  add("routed experts", cuda::can_implement(with_pointers(experts_shape(cap, d.hidden, d.intermediate,
                                                                        d.local_experts(), d.swiglu_limit))));
  if (d.has_shared()) {
    add("shared expert", cuda::can_implement(with_pointers(
                             experts_shape(round_up(d.tokens_per_rank, cuda::kRowAlign), d.hidden,
                                           d.shared_intermediate, 1, d.swiglu_limit))));
  }
  cuda::CombineArgs c;
  c.tokens = d.tokens_per_rank;
  c.hidden = d.hidden;
  c.topk = d.topk;
  c.slots = c.y_shared = placeholder<const void>();
  c.topk_w = placeholder<const float>();
  c.topk_idx = placeholder<const int32_t>();
  c.y = placeholder<void>();
  add("combine epilogue", cuda::can_implement(c));

  auto backward_with_pointers = [](int64_t rows, int64_t H, int64_t I, int64_t experts,
                                   const std::optional<float>& limit) {
    cuda::ExpertsBackwardArgs a;
    a.row_capacity = rows;
    a.hidden = H;
    a.intermediate = I;
    a.local_experts = experts;
    a.swiglu_limit = limit;
    a.expert_offsets = placeholder<const int32_t>();
    a.x = a.gu = a.h = a.dy = a.w_gate = a.w_up = a.w_down = placeholder<const void>();
    a.row_weight = placeholder<const float>();
    a.dgu = a.hw = a.dx = a.d_w_gate = a.d_w_up = a.d_w_down = placeholder<void>();
    a.dw_partial = a.d_row_weight = placeholder<float>();
    a.status = placeholder<int32_t>();
    return a;
  };
  add("routed experts backward",
      cuda::can_implement(backward_with_pointers(cap, d.hidden, d.intermediate, d.local_experts(), d.swiglu_limit)));
  if (d.has_shared()) {
    add("shared expert backward",
        cuda::can_implement(backward_with_pointers(round_up(d.tokens_per_rank, cuda::kRowAlign), d.hidden,
                                                   d.shared_intermediate, 1, d.swiglu_limit)));
  }
  const cuda::ScheduleView view{d.local_experts(), cap, placeholder<const int32_t>(), placeholder<const int32_t>(),
                                placeholder<const int32_t>()};
  std::vector<const void*> rows_table(idx.size(), placeholder<const void>());
  std::vector<const float*> weights_table(idx.size(), placeholder<const float>());
  std::vector<void*> slots_table(idx.size(), placeholder<void>());
  std::vector<float*> values_table(idx.size(), placeholder<float>());
  cuda::GatherArgs g;
  g.shape = shape;
  g.hidden = d.hidden;
  g.schedule = view;
  g.x = rows_table.data();
  g.rows = placeholder<void>();
  g.topk_w = weights_table.data();
  g.row_weights = placeholder<float>();
  add("dispatch", cuda::can_implement(g));
  cuda::ScatterArgs sc;
  sc.shape = shape;
  sc.hidden = d.hidden;
  sc.schedule = view;
  sc.rows = placeholder<const void>();
  sc.slots = slots_table.data();
  add("combine / dx scatter", cuda::can_implement(sc));
  cuda::ScatterValuesArgs sv;
  sv.shape = shape;
  sv.schedule = view;
  sv.values = placeholder<const float>();
  sv.slot_values = values_table.data();
  add("d topk_w scatter", cuda::can_implement(sv));
  cuda::DispatchGradArgs dg;
  dg.tokens = d.tokens_per_rank;
  dg.hidden = d.hidden;
  dg.topk = d.topk;
  dg.dx_shared = dg.slots = placeholder<const void>();
  dg.topk_idx = placeholder<const int32_t>();
  dg.slot_values = placeholder<const float>();
  dg.d_topk_w = placeholder<float>();
  dg.dx = placeholder<void>();
  add("dispatch-gradient epilogue", cuda::can_implement(dg));
  return why;
}

// The fused forward and backward of every rank (megakernel.h), ranks sharing this GPU: each on its
// own stream with SMs / R - 1 CTAs (all of a rank's CTAs must be resident while it spins; the
// spare SM per rank keeps the others' small kernels from holding one). The forward keeps every
// row (the ring holds them all) and the backward megakernel runs after it. y, dx, d topk_w and the
// routed weight gradients must equal the staged run's bit for bit (same tiles, k order and
// epilogues); the shared expert's output and input gradient come from the staged run. Records
// why it did not run rather than failing the staged result.
static void fused_layer(const ref::LayerInputs<float>& in, const std::vector<RankBuffers>& ranks,
                        const std::vector<std::vector<float>>& staged_y, const ref::LayerGrads<float>& staged,
                        int64_t runs, CudaLayer& out) {
  const MoeDesc& d = in.desc;
  const int R = static_cast<int>(d.ranks);
  const int64_t T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk;
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  const int ctas = R == 1 ? sms : sms / R - 1;
  if (ctas < 2) {
    out.fused_skipped = std::to_string(R) + " ranks cannot share " + std::to_string(sms) + " SMs (2 CTAs each at least)";
    return;
  }
  if (R > cuda::kMaxRanks) {
    out.fused_skipped = "more ranks than the megakernel's pointer tables hold";
    return;
  }
  const cuda::RoutingShape shape = routing_shape(d);
  const SymmetricLayout layout = SymmetricLayout::make(T, H, k, d.ranks);
  MoeDesc planned = d;
  cudaDeviceProp props{};
  check(cudaGetDeviceProperties(&props, device), "cudaGetDeviceProperties");
  // This GPU's facts (as the C API's and the Python package's plans), with each rank's share of it.
  const DeviceFacts facts = facts_for_gpu(props.name, ctas, static_cast<int64_t>(props.totalGlobalMem));
  const MoeConfig config = plan(planned, facts);
  const int64_t minibatch = config.minibatch_rows, cap = cuda::routed_row_capacity(shape);
  // Every row kept, for the backward (fp8: the forward's h and g|u; its x rows are pulled again).
  // fp8_dgrad's backward runs the stage kernels through moe_backward (the megakernel's is bf16).
  const bool fp8 = fp8_forward(d.precision), dgrad8 = fp8_dgrad(d.precision);
  const int64_t ring = (cap + minibatch - 1) / minibatch * minibatch;
  const int comm = std::min(config.comm_sms, ctas / 4);  // 0: comm warps
  const int64_t El = d.local_experts();
  out.fused_plan = "minibatch " + std::to_string(minibatch) + " rows, ring " + std::to_string(ring) + " rows, " +
                   (comm > 0 ? std::to_string(comm) + " comm of " : std::string("comm warps in each of ")) +
                   std::to_string(ctas) + " CTAs per rank" +
                   (dgrad8 ? "; backward: the stage kernels (fp8_dgrad)" : "");

  struct FusedRank {
    DeviceArray<uint8_t> symmetric;
    std::unique_ptr<cuda::FusedBuffers> buffers;
    DeviceArray<uint16_t> y, gu, dx;
    DeviceArray<float> d_topk_w, d_gate, d_up, d_down;
    DeviceArray<uint8_t> dgrad_scratch;  // fp8_dgrad
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr, backward_start = nullptr, backward_stop = nullptr;
  };
  std::vector<FusedRank> fr(static_cast<size_t>(R));
  std::vector<void*> bases;
  for (int r = 0; r < R; ++r) {
    FusedRank& f = fr[static_cast<size_t>(r)];
    const RankBuffers& b = ranks[static_cast<size_t>(r)];
    f.symmetric = DeviceArray<uint8_t>(static_cast<size_t>(layout.total), "symmetric buffer");
    check(cudaMemset(f.symmetric.get(), 0, f.symmetric.bytes()), "zero the symmetric buffer");
    void* base = f.symmetric.get();
    check(cudaMemcpy(SymmetricLayout::at<void>(base, layout.x), b.x.get(), size_t(T * H) * 2, cudaMemcpyDeviceToDevice),
          "copy x");
    check(cudaMemcpy(SymmetricLayout::at<void>(base, layout.topk_idx), b.topk_idx.get(), size_t(T * k) * 4,
                     cudaMemcpyDeviceToDevice), "copy topk_idx");
    check(cudaMemcpy(SymmetricLayout::at<void>(base, layout.topk_w), b.topk_w.get(), size_t(T * k) * 4,
                     cudaMemcpyDeviceToDevice), "copy topk_w");
    check(cudaMemcpy(SymmetricLayout::at<void>(base, layout.dy), b.dy.get(), size_t(T * H) * 2, cudaMemcpyDeviceToDevice),
          "copy dy");
    bases.push_back(base);
    f.buffers = std::make_unique<cuda::FusedBuffers>(shape, H, I, minibatch, ring, /*keep_rows=*/true, fp8);
    f.y = DeviceArray<uint16_t>(static_cast<size_t>(T * H), "fused y");
    f.gu = DeviceArray<uint16_t>(static_cast<size_t>(cap * 2 * I), "fused g|u");
    f.dx = DeviceArray<uint16_t>(static_cast<size_t>(T * H), "fused dx");
    f.d_topk_w = DeviceArray<float>(static_cast<size_t>(T * k), "fused d topk_w");
    f.d_gate = DeviceArray<float>(static_cast<size_t>(El * I * H), "fused dW_gate");
    f.d_up = DeviceArray<float>(static_cast<size_t>(El * I * H), "fused dW_up");
    f.d_down = DeviceArray<float>(static_cast<size_t>(El * H * I), "fused dW_down");
    if (dgrad8)
      f.dgrad_scratch = DeviceArray<uint8_t>(static_cast<size_t>(cuda::fp8_dgrad_scratch_bytes(cap, H, I)),
                                             "fp8 dgrad scratch");
    check(cudaStreamCreateWithFlags(&f.stream, cudaStreamNonBlocking), "stream");
    for (cudaEvent_t* e : {&f.start, &f.stop, &f.backward_start, &f.backward_stop}) check(cudaEventCreate(e), "event");
  }
  // The legacy-stream copies and memsets above are done before any rank's stream starts.
  check(cudaDeviceSynchronize(), "fused forward setup");
  auto release = [&]() {
    for (FusedRank& f : fr) {
      for (cudaEvent_t e : {f.start, f.stop, f.backward_start, f.backward_stop}) cudaEventDestroy(e);
      cudaStreamDestroy(f.stream);
    }
  };
  // What both passes' arguments take alike: the rank, every rank's buffer, its weights, and its
  // FusedBuffers' schedule, ring and counters.
  auto rank_args = [&](auto& args, int r, FusedRank& f, const RankBuffers& b) {
    args.rank = r;
    args.bases = bases.data();
    args.w_gate = b.w_gate.get();
    args.w_up = b.w_up.get();
    args.w_down = b.w_down.get();
    f.buffers->wire(args);
  };
  try {
    cuda::preload_kernels();  // before any rank's barrier spins
    for (int64_t run = 0; run <= runs; ++run) {  // run 0: warm-up
      for (int r = 0; r < R; ++r) {
        FusedRank& f = fr[static_cast<size_t>(r)];
        const RankBuffers& b = ranks[static_cast<size_t>(r)];
        check(cudaMemsetAsync(f.y.get(), 0xff, f.y.bytes(), f.stream), "poison fused y");
        cuda::MoeForwardArgs a;
        rank_args(a, r, f, b);
        a.gu = f.gu.get();
        a.y_shared = d.has_shared() ? b.y_shared.get() : nullptr;
        a.y = f.y.get();
        a.epoch = static_cast<uint32_t>(2 * run + 1);  // the forward and the backward share one sequence
        a.comm_ctas = comm;
        a.num_sms = ctas;
        a.swiglu_limit = d.swiglu_limit;
        if (fp8) {
          a.w_gate = b.w_gate8.codes.get();
          a.w_up = b.w_up8.codes.get();
          a.w_down = b.w_down8.codes.get();
          a.w_gate_scales = b.w_gate8.scales.get();
          a.w_up_scales = b.w_up8.scales.get();
          a.w_down_scales = b.w_down8.scales.get();
        }
        check(cudaEventRecord(f.start, f.stream), "event");
        cuda::moe_forward(a, f.stream);
        check(cudaEventRecord(f.stop, f.stream), "event");
      }
      for (int r = 0; r < R; ++r) {  // the backward megakernel of every rank, after its forward
        FusedRank& f = fr[static_cast<size_t>(r)];
        const RankBuffers& b = ranks[static_cast<size_t>(r)];
        for (const auto& [ptr, bytes] : {std::pair<void*, size_t>{f.dx.get(), f.dx.bytes()},
                                         {f.d_topk_w.get(), f.d_topk_w.bytes()}, {f.d_gate.get(), f.d_gate.bytes()},
                                         {f.d_up.get(), f.d_up.bytes()}, {f.d_down.get(), f.d_down.bytes()}})
          check(cudaMemsetAsync(ptr, 0xff, bytes, f.stream), "poison the fused gradients");
        cuda::MoeBackwardArgs g;
        rank_args(g, r, f, b);  // the forward's schedule and rows (the ring holds every row), the scratch
        g.gu = f.gu.get();
        g.dx_shared = d.has_shared() ? b.dx_shared.get() : nullptr;
        g.dx = f.dx.get();
        g.d_topk_w = f.d_topk_w.get();
        g.d_w_gate = f.d_gate.get();
        g.d_w_up = f.d_up.get();
        g.d_w_down = f.d_down.get();
        g.epoch = static_cast<uint32_t>(2 * run + 2);
        g.num_sms = ctas;
        g.fused = !dgrad8;
        g.swiglu_limit = d.swiglu_limit;
        if (dgrad8) {
          g.fp8_dgrad = true;
          g.w_down_t_codes = b.w_t8.down_t.codes.get();
          g.w_down_t_scales = b.w_t8.down_t.scales.get();
          g.w_gate_up_t_codes = b.w_t8.gate_up_t.codes.get();
          g.w_gate_up_t_scales = b.w_t8.gate_up_t.scales.get();
          g.fp8_dgrad_scratch = f.dgrad_scratch.get();
        }
        check(cudaEventRecord(f.backward_start, f.stream), "event");
        cuda::moe_backward(g, f.stream);
        check(cudaEventRecord(f.backward_stop, f.stream), "event");
      }
      double slowest = 0, slowest_backward = 0;
      for (int r = 0; r < R; ++r) {
        FusedRank& f = fr[static_cast<size_t>(r)];
        check(cudaStreamSynchronize(f.stream), "fused forward and backward of rank " + std::to_string(r));
        float ms = 0;
        check(cudaEventElapsedTime(&ms, fr[0].start, f.stop), "event time");
        slowest = std::max(slowest, double(ms));
        check(cudaEventElapsedTime(&ms, fr[0].backward_start, f.backward_stop), "event time");
        slowest_backward = std::max(slowest_backward, double(ms));
      }
      for (int r = 0; r < R && out.fused_difference.empty(); ++r) {
        FusedRank& f = fr[static_cast<size_t>(r)];
        int32_t words[cuda::kFailureWords];
        check(cudaMemcpy(words, f.buffers->status(), sizeof words, cudaMemcpyDeviceToHost), "read the status");
        const std::string why = cuda::describe_wait_status(words);
        if (!why.empty()) out.fused_difference = why;
        int32_t experts = 0;
        if (f.buffers->experts_status() != nullptr)
          check(cudaMemcpy(&experts, f.buffers->experts_status(), sizeof experts, cudaMemcpyDeviceToHost),
                "read the expert kernels' status");
        if (experts != 0) out.fused_backward_difference = cuda::status_message(experts);
      }
      if (run == 0) continue;
      out.fused_forward_ms.push_back(slowest);
      out.fused_backward_ms.push_back(slowest_backward);
      {  // the backward's outputs against the staged run's
        bool same = out.fused_difference.empty() && out.fused_backward_difference.empty();
        auto first = [&](const std::string& name, const std::vector<float>& got, const std::vector<float>& want) {
          const int64_t at = first_bit_difference(got, want);
          if (same && at >= 0) {
            same = false;
            out.fused_backward_difference = name + " differs from the staged backward at index " +
                                            std::to_string(at) + " in run " + std::to_string(run);
          }
        };
        ref::RoutedWeights<float> dw;
        for (int r = 0; r < R; ++r) {
          const FusedRank& f = fr[static_cast<size_t>(r)];
          const std::string of = " of rank " + std::to_string(r);
          std::vector<uint16_t> bits(static_cast<size_t>(T * H));
          if (!bits.empty())
            check(cudaMemcpy(bits.data(), f.dx.get(), bits.size() * 2, cudaMemcpyDeviceToHost), "download fused dx");
          std::vector<float> dx(bits.size());
          for (size_t i = 0; i < bits.size(); ++i) dx[i] = bf16_to_float(bf16{bits[i]});
          first("dx" + of, dx, staged.dx[static_cast<size_t>(r)]);
          first("d topk_w" + of, f.d_topk_w.download(), staged.d_topk_w[static_cast<size_t>(r)]);
          for (const auto& [to, from] : {std::pair{&dw.gate, &f.d_gate}, {&dw.up, &f.d_up}, {&dw.down, &f.d_down}}) {
            const std::vector<float> part = from->download();
            to->insert(to->end(), part.begin(), part.end());
          }
        }
        first("dW_gate", dw.gate, staged.d_routed.gate);
        first("dW_up", dw.up, staged.d_routed.up);
        first("dW_down", dw.down, staged.d_routed.down);
        out.fused_backward_identical_runs += same ? 1 : 0;
      }
      bool same = out.fused_difference.empty();
      for (int r = 0; r < R && same; ++r) {
        std::vector<uint16_t> bits(static_cast<size_t>(T * H));
        if (!bits.empty())
          check(cudaMemcpy(bits.data(), fr[static_cast<size_t>(r)].y.get(), bits.size() * 2, cudaMemcpyDeviceToHost),
                "download fused y");
        std::vector<float> y(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) y[i] = bf16_to_float(bf16{bits[i]});
        const int64_t at = first_bit_difference(y, staged_y[static_cast<size_t>(r)]);
        if (at >= 0) {
          same = false;
          out.fused_difference = "y of rank " + std::to_string(r) + " differs from the staged forward at index " +
                                 std::to_string(at) + " in run " + std::to_string(run);
        }
      }
      out.fused_identical_runs += same ? 1 : 0;
    }
  } catch (...) {
    release();
    throw;
  }
  release();
}

CudaLayer cuda_layer(const ref::LayerInputs<float>& in, const std::vector<std::vector<float>>& dy, int64_t runs,
                     bool fused) {
  const MoeDesc& d = in.desc;
  if (const std::string why = cuda_unavailable_reason(); !why.empty())
    throw NotSupported("backend cuda: " + why);
  if (const std::string why = cuda_cannot_run(d); !why.empty()) throw NotSupported("backend cuda: " + why);
  const int64_t R = d.ranks, T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk;
  const int64_t El = d.local_experts(), Is = d.shared_intermediate;
  const int64_t Tpad = round_up(T, cuda::kRowAlign);
  const cuda::RoutingShape shape = routing_shape(d);
  const int64_t cap = cuda::routed_row_capacity(shape);
  const size_t sT = static_cast<size_t>(T), sH = static_cast<size_t>(H), sk = static_cast<size_t>(k);
  const size_t scap = static_cast<size_t>(cap), sEl = static_cast<size_t>(El), sI = static_cast<size_t>(I);
  const size_t sTpad = static_cast<size_t>(Tpad), sIs = static_cast<size_t>(Is);

  if (dy.size() != static_cast<size_t>(R)) throw InvalidArgument("backend cuda: dy needs one tensor per rank");
  for (const auto& v : dy) {
    if (v.size() != sT * sH) throw InvalidArgument("backend cuda: every rank's dy must have T*H values");
  }
  const size_t sIs_blocks = static_cast<size_t>(cuda::dw_partial_blocks(Is));
  const size_t sI_blocks = static_cast<size_t>(cuda::dw_partial_blocks(I));

  CudaLayer out;
  {
    int device = 0;
    cudaDeviceProp prop{};
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    out.device = std::string(prop.name) + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
  }
  Stream stream;

  // ---- Buffers and inputs ----
  DeviceArray<uint16_t> s_gate, s_up, s_down;  // the shared expert: replicated, so one copy serves every rank
  if (d.has_shared()) {
    s_gate = DeviceArray<uint16_t>(sIs * sH, "shared w_gate");
    s_up = DeviceArray<uint16_t>(sIs * sH, "shared w_up");
    s_down = DeviceArray<uint16_t>(sH * sIs, "shared w_down");
    s_gate.upload(to_bf16_bits(in.shared.gate));
    s_up.upload(to_bf16_bits(in.shared.up));
    s_down.upload(to_bf16_bits(in.shared.down));
  }
  const bool fp8 = fp8_forward(d.precision), dgrad8 = fp8_dgrad(d.precision);
  Fp8Matrix s_gate8, s_up8, s_down8;
  Fp8Transposes s_t8;
  if (fp8 && d.has_shared()) {
    s_gate8 = quantized_weight(s_gate, 1, Is, H, "shared w_gate", stream.s);
    s_up8 = quantized_weight(s_up, 1, Is, H, "shared w_up", stream.s);
    s_down8 = quantized_weight(s_down, 1, H, Is, "shared w_down", stream.s);
    if (dgrad8) s_t8 = transposed_weights(s_gate, s_up, s_down, 1, H, Is, " (shared)", stream.s);
  }
  std::vector<RankBuffers> ranks(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    RankBuffers& b = ranks[static_cast<size_t>(r)];
    const std::string of = " of rank " + std::to_string(r);
    b.x = DeviceArray<uint16_t>(sTpad * sH, "x" + of);
    check(cudaMemset(b.x.get(), 0, b.x.bytes()), "zero x padding");
    b.x.upload(to_bf16_bits(in.x[static_cast<size_t>(r)]));
    b.topk_idx = DeviceArray<int32_t>(sT * sk, "topk_idx" + of);
    b.topk_idx.upload(in.topk_idx[static_cast<size_t>(r)]);
    b.topk_w = DeviceArray<float>(sT * sk, "topk_w" + of);
    b.topk_w.upload(in.topk_w[static_cast<size_t>(r)]);
    b.slots = DeviceArray<uint16_t>(sT * sk * sH, "combine slots" + of);
    b.y = DeviceArray<uint16_t>(sT * sH, "y" + of);
    const size_t expert_elems = sEl * sI * sH, first = static_cast<size_t>(r) * expert_elems;
    b.w_gate = DeviceArray<uint16_t>(expert_elems, "w_gate" + of);
    b.w_up = DeviceArray<uint16_t>(expert_elems, "w_up" + of);
    b.w_down = DeviceArray<uint16_t>(expert_elems, "w_down" + of);
    b.w_gate.upload(to_bf16_bits(in.routed.gate.data() + first, expert_elems));
    b.w_up.upload(to_bf16_bits(in.routed.up.data() + first, expert_elems));
    b.w_down.upload(to_bf16_bits(in.routed.down.data() + first, expert_elems));
    b.offsets = DeviceArray<int32_t>(sEl + 1, "expert offsets" + of);
    b.rows = DeviceArray<int32_t>(sEl, "expert rows" + of);
    b.src_rank = DeviceArray<int32_t>(scap, "schedule src_rank" + of);
    b.src_slot = DeviceArray<int32_t>(scap, "schedule src_slot" + of);
    b.workspace = DeviceArray<uint8_t>(static_cast<size_t>(cuda::schedule_workspace_bytes(shape)),
                                       "schedule workspace" + of);
    b.routing_status = DeviceArray<cuda::RoutingStatus>(1, "routing status" + of);
    check(cudaMemset(b.routing_status.get(), 0, sizeof(cuda::RoutingStatus)), "zero routing status");
    b.x_rows = DeviceArray<uint16_t>(scap * sH, "dispatched rows" + of);
    b.gu = DeviceArray<uint16_t>(scap * 2 * sI, "gu rows" + of);
    b.h = DeviceArray<uint16_t>(scap * sI, "h rows" + of);
    b.y_rows = DeviceArray<uint16_t>(scap * sH, "expert output rows" + of);
    b.experts_status = DeviceArray<int32_t>(1, "experts status" + of);
    check(cudaMemset(b.experts_status.get(), 0, sizeof(int32_t)), "zero experts status");
    if (d.has_shared()) {
      b.shared_offsets = DeviceArray<int32_t>(2, "shared offsets" + of);
      b.shared_offsets.upload({0, static_cast<int32_t>(Tpad)});
      b.shared_gu = DeviceArray<uint16_t>(sTpad * 2 * sIs, "shared gu" + of);
      b.shared_h = DeviceArray<uint16_t>(sTpad * sIs, "shared h" + of);
      b.y_shared = DeviceArray<uint16_t>(sTpad * sH, "shared y" + of);
      b.shared_status = DeviceArray<int32_t>(1, "shared status" + of);
      check(cudaMemset(b.shared_status.get(), 0, sizeof(int32_t)), "zero shared status");
      b.dx_shared = DeviceArray<uint16_t>(sTpad * sH, "shared dx" + of);
      b.shared_d_gate = DeviceArray<float>(sIs * sH, "shared dW_gate" + of);
      b.shared_d_up = DeviceArray<float>(sIs * sH, "shared dW_up" + of);
      b.shared_d_down = DeviceArray<float>(sH * sIs, "shared dW_down" + of);
      b.shared_backward_status = DeviceArray<int32_t>(1, "shared backward status" + of);
      check(cudaMemset(b.shared_backward_status.get(), 0, sizeof(int32_t)), "zero shared backward status");
    }
    b.dy = DeviceArray<uint16_t>(sTpad * sH, "dy" + of);
    check(cudaMemset(b.dy.get(), 0, b.dy.bytes()), "zero dy padding");
    b.dy.upload(to_bf16_bits(dy[static_cast<size_t>(r)]));
    b.dx_slots = DeviceArray<uint16_t>(sT * sk * sH, "dispatch-gradient slots" + of);
    b.d_topk_w = DeviceArray<float>(sT * sk, "d topk_w" + of);
    b.dx = DeviceArray<uint16_t>(sT * sH, "dx" + of);
    b.dy_rows = DeviceArray<uint16_t>(scap * sH, "dy rows" + of);
    b.dx_rows = DeviceArray<uint16_t>(scap * sH, "dx rows" + of);
    b.row_weights = DeviceArray<float>(scap, "row weights" + of);
    b.d_row_weight = DeviceArray<float>(scap, "d row weight" + of);
    b.d_gate = DeviceArray<float>(expert_elems, "dW_gate" + of);
    b.d_up = DeviceArray<float>(expert_elems, "dW_up" + of);
    b.d_down = DeviceArray<float>(expert_elems, "dW_down" + of);
    b.backward_status = DeviceArray<int32_t>(1, "backward status" + of);
    check(cudaMemset(b.backward_status.get(), 0, sizeof(int32_t)), "zero backward status");
    if (fp8) {
      b.w_gate8 = quantized_weight(b.w_gate, El, I, H, "w_gate" + of, stream.s);
      b.w_up8 = quantized_weight(b.w_up, El, I, H, "w_up" + of, stream.s);
      b.w_down8 = quantized_weight(b.w_down, El, H, I, "w_down" + of, stream.s);
      b.x_rows8 = Fp8Matrix(scap * sH, sH / 128 * scap, "dispatched rows" + of);
      b.h8 = Fp8Matrix(scap * sI, sI / 128 * scap, "h rows" + of);
      if (dgrad8) b.w_t8 = transposed_weights(b.w_gate, b.w_up, b.w_down, El, H, I, of, stream.s);
      if (d.has_shared()) {
        b.shared_x8 = Fp8Matrix(sTpad * sH, sH / 128 * sTpad, "shared x" + of);
        b.shared_h8 = Fp8Matrix(sTpad * sIs, sIs / 128 * sTpad, "shared h" + of);
      }
    }
  }
  check(cudaStreamSynchronize(stream.s), "quantize the weights");
  // Scratch of the experts backward, consumed within one launch: one set serves every rank (the
  // launches are ordered on one stream).
  DeviceArray<uint16_t> dgu(scap * 2 * sI, "dg|du rows"), hw(scap * sI, "w*h rows");
  DeviceArray<float> dw_partial(scap * sI_blocks, "d row weight partials");
  DeviceArray<uint16_t> shared_dgu, shared_hw;
  DeviceArray<float> shared_dw_partial, shared_row_weight, shared_d_row_weight;
  DeviceArray<uint8_t> dgrad_scratch, shared_dgrad_scratch;  // fp8_dgrad
  if (dgrad8) {
    dgrad_scratch = DeviceArray<uint8_t>(static_cast<size_t>(cuda::fp8_dgrad_scratch_bytes(cap, H, I)), "fp8 dgrad scratch");
    if (d.has_shared())
      shared_dgrad_scratch = DeviceArray<uint8_t>(static_cast<size_t>(cuda::fp8_dgrad_scratch_bytes(Tpad, H, Is)),
                                                  "shared fp8 dgrad scratch");
  }
  if (d.has_shared()) {
    shared_dgu = DeviceArray<uint16_t>(sTpad * 2 * sIs, "shared dg|du rows");
    shared_hw = DeviceArray<uint16_t>(sTpad * sIs, "shared w*h rows");
    shared_dw_partial = DeviceArray<float>(sTpad * sIs_blocks, "shared d row weight partials");
    shared_d_row_weight = DeviceArray<float>(sTpad, "shared d row weight");
    // Row weight 1 for the T real rows, 0 for the padding rows (they contribute nothing).
    std::vector<float> w(sTpad, 0.0f);
    std::fill(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(sT), 1.0f);
    shared_row_weight = DeviceArray<float>(sTpad, "shared row weights");
    shared_row_weight.upload(w);
  }
  // The tables of per-rank pointers every kernel reads the other ranks through.
  std::vector<const int32_t*> idx_ptrs;
  std::vector<const void*> x_ptrs;
  std::vector<void*> slot_ptrs;
  for (const RankBuffers& b : ranks) {
    idx_ptrs.push_back(b.topk_idx.get());
    x_ptrs.push_back(b.x.get());
    slot_ptrs.push_back(b.slots.get());
  }
  std::vector<const void*> dy_ptrs;
  std::vector<const float*> w_ptrs;
  std::vector<void*> dx_slot_ptrs;
  std::vector<float*> d_topk_w_ptrs;
  for (RankBuffers& b : ranks) {
    dy_ptrs.push_back(b.dy.get());
    w_ptrs.push_back(b.topk_w.get());
    dx_slot_ptrs.push_back(b.dx_slots.get());
    d_topk_w_ptrs.push_back(b.d_topk_w.get());
  }

  // ---- The forward: one stage over all ranks at a time, an event after each stage ----
  StageTimer forward_timer({"schedule", "dispatch", "experts", "combine", "shared", "epilogue"});
  StageTimer backward_timer({"dispatch dy", "experts", "scatter dx", "shared", "epilogue"});
  auto mark = [&](size_t i, bool timed) { forward_timer.mark(i, timed, stream.s); };
  auto mark_backward = [&](size_t i, bool timed) { backward_timer.mark(i, timed, stream.s); };
  auto view = [&](const RankBuffers& b) {
    return cuda::ScheduleView{El, cap, b.offsets.get(), b.src_rank.get(), b.src_slot.get()};
  };
  auto forward = [&](bool timed) {
    // Outputs poisoned (bf16 0xffff is NaN): a slot or y that is not written fails the check.
    for (RankBuffers& b : ranks) {
      check(cudaMemsetAsync(b.slots.get(), 0xff, b.slots.bytes(), stream.s), "poison combine slots");
      check(cudaMemsetAsync(b.y.get(), 0xff, b.y.bytes(), stream.s), "poison y");
    }
    mark(0, timed);
    for (int64_t dst = 0; dst < R; ++dst) {
      RankBuffers& b = ranks[static_cast<size_t>(dst)];
      cuda::ScheduleArgs a;
      a.shape = shape;
      a.dest_rank = dst;
      a.topk_idx = idx_ptrs.data();
      a.expert_offsets = b.offsets.get();
      a.expert_rows = b.rows.get();
      a.src_rank = b.src_rank.get();
      a.src_slot = b.src_slot.get();
      a.row_capacity = cap;
      a.workspace = b.workspace.get();
      a.status = b.routing_status.get();
      cuda::build_schedule(a, stream.s);
    }
    mark(1, timed);
    for (RankBuffers& b : ranks) {
      cuda::GatherArgs g;
      g.shape = shape;
      g.hidden = H;
      g.schedule = view(b);
      g.x = x_ptrs.data();
      g.rows = b.x_rows.get();
      cuda::gather_rows(g, stream.s);
    }
    mark(2, timed);
    for (RankBuffers& b : ranks) {
      if (fp8) {
        staged_experts_fp8(cap, H, I, El, d.swiglu_limit, b.offsets.get(), b.x_rows.get(), b.x_rows8, b.w_gate8,
                           b.w_up8, b.w_down8, b.gu.get(), b.h.get(), b.h8, b.y_rows.get(), b.experts_status.get(),
                           stream.s);
        continue;
      }
      staged_experts(cap, H, I, El, d.swiglu_limit, b.offsets.get(), b.x_rows.get(), b.w_gate.get(), b.w_up.get(),
                     b.w_down.get(), b.gu.get(), b.h.get(), b.y_rows.get(), b.experts_status.get(), stream.s);
    }
    mark(3, timed);
    for (RankBuffers& b : ranks) {
      cuda::ScatterArgs s;
      s.shape = shape;
      s.hidden = H;
      s.schedule = view(b);
      s.rows = b.y_rows.get();
      s.slots = slot_ptrs.data();
      cuda::scatter_rows(s, stream.s);
    }
    mark(4, timed);
    if (d.has_shared()) {
      for (RankBuffers& b : ranks) {
        if (fp8) {
          staged_experts_fp8(Tpad, H, Is, 1, d.swiglu_limit, b.shared_offsets.get(), b.x.get(), b.shared_x8, s_gate8,
                             s_up8, s_down8, b.shared_gu.get(), b.shared_h.get(), b.shared_h8, b.y_shared.get(),
                             b.shared_status.get(), stream.s);
          continue;
        }
        staged_experts(Tpad, H, Is, 1, d.swiglu_limit, b.shared_offsets.get(), b.x.get(), s_gate.get(), s_up.get(),
                       s_down.get(), b.shared_gu.get(), b.shared_h.get(), b.y_shared.get(), b.shared_status.get(),
                       stream.s);
      }
    }
    mark(5, timed);
    for (RankBuffers& b : ranks) {
      cuda::CombineArgs c;
      c.tokens = T;
      c.hidden = H;
      c.topk = k;
      c.y_shared = d.has_shared() ? b.y_shared.get() : nullptr;
      c.slots = b.slots.get();
      c.topk_w = b.topk_w.get();
      c.topk_idx = b.topk_idx.get();
      c.y = b.y.get();
      cuda::combine_epilogue(c, stream.s);
    }
    mark(6, timed);
    check(cudaStreamSynchronize(stream.s), "forward");
  };

  // ---- The backward: reuses the forward's schedules, x rows, g|u and h ----
  auto backward = [&](bool timed) {
    // Outputs poisoned (0xff bytes are NaN in bf16 and fp32).
    for (RankBuffers& b : ranks) {
      check(cudaMemsetAsync(b.dx_slots.get(), 0xff, b.dx_slots.bytes(), stream.s), "poison dx slots");
      check(cudaMemsetAsync(b.d_topk_w.get(), 0xff, b.d_topk_w.bytes(), stream.s), "poison d topk_w");
      check(cudaMemsetAsync(b.dx.get(), 0xff, b.dx.bytes(), stream.s), "poison dx");
      check(cudaMemsetAsync(b.d_gate.get(), 0xff, b.d_gate.bytes(), stream.s), "poison dW_gate");
      check(cudaMemsetAsync(b.d_up.get(), 0xff, b.d_up.bytes(), stream.s), "poison dW_up");
      check(cudaMemsetAsync(b.d_down.get(), 0xff, b.d_down.bytes(), stream.s), "poison dW_down");
      if (d.has_shared()) {
        check(cudaMemsetAsync(b.shared_d_gate.get(), 0xff, b.shared_d_gate.bytes(), stream.s), "poison shared dW");
        check(cudaMemsetAsync(b.shared_d_up.get(), 0xff, b.shared_d_up.bytes(), stream.s), "poison shared dW");
        check(cudaMemsetAsync(b.shared_d_down.get(), 0xff, b.shared_d_down.bytes(), stream.s), "poison shared dW");
      }
    }
    mark_backward(0, timed);
    for (RankBuffers& b : ranks) {  // dy rows (unscaled) and each row's router weight
      cuda::GatherArgs g;
      g.shape = shape;
      g.hidden = H;
      g.schedule = view(b);
      g.x = dy_ptrs.data();
      g.rows = b.dy_rows.get();
      g.topk_w = w_ptrs.data();
      g.row_weights = b.row_weights.get();
      cuda::gather_rows(g, stream.s);
    }
    mark_backward(1, timed);
    for (RankBuffers& b : ranks) {
      cuda::ExpertsBackwardArgs e;
      e.row_capacity = cap;
      e.hidden = H;
      e.intermediate = I;
      e.local_experts = El;
      e.expert_offsets = b.offsets.get();
      e.x = b.x_rows.get();
      e.gu = b.gu.get();
      e.h = b.h.get();
      e.dy = b.dy_rows.get();
      e.row_weight = b.row_weights.get();
      e.w_gate = b.w_gate.get();
      e.w_up = b.w_up.get();
      e.w_down = b.w_down.get();
      e.dgu = dgu.get();
      e.hw = hw.get();
      e.dw_partial = dw_partial.get();
      e.dx = b.dx_rows.get();
      e.d_row_weight = b.d_row_weight.get();
      e.d_w_gate = b.d_gate.get();
      e.d_w_up = b.d_up.get();
      e.d_w_down = b.d_down.get();
      e.swiglu_limit = d.swiglu_limit;
      e.status = b.backward_status.get();
      staged_experts_backward(e, dgrad8 ? &b.w_t8 : nullptr, dgrad_scratch.get(), stream.s);
    }
    mark_backward(2, timed);
    for (RankBuffers& b : ranks) {
      cuda::ScatterArgs s;
      s.shape = shape;
      s.hidden = H;
      s.schedule = view(b);
      s.rows = b.dx_rows.get();
      s.slots = dx_slot_ptrs.data();
      cuda::scatter_rows(s, stream.s);
      cuda::ScatterValuesArgs v;
      v.shape = shape;
      v.schedule = view(b);
      v.values = b.d_row_weight.get();
      v.slot_values = d_topk_w_ptrs.data();
      cuda::scatter_row_values(v, stream.s);
    }
    mark_backward(3, timed);
    if (d.has_shared()) {
      for (RankBuffers& b : ranks) {
        cuda::ExpertsBackwardArgs e;
        e.row_capacity = Tpad;
        e.hidden = H;
        e.intermediate = Is;
        e.local_experts = 1;
        e.expert_offsets = b.shared_offsets.get();
        e.x = b.x.get();
        e.gu = b.shared_gu.get();
        e.h = b.shared_h.get();
        e.dy = b.dy.get();
        e.row_weight = shared_row_weight.get();
        e.w_gate = s_gate.get();
        e.w_up = s_up.get();
        e.w_down = s_down.get();
        e.dgu = shared_dgu.get();
        e.hw = shared_hw.get();
        e.dw_partial = shared_dw_partial.get();
        e.dx = b.dx_shared.get();
        e.d_row_weight = shared_d_row_weight.get();
        e.d_w_gate = b.shared_d_gate.get();
        e.d_w_up = b.shared_d_up.get();
        e.d_w_down = b.shared_d_down.get();
        e.swiglu_limit = d.swiglu_limit;
        e.status = b.shared_backward_status.get();
        staged_experts_backward(e, dgrad8 ? &s_t8 : nullptr, shared_dgrad_scratch.get(), stream.s);
      }
    }
    mark_backward(4, timed);
    for (RankBuffers& b : ranks) {
      cuda::DispatchGradArgs g;
      g.tokens = T;
      g.hidden = H;
      g.topk = k;
      g.dx_shared = d.has_shared() ? b.dx_shared.get() : nullptr;
      g.slots = b.dx_slots.get();
      g.topk_idx = b.topk_idx.get();
      g.slot_values = g.d_topk_w = b.d_topk_w.get();  // the empty slots' d topk_w (no row wrote them) <- 0
      g.dx = b.dx.get();
      cuda::dispatch_grad_epilogue(g, stream.s);
    }
    mark_backward(5, timed);
    check(cudaStreamSynchronize(stream.s), "backward");
  };

  // Every output of one run, as floats (bf16 widened exactly, so bit comparisons stay exact).
  struct RunOutputs {
    std::vector<std::vector<float>> y;
    ref::LayerGrads<float> grads;
  };
  auto download_bf16 = [](const uint16_t* src, size_t n, const char* what) {
    std::vector<uint16_t> bits(n);
    if (n > 0) check(cudaMemcpy(bits.data(), src, n * 2, cudaMemcpyDeviceToHost), what);
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = bf16_to_float(bf16{bits[i]});
    return f;
  };
  auto download_f32 = [](std::vector<float>& dst, const float* src, size_t n, const char* what) {
    const size_t at = dst.size();
    dst.resize(at + n);
    if (n > 0) check(cudaMemcpy(dst.data() + at, src, n * 4, cudaMemcpyDeviceToHost), what);
  };
  auto download = [&]() {
    RunOutputs o;
    for (const RankBuffers& b : ranks) {
      o.y.push_back(download_bf16(b.y.get(), sT * sH, "download y"));
      o.grads.dx.push_back(download_bf16(b.dx.get(), sT * sH, "download dx"));
      o.grads.d_topk_w.emplace_back();
      download_f32(o.grads.d_topk_w.back(), b.d_topk_w.get(), sT * sk, "download d topk_w");
      // Destination rank r holds global experts [r*El, (r+1)*El): appended in rank order.
      download_f32(o.grads.d_routed.gate, b.d_gate.get(), b.d_gate.size(), "download dW_gate");
      download_f32(o.grads.d_routed.up, b.d_up.get(), b.d_up.size(), "download dW_up");
      download_f32(o.grads.d_routed.down, b.d_down.get(), b.d_down.size(), "download dW_down");
      o.grads.d_shared.emplace_back();
      if (d.has_shared()) {
        auto& s = o.grads.d_shared.back();
        download_f32(s.gate, b.shared_d_gate.get(), b.shared_d_gate.size(), "download shared dW_gate");
        download_f32(s.up, b.shared_d_up.get(), b.shared_d_up.size(), "download shared dW_up");
        download_f32(s.down, b.shared_d_down.get(), b.shared_d_down.size(), "download shared dW_down");
      }
    }
    return o;
  };
  // "" when b equals a bit for bit, else the first differing tensor and index.
  auto bit_difference = [&](const RunOutputs& a, const RunOutputs& b) -> std::string {
    auto first = [](const std::string& name, const std::vector<float>& x, const std::vector<float>& y) {
      const int64_t at = first_bit_difference(x, y);
      return at < 0 ? std::string() : name + " differs at index " + std::to_string(at);
    };
    for (int64_t r = 0; r < R; ++r) {
      const size_t i = static_cast<size_t>(r);
      const std::string of = " of rank " + std::to_string(r);
      for (const std::string& why :
           {first("y" + of, a.y[i], b.y[i]), first("dx" + of, a.grads.dx[i], b.grads.dx[i]),
            first("d_topk_w" + of, a.grads.d_topk_w[i], b.grads.d_topk_w[i]),
            first("shared dW_gate" + of, a.grads.d_shared[i].gate, b.grads.d_shared[i].gate),
            first("shared dW_up" + of, a.grads.d_shared[i].up, b.grads.d_shared[i].up),
            first("shared dW_down" + of, a.grads.d_shared[i].down, b.grads.d_shared[i].down)}) {
        if (!why.empty()) return why;
      }
    }
    for (const std::string& why : {first("dW_gate", a.grads.d_routed.gate, b.grads.d_routed.gate),
                                   first("dW_up", a.grads.d_routed.up, b.grads.d_routed.up),
                                   first("dW_down", a.grads.d_routed.down, b.grads.d_routed.down)}) {
      if (!why.empty()) return why;
    }
    return "";
  };

  forward(/*timed=*/false);  // warm-up: module loading, kernel attributes
  backward(/*timed=*/false);
  RunOutputs first_run;
  for (int64_t run = 0; run < runs; ++run) {
    forward(/*timed=*/true);
    backward(/*timed=*/true);
    out.forward_ms.push_back(forward_timer.collect());
    out.backward_ms.push_back(backward_timer.collect());
    RunOutputs o = download();
    if (run == 0) {
      first_run = std::move(o);
      continue;
    }
    const std::string why = bit_difference(o, first_run);
    if (why.empty()) {
      ++out.identical_runs;
    } else if (out.first_difference.empty()) {
      out.first_difference = why + " in run " + std::to_string(run + 1);
    }
  }

  // ---- Statuses: any bad id or malformed offsets is an error, never a silent result ----
  for (int64_t r = 0; r < R; ++r) {
    const RankBuffers& b = ranks[static_cast<size_t>(r)];
    const std::string bad = cuda::read_routing_status(b.routing_status.get(), shape, stream.s);
    if (!bad.empty())
      throw std::runtime_error("backend cuda: schedule of rank " + std::to_string(r) + ": " + bad);
    int32_t status = 0;
    check(cudaMemcpy(&status, b.experts_status.get(), sizeof status, cudaMemcpyDeviceToHost),
          "read experts status");
    if (status != 0) {
      throw std::runtime_error("backend cuda: routed experts of rank " + std::to_string(r) + ": " +
                               cuda::status_message(status));
    }
    check(cudaMemcpy(&status, b.backward_status.get(), sizeof status, cudaMemcpyDeviceToHost),
          "read backward status");
    if (status != 0) {
      throw std::runtime_error("backend cuda: routed experts backward of rank " + std::to_string(r) + ": " +
                               cuda::status_message(status));
    }
    if (d.has_shared()) {
      check(cudaMemcpy(&status, b.shared_status.get(), sizeof status, cudaMemcpyDeviceToHost),
            "read shared status");
      if (status != 0) {
        throw std::runtime_error("backend cuda: shared expert of rank " + std::to_string(r) + ": " +
                                 cuda::status_message(status));
      }
      check(cudaMemcpy(&status, b.shared_backward_status.get(), sizeof status, cudaMemcpyDeviceToHost),
            "read shared backward status");
      if (status != 0) {
        throw std::runtime_error("backend cuda: shared expert backward of rank " + std::to_string(r) + ": " +
                                 cuda::status_message(status));
      }
    }
  }

  if (fused) {
    fused_layer(in, ranks, first_run.y, first_run.grads, runs, out);
  } else {
    out.fused_skipped = "--fused off";
  }

  out.y = std::move(first_run.y);
  out.grads = std::move(first_run.grads);
  out.forward_stage_ms = forward_timer.medians();
  out.backward_stage_ms = backward_timer.medians();
  return out;
}

}  // namespace mok::cli
