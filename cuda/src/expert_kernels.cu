// Host launchers of the sm_90a expert kernels (include/mok/cuda/expert_kernels.h).
#include "mok/cuda/expert_kernels.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "mok/cuda/detail/expert_epilogues.cuh"
#include "mok/cuda/detail/grouped_gemm_kernel.cuh"
#include "mok/cuda/detail/pingpong_gemm_kernel.cuh"
#include "launch_util.h"

namespace mok::cuda {
namespace {

using detail::GemmConfig;
// sm_90's largest opt-in shared memory per block: 227 KiB.
static_assert(sizeof(detail::GroupedGemmSharedStorage<detail::bfloat16_t>) <= 232448, "shared storage exceeds 227 KiB");
static_assert(sizeof(detail::GroupedGemmSharedStorage<detail::float_e4m3_t>) <= 232448, "shared storage exceeds 227 KiB");
static_assert(sizeof(detail::PingPongSharedStorage<detail::ForwardMainloopOf<detail::bfloat16_t, 64>>) <= 232448,
              "shared storage exceeds 227 KiB");
static_assert(sizeof(detail::PingPongSharedStorage<
                  detail::BackwardMainloopOf<detail::bfloat16_t, cute::GMMA::Major::K, 64>>) <= 232448,
              "shared storage exceeds 227 KiB");

using host_util::bf;
using host_util::bind_context;
using host_util::check;
using host_util::ceil_div;
using host_util::device_sms;
using host_util::store_target;
using host_util::trimmed;

template <class Mainloop, class Epilogue>
void launch(const detail::GroupedGemmParams<Mainloop, Epilogue>& params, int num_sms, cudaStream_t stream) {
  // A 64-row mainloop is the ping-pong kernel's (grouped rows only).
  auto [kernel, smem] = [] {
    if constexpr (Mainloop::kRows == detail::kPingPongRows) {
      return std::make_pair(detail::pingpong_gemm_kernel<Mainloop, Epilogue>,
                            int(sizeof(detail::PingPongSharedStorage<Mainloop>)));
    } else {
      return std::make_pair(detail::grouped_gemm_kernel<Mainloop, Epilogue>,
                            int(sizeof(detail::GroupedGemmSharedStorage<typename Mainloop::Element>)));
    }
  }();
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "set shared memory");
  kernel<<<device_sms(num_sms), GemmConfig::kThreads, smem, stream>>>(params);
  check(cudaGetLastError(), "launch grouped GEMM");
}

// The schedule of a grouped GEMM launch: cooperative (two warpgroups on a 128-row tile) or
// ping-pong (one warpgroup per 64-row tile, its epilogue under the other's mainloop). Each launch
// names the one measured faster for it (bench.gemms, session 9, 6 presets x 3 sizes on one H200):
// the dgrad's dh launch, whose SwiGLU backward epilogue is latency-bound, ran 14-28% faster
// ping-pong; the forward's gate|up and down ran up to 16% slower. The weight gradients' ping-pong
// keeps the cooperative 128-row tiles and lets the two warpgroups take turns, each storing its 64
// rows under the other's mainloop (grouped_gemm_kernel.cuh): 6-9% faster at 256 and 384 rows per
// expert, 0-3% at 1024 (session 11), so it is their default. MOK_EXPERT_SCHEDULE=cooperative or pingpong
// forces one schedule on every launch, read at each call (the benchmark's A/B switch).
// can_implement reports a bad value, so the megakernel's stage kernels refuse it before their first
// launch; the launchers check again (the variable may change in between).
enum class Schedule { cooperative, pingpong };

// The weight gradients' tile order (ExpertTileScheduler): columns by default, each CTA keeping a
// column's B tiles (the activations) in shared memory while it goes down the column's row
// blocks, where every expert's rows fit the stages (at most 256; the kernel decides from the
// offsets, else it takes the rows order). Session 12, bench.gemms, 48 experts x 256 rows:
// deepseek-v4 8.5% faster, kimi 3%. MOK_WGRAD_TILES=rows forces the rows order, every stage
// loading both operands.
std::string schedule_problem() {
  std::string why;
  const char* v = std::getenv("MOK_EXPERT_SCHEDULE");
  if (!(v == nullptr || *v == '\0' || std::strcmp(v, "pingpong") == 0 || std::strcmp(v, "cooperative") == 0))
    why += std::string("MOK_EXPERT_SCHEDULE must be cooperative or pingpong, got '") + v + "'; ";
  const char* w = std::getenv("MOK_WGRAD_TILES");
  if (!(w == nullptr || *w == '\0' || std::strcmp(w, "columns") == 0 || std::strcmp(w, "rows") == 0))
    why += std::string("MOK_WGRAD_TILES must be columns or rows, got '") + w + "'; ";
  return why;
}

detail::TileOrder wgrad_order() {
  if (const std::string why = schedule_problem(); !why.empty())
    throw std::invalid_argument("mok cuda: " + host_util::trimmed(why));
  const char* w = std::getenv("MOK_WGRAD_TILES");
  return w != nullptr && std::strcmp(w, "rows") == 0 ? detail::TileOrder::expert_weights
                                                     : detail::TileOrder::expert_weight_columns;
}

bool pingpong(Schedule preferred) {
  if (const std::string why = schedule_problem(); !why.empty())
    throw std::invalid_argument("mok cuda: " + host_util::trimmed(why));
  const char* v = std::getenv("MOK_EXPERT_SCHEDULE");
  if (v == nullptr || *v == '\0') return preferred == Schedule::pingpong;
  return std::strcmp(v, "pingpong") == 0;
}

template <class Mainloop, class Epilogue>
detail::GroupedGemmParams<Mainloop, Epilogue> rows_params(const typename Mainloop::Params& m,
                                                          const typename Epilogue::Params& e, int64_t experts,
                                                          int64_t rows, int n_blocks, int k_blocks,
                                                          const int32_t* offsets, int32_t* status) {
  return {m, e, detail::TileOrder::grouped_rows, int(experts), int(rows), 0, n_blocks, k_blocks, offsets, status};
}

// d_row_weight[r] = sum of the row's d topk_w partials, in column-block order, for the rows the
// experts hold ([0, offsets[El])); rows past them are not touched, as by every other kernel.
__global__ void reduce_row_partials_kernel(const float* partial, int blocks, const int32_t* offsets, int experts,
                                           float* out) {
  const int64_t rows = offsets[experts];
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; ++b) acc = __fadd_rn(acc, partial[r * blocks + b]);
    out[r] = acc;
  }
}

