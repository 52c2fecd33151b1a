// Development timing of the fused forward (megakernel.h) on one GPU: R ranks share it (each on its
// own stream with SMs / R - 1 CTAs, as in the GPU tests), against the expert GEMMs alone on rank
// 0's rows with the same CTA count (the overlap yardstick: the fused forward should cost little
// more than its GEMMs). Not the benchmark of record (bench/, on 2 GPUs, against the baselines).
// MOK_MK_TIMING_BACKWARD=1: the backward megakernel instead (after one training forward that keeps
// its rows), in the same four variants and against the backward's stage kernels; with
// MOK_TIMING_DW=bf16 its weight gradients are bf16 (the layer's for bf16 weights), else fp32;
// MOK_MK_TIMING_BACKWARD_AB=<skips>: also the default against MOK_EXPERIMENT_SKIP=<skips> (timing
// builds, -DMOK_EXPERIMENTS), e.g. "turns". MOK_MK_TIMING_STAGES_AB=1: also the stage kernels with
// the dx scatter fused into the dx GEMM against the scatter kernel (MOK_EXPERIMENT_DX_SCATTER=kernel).
// MOK_MK_TIMING_FP8=1: also the block-scaled fp8 forward (MoeForwardArgs::fp8), in rounds with the
// bf16 one, and the fp8 experts' GEMMs alone (experts_forward_fp8) on rank 0's rows.
//   megakernel_timing [H I E k T R minibatch comm]...   (0 = the planner's; defaults: a few presets)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "mok/core/planner.h"
#include "mok/core/symmetric_layout.h"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "mok/cuda/megakernel.h"
#include "timing_util.h"

namespace {

std::vector<void*> allocations;  // of the running shape, freed after it (FreeAtEnd)

template <class T>
T* device(int64_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
  CHECK_CUDA(cudaMemset(p, 0, std::max<int64_t>(n, 1) * sizeof(T)));
  allocations.push_back(p);
  return static_cast<T*>(p);
}

// Declared first in run(), so it runs last: a shape's buffers go before the next shape's (the
// backward's gradients of Kimi K2 at R = 1 did not fit beside the previous shapes').
struct FreeAtEnd {
  ~FreeAtEnd() {
    CHECK_CUDA(cudaDeviceSynchronize());
    for (void* p : allocations) CHECK_CUDA(cudaFree(p));
    allocations.clear();
  }
};

struct Shape {
  int64_t H, I, E, k, T, R, minibatch = 0, comm = 0;
};

// Variants of a pass, round-robin 3 times each: claimed tasks or the static order (claim_tasks),
// each with and without the padding halves' MMA (skip_padding_halves), and for the backward its
// stage kernels (`stages`). The clocks drift under the power cap, so one of each would compare
// moments. Each round starts one variant later (round r runs variant r first): with a fixed order
// the backward's default, always run right after the stage kernels, measured 3.7% slower than the
// same work with its padding flag off (session 17, Kimi K2 at 8192 tokens, where no half is all
// padding). Prints and returns the medians; the first variant is the default.
template <class Call>
std::vector<float> time_variants(Call call, bool& claim_tasks, bool& skip_padding_halves, bool* stages = nullptr) {
  const char* names[5] = {"claimed, skipping", "claimed, every MMA", "static, skipping", "static, every MMA",
                          "stage kernels"};
  const int variants = stages != nullptr ? 5 : 4;
  std::vector<float> times[5];
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < variants; ++i) {
      const int v = (i + round) % variants;
      claim_tasks = v < 2;
      skip_padding_halves = v % 2 == 0;
      if (stages != nullptr) *stages = v == 4;
      times[v].push_back(time_ms(call, 10, /*warmup=*/2));
    }
  }
  claim_tasks = true;
  skip_padding_halves = true;
  if (stages != nullptr) *stages = false;
  std::vector<float> medians;
  for (int v = 0; v < variants; ++v) {
    std::sort(times[v].begin(), times[v].end());
    std::printf("  %-19s %8.3f %8.3f %8.3f ms (sorted)\n", names[v], times[v][0], times[v][1], times[v][2]);
    medians.push_back(times[v][1]);
  }
  return medians;
}

