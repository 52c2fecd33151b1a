// mok._C: the Python binding of the C++ core (include/mok/core).
//
// Thin on purpose: no torch headers. Arrays cross as numpy buffers (Python passes tensor.numpy()
// views of contiguous CPU tensors, so nothing is copied); every array is checked here for dtype,
// C-contiguity, writability (outputs) and element count, because a silently converted copy of an
// output would drop the result. Compute runs with the GIL released.
//
// Errors: mok::InvalidArgument (a std::invalid_argument) becomes ValueError, mok::NotSupported
// becomes NotImplementedError.
#include <pybind11/numpy.h>
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mok/core/desc.h"
#include "mok/core/error.h"
#include "mok/core/parallel.h"
#include "mok/core/planner.h"
#include "mok/core/reference.h"
#include "mok/core/schedule.h"

namespace py = pybind11;

namespace mok::python {
namespace {

using ref::Rounding;

// The Python package always runs the bf16 path: values rounded where the GPU stores bf16.
constexpr Rounding kRounding = Rounding::bf16;

template <class T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, int32_t>) return "int32";
  if constexpr (std::is_same_v<T, int64_t>) return "int64";
}

template <class T>
void check_array(const py::array& a, int64_t numel, const char* name) {
  MOK_REQUIRE(a.dtype().is(py::dtype::of<T>()), name, " must be a ", dtype_name<T>(), " array, got ",
              std::string(py::str(a.dtype())));
  MOK_REQUIRE((a.flags() & py::array::c_style) != 0, name, " must be C-contiguous");
  MOK_REQUIRE(static_cast<int64_t>(a.size()) == numel, name, " has ", a.size(), " elements, expected ",
              numel);
}

template <class T>
const T* input(const py::array& a, int64_t numel, const char* name) {
  check_array<T>(a, numel, name);
  return static_cast<const T*>(a.data());
}

template <class T>
T* output(py::array& a, int64_t numel, const char* name) {
  check_array<T>(a, numel, name);
  MOK_REQUIRE(a.writeable(), name, " must be writeable");
  return static_cast<T*>(a.mutable_data());
}

template <class T>
const T* optional_input(const std::optional<py::array>& a, int64_t numel, const char* name) {
  return a ? input<T>(*a, numel, name) : nullptr;
}

template <class T>
T* optional_output(std::optional<py::array>& a, int64_t numel, const char* name) {
  return a ? output<T>(*a, numel, name) : nullptr;
}

template <class T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// Rows of `count` experts, grouped: offsets [count+1] int64.
std::vector<int64_t> read_offsets(const py::array& offsets, int64_t count) {
  const int64_t* p = input<int64_t>(offsets, count + 1, "expert_offsets");
  return std::vector<int64_t>(p, p + count + 1);
}

struct Mlp {
  ref::MlpShape shape;
  ref::ExpertsView<float> w;
};

// Weights of `count` SwiGLU experts: gate, up [count,I,H], down [count,H,I], float32.
Mlp read_mlp(int64_t hidden, int64_t intermediate, std::optional<float> swiglu_limit, const py::array& gate,
             const py::array& up, const py::array& down, int64_t count) {
  MOK_REQUIRE(hidden >= 1 && intermediate >= 1 && count >= 0, "bad MLP shape: hidden=", hidden,
              " intermediate=", intermediate, " count=", count);
  const int64_t n = count * intermediate * hidden;
  Mlp m;
  m.shape = ref::MlpShape{hidden, intermediate, swiglu_limit};
  m.w = ref::ExpertsView<float>{input<float>(gate, n, "gate"), input<float>(up, n, "up"),
                                input<float>(down, n, "down"), count};
  return m;
}

py::dict plan_to_dict(const MoeConfig& c) {
  py::dict d;
  d["desc"] = c.desc;
  d["device"] = c.device.name;
  d["comm_sms"] = c.comm_sms;
  d["compute_sms"] = c.compute_sms;
  d["minibatch_rows"] = c.minibatch_rows;
  d["ring_rows"] = c.ring_rows;
  d["ring_row_bytes"] = c.ring_row_bytes;
  d["expected_rows"] = c.expected_rows;
  d["schedule_capacity_rows"] = c.schedule_capacity_rows;
  d["rows_per_expert"] = c.rows_per_expert;
  d["padded_rows_per_expert"] = c.padded_rows_per_expert;
  d["padding_share"] = c.padding_share;
  d["keeps_forward_context"] = c.keeps_forward_context;
  d["fused_backward"] = c.fused_backward;
  py::dict ws;
  ws["symmetric"] = c.workspace.symmetric;
  ws["schedule"] = c.workspace.schedule;
  ws["ring"] = c.workspace.ring;
  ws["total"] = c.workspace.total();
  d["workspace_bytes"] = ws;
  auto cost = [](const PassCost& p) {
    py::dict out;
    out["flops"] = p.flops;
    out["hbm_bytes"] = p.hbm_bytes;
    out["nvlink_bytes"] = p.nvlink_bytes;
    out["floor_ms"] = p.floor_ms;
    out["bound_by"] = std::string(p.bound_by);
    return out;
  };
  d["forward"] = cost(c.forward);
  d["backward"] = cost(c.backward);
  d["explanation"] = c.explanation;
  return d;
}