std::string common_checks(int64_t H, int64_t I, int64_t El, int64_t capacity, const int32_t* offsets) {
  std::ostringstream why;
  if (H < 8 || H % 8 != 0) why << "hidden must be a positive multiple of 8 (16-byte rows for TMA), got " << H << "; ";
  if (I < 8 || I % 8 != 0) why << "intermediate must be a positive multiple of 8 (16-byte rows for TMA), got " << I << "; ";
  if (El < 1 || El > GemmConfig::kMaxExperts)
    why << "local_experts must be in [1, " << GemmConfig::kMaxExperts << "], got " << El << "; ";
  if (capacity < 0 || capacity > (int64_t{1} << 30)) why << "row_capacity must be in [0, 2^30], got " << capacity << "; ";
  if (offsets == nullptr) why << "expert_offsets is null; ";
  return why.str();
}

}  // namespace

void host_util::reduce_row_partials(const float* partial, int blocks, const int32_t* offsets, int experts, float* out,
                                    int64_t rows, cudaStream_t stream) {
  reduce_row_partials_kernel<<<ceil_div(rows, 256), 256, 0, stream>>>(partial, blocks, offsets, experts, out);
  check(cudaGetLastError(), "launch reduce_row_partials");
}

const char* status_message(int32_t code) {
  switch (code) {
    case kStatusOk: return "ok";
    case kStatusMisalignedOffsets: return "an expert offset is not a multiple of kRowAlign (128)";
    case kStatusOffsetsOutOfRange: return "expert offsets decrease, do not start at 0, or exceed the row capacity";
  }
  return "unknown status";
}

