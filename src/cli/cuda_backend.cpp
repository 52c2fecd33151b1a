#include "cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mok/core/bf16.h"
#include "mok/core/error.h"
#include "mok/core/planner.h"
#include "mok/cuda/expert_kernels.h"
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
  c.y = placeholder<void>();
  add("combine epilogue", cuda::can_implement(c));
  return why;
}

CudaForward cuda_layer_forward(const ref::LayerInputs<float>& in, int64_t runs) {
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

  CudaForward out;
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
    }
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

  // ---- The forward: one stage over all ranks at a time, an event after each stage ----
  const std::vector<std::string> stages{"schedule", "dispatch", "experts", "combine", "shared", "epilogue"};
  Events events(stages.size() + 1);
  auto mark = [&](size_t i, bool timed) {
    if (timed) check(cudaEventRecord(events.e[i], stream.s), "cudaEventRecord");
  };
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
      cuda::ExpertsForwardArgs e = experts_shape(cap, H, I, El, d.swiglu_limit);
      e.expert_offsets = b.offsets.get();
      e.x = b.x_rows.get();
      e.w_gate = b.w_gate.get();
      e.w_up = b.w_up.get();
      e.w_down = b.w_down.get();
      e.gu = b.gu.get();
      e.h = b.h.get();
      e.y = b.y_rows.get();
      e.status = b.experts_status.get();
      cuda::experts_forward(e, stream.s);
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
        cuda::ExpertsForwardArgs e = experts_shape(Tpad, H, Is, 1, d.swiglu_limit);
        e.expert_offsets = b.shared_offsets.get();
        e.x = b.x.get();
        e.w_gate = s_gate.get();
        e.w_up = s_up.get();
        e.w_down = s_down.get();
        e.gu = b.shared_gu.get();
        e.h = b.shared_h.get();
        e.y = b.y_shared.get();
        e.status = b.shared_status.get();
        cuda::experts_forward(e, stream.s);
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
      c.y = b.y.get();
      cuda::combine_epilogue(c, stream.s);
    }
    mark(6, timed);
    check(cudaStreamSynchronize(stream.s), "forward");
  };

  forward(/*timed=*/false);  // warm-up: module loading, kernel attributes
  std::vector<std::vector<double>> stage_ms(stages.size());
  std::vector<std::vector<uint16_t>> first_y;
  for (int64_t run = 0; run < runs; ++run) {
    forward(/*timed=*/true);
    float ms = 0;
    check(cudaEventElapsedTime(&ms, events.e.front(), events.e.back()), "cudaEventElapsedTime");
    out.forward_ms.push_back(ms);
    for (size_t i = 0; i < stages.size(); ++i) {
      check(cudaEventElapsedTime(&ms, events.e[i], events.e[i + 1]), "cudaEventElapsedTime");
      stage_ms[i].push_back(ms);
    }
    std::vector<std::vector<uint16_t>> y(static_cast<size_t>(R), std::vector<uint16_t>(sT * sH));
    for (int64_t r = 0; r < R; ++r) {
      if (T > 0) {
        check(cudaMemcpy(y[static_cast<size_t>(r)].data(), ranks[static_cast<size_t>(r)].y.get(), sT * sH * 2,
                         cudaMemcpyDeviceToHost),
              "download y");
      }
    }
    if (run == 0) {
      first_y = std::move(y);
      continue;
    }
    bool same = true;
    for (int64_t r = 0; r < R && same; ++r) {
      const auto& a = y[static_cast<size_t>(r)];
      const auto& f = first_y[static_cast<size_t>(r)];
      const auto at = std::mismatch(a.begin(), a.end(), f.begin());
      if (at.first != a.end()) {
        same = false;
        if (out.first_difference.empty()) {
          out.first_difference = "y of rank " + std::to_string(r) + " differs at index " +
                                 std::to_string(at.first - a.begin()) + " in run " + std::to_string(run + 1);
        }
      }
    }
    out.identical_runs += same ? 1 : 0;
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
    if (d.has_shared()) {
      check(cudaMemcpy(&status, b.shared_status.get(), sizeof status, cudaMemcpyDeviceToHost),
            "read shared status");
      if (status != 0) {
        throw std::runtime_error("backend cuda: shared expert of rank " + std::to_string(r) + ": " +
                                 cuda::status_message(status));
      }
    }
  }

  for (const auto& y : first_y) {
    std::vector<float> f(y.size());
    for (size_t i = 0; i < y.size(); ++i) f[i] = bf16_to_float(bf16{y[i]});
    out.y.push_back(std::move(f));
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    std::vector<double> v = stage_ms[i];
    std::sort(v.begin(), v.end());
    out.stage_ms.emplace_back(stages[i], v[v.size() / 2]);
  }
  return out;
}

}  // namespace mok::cli