// The whole layer over R emulated ranks (reference.h layer_forward + layer_backward), for tests:
// the oracle the distributed Python path must match bit for bit.
py::dict reference_layer(const MoeDesc& desc, const std::vector<py::array>& x,
                         const std::vector<py::array>& topk_idx, const std::vector<py::array>& topk_w,
                         const py::array& gate, const py::array& up, const py::array& down,
                         const std::optional<py::array>& shared_gate, const std::optional<py::array>& shared_up,
                         const std::optional<py::array>& shared_down, const std::vector<py::array>& dy) {
  desc.validate();
  const int64_t R = desc.ranks, T = desc.tokens_per_rank, H = desc.hidden, I = desc.intermediate;
  const int64_t k = desc.topk, E = desc.num_experts, Is = desc.shared_intermediate;
  MOK_REQUIRE(static_cast<int64_t>(x.size()) == R && static_cast<int64_t>(topk_idx.size()) == R &&
                  static_cast<int64_t>(topk_w.size()) == R && static_cast<int64_t>(dy.size()) == R,
              "x, topk_idx, topk_w and dy must be given for ranks=", R, " ranks");
  MOK_REQUIRE(desc.has_shared() == (shared_gate.has_value() && shared_up.has_value() && shared_down.has_value()),
              "shared weights must be given exactly when shared_intermediate > 0");
  ref::LayerInputs<float> in;
  in.desc = desc;
  auto vec = [](const float* p, int64_t n) { return std::vector<float>(p, p + n); };
  for (int64_t r = 0; r < R; ++r) {
    in.x.push_back(vec(input<float>(x[r], T * H, "x"), T * H));
    const int32_t* idx = input<int32_t>(topk_idx[r], T * k, "topk_idx");
    in.topk_idx.emplace_back(idx, idx + T * k);
    in.topk_w.push_back(vec(input<float>(topk_w[r], T * k, "topk_w"), T * k));
  }
  in.routed.gate = vec(input<float>(gate, E * I * H, "gate"), E * I * H);
  in.routed.up = vec(input<float>(up, E * I * H, "up"), E * I * H);
  in.routed.down = vec(input<float>(down, E * H * I, "down"), E * H * I);
  if (desc.has_shared()) {
    in.shared.gate = vec(input<float>(*shared_gate, Is * H, "shared_gate"), Is * H);
    in.shared.up = vec(input<float>(*shared_up, Is * H, "shared_up"), Is * H);
    in.shared.down = vec(input<float>(*shared_down, H * Is, "shared_down"), H * Is);
  }
  std::vector<std::vector<float>> dys;
  for (int64_t r = 0; r < R; ++r) dys.push_back(vec(input<float>(dy[r], T * H, "dy"), T * H));

  ref::LayerForward<float> f;
  ref::LayerGrads<float> g;
  {
    py::gil_scoped_release release;
    f = ref::layer_forward(in, kRounding);
    g = ref::layer_backward(in, f.context, dys, kRounding);
  }
  auto list = [](const std::vector<std::vector<float>>& v) {
    py::list out;
    for (const auto& part : v) out.append(to_numpy(part));
    return out;
  };
  py::dict out;
  out["y"] = list(f.y);
  out["dx"] = list(g.dx);
  out["d_topk_w"] = list(g.d_topk_w);
  out["d_gate"] = to_numpy(g.d_routed.gate);
  out["d_up"] = to_numpy(g.d_routed.up);
  out["d_down"] = to_numpy(g.d_routed.down);
  py::list sg, su, sd;
  for (const auto& s : g.d_shared) {
    sg.append(to_numpy(s.gate));
    su.append(to_numpy(s.up));
    sd.append(to_numpy(s.down));
  }
  out["d_shared_gate"] = sg;
  out["d_shared_up"] = su;
  out["d_shared_down"] = sd;
  return out;
}

}  // namespace
}  // namespace mok::python