std::string can_implement(const ExpertsForwardArgs& a) {
  std::ostringstream why;
  why << common_checks(a.hidden, a.intermediate, a.local_experts, a.row_capacity, a.expert_offsets);
  if (a.x == nullptr || a.w_gate == nullptr || a.w_up == nullptr || a.w_down == nullptr || a.h == nullptr || a.y == nullptr)
    why << "x, w_gate, w_up, w_down, h and y must not be null; ";
  why << schedule_problem();
  if (a.swiglu_limit && !(*a.swiglu_limit > 0.0f)) why << "swiglu_limit must be > 0; ";
  return trimmed(why.str());
}

std::string host_util::dx_push_problem(const DxPush& push) {
  std::ostringstream why;
  if (push.ranks < 1 || push.ranks > detail::kMaxPushRanks)
    why << "dx_push.ranks must be in [1, " << detail::kMaxPushRanks << "], got " << push.ranks << "; ";
  if (push.slots < 0 || push.slots >= (int64_t{1} << 24))
    why << "dx_push.slots must be in [0, 2^24), got " << push.slots << "; ";
  bool tables = push.slots_of != nullptr && push.src_rank != nullptr && push.src_slot != nullptr;
  for (int64_t r = 0; tables && r < push.ranks && r < detail::kMaxPushRanks; ++r)
    tables = push.slots_of[r] != nullptr || push.slots == 0;
  if (!tables) why << "dx_push needs slots_of (one pointer a rank), src_rank and src_slot; ";
  return why.str();
}

std::string can_implement(const ExpertsBackwardArgs& a) {
  std::ostringstream why;
  why << common_checks(a.hidden, a.intermediate, a.local_experts, a.row_capacity, a.expert_offsets);
  if (!a.x || !a.gu || !a.h || !a.dy || !a.row_weight || !a.w_gate || !a.w_up || !a.w_down || !a.dgu || !a.hw ||
      !a.dw_partial || !(a.dx || a.dx_push) || !a.d_row_weight || !a.d_w_gate || !a.d_w_up || !a.d_w_down)
    why << "every pointer of ExpertsBackwardArgs must be set (dx or dx_push); ";
  if (a.dx_push) why << host_util::dx_push_problem(*a.dx_push);
  why << schedule_problem();
  if (a.swiglu_limit && !(*a.swiglu_limit > 0.0f)) why << "swiglu_limit must be > 0; ";
  return trimmed(why.str());
}

namespace {
template <class Args>
void require(const Args& a) {  // (every public entry point: its arguments, then this thread's context)
  const std::string why = can_implement(a);
  if (!why.empty()) throw std::invalid_argument("mok cuda experts: " + why);
  bind_context();
}
}  // namespace