void run(const Shape& s) {
  const FreeAtEnd free_at_end;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int R = int(s.R), ctas = R == 1 ? sms : sms / R - 1;
  const int64_t El = s.E / s.R, H = s.H, I = s.I, T = s.T, k = s.k;
  const mok::cuda::RoutingShape shape{s.R, T, k, s.E};
  const int64_t cap = mok::cuda::routed_row_capacity(shape);
  const mok::SymmetricLayout layout = mok::SymmetricLayout::make(T, H, k, s.R);
  mok::MoeDesc d;
  d.ranks = s.R;
  d.tokens_per_rank = T;
  d.hidden = H;
  d.intermediate = I;
  d.num_experts = s.E;
  d.topk = k;
  mok::DeviceFacts facts = mok::DeviceFacts::h200();
  facts.sm_count = ctas;
  mok::PlanOverrides o;
  if (s.minibatch > 0) o.minibatch_rows = s.minibatch;
  if (s.comm > 0) o.comm_sms = int(s.comm);
  const mok::MoeConfig c = mok::plan(d, facts, o);

  const char* backward_env = std::getenv("MOK_MK_TIMING_BACKWARD");
  const bool backward = backward_env != nullptr && std::atoi(backward_env) != 0;
  // MOK_MK_TIMING_STAGES_AB=1 (below): the scatter kernel's A/B, which alone needs dx rows.
  const char* stages_ab_env = std::getenv("MOK_MK_TIMING_STAGES_AB");
  const bool stages_ab = backward && stages_ab_env != nullptr && std::string(stages_ab_env) == "1";
  // The training forward keeps every row for the backward: its ring holds them all.
  const int64_t all_rows = (cap + c.minibatch_rows - 1) / c.minibatch_rows * c.minibatch_rows;
  const int64_t ring_rows = backward ? all_rows : c.ring_rows;
  struct RankData {
    void* base;
    uint16_t *wg, *wu, *wd, *y;
    uint16_t *gu = nullptr, *dx = nullptr, *dx_rows = nullptr;  // the backward's (dx_rows: the scatter A/B's)
    float *d_topk_w = nullptr, *dwg = nullptr, *dwu = nullptr, *dwd = nullptr;
    std::unique_ptr<mok::cuda::FusedBuffers> buffers;
    cudaStream_t stream;
  };
  std::vector<RankData> ranks(R);
  std::vector<void*> bases(R);
  for (int r = 0; r < R; ++r) {
    RankData& rd = ranks[r];
    rd.base = device<uint8_t>(layout.total);
    bases[r] = rd.base;
    fill_random(mok::SymmetricLayout::at<uint16_t>(rd.base, layout.x), size_t(T * H), 10 + r, 1.0f);
    std::vector<int32_t> idx(T * k);
    for (int64_t t = 0; t < T; ++t)  // balanced: global token g takes experts (g*k + j) mod E
      for (int64_t j = 0; j < k; ++j) idx[t * k + j] = int32_t(((r * T + t) * k + j) % s.E);
    std::vector<float> w(T * k, 1.0f / float(k));
    CHECK_CUDA(cudaMemcpy(mok::SymmetricLayout::at<void>(rd.base, layout.topk_idx), idx.data(), idx.size() * 4,
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(mok::SymmetricLayout::at<void>(rd.base, layout.topk_w), w.data(), w.size() * 4,
                          cudaMemcpyHostToDevice));
    rd.wg = device<uint16_t>(El * I * H);
    rd.wu = device<uint16_t>(El * I * H);
    rd.wd = device<uint16_t>(El * H * I);
    fill_random(rd.wg, size_t(El * I * H), 20 + r, 0.02f);
    fill_random(rd.wu, size_t(El * I * H), 30 + r, 0.02f);
    fill_random(rd.wd, size_t(El * H * I), 40 + r, 0.02f);
    rd.y = device<uint16_t>(T * H);
    rd.buffers = std::make_unique<mok::cuda::FusedBuffers>(shape, H, I, c.minibatch_rows, ring_rows, backward);
    if (backward) {
      fill_random(mok::SymmetricLayout::at<uint16_t>(rd.base, layout.dy), size_t(T * H), 50 + r, 1.0f);
      rd.gu = device<uint16_t>(cap * 2 * I);
      rd.dx = device<uint16_t>(T * H);
      if (stages_ab) rd.dx_rows = device<uint16_t>(cap * H);
      rd.d_topk_w = device<float>(T * k);
      rd.dwg = device<float>(El * I * H);
      rd.dwu = device<float>(El * I * H);
      rd.dwd = device<float>(El * H * I);
    }
    CHECK_CUDA(cudaStreamCreateWithFlags(&rd.stream, cudaStreamNonBlocking));
  }
  mok::cuda::preload_kernels();  // before any rank's barrier spins
  uint32_t epoch = 0;
  bool claim_tasks = true, skip_padding_halves = true;
  // What both passes' arguments share (MoeForwardArgs and MoeBackwardArgs use the same names).
  auto wire = [&](auto& a, int r) {
    RankData& rd = ranks[r];
    a.rank = r;
    a.bases = bases.data();
    a.w_gate = rd.wg;
    a.w_up = rd.wu;
    a.w_down = rd.wd;
    rd.buffers->wire(a);
    a.gu = rd.gu;  // (the forward's: null for inference)
    a.epoch = epoch;
    a.num_sms = ctas;
    a.claim_tasks = claim_tasks;
    a.skip_padding_halves = skip_padding_halves;
  };
  auto fused = [&]() {
    ++epoch;
    for (int r = 0; r < R; ++r) {
      mok::cuda::MoeForwardArgs a;
      wire(a, r);
      a.y = ranks[r].y;
      a.comm_ctas = c.comm_sms;
      mok::cuda::moe_forward(a, ranks[r].stream);
    }
    for (int r = 0; r < R; ++r) CHECK_CUDA(cudaStreamSynchronize(ranks[r].stream));
  };
  CHECK_CUDA(cudaDeviceSynchronize());  // the setup fills are done before the timed calls
  if (backward) {
    fused();  // the forward whose rows the backward calls read
    // MOK_TIMING_DW=bf16: bf16 weight gradients (what the layer writes for bf16 weights; the
    // fp32 buffers are large enough), else fp32.
    const char* dw_env = std::getenv("MOK_TIMING_DW");
    const bool dw_bf16 = dw_env != nullptr && std::string(dw_env) == "bf16";
    bool stages = false;
    auto fused_backward = [&]() {
      ++epoch;
      for (int r = 0; r < R; ++r) {
        RankData& rd = ranks[r];
        mok::cuda::MoeBackwardArgs b;
        wire(b, r);
        b.d_w_gate = rd.dwg;
        b.d_w_up = rd.dwu;
        b.d_w_down = rd.dwd;
        b.d_w_type = dw_bf16 ? mok::cuda::GradType::bf16 : mok::cuda::GradType::fp32;
        b.dx = rd.dx;
        b.dx_rows = rd.dx_rows;  // (MOK_MK_TIMING_STAGES_AB's: read only under MOK_EXPERIMENT_DX_SCATTER=kernel)
        b.d_topk_w = rd.d_topk_w;
        b.fused = !stages;
        mok::cuda::moe_backward(b, rd.stream);
      }
      for (int r = 0; r < R; ++r) CHECK_CUDA(cudaStreamSynchronize(ranks[r].stream));
    };
    const std::vector<float> t = time_variants(fused_backward, claim_tasks, skip_padding_halves, &stages);
    // MOK_MK_TIMING_BACKWARD_AB: the default against MOK_EXPERIMENT_SKIP=<this> (timing builds), 4
    // rounds alternating which runs first.
    if (const char* ab = std::getenv("MOK_MK_TIMING_BACKWARD_AB"); ab != nullptr && *ab != '\0') {
      const char* before = std::getenv("MOK_EXPERIMENT_SKIP");
      const std::string saved = before != nullptr ? before : "";
      std::vector<float> with_default, with_skip;
      for (int round = 0; round < 4; ++round) {
        for (int i = 0; i < 2; ++i) {
          const bool skip = (i + round) % 2 == 1;
          setenv("MOK_EXPERIMENT_SKIP", skip ? ab : saved.c_str(), 1);
          (skip ? with_skip : with_default).push_back(time_ms(fused_backward, 10, /*warmup=*/2));
        }
      }
      setenv("MOK_EXPERIMENT_SKIP", saved.c_str(), 1);
      std::sort(with_default.begin(), with_default.end());
      std::sort(with_skip.begin(), with_skip.end());
      std::printf("  backward A/B: default %8.3f %8.3f %8.3f %8.3f | MOK_EXPERIMENT_SKIP=%s %8.3f %8.3f %8.3f %8.3f ms (sorted)\n",
                  with_default[0], with_default[1], with_default[2], with_default[3], ab, with_skip[0], with_skip[1],
                  with_skip[2], with_skip[3]);
    }
    // MOK_MK_TIMING_STAGES_AB=1: the stage kernels with the dx scatter fused into the dx GEMM (the
    // default) against the scatter kernel (MOK_EXPERIMENT_DX_SCATTER=kernel), 4 rounds alternating.
    if (stages_ab) {
      stages = true;
      std::vector<float> pushed, kernel;
      for (int round = 0; round < 4; ++round) {
        for (int i = 0; i < 2; ++i) {
          const bool scatter = (i + round) % 2 == 1;
          setenv("MOK_EXPERIMENT_DX_SCATTER", scatter ? "kernel" : "", 1);
          (scatter ? kernel : pushed).push_back(time_ms(fused_backward, 10, /*warmup=*/2));
        }
      }
      unsetenv("MOK_EXPERIMENT_DX_SCATTER");
      stages = false;
      std::sort(pushed.begin(), pushed.end());
      std::sort(kernel.begin(), kernel.end());
      std::printf("  stage kernels A/B: dx pushed by its GEMM %8.3f %8.3f %8.3f %8.3f | scatter kernel %8.3f %8.3f "
                  "%8.3f %8.3f ms (sorted)\n",
                  pushed[0], pushed[1], pushed[2], pushed[3], kernel[0], kernel[1], kernel[2], kernel[3]);
    }
    int32_t words[mok::cuda::kFailureWords];
    CHECK_CUDA(cudaMemcpy(words, ranks[0].buffers->status(), sizeof words, cudaMemcpyDeviceToHost));
    const std::string status = mok::cuda::describe_wait_status(words);
    std::printf("H=%-5lld I=%-5lld E=%-4lld k=%-2lld T=%-6lld R=%lld | %d CTAs/rank, minibatch %lld | backward "
                "megakernel %8.3f ms (all ranks, the default; every MMA %8.3f, static order %8.3f) | stage kernels "
                "%8.3f ms%s%s\n",
                (long long)H, (long long)I, (long long)s.E, (long long)k, (long long)T, (long long)s.R, ctas,
                (long long)c.minibatch_rows, t[0], t[1], t[2], t[4], status.empty() ? "" : " | ", status.c_str());
    return;
  }
  const std::vector<float> t = time_variants(fused, claim_tasks, skip_padding_halves);
  const float t_fused = t[0], t_every_mma = t[1], t_static = t[2];
  int32_t words[mok::cuda::kFailureWords];
  CHECK_CUDA(cudaMemcpy(words, ranks[0].buffers->status(), sizeof words, cudaMemcpyDeviceToHost));
  const std::string status = mok::cuda::describe_wait_status(words);

  // The GEMMs alone on rank 0's rows (gathered once), with the same CTAs.
  RankData& r0 = ranks[0];
  mok::cuda::MoeForwardArgs s0;  // rank 0's schedule, as its last fused call left it
  r0.buffers->wire(s0);
  std::vector<int32_t> offsets(El + 1);
  CHECK_CUDA(cudaMemcpy(offsets.data(), s0.expert_offsets, (El + 1) * 4, cudaMemcpyDeviceToHost));
  const int64_t used = offsets[El];
  uint16_t* x_rows = device<uint16_t>(cap * H);
  uint16_t* h = device<uint16_t>(cap * I);
  uint16_t* y_rows = device<uint16_t>(cap * H);
  int32_t* st = device<int32_t>(1);
  std::vector<const void*> x_table(R);
  for (int r = 0; r < R; ++r) x_table[r] = mok::SymmetricLayout::at<const void>(bases[r], layout.x);
  mok::cuda::GatherArgs g;
  g.shape = shape;
  g.hidden = H;
  g.schedule = {El, cap, s0.expert_offsets, s0.src_rank, s0.src_slot};
  g.x = x_table.data();
  g.rows = x_rows;
  mok::cuda::gather_rows(g, nullptr);
  mok::cuda::ExpertsForwardArgs e;
  e.row_capacity = cap;
  e.hidden = H;
  e.intermediate = I;
  e.local_experts = El;
  e.expert_offsets = s0.expert_offsets;
  e.x = x_rows;
  e.w_gate = r0.wg;
  e.w_up = r0.wu;
  e.w_down = r0.wd;
  e.h = h;
  e.y = y_rows;
  e.status = st;
  e.num_sms = ctas;
  const float t_gemms = time_ms([&] { mok::cuda::experts_forward(e, nullptr); }, 10, /*warmup=*/2);
  const double flops = 6.0 * double(used) * double(H) * double(I);
  std::printf(
      "H=%-5lld I=%-5lld E=%-4lld k=%-2lld T=%-6lld R=%lld | %d CTAs/rank, comm %d, minibatch %lld, ring %lld | "
      "fused %8.3f ms (all ranks, the default; every MMA %8.3f, static order %8.3f) | GEMMs alone %8.3f ms (rank 0, "
      "%lld rows, %.0f TF/s) | fused/GEMMs %.2f%s%s\n",
      (long long)H, (long long)I, (long long)s.E, (long long)k, (long long)T, (long long)s.R, ctas, c.comm_sms,
      (long long)c.minibatch_rows, (long long)c.ring_rows, t_fused, t_every_mma, t_static, t_gemms, (long long)used,
      flops / (t_gemms * 1e-3) / 1e12, t_fused / t_gemms, status.empty() ? "" : " | ", status.c_str());

  const char* fp8_env = std::getenv("MOK_MK_TIMING_FP8");
  if (fp8_env == nullptr || std::atoi(fp8_env) == 0) return;
  if (H % 128 != 0 || I % 128 != 0) {
    std::printf("  fp8: skipped (H and I must be multiples of 128)\n");
    return;
  }
  // The fp8 forward: its own buffers, the weights quantized on the GPU.
  struct Fp8Rank {
    uint8_t *wg, *wu, *wd;
    float *sg, *su, *sd;
    std::unique_ptr<mok::cuda::FusedBuffers> buffers;
  };
  std::vector<Fp8Rank> q(R);
  for (int r = 0; r < R; ++r) {
    Fp8Rank& f = q[r];
    f.wg = device<uint8_t>(El * I * H);
    f.wu = device<uint8_t>(El * I * H);
    f.wd = device<uint8_t>(El * H * I);
    f.sg = device<float>(El * (I / 128) * (H / 128));
    f.su = device<float>(El * (I / 128) * (H / 128));
    f.sd = device<float>(El * (H / 128) * (I / 128));
    mok::cuda::quantize_blocks_e4m3(ranks[r].wg, El, I, H, f.wg, f.sg, nullptr);
    mok::cuda::quantize_blocks_e4m3(ranks[r].wu, El, I, H, f.wu, f.su, nullptr);
    mok::cuda::quantize_blocks_e4m3(ranks[r].wd, El, H, I, f.wd, f.sd, nullptr);
    f.buffers = std::make_unique<mok::cuda::FusedBuffers>(shape, H, I, c.minibatch_rows, c.ring_rows, false, true);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  auto fused_fp8 = [&]() {
    ++epoch;
    for (int r = 0; r < R; ++r) {
      const Fp8Rank& f = q[r];
      mok::cuda::MoeForwardArgs a;
      a.rank = r;
      a.bases = bases.data();
      f.buffers->wire(a);
      a.w_gate = f.wg;
      a.w_up = f.wu;
      a.w_down = f.wd;
      a.w_gate_scales = f.sg;
      a.w_up_scales = f.su;
      a.w_down_scales = f.sd;
      a.epoch = epoch;
      a.num_sms = ctas;
      a.y = ranks[r].y;
      a.comm_ctas = c.comm_sms;
      mok::cuda::moe_forward(a, ranks[r].stream);
    }
    for (int r = 0; r < R; ++r) CHECK_CUDA(cudaStreamSynchronize(ranks[r].stream));
  };
  // Rounds alternating which goes first (the clocks drift under the power cap).
  std::vector<float> bf16_times, fp8_times, alt_times;
  const char* ab = std::getenv("MOK_MK_TIMING_FP8_AB");  // MOK_EXPERIMENT_SKIP of a third variant (timing builds)
  const int variants = ab != nullptr ? 3 : 2;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < variants; ++i) {
      const int v = (i + round) % variants;
      if (v == 0) {
        bf16_times.push_back(time_ms(fused, 10, /*warmup=*/2));
      } else if (v == 1) {
        fp8_times.push_back(time_ms(fused_fp8, 10, /*warmup=*/2));
      } else {
        const char* before = std::getenv("MOK_EXPERIMENT_SKIP");
        const std::string saved = before != nullptr ? before : "";
        setenv("MOK_EXPERIMENT_SKIP", ab, 1);
        alt_times.push_back(time_ms(fused_fp8, 10, /*warmup=*/2));
        setenv("MOK_EXPERIMENT_SKIP", saved.c_str(), 1);
      }
    }
  }
  std::sort(bf16_times.begin(), bf16_times.end());
  std::sort(fp8_times.begin(), fp8_times.end());
  if (!alt_times.empty()) {
    std::sort(alt_times.begin(), alt_times.end());
    std::printf("  fp8 fused with MOK_EXPERIMENT_SKIP=%s: %8.3f ms (sorted %8.3f %8.3f %8.3f)\n", ab, alt_times[1],
                alt_times[0], alt_times[1], alt_times[2]);
  }
  CHECK_CUDA(cudaMemcpy(words, q[0].buffers->status(), sizeof words, cudaMemcpyDeviceToHost));
  const std::string fp8_status = mok::cuda::describe_wait_status(words);
  // The fp8 GEMMs alone on rank 0's rows (the same schedule: the same routing), with the same CTAs.
  uint8_t* x8 = device<uint8_t>(cap * H);
  uint8_t* h8 = device<uint8_t>(cap * I);
  float* x_scales = device<float>(H / 128 * cap);
  float* h_scales = device<float>(I / 128 * cap);
  mok::cuda::quantize_rows_e4m3_k_major(x_rows, cap, H, x8, x_scales, s0.expert_offsets + El, nullptr);
  mok::cuda::ExpertsForwardFp8Args e8;
  e8.row_capacity = cap;
  e8.hidden = H;
  e8.intermediate = I;
  e8.local_experts = El;
  e8.expert_offsets = s0.expert_offsets;
  e8.x = x8;
  e8.x_scales = x_scales;
  e8.w_gate = q[0].wg;
  e8.w_gate_scales = q[0].sg;
  e8.w_up = q[0].wu;
  e8.w_up_scales = q[0].su;
  e8.w_down = q[0].wd;
  e8.w_down_scales = q[0].sd;
  e8.h = h;
  e8.h_codes = h8;
  e8.h_scales = h_scales;
  e8.y = y_rows;
  e8.status = st;
  e8.num_sms = ctas;
  const float t_gemms8 = time_ms([&] { mok::cuda::experts_forward_fp8(e8, nullptr); }, 10, /*warmup=*/2);
  std::printf("  fp8 fused %8.3f ms (sorted %8.3f %8.3f %8.3f) | bf16 fused %8.3f ms | fp8/bf16 speed %.3fx | fp8 "
              "GEMMs alone %8.3f ms (%.0f TF/s) | fp8 fused/GEMMs %.2f%s%s\n",
              fp8_times[1], fp8_times[0], fp8_times[1], fp8_times[2], bf16_times[1], bf16_times[1] / fp8_times[1],
              t_gemms8, flops / (t_gemms8 * 1e-3) / 1e12, fp8_times[1] / t_gemms8, fp8_status.empty() ? "" : " | ",
              fp8_status.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  // Groups of 8 arguments: H I E k T R minibatch comm (0 = the planner's choice).
  std::vector<Shape> shapes;
  for (int i = 1; i + 7 < argc; i += 8) {
    Shape s;
    int64_t* fields[8] = {&s.H, &s.I, &s.E, &s.k, &s.T, &s.R, &s.minibatch, &s.comm};
    for (int f = 0; f < 8; ++f) *fields[f] = std::atoll(argv[i + f]);
    shapes.push_back(s);
  }
  if (shapes.empty()) {
    shapes = {{7168, 2048, 384, 8, 4096, 1}, {7168, 2048, 384, 8, 4096, 2}, {2048, 768, 128, 8, 8192, 1},
              {2880, 2880, 128, 4, 8192, 1}, {4096, 14336, 8, 2, 4096, 1}};
  }
  for (const Shape& s : shapes) run(s);
  return 0;
}