PYBIND11_MODULE(_C, m) {
  using namespace mok;
  using namespace mok::python;
  m.doc() = "MoK's C++ core: problem descriptor, routing schedule, planner and the CPU reference stages";
  py::register_exception<NotSupported>(m, "NotSupported", PyExc_NotImplementedError);

  py::class_<MoeDesc>(m, "MoeDesc", "The problem one MoE layer poses, per rank of the expert-parallel group")
      .def(py::init([](int64_t tokens_per_rank, int64_t hidden, int64_t intermediate, int64_t num_experts,
                       int64_t topk, int64_t ranks, int64_t shared_intermediate,
                       std::optional<float> swiglu_limit, const std::string& precision) {
             MoeDesc d;
             d.tokens_per_rank = tokens_per_rank;
             d.hidden = hidden;
             d.intermediate = intermediate;
             d.num_experts = num_experts;
             d.topk = topk;
             d.ranks = ranks;
             d.shared_intermediate = shared_intermediate;
             d.swiglu_limit = swiglu_limit;
             d.precision = parse_precision(precision);
             return d;
           }),
           py::kw_only(), py::arg("tokens_per_rank"), py::arg("hidden"), py::arg("intermediate"),
           py::arg("num_experts"), py::arg("topk"), py::arg("ranks") = 1, py::arg("shared_intermediate") = 0,
           py::arg("swiglu_limit") = py::none(), py::arg("precision") = "bf16")
      .def_readwrite("tokens_per_rank", &MoeDesc::tokens_per_rank)
      .def_readwrite("hidden", &MoeDesc::hidden)
      .def_readwrite("intermediate", &MoeDesc::intermediate)
      .def_readwrite("num_experts", &MoeDesc::num_experts)
      .def_readwrite("topk", &MoeDesc::topk)
      .def_readwrite("ranks", &MoeDesc::ranks)
      .def_readwrite("shared_intermediate", &MoeDesc::shared_intermediate)
      .def_readwrite("swiglu_limit", &MoeDesc::swiglu_limit)
      .def_property_readonly("precision", [](const MoeDesc& d) { return std::string(to_string(d.precision)); })
      .def_property_readonly("local_experts", &MoeDesc::local_experts)
      .def("validate", &MoeDesc::validate, "Raises ValueError naming the first bad field and its value")
      .def("__str__", &MoeDesc::to_string)
      .def("__repr__", [](const MoeDesc& d) { return "MoeDesc(" + d.to_string() + ")"; })
      .def(py::self == py::self);

  py::class_<DeviceFacts>(m, "DeviceFacts", "What the planner knows about a device")
      .def(py::init([](const std::string& name, int sm_count, int64_t memory_bytes, double bf16_tflops,
                       double hbm_gbps, double nvlink_gbps) {
             return DeviceFacts{name, sm_count, memory_bytes, bf16_tflops, hbm_gbps, nvlink_gbps};
           }),
           py::kw_only(), py::arg("name"), py::arg("sm_count"), py::arg("memory_bytes"),
           py::arg("bf16_tflops") = 0.0, py::arg("hbm_gbps") = 0.0, py::arg("nvlink_gbps") = 0.0)
      .def_static("find", &find_device, py::arg("name"), "Known devices: h200, h100, cpu")
      .def_static("for_gpu", &facts_for_gpu, py::arg("name"), py::arg("sm_count"), py::arg("memory_bytes"),
                  "A GPU as its driver names it: an H200 or H100 gets the rates known for it with its own SMs; "
                  "any other GPU its SMs and memory and no rates")
      .def_readonly("name", &DeviceFacts::name)
      .def_readonly("sm_count", &DeviceFacts::sm_count)
      .def_readonly("memory_bytes", &DeviceFacts::memory_bytes)
      .def_readonly("bf16_tflops", &DeviceFacts::bf16_tflops)
      .def_readonly("hbm_gbps", &DeviceFacts::hbm_gbps)
      .def_readonly("nvlink_gbps", &DeviceFacts::nvlink_gbps);

  m.def(
      "plan",
      [](const MoeDesc& desc, const DeviceFacts& device, std::optional<int> comm_sms,
         std::optional<int64_t> minibatch_rows, std::optional<int64_t> ring_rows,
         std::optional<int64_t> ring_budget_bytes, std::optional<bool> fused_backward) {
        return plan_to_dict(
            plan(desc, device, PlanOverrides{comm_sms, minibatch_rows, ring_rows, ring_budget_bytes, fused_backward}));
      },
      py::arg("desc"), py::arg("device"), py::kw_only(), py::arg("comm_sms") = py::none(),
      py::arg("minibatch_rows") = py::none(), py::arg("ring_rows") = py::none(),
      py::arg("ring_budget_bytes") = py::none(), py::arg("fused_backward") = py::none(),
      "The planner: comm/compute SMs, minibatch, ring, workspace bytes, floors and the explanation");

  m.def(
      "build_rank_schedule",
      [](const MoeDesc& desc, int64_t dest_rank, const py::array& topk_idx, int64_t pad_to) {
        const int64_t slots = desc.routed_slots();
        const int32_t* all = input<int32_t>(topk_idx, desc.ranks * slots, "topk_idx");
        std::vector<const int32_t*> per_rank;
        for (int64_t r = 0; r < desc.ranks; ++r) per_rank.push_back(all + r * slots);
        RankSchedule s;
        {
          py::gil_scoped_release release;
          s = build_rank_schedule(desc, dest_rank, per_rank, pad_to);
        }
        std::vector<int32_t> src_rank(s.rows.size()), src_slot(s.rows.size());
        for (size_t i = 0; i < s.rows.size(); ++i) {
          src_rank[i] = s.rows[i].src_rank;
          src_slot[i] = s.rows[i].src_slot;
        }
        return py::make_tuple(to_numpy(s.expert_offsets), to_numpy(src_rank), to_numpy(src_slot));
      },
      py::arg("desc"), py::arg("dest_rank"), py::arg("topk_idx"), py::arg("pad_to") = 1,
      "Rows the experts of dest_rank compute, in canonical order (global token, then j).\n"
      "topk_idx: int32 [R, T, k], every rank's routing. Returns (expert_offsets int64 [El+1],\n"
      "src_rank int32 [M], src_slot int32 [M]); padding rows are (-1, -1).");

  m.def(
      "experts_forward",
      [](int64_t hidden, int64_t intermediate, std::optional<float> swiglu_limit, const py::array& gate,
         const py::array& up, const py::array& down, int64_t count, const py::array& offsets, const py::array& x,
         std::optional<py::array> gu, py::array h, py::array y) {
        const Mlp mlp = read_mlp(hidden, intermediate, swiglu_limit, gate, up, down, count);
        const std::vector<int64_t> off = read_offsets(offsets, count);
        MOK_REQUIRE(count == 0 || off[0] == 0, "expert_offsets must start at 0");
        const int64_t M = count == 0 ? 0 : off.back();
        const float* xp = input<float>(x, M * hidden, "x");
        float* gup = optional_output<float>(gu, M * 2 * intermediate, "gu");
        float* hp = output<float>(h, M * intermediate, "h");
        float* yp = output<float>(y, M * hidden, "y");
        py::gil_scoped_release release;
        ref::experts_forward<float>(mlp.shape, mlp.w, off, xp, gup, hp, yp, kRounding);
      },
      py::arg("hidden"), py::arg("intermediate"), py::arg("swiglu_limit"), py::arg("gate"), py::arg("up"),
      py::arg("down"), py::arg("count"), py::arg("offsets"), py::arg("x"), py::arg("gu"), py::arg("h"),
      py::arg("y"),
      "reference.h experts_forward (bf16 rounding): x [M,H] -> gu [M,2I] (optional), h [M,I], y [M,H]");

  m.def(
      "experts_backward",
      [](int64_t hidden, int64_t intermediate, std::optional<float> swiglu_limit, const py::array& gate,
         const py::array& up, const py::array& down, int64_t count, const py::array& offsets, const py::array& x,
         const py::array& gu, const py::array& h, const py::array& dy, const py::array& row_weight, py::array dx,
         std::optional<py::array> d_row_weight, py::array d_gate, py::array d_up, py::array d_down) {
        const Mlp mlp = read_mlp(hidden, intermediate, swiglu_limit, gate, up, down, count);
        const std::vector<int64_t> off = read_offsets(offsets, count);
        MOK_REQUIRE(count == 0 || off[0] == 0, "expert_offsets must start at 0");
        const int64_t M = count == 0 ? 0 : off.back();
        const int64_t H = hidden, I = intermediate;
        const float* xp = input<float>(x, M * H, "x");
        const float* gup = input<float>(gu, M * 2 * I, "gu");
        const float* hp = input<float>(h, M * I, "h");
        const float* dyp = input<float>(dy, M * H, "dy");
        const float* rwp = input<float>(row_weight, M, "row_weight");
        float* dxp = output<float>(dx, M * H, "dx");
        float* drwp = optional_output<float>(d_row_weight, M, "d_row_weight");
        float* dgp = output<float>(d_gate, count * I * H, "d_gate");
        float* dup = output<float>(d_up, count * I * H, "d_up");
        float* ddp = output<float>(d_down, count * H * I, "d_down");
        py::gil_scoped_release release;
        ref::experts_backward<float>(mlp.shape, mlp.w, off, xp, gup, hp, dyp, rwp, dxp, drwp, dgp, dup, ddp,
                                     kRounding);
      },
      py::arg("hidden"), py::arg("intermediate"), py::arg("swiglu_limit"), py::arg("gate"), py::arg("up"),
      py::arg("down"), py::arg("count"), py::arg("offsets"), py::arg("x"), py::arg("gu"), py::arg("h"),
      py::arg("dy"), py::arg("row_weight"), py::arg("dx"), py::arg("d_row_weight"), py::arg("d_gate"),
      py::arg("d_up"), py::arg("d_down"),
      "reference.h experts_backward (bf16 rounding); dy unscaled, row_weight [M] separate");

  m.def(
      "combine_epilogue",
      [](int64_t tokens, int64_t hidden, int64_t topk, const std::optional<py::array>& y_shared,
         const py::array& slots, const py::array& topk_w, py::array y, const std::optional<py::array>& topk_idx) {
        MOK_REQUIRE(tokens >= 0 && hidden >= 1 && topk >= 1, "bad epilogue shape: tokens=", tokens,
                    " hidden=", hidden, " topk=", topk);
        const float* ys = optional_input<float>(y_shared, tokens * hidden, "y_shared");
        const float* sp = input<float>(slots, tokens * topk * hidden, "slots");
        const float* wp = input<float>(topk_w, tokens * topk, "topk_w");
        const int32_t* ip = optional_input<int32_t>(topk_idx, tokens * topk, "topk_idx");
        float* yp = output<float>(y, tokens * hidden, "y");
        py::gil_scoped_release release;
        ref::combine_epilogue<float>(tokens, hidden, topk, ys, sp, wp, ip, yp, kRounding);
      },
      py::arg("tokens"), py::arg("hidden"), py::arg("topk"), py::arg("y_shared"), py::arg("slots"),
      py::arg("topk_w"), py::arg("y"), py::arg("topk_idx") = py::none(),
      "y[t] = bf16(y_shared[t] + sum_j topk_w[t,j] * slots[t*k+j]), j in order, skipping the slots whose "
      "topk_idx (int32, optional) is -1");

  m.def(
      "dispatch_grad_epilogue",
      [](int64_t tokens, int64_t hidden, int64_t topk, const std::optional<py::array>& dx_shared,
         const py::array& slots, py::array dx, const std::optional<py::array>& topk_idx) {
        MOK_REQUIRE(tokens >= 0 && hidden >= 1 && topk >= 1, "bad epilogue shape: tokens=", tokens,
                    " hidden=", hidden, " topk=", topk);
        const float* ds = optional_input<float>(dx_shared, tokens * hidden, "dx_shared");
        const float* sp = input<float>(slots, tokens * topk * hidden, "slots");
        const int32_t* ip = optional_input<int32_t>(topk_idx, tokens * topk, "topk_idx");
        float* dxp = output<float>(dx, tokens * hidden, "dx");
        py::gil_scoped_release release;
        ref::dispatch_grad_epilogue<float>(tokens, hidden, topk, ds, sp, ip, dxp, kRounding);
      },
      py::arg("tokens"), py::arg("hidden"), py::arg("topk"), py::arg("dx_shared"), py::arg("slots"),
      py::arg("dx"), py::arg("topk_idx") = py::none(),
      "dx[t] = bf16(dx_shared[t] + sum_j slots[t*k+j]), j in order, skipping the slots whose topk_idx is -1");

  m.def("reference_layer", &reference_layer, py::arg("desc"), py::arg("x"), py::arg("topk_idx"),
        py::arg("topk_w"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("shared_gate"),
        py::arg("shared_up"), py::arg("shared_down"), py::arg("dy"),
        "The whole layer forward and backward over desc.ranks emulated ranks (the test oracle).\n"
        "Per-rank lists of float32 x [T*H], int32 topk_idx [T*k], topk_w [T*k], dy [T*H]; routed\n"
        "weights of all E experts; returns y, dx, d_topk_w (lists), d_gate/up/down, d_shared_* (lists).");

  m.def("set_cpu_threads", &set_cpu_threads, py::arg("threads"),
        "Threads of the CPU reference (0 = all hardware threads); results do not depend on it");
  m.def("cpu_threads", &cpu_threads);
}