namespace {
template <int kRows>
void gate_up_swiglu_rows(const ExpertsForwardArgs& a, cudaStream_t stream) {
  using Mainloop = detail::ForwardMainloopOf<detail::bfloat16_t, kRows>;
  using Epilogue = detail::SwiGluEpilogueOf<kRows>;
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  const typename Mainloop::Params m{Mainloop::make_a(bf(a.x), int(R), int(H)),
                                    Mainloop::make_b(bf(a.w_gate), int(I), int(H), int(El)),
                                    Mainloop::make_b(bf(a.w_up), int(I), int(H), int(El)), int(R), int(H), int(I),
                                    int(El), /*b1_row_shift=*/0};
  void* gu = a.gu != nullptr ? a.gu : a.h;  // a valid pointer for the unused descriptors
  const typename Epilogue::Params e{store_target<kRows>(a.h, R, I, I), store_target<kRows>(gu, R, I, 2 * I),
                                    store_target<kRows>(a.gu != nullptr ? static_cast<void*>(bf(a.gu) + I) : a.h, R,
                                                        I, 2 * I),
                                    a.gu != nullptr, a.swiglu_limit.has_value(), a.swiglu_limit.value_or(0.0f)};
  launch(rows_params<Mainloop, Epilogue>(m, e, El, R, ceil_div(I, GemmConfig::kHalfN), ceil_div(H, Mainloop::kBlockK),
                                         a.expert_offsets, a.status),
         a.num_sms, stream);
}

template <int kRows>
void down_projection_rows(const ExpertsForwardArgs& a, cudaStream_t stream) {
  using Mainloop = detail::ForwardMainloopOf<detail::bfloat16_t, kRows>;
  using Epilogue = detail::StoreEpilogueOf<kRows>;
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  const typename Mainloop::Params m{Mainloop::make_a(bf(a.h), int(R), int(I)),
                                    Mainloop::make_b(bf(a.w_down), int(H), int(I), int(El)),
                                    Mainloop::make_b(bf(a.w_down), int(H), int(I), int(El)), int(R), int(I), int(H),
                                    int(El), /*b1_row_shift=*/1};
  const typename Epilogue::Params e{store_target<kRows>(a.y, R, H, H)};
  launch(rows_params<Mainloop, Epilogue>(m, e, El, R, ceil_div(H, GemmConfig::kBlockN), ceil_div(I, Mainloop::kBlockK),
                                         a.expert_offsets, a.status),
         a.num_sms, stream);
}
}  // namespace

void gate_up_swiglu(const ExpertsForwardArgs& a, cudaStream_t stream) {
  require(a);
  if (a.row_capacity == 0) return;
  if (pingpong(Schedule::cooperative)) {
    gate_up_swiglu_rows<detail::kPingPongRows>(a, stream);
  } else {
    gate_up_swiglu_rows<GemmConfig::kBlockM>(a, stream);
  }
}

void down_projection(const ExpertsForwardArgs& a, cudaStream_t stream) {
  require(a);
  if (a.row_capacity == 0) return;
  if (pingpong(Schedule::cooperative)) {
    down_projection_rows<detail::kPingPongRows>(a, stream);
  } else {
    down_projection_rows<GemmConfig::kBlockM>(a, stream);
  }
}

void experts_forward(const ExpertsForwardArgs& a, cudaStream_t stream) {
  gate_up_swiglu(a, stream);
  down_projection(a, stream);
}

// The backward's launches, each public entry point checking its arguments once before them.
namespace {
template <int kRows>
void dh_swiglu_backward_rows(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  using Mainloop = detail::BackwardMainloopOf<detail::bfloat16_t, cute::GMMA::Major::K, kRows>;
  using Epilogue = detail::SwiGluBackwardEpilogueOf<kRows>;
  const typename Mainloop::Params m = host_util::dh_operands<kRows>(a.dy, a.w_down, R, H, I, El);
  const detail::SwiGluBackwardParams e = host_util::swiglu_backward_target(a.dgu, a.hw, a.gu, a.h, a.row_weight,
                                                                           a.dw_partial, I, a.swiglu_limit);
  launch(rows_params<Mainloop, Epilogue>(m, e, El, R, int(dw_partial_blocks(I)), ceil_div(H, Mainloop::kBlockK),
                                         a.expert_offsets, a.status),
         a.num_sms, stream);
}

void dh_swiglu_backward_launch(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  const int64_t R = a.row_capacity, I = a.intermediate, El = a.local_experts;
  if (R == 0) return;
  // dh = dy * W_down, SwiGLU backward in the epilogue, then d row weight from its partials.
  if (pingpong(Schedule::pingpong)) {
    dh_swiglu_backward_rows<detail::kPingPongRows>(a, stream);
  } else {
    dh_swiglu_backward_rows<GemmConfig::kBlockM>(a, stream);
  }
  host_util::reduce_row_partials(a.dw_partial, int(dw_partial_blocks(I)), a.expert_offsets, int(El), a.d_row_weight, R,
                                 stream);
}

void dx_launch(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  if (R == 0) return;
  using KMajor = host_util::BackwardK;
  // dx = dg * W_gate + du * W_up, one accumulator over both planes.
  const KMajor::Params m = host_util::dx_operands(a.dgu, a.w_gate, a.w_up, R, H, I, El);
  const int n_blocks = ceil_div(H, GemmConfig::kBlockN), k_blocks = 2 * ceil_div(I, KMajor::kBlockK);
  if (const DxPush* push = a.dx_push) {  // each row into its (token, j) slot (the stage backward's scatter)
    const detail::PushRowsEpilogue::Params e = host_util::push_rows_params(*push, H);
    launch(rows_params<KMajor, detail::PushRowsEpilogue>(m, e, El, R, n_blocks, k_blocks, a.expert_offsets, a.status),
           a.num_sms, stream);
    return;
  }
  const detail::StoreEpilogue::Params e{store_target(a.dx, R, H, H)};
  launch(rows_params<KMajor, detail::StoreEpilogue>(m, e, El, R, n_blocks, k_blocks, a.expert_offsets, a.status),
         a.num_sms, stream);
}

void wgrad_launch(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  const int64_t R = a.row_capacity, H = a.hidden, I = a.intermediate, El = a.local_experts;
  using MnMajor = host_util::BackwardMN;
  // 3. Weight gradients, per expert over its rows in order: dW_gate = dg^T x, dW_up = du^T x,
  //    dW_down = dy^T hw. A is read transposed (MN-major), B too. Empty experts get zeros.
  // The tiles are fp32 or bf16 (d_w_type): the same accumulation, one rounding in the epilogue.
  const detail::TileOrder order = wgrad_order();
  auto wgrad = [&](const void* a_ptr, int64_t a_cols, int64_t a_row_stride, const void* b_ptr, int64_t b_cols,
                   void* out) {
    const MnMajor::Params m = host_util::weight_grad_operands(a_ptr, a_cols, a_row_stride, b_ptr, b_cols, R);
    auto run = [&](auto* epilogue, const auto& e) {  // epilogue: a null pointer naming the type
      using Epilogue = std::remove_pointer_t<decltype(epilogue)>;
      detail::GroupedGemmParams<MnMajor, Epilogue> p{
          m, e, order, int(El), int(R), ceil_div(a_cols, GemmConfig::kBlockM),
          ceil_div(b_cols, GemmConfig::kBlockN), 0, a.expert_offsets, a.status};
      launch(p, a.num_sms, stream);
    };
    // Ping-pong here: the cooperative tiles, each warpgroup's epilogue under the other's mainloop.
    const bool turns = pingpong(Schedule::pingpong);
    if (a.d_w_type == GradType::bf16 && turns) {
      run(static_cast<detail::StoreBf16PlanesTurnsEpilogue*>(nullptr),
          host_util::bf16_planes_target<64>(out, a_cols, b_cols, El));
    } else if (a.d_w_type == GradType::bf16) {
      run(static_cast<detail::StoreBf16PlanesEpilogue*>(nullptr), host_util::bf16_planes_target(out, a_cols, b_cols, El));
    } else if (turns) {
      run(static_cast<detail::StoreF32TurnsEpilogue*>(nullptr),
          host_util::f32_planes_target<64>(out, a_cols, b_cols, El));
    } else {
      run(static_cast<detail::StoreF32Epilogue*>(nullptr), host_util::f32_planes_target(out, a_cols, b_cols, El));
    }
  };
  if (R == 0) {  // no rows at all: every expert is empty (a TMA descriptor cannot have a zero extent)
    const int64_t bytes = grad_bytes(a.d_w_type) * El * I * H;
    check(cudaMemsetAsync(a.d_w_gate, 0, bytes, stream), "zero dW_gate");
    check(cudaMemsetAsync(a.d_w_up, 0, bytes, stream), "zero dW_up");
    check(cudaMemsetAsync(a.d_w_down, 0, bytes, stream), "zero dW_down");
    return;
  }
  wgrad(a.dgu, I, 2 * I, a.x, H, a.d_w_gate);
  wgrad(bf(a.dgu) + I, I, 2 * I, a.x, H, a.d_w_up);
  wgrad(a.dy, H, H, a.hw, I, a.d_w_down);
}
}  // namespace

void experts_backward(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  require(a);
  dh_swiglu_backward_launch(a, stream);
  dx_launch(a, stream);
  wgrad_launch(a, stream);
}

void experts_dgrad(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  require(a);
  dh_swiglu_backward_launch(a, stream);
  dx_launch(a, stream);
}

void experts_dh_swiglu_backward(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  require(a);
  dh_swiglu_backward_launch(a, stream);
}

void experts_dx(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  require(a);
  dx_launch(a, stream);
}

void experts_wgrad(const ExpertsBackwardArgs& a, cudaStream_t stream) {
  // The weights are not read: a caller without bf16 weights (experts_backward_fp8_dgrad's, which
  // reads their e4m3 transposes) is not refused for them.
  ExpertsBackwardArgs checked = a;
  static const char kNotRead = 0;
  for (const void** w : {&checked.w_gate, &checked.w_up, &checked.w_down})
    if (*w == nullptr) *w = &kNotRead;
  require(checked);
  wgrad_launch(a, stream);
}

void preload_expert_kernels() {
  using KMajor = detail::BackwardMainloop<cute::GMMA::Major::K>;
  using MnMajor = detail::BackwardMainloop<cute::GMMA::Major::MN>;
  cudaFuncAttributes attr;
  const char* what = "load the expert kernels";
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<detail::ForwardMainloop, detail::SwiGluEpilogue>), what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<detail::ForwardMainloop, detail::StoreEpilogue>), what);
  using PingPongMainloop = detail::ForwardMainloopOf<detail::bfloat16_t, detail::kPingPongRows>;
  check(cudaFuncGetAttributes(
            &attr, detail::pingpong_gemm_kernel<PingPongMainloop, detail::SwiGluEpilogueOf<detail::kPingPongRows>>),
        what);
  check(cudaFuncGetAttributes(
            &attr, detail::pingpong_gemm_kernel<PingPongMainloop, detail::StoreEpilogueOf<detail::kPingPongRows>>),
        what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<KMajor, detail::SwiGluBackwardEpilogue>), what);
  check(cudaFuncGetAttributes(
            &attr, detail::pingpong_gemm_kernel<detail::BackwardMainloopOf<detail::bfloat16_t, cute::GMMA::Major::K,
                                                                           detail::kPingPongRows>,
                                                detail::SwiGluBackwardEpilogueOf<detail::kPingPongRows>>),
        what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<KMajor, detail::StoreEpilogue>), what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<KMajor, detail::PushRowsEpilogue>), what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<MnMajor, detail::StoreF32Epilogue>), what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<MnMajor, detail::StoreBf16PlanesEpilogue>), what);
  check(cudaFuncGetAttributes(&attr, detail::grouped_gemm_kernel<MnMajor, detail::StoreF32TurnsEpilogue>),
        what);
  check(cudaFuncGetAttributes(&attr,
                              detail::grouped_gemm_kernel<MnMajor, detail::StoreBf16PlanesTurnsEpilogue>),
        what);
  check(cudaFuncGetAttributes(&attr, reduce_row_partials_kernel), what);
}

}  // namespace mok::cuda
