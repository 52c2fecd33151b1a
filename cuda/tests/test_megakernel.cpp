// The fused forward (megakernel.h) against the CPU reference of the whole layer, with R ranks:
// on one GPU (each rank its own stream and a share of the SMs, run concurrently) and on several
// GPUs with peer access when the machine has them. Outputs are poisoned first; reruns and other
// minibatch / ring / comm sizes must give the same bits; a rank that never launches must end in a
// named timeout, not a hang.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "mok/core/bf16.h"
#include "mok/core/compare.h"
#include "mok/core/problem.h"
#include "mok/core/reference.h"
#include "mok/core/symmetric_layout.h"
#include "mok/cuda/expert_kernels.h"
#include "mok/cuda/fp8.h"
#include "mok/cuda/megakernel.h"

namespace mok::test {
namespace {

struct RunConfig {
  int64_t minibatch_rows = 128;
  int64_t ring_slots = 2;
  int comm_ctas = 0;
  bool own_gpus = false;  // one GPU per rank (else every rank on GPU 0, sharing its SMs)
  double timeout_s = 5.0;
  std::vector<int> launch;  // ranks that launch (empty = all)
  bool backward = false;    // keep the rows (ring = capacity) and run moe_backward after each forward
  bool bf16_grads = false;  // the backward writes bf16 weight gradients (Outputs gets their values)
  bool stage_backward = false;  // the backward's stage kernels instead of its megakernel
  bool replay = false;  // with backward: the forward keeps only its schedule (ring_slots minibatches,
                        // no g|u) and the backward replays the rows (MoeBackwardArgs::replay)
  bool rank1_other_call = false;  // rank 1 calls with another swiglu_limit (a call the others do not make)
  bool rank1_replays = false;     // with backward: only rank 1's backward replays (another call too)
  const std::vector<std::vector<float>>* dy = nullptr;  // [R][T*H], for the backward
  bool capture = false;  // every call is made inside a CUDA graph capture of its stream (then dropped)
  // Each rank's forward (and backward) captured once into CUDA graphs, with the buffers' epoch
  // counter, and the graphs launched on every run instead of the calls.
  bool graph = false;
  int rank1_graph_runs = -1;  // with graph: rank 1 launches its graphs only on runs 1..this (-1: all)
  bool claim_tasks = true;          // both passes' claim_tasks (false: the static order c + j CTAs)
  bool skip_padding_halves = true;  // both passes' skip_padding_halves
  bool fp8 = false;  // the block-scaled fp8 forward (weights quantized on the GPU; its backward: fp8_forward)
  bool fp8_dgrad = false;  // with fp8 and backward: Precision::fp8_dgrad's backward (stage kernels, e4m3 data gradients)
  // With stage_backward: the dx GEMM writes its rows (MoeBackwardArgs::dx_rows) and the scatter
  // kernel copies them into their slots (MOK_EXPERIMENT_DX_SCATTER=kernel), instead of the GEMM's push.
  bool scatter_kernel = false;
  bool dx_rows_given = true;  // with scatter_kernel: MoeBackwardArgs::dx_rows set (false: refused by name)
  // Each forward's schedule built first in a call of its own (moe_schedule, one more epoch), and the
  // forward run on it (schedule_given): the explicit passes' build_schedule and forward. Not with graph.
  bool schedule_first = false;
  // With schedule_first: after its schedule call each rank's topk_idx is replaced by another routing
  // (every id + 1 mod E; the original is written back before the next schedule call), so a forward
  // that built its schedule again instead of running on the given one would compute other rows.
  bool scramble_after_schedule = false;

  bool replays(int rank) const { return replay || (rank1_replays && rank == 1); }
};

// A CUDA graph capture of a stream for the scope (when `on`); the graph is dropped, not run.
struct Capture {
  cudaStream_t stream;
  bool on;
  Capture(bool on_, cudaStream_t s) : stream(s), on(on_) {
    if (on) EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  }
  ~Capture() {
    if (!on) return;
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
};

// A stream's calls captured into an instantiated CUDA graph (the calls run only when it is launched).
struct CapturedGraph {
  cudaGraphExec_t exec = nullptr;
  ~CapturedGraph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
  template <class Calls>
  void capture(cudaStream_t stream, const Calls& calls) {
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    try {
      calls();
    } catch (...) {
      cudaGraph_t dropped = nullptr;
      cudaStreamEndCapture(stream, &dropped);
      if (dropped != nullptr) cudaGraphDestroy(dropped);
      throw;
    }
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  }
};

// Everything one rank owns on its device.
struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<DeviceBuffer<uint8_t>> symmetric;
  std::unique_ptr<DeviceBuffer<uint16_t>> w_gate, w_up, w_down, gu, y;
  std::unique_ptr<DeviceBuffer<uint16_t>> replay_x, replay_h;  // replay: the backward's rows
  std::unique_ptr<cuda::FusedBuffers> buffers;  // schedule, ring, counters, statuses, backward scratch
  // The backward's outputs.
  std::unique_ptr<DeviceBuffer<uint16_t>> dx, dx_rows;  // dx_rows: scatter_kernel's
  std::unique_ptr<DeviceBuffer<float>> d_topk_w, dwg, dwu, dwd;
  std::unique_ptr<DeviceBuffer<uint16_t>> dwg16, dwu16, dwd16;  // bf16_grads
  // fp8: the weights' e4m3 codes and 128 x 128 block scales.
  std::unique_ptr<DeviceBuffer<uint8_t>> wg8, wu8, wd8;
  std::unique_ptr<DeviceBuffer<float>> wg_scales, wu_scales, wd_scales;
  // fp8_dgrad: W_down^T and [W_gate^T | W_up^T] in e4m3 with their scales, and the scratch.
  std::unique_ptr<DeviceBuffer<uint8_t>> wd_t8, wgu_t8, dgrad_scratch;
  std::unique_ptr<DeviceBuffer<float>> wd_t_scales, wgu_t_scales;
  // scramble_after_schedule: the rank's routing and the other one.
  std::unique_ptr<DeviceBuffer<int32_t>> routing, scrambled;
};

// A weight [El, rows, cols] (bf16 on the device) as e4m3 codes and block scales, on the GPU.
void quantize_weight(const DeviceBuffer<uint16_t>& w, int64_t El, int64_t rows, int64_t cols,
                     std::unique_ptr<DeviceBuffer<uint8_t>>& codes, std::unique_ptr<DeviceBuffer<float>>& scales) {
  codes = std::make_unique<DeviceBuffer<uint8_t>>(size_t(El * rows * cols));
  scales = std::make_unique<DeviceBuffer<float>>(size_t(El * (rows / 128) * (cols / 128)));
  cuda::quantize_blocks_e4m3(w.ptr, El, rows, cols, codes->ptr, scales->ptr, nullptr);
}

struct Outputs {
  std::vector<uint32_t> epochs;               // per rank, its epoch counter after the runs (graph)
  std::vector<std::vector<uint16_t>> y;       // [R][T*H]
  std::vector<std::vector<uint16_t>> gu;      // [R][rows*2I], rows [0, offsets[El])
  std::vector<int> padding_halves;            // per rank, the 128-row blocks whose last 64 rows are all padding
  std::vector<std::string> errors;            // per rank, "" = fine
  // With the backward: per rank dx [T*H] bf16 bits, d topk_w [T*k]; weight gradients of all E
  // experts in rank order (as the reference's d_routed).
  std::vector<std::vector<uint16_t>> dx;
  std::vector<std::vector<float>> d_topk_w;
  std::vector<float> dwg, dwu, dwd;
};

template <class T>
std::vector<T> slice(const std::vector<T>& v, size_t begin, size_t count) {
  return std::vector<T>(v.begin() + begin, v.begin() + begin + count);
}

// Runs the forward `runs` times (epochs 1..runs) on the inputs; returns the last run's outputs.
Outputs run_forward(const ref::LayerInputs<float>& in, const RunConfig& cfg, int runs) {
  const MoeDesc& d = in.desc;
  const int R = int(d.ranks);
  const int64_t T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk, El = d.local_experts();
  cuda::RoutingShape shape{R, T, k, d.num_experts};
  const int64_t capacity = cuda::routed_row_capacity(shape);
  const SymmetricLayout layout = SymmetricLayout::make(T, H, k, R);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  // Ranks sharing one GPU split its SMs and leave one per rank free: a rank's small kernels (its
  // combine wait spins until the others finish) must not hold an SM another rank's megakernel needs.
  const int ctas = cfg.own_gpus || R == 1 ? sms : sms / R - 1;

  std::vector<Rank> ranks(R);
  std::vector<void*> bases(R);
  for (int r = 0; r < R; ++r) {
    Rank& rk = ranks[r];
    rk.device = cfg.own_gpus ? r : 0;
    cudaSetDevice(rk.device);
    cudaStreamCreateWithFlags(&rk.stream, cudaStreamNonBlocking);
    rk.symmetric = std::make_unique<DeviceBuffer<uint8_t>>(layout.total);
    cudaMemset(rk.symmetric->ptr, 0, layout.total);
    bases[r] = rk.symmetric->ptr;
    auto bf = [](int64_t n) { return std::make_unique<DeviceBuffer<uint16_t>>(size_t(n)); };
    rk.w_gate = bf(El * I * H);
    rk.w_up = bf(El * I * H);
    rk.w_down = bf(El * H * I);
    rk.w_gate->upload(to_bits(slice(in.routed.gate, r * El * I * H, El * I * H)));
    rk.w_up->upload(to_bits(slice(in.routed.up, r * El * I * H, El * I * H)));
    rk.w_down->upload(to_bits(slice(in.routed.down, r * El * H * I, El * H * I)));
    const int64_t all_rows = (capacity + cfg.minibatch_rows - 1) / cfg.minibatch_rows * cfg.minibatch_rows;
    const int64_t ring = cfg.backward && !cfg.replay ? all_rows : cfg.minibatch_rows * cfg.ring_slots;
    rk.buffers = std::make_unique<cuda::FusedBuffers>(shape, H, I, cfg.minibatch_rows, ring, cfg.backward, cfg.fp8);
    if (cfg.fp8) {
      quantize_weight(*rk.w_gate, El, I, H, rk.wg8, rk.wg_scales);
      quantize_weight(*rk.w_up, El, I, H, rk.wu8, rk.wu_scales);
      quantize_weight(*rk.w_down, El, H, I, rk.wd8, rk.wd_scales);
      cudaMemset(rk.buffers->ring_h_codes(), 0xff, size_t(ring * I));  // e4m3 NaN
      cudaMemset(rk.buffers->ring_x_scales(), 0xff, size_t(H / 128 * ring * 4));
      cudaMemset(rk.buffers->ring_h_scales(), 0xff, size_t(I / 128 * ring * 4));
    }
    if (cfg.fp8_dgrad) {
      rk.wd_t8 = std::make_unique<DeviceBuffer<uint8_t>>(size_t(El * I * H));
      rk.wd_t_scales = std::make_unique<DeviceBuffer<float>>(size_t(El * (I / 128) * (H / 128)));
      rk.wgu_t8 = std::make_unique<DeviceBuffer<uint8_t>>(size_t(El * H * 2 * I));
      rk.wgu_t_scales = std::make_unique<DeviceBuffer<float>>(size_t(El * (H / 128) * (2 * I / 128)));
      cuda::quantize_dgrad_weights(rk.w_gate->ptr, rk.w_up->ptr, rk.w_down->ptr, El, H, I, rk.wd_t8->ptr,
                                   rk.wd_t_scales->ptr, rk.wgu_t8->ptr, rk.wgu_t_scales->ptr, nullptr);
      rk.dgrad_scratch = std::make_unique<DeviceBuffer<uint8_t>>(size_t(cuda::fp8_dgrad_scratch_bytes(capacity, H, I)));
      rk.dgrad_scratch->poison();
    }
    rk.gu = bf(capacity * 2 * I);
    rk.y = bf(T * H);
    rk.gu->poison();
    rk.y->poison();
    cudaMemset(rk.buffers->ring_x(), 0xff, size_t(ring * H * 2));  // rows the dispatch does not write stay NaN
    cudaMemset(rk.buffers->ring_h(), 0xff, size_t(ring * I * 2));
    if (cfg.backward) {
      auto poisoned = [](auto buffer) {  // outputs start as NaN
        buffer->poison();
        return buffer;
      };
      auto f32 = [](int64_t n) { return std::make_unique<DeviceBuffer<float>>(size_t(n)); };
      if (cfg.replays(r)) {
        rk.replay_x = poisoned(bf(all_rows * H));
        rk.replay_h = poisoned(bf(all_rows * I));
      }
      rk.dx = poisoned(bf(T * H));
      if (cfg.scatter_kernel) rk.dx_rows = poisoned(bf(capacity * H));
      rk.d_topk_w = poisoned(f32(T * k));
      rk.dwg = poisoned(f32(El * I * H));
      rk.dwu = poisoned(f32(El * I * H));
      rk.dwd = poisoned(f32(El * H * I));
      if (cfg.bf16_grads) {
        rk.dwg16 = poisoned(bf(El * I * H));
        rk.dwu16 = poisoned(bf(El * I * H));
        rk.dwd16 = poisoned(bf(El * H * I));
      }
      std::vector<uint16_t> dy = to_bits((*cfg.dy)[r]);
      cudaMemcpy(SymmetricLayout::at<void>(bases[r], layout.dy), dy.data(), dy.size() * 2, cudaMemcpyHostToDevice);
    }
    // The rank's inputs in its symmetric buffer.
    std::vector<uint16_t> x = to_bits(in.x[r]);
    cudaMemcpy(SymmetricLayout::at<void>(bases[r], layout.x), x.data(), x.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(SymmetricLayout::at<void>(bases[r], layout.topk_idx), in.topk_idx[r].data(), T * k * 4,
               cudaMemcpyHostToDevice);
    cudaMemcpy(SymmetricLayout::at<void>(bases[r], layout.topk_w), in.topk_w[r].data(), T * k * 4,
               cudaMemcpyHostToDevice);
    if (cfg.scramble_after_schedule) {
      std::vector<int32_t> other(in.topk_idx[r].begin(), in.topk_idx[r].end());
      for (int32_t& e : other)
        if (e >= 0) e = int32_t((e + 1) % d.num_experts);
      rk.routing = std::make_unique<DeviceBuffer<int32_t>>(size_t(T * k));
      rk.scrambled = std::make_unique<DeviceBuffer<int32_t>>(size_t(T * k));
      rk.routing->upload(std::vector<int32_t>(in.topk_idx[r].begin(), in.topk_idx[r].end()));
      rk.scrambled->upload(other);
    }
  }
  if (cfg.own_gpus) {
    for (int r = 0; r < R; ++r) {
      cudaSetDevice(r);
      for (int s = 0; s < R; ++s) {
        if (s == r) continue;
        const cudaError_t e = cudaDeviceEnablePeerAccess(s, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
          ADD_FAILURE() << "peer access " << r << " -> " << s << ": " << cudaGetErrorString(e);
      }
      cudaGetLastError();  // "already enabled" is fine
    }
  }
  for (int r = 0; r < R; ++r) {  // every device's kernels loaded before any rank spins
    cudaSetDevice(ranks[r].device);
    cuda::preload_kernels();
  }
  std::vector<bool> launches(R, cfg.launch.empty());
  for (int r : cfg.launch) launches[r] = true;

  Outputs out;
  out.errors.assign(R, "");
  std::vector<CapturedGraph> forward_graphs(R), backward_graphs(R);
  // Graph mode: whether rank r launches its graphs on this run.
  auto replays = [&](int r, int run) { return r != 1 || cfg.rank1_graph_runs < 0 || run <= cfg.rank1_graph_runs; };
  for (int run = 1; run <= runs; ++run) {
    for (int r = 0; r < R; ++r) {
      if (!launches[r]) continue;
      Rank& rk = ranks[r];
      cudaSetDevice(rk.device);
      cuda::MoeForwardArgs a;
      a.rank = r;
      a.bases = bases.data();
      a.w_gate = rk.w_gate->ptr;
      a.w_up = rk.w_up->ptr;
      a.w_down = rk.w_down->ptr;
      rk.buffers->wire(a);  // shape, schedule, ring, counters, statuses (and fp8's buffers)
      if (cfg.fp8) {
        a.w_gate = rk.wg8->ptr;
        a.w_up = rk.wu8->ptr;
        a.w_down = rk.wd8->ptr;
        a.w_gate_scales = rk.wg_scales->ptr;
        a.w_up_scales = rk.wu_scales->ptr;
        a.w_down_scales = rk.wd_scales->ptr;
      }
      a.gu = cfg.replay ? nullptr : rk.gu->ptr;
      a.y = rk.y->ptr;
      // Per run: [the schedule,] the forward[, the backward], one epoch each.
      const int calls = 1 + int(cfg.backward) + int(cfg.schedule_first);
      a.epoch = uint32_t((run - 1) * calls + 1 + int(cfg.schedule_first));
      a.comm_ctas = cfg.comm_ctas;
      a.num_sms = ctas;
      a.claim_tasks = cfg.claim_tasks;
      a.skip_padding_halves = cfg.skip_padding_halves;
      a.swiglu_limit = d.swiglu_limit;
      if (cfg.rank1_other_call && r == 1) a.swiglu_limit = d.swiglu_limit ? std::nullopt : std::optional<float>(0.5f);
      a.timeout_s = cfg.timeout_s;
      try {
        if (cfg.graph) {
          a.epoch_counter = rk.buffers->epoch_counter();
          if (run == 1) forward_graphs[r].capture(rk.stream, [&] { cuda::moe_forward(a, rk.stream); });
          if (replays(r, run) && forward_graphs[r].exec != nullptr)
            EXPECT_EQ(cudaGraphLaunch(forward_graphs[r].exec, rk.stream), cudaSuccess);
        } else {
          Capture capture(cfg.capture, rk.stream);
          if (cfg.schedule_first) {
            void* topk_idx = SymmetricLayout::at<void>(bases[r], layout.topk_idx);
            const size_t bytes = size_t(T * k) * 4;
            if (cfg.scramble_after_schedule)  // (stream-ordered: no peer reads it before this call's start barrier)
              cudaMemcpyAsync(topk_idx, rk.routing->ptr, bytes, cudaMemcpyDeviceToDevice, rk.stream);
            cuda::MoeForwardArgs schedule = a;
            schedule.epoch = a.epoch - 1;
            cuda::moe_schedule(schedule, rk.stream);
            if (cfg.scramble_after_schedule)  // (after the end barrier: every peer has read it)
              cudaMemcpyAsync(topk_idx, rk.scrambled->ptr, bytes, cudaMemcpyDeviceToDevice, rk.stream);
            a.schedule_given = true;
          }
          cuda::moe_forward(a, rk.stream);
        }
      } catch (const std::exception& e) {
        out.errors[r] += std::string("launch: ") + e.what() + "; ";
      }
    }
    for (int r = 0; r < R && cfg.backward; ++r) {
      if (!launches[r]) continue;
      Rank& rk = ranks[r];
      cudaSetDevice(rk.device);
      cuda::MoeBackwardArgs b;
      b.rank = r;
      b.bases = bases.data();
      b.w_gate = rk.w_gate->ptr;
      b.w_up = rk.w_up->ptr;
      b.w_down = rk.w_down->ptr;
      rk.buffers->wire(b);  // the forward's schedule and rows (the ring holds every row), the scratch
      b.gu = rk.gu->ptr;
      b.claim_tasks = cfg.claim_tasks;
      b.skip_padding_halves = cfg.skip_padding_halves;
      if (cfg.replays(r)) {  // rows rebuilt from every rank's x, still in its symmetric buffer
        b.replay = true;
        b.x_rows = rk.replay_x->ptr;
        b.h = rk.replay_h->ptr;
        if (cfg.fp8) {  // the fp8 gate|up runs again on the pulled rows
          b.w_gate_codes = rk.wg8->ptr;
          b.w_gate_scales = rk.wg_scales->ptr;
          b.w_up_codes = rk.wu8->ptr;
          b.w_up_scales = rk.wu_scales->ptr;
        }
      }
      b.d_w_gate = rk.dwg->ptr;
      b.d_w_up = rk.dwu->ptr;
      b.d_w_down = rk.dwd->ptr;
      if (cfg.bf16_grads) {
        b.d_w_gate = rk.dwg16->ptr;
        b.d_w_up = rk.dwu16->ptr;
        b.d_w_down = rk.dwd16->ptr;
        b.d_w_type = cuda::GradType::bf16;
      }
      b.dx = rk.dx->ptr;
      if (cfg.scatter_kernel && cfg.dx_rows_given) b.dx_rows = rk.dx_rows->ptr;
      b.d_topk_w = rk.d_topk_w->ptr;
      b.epoch = uint32_t((run - 1) * (2 + int(cfg.schedule_first)) + 2 + int(cfg.schedule_first));
      b.num_sms = ctas;
      b.fused = !cfg.stage_backward;
      if (cfg.fp8_dgrad) {
        b.fp8_dgrad = true;
        b.w_down_t_codes = rk.wd_t8->ptr;
        b.w_down_t_scales = rk.wd_t_scales->ptr;
        b.w_gate_up_t_codes = rk.wgu_t8->ptr;
        b.w_gate_up_t_scales = rk.wgu_t_scales->ptr;
        b.fp8_dgrad_scratch = rk.dgrad_scratch->ptr;
      }
      b.swiglu_limit = d.swiglu_limit;
      b.timeout_s = cfg.timeout_s;
      try {
        if (cfg.graph) {
          b.epoch_counter = rk.buffers->epoch_counter();
          if (run == 1) backward_graphs[r].capture(rk.stream, [&] { cuda::moe_backward(b, rk.stream); });
          if (replays(r, run) && backward_graphs[r].exec != nullptr)
            EXPECT_EQ(cudaGraphLaunch(backward_graphs[r].exec, rk.stream), cudaSuccess);
        } else {
          Capture capture(cfg.capture, rk.stream);
          const SwitchEnv scatter("MOK_EXPERIMENT_DX_SCATTER", cfg.scatter_kernel ? "kernel" : "");
          cuda::moe_backward(b, rk.stream);
        }
      } catch (const std::exception& e) {
        out.errors[r] += std::string("launch backward: ") + e.what() + "; ";
      }
    }
    for (int r = 0; r < R; ++r) {
      if (!launches[r]) continue;
      cudaSetDevice(ranks[r].device);
      const cudaError_t e = cudaStreamSynchronize(ranks[r].stream);
      if (e != cudaSuccess) out.errors[r] += std::string("CUDA error: ") + cudaGetErrorString(e) + "; ";
    }
  }
  for (int r = 0; r < R; ++r) {
    Rank& rk = ranks[r];
    cudaSetDevice(rk.device);
    uint32_t epoch = 0;
    cudaMemcpy(&epoch, rk.buffers->epoch_counter(), 4, cudaMemcpyDeviceToHost);
    out.epochs.push_back(epoch);
    if (launches[r]) {
      int32_t words[cuda::kFailureWords];
      cudaMemcpy(words, rk.buffers->status(), sizeof words, cudaMemcpyDeviceToHost);
      out.errors[r] += cuda::describe_wait_status(words);
      cuda::RoutingStatus rs;
      cudaMemcpy(&rs, rk.buffers->routing_status(), sizeof(rs), cudaMemcpyDeviceToHost);
      const std::string bad = cuda::describe(rs, shape);
      if (!bad.empty()) out.errors[r] += bad;
    }
    out.y.push_back(rk.y->download());
    if (cfg.backward) {
      out.dx.push_back(rk.dx->download());
      out.d_topk_w.push_back(rk.d_topk_w->download());
      auto append = [](std::vector<float>& to, const std::vector<float>& v) { to.insert(to.end(), v.begin(), v.end()); };
      append(out.dwg, cfg.bf16_grads ? from_bits(rk.dwg16->download()) : rk.dwg->download());
      append(out.dwu, cfg.bf16_grads ? from_bits(rk.dwu16->download()) : rk.dwu->download());
      append(out.dwd, cfg.bf16_grads ? from_bits(rk.dwd16->download()) : rk.dwd->download());
      int32_t experts = 0;
      cudaMemcpy(&experts, rk.buffers->experts_status(), 4, cudaMemcpyDeviceToHost);
      if (experts != 0) out.errors[r] += "expert backward status nonzero; ";
    }
    std::vector<int32_t> offsets(size_t(El + 1));
    cudaMemcpy(offsets.data(), rk.buffers->expert_offsets(), offsets.size() * 4, cudaMemcpyDeviceToHost);
    std::vector<uint16_t> gu = rk.gu->download();
    gu.resize(size_t(std::max(0, offsets[El])) * 2 * I);
    out.gu.push_back(gu);
    cuda::MoeForwardArgs wired;
    rk.buffers->wire(wired);
    std::vector<int32_t> rows(static_cast<size_t>(El));
    cudaMemcpy(rows.data(), wired.expert_rows, rows.size() * 4, cudaMemcpyDeviceToHost);
    int halves = 0;
    for (int32_t n : rows) halves += n % 128 != 0 && n % 128 <= 64;
    out.padding_halves.push_back(halves);
    cudaStreamDestroy(rk.stream);
  }
  return out;
}

// The same forward through the separate stage kernels (schedule, gather, expert GEMMs, scatter,
// combine) on one GPU: the fused forward must equal it bit for bit (same tiles, same k order,
// same epilogues), so any difference is a fusion bug, not rounding. fp8: the gathered rows and
// the weights quantized on the GPU, then experts_forward_fp8.
std::vector<std::vector<uint16_t>> staged_forward(const ref::LayerInputs<float>& in, bool fp8 = false) {
  const MoeDesc& d = in.desc;
  const int R = int(d.ranks);
  const int64_t T = d.tokens_per_rank, H = d.hidden, I = d.intermediate, k = d.topk, El = d.local_experts();
  const cuda::RoutingShape shape{R, T, k, d.num_experts};
  const int64_t cap = cuda::routed_row_capacity(shape);
  cudaSetDevice(0);
  std::vector<DeviceBuffer<uint16_t>> x, slots;
  std::vector<DeviceBuffer<int32_t>> idx;
  std::vector<DeviceBuffer<float>> w;
  std::vector<const int32_t*> idx_ptrs;
  std::vector<const void*> x_ptrs;
  std::vector<void*> slot_ptrs;
  for (int r = 0; r < R; ++r) {
    x.emplace_back(size_t(T * H));
    x.back().upload(to_bits(in.x[r]));
    idx.emplace_back(size_t(T * k));
    idx.back().upload(in.topk_idx[r]);
    w.emplace_back(size_t(T * k));
    w.back().upload(in.topk_w[r]);
    slots.emplace_back(size_t(T * k * H));
  }
  for (int r = 0; r < R; ++r) {
    idx_ptrs.push_back(idx[r].ptr);
    x_ptrs.push_back(x[r].ptr);
    slot_ptrs.push_back(slots[r].ptr);
  }
  for (int dst = 0; dst < R; ++dst) {
    DeviceBuffer<int32_t> offsets(El + 1), rows(El), src_rank(cap), src_slot(cap), status(1);
    DeviceBuffer<uint8_t> workspace(size_t(cuda::schedule_workspace_bytes(shape)));
    DeviceBuffer<cuda::RoutingStatus> rstatus(1);
    cudaMemset(rstatus.ptr, 0, sizeof(cuda::RoutingStatus));
    cudaMemset(status.ptr, 0, 4);
    cuda::ScheduleArgs sa;
    sa.shape = shape;
    sa.dest_rank = dst;
    sa.topk_idx = idx_ptrs.data();
    sa.expert_offsets = offsets.ptr;
    sa.expert_rows = rows.ptr;
    sa.src_rank = src_rank.ptr;
    sa.src_slot = src_slot.ptr;
    sa.row_capacity = cap;
    sa.workspace = workspace.ptr;
    sa.status = rstatus.ptr;
    cuda::build_schedule(sa, nullptr);
    DeviceBuffer<uint16_t> x_rows(cap * H), h(cap * I), gu(cap * 2 * I), y_rows(cap * H);
    DeviceBuffer<uint16_t> wg(El * I * H), wu(El * I * H), wd(El * H * I);
    wg.upload(to_bits(slice(in.routed.gate, dst * El * I * H, El * I * H)));
    wu.upload(to_bits(slice(in.routed.up, dst * El * I * H, El * I * H)));
    wd.upload(to_bits(slice(in.routed.down, dst * El * H * I, El * H * I)));
    const cuda::ScheduleView view{El, cap, offsets.ptr, src_rank.ptr, src_slot.ptr};
    cuda::GatherArgs g;
    g.shape = shape;
    g.hidden = H;
    g.schedule = view;
    g.x = x_ptrs.data();
    g.rows = x_rows.ptr;
    cuda::gather_rows(g, nullptr);
    if (fp8) {
      DeviceBuffer<uint8_t> x8(size_t(cap * H)), h8(size_t(cap * I));
      DeviceBuffer<float> x_scales(size_t(H / 128 * cap)), h_scales(size_t(I / 128 * cap));
      std::unique_ptr<DeviceBuffer<uint8_t>> wg8, wu8, wd8;
      std::unique_ptr<DeviceBuffer<float>> sg, su, sd;
      quantize_weight(wg, El, I, H, wg8, sg);
      quantize_weight(wu, El, I, H, wu8, su);
      quantize_weight(wd, El, H, I, wd8, sd);
      cuda::quantize_rows_e4m3_k_major(x_rows.ptr, cap, H, x8.ptr, x_scales.ptr, offsets.ptr + El, nullptr);
      cuda::ExpertsForwardFp8Args e;
      e.row_capacity = cap;
      e.hidden = H;
      e.intermediate = I;
      e.local_experts = El;
      e.expert_offsets = offsets.ptr;
      e.x = x8.ptr;
      e.x_scales = x_scales.ptr;
      e.w_gate = wg8->ptr;
      e.w_gate_scales = sg->ptr;
      e.w_up = wu8->ptr;
      e.w_up_scales = su->ptr;
      e.w_down = wd8->ptr;
      e.w_down_scales = sd->ptr;
      e.gu = gu.ptr;
      e.h = h.ptr;
      e.h_codes = h8.ptr;
      e.h_scales = h_scales.ptr;
      e.y = y_rows.ptr;
      e.swiglu_limit = d.swiglu_limit;
      e.status = status.ptr;
      cuda::experts_forward_fp8(e, nullptr);
      cudaDeviceSynchronize();
    } else {
      cuda::ExpertsForwardArgs e;
      e.row_capacity = cap;
      e.hidden = H;
      e.intermediate = I;
      e.local_experts = El;
      e.expert_offsets = offsets.ptr;
      e.x = x_rows.ptr;
      e.w_gate = wg.ptr;
      e.w_up = wu.ptr;
      e.w_down = wd.ptr;
      e.gu = gu.ptr;
      e.h = h.ptr;
      e.y = y_rows.ptr;
      e.swiglu_limit = d.swiglu_limit;
      e.status = status.ptr;
      cuda::experts_forward(e, nullptr);
    }
    cuda::ScatterArgs sc;
    sc.shape = shape;
    sc.hidden = H;
    sc.schedule = view;
    sc.rows = y_rows.ptr;
    sc.slots = slot_ptrs.data();
    cuda::scatter_rows(sc, nullptr);
    cudaDeviceSynchronize();
  }
  std::vector<std::vector<uint16_t>> y;
  for (int r = 0; r < R; ++r) {
    DeviceBuffer<uint16_t> out(size_t(T * H));
    cuda::CombineArgs c;
    c.tokens = T;
    c.hidden = H;
    c.topk = k;
    c.slots = slots[r].ptr;
    c.topk_w = w[r].ptr;
    c.topk_idx = idx[r].ptr;  // empty slots: no row wrote them
    c.y = out.ptr;
    cuda::combine_epilogue(c, nullptr);
    cudaDeviceSynchronize();
    y.push_back(out.download());
  }
  return y;
}

struct Case {
  const char* name;
  MoeDesc desc;
  RoutingKind routing;
};

MoeDesc desc(int64_t R, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k) {
  MoeDesc d;
  d.ranks = R;
  d.tokens_per_rank = T;
  d.hidden = H;
  d.intermediate = I;
  d.num_experts = E;
  d.topk = k;
  return d;
}

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

class Megakernel : public ::testing::TestWithParam<Case> {};

TEST_P(Megakernel, MatchesTheReferenceAndIsBitwiseStable) {
  const Case& c = GetParam();
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const auto in = make_inputs<float>(c.desc, c.routing, 1234, true);
  const auto ref = ref::layer_forward(in, ref::Rounding::bf16);
  RunConfig base;
  const Outputs first = run_forward(in, base, 3);  // reruns: epochs 1..3 over the same buffers
  for (int r = 0; r < c.desc.ranks; ++r) {
    EXPECT_EQ(first.errors[r], "") << "rank " << r;
    const Comparison cmp = compare(from_bits(first.y[r]), ref.y[r]);
    EXPECT_TRUE(cmp.within(kBf16RelTolerance)) << cmp.describe("y rank " + std::to_string(r));
    std::printf("[ %s ] rank %d rel error y %.2e\n", c.name, r, cmp.rel_error);
  }
  // The stage kernels give the same bits.
  const auto staged = staged_forward(in);
  for (int r = 0; r < c.desc.ranks; ++r)
    EXPECT_EQ(first_bit_difference(first.y[r], staged[r]), -1) << "y rank " << r << " differs from the staged path";
  // Other minibatch, ring and comm sizes, the static task order, and one more fresh run: the same bits.
  std::vector<RunConfig> others(5);
  others[0].minibatch_rows = 256, others[0].ring_slots = 1, others[0].comm_ctas = 1;
  others[1].minibatch_rows = 128, others[1].ring_slots = 64, others[1].comm_ctas = 5;
  others[2].minibatch_rows = 384, others[2].ring_slots = 3;
  others[3].claim_tasks = false;
  others[4].claim_tasks = false, others[4].minibatch_rows = 256, others[4].ring_slots = 1, others[4].comm_ctas = 2;
  for (const RunConfig& cfg : others) {
    const Outputs again = run_forward(in, cfg, 1);
    for (int r = 0; r < c.desc.ranks; ++r) {
      ASSERT_EQ(again.errors[r], "") << "rank " << r;
      EXPECT_EQ(first_bit_difference(again.y[r], first.y[r]), -1)
          << "y rank " << r << " differs with minibatch " << cfg.minibatch_rows << " x " << cfg.ring_slots << " slots"
          << (cfg.claim_tasks ? "" : ", static task order");
      EXPECT_EQ(first_bit_difference(again.gu[r], first.gu[r]), -1)
          << "g|u rank " << r << " differs with minibatch " << cfg.minibatch_rows;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, Megakernel,
    ::testing::Values(Case{"R1_balanced", desc(1, 300, 512, 256, 16, 4), RoutingKind::balanced},
                      Case{"R1_zipf_odd_widths", desc(1, 257, 520, 200, 8, 2), RoutingKind::zipf},
                      Case{"R2_uniform", desc(2, 300, 512, 256, 16, 4), RoutingKind::uniform},
                      Case{"R2_one_expert_rank1_gets_nothing", desc(2, 130, 256, 128, 8, 2), RoutingKind::one_expert},
                      Case{"R2_one_token", desc(2, 1, 256, 128, 8, 2), RoutingKind::uniform},
                      Case{"R4_zipf", desc(4, 100, 256, 384, 16, 4), RoutingKind::zipf},
                      Case{"R2_wide", desc(2, 96, 2048, 768, 16, 8), RoutingKind::uniform},
                      Case{"R2_empty_slots", desc(2, 300, 512, 256, 16, 4), RoutingKind::masked}),
    [](const auto& info) { return std::string(info.param.name); });

// The block-scaled fp8 forward (MoeForwardArgs::fp8) against the CPU oracle's fp8 layer
// (ref::layer_forward at Precision::fp8_block) within a tolerance, and bit for bit against the
// stage kernels (gather, quantize, experts_forward_fp8, scatter, combine), across reruns and
// other minibatch, ring, comm and task-order settings.
inline constexpr double kFp8LayerTolerance = 1e-2;

class MegakernelFp8 : public ::testing::TestWithParam<Case> {};

TEST_P(MegakernelFp8, MatchesTheOracleAndTheStageKernelsBitForBit) {
  const Case& c = GetParam();
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const auto in = make_inputs<float>(c.desc, c.routing, 2468, true);
  const auto ref = ref::layer_forward(in, ref::Rounding::bf16);
  RunConfig base;
  base.fp8 = true;
  const Outputs first = run_forward(in, base, 3);
  const auto staged = staged_forward(in, /*fp8=*/true);
  for (int r = 0; r < c.desc.ranks; ++r) {
    EXPECT_EQ(first.errors[r], "") << "rank " << r;
    const Comparison cmp = compare(from_bits(first.y[r]), ref.y[r]);
    EXPECT_TRUE(cmp.within(kFp8LayerTolerance)) << cmp.describe("y rank " + std::to_string(r));
    std::printf("[ %s fp8 ] rank %d rel error y %.2e against the fp8 oracle\n", c.name, r, cmp.rel_error);
    EXPECT_EQ(first_bit_difference(first.y[r], staged[r]), -1) << "y rank " << r << " differs from the staged fp8 path";
  }
  std::vector<RunConfig> others(4);
  others[0].minibatch_rows = 256, others[0].ring_slots = 1, others[0].comm_ctas = 1;
  others[1].minibatch_rows = 128, others[1].ring_slots = 64, others[1].comm_ctas = 5;
  others[2].minibatch_rows = 384, others[2].ring_slots = 3;
  others[3].claim_tasks = false, others[3].minibatch_rows = 256, others[3].ring_slots = 1, others[3].comm_ctas = 2;
  for (RunConfig cfg : others) {
    cfg.fp8 = true;
    const Outputs again = run_forward(in, cfg, 1);
    for (int r = 0; r < c.desc.ranks; ++r) {
      ASSERT_EQ(again.errors[r], "") << "rank " << r;
      EXPECT_EQ(first_bit_difference(again.y[r], first.y[r]), -1)
          << "y rank " << r << " differs with minibatch " << cfg.minibatch_rows << " x " << cfg.ring_slots << " slots"
          << ", comm CTAs " << cfg.comm_ctas << (cfg.claim_tasks ? "" : ", static task order");
      EXPECT_EQ(first_bit_difference(again.gu[r], first.gu[r]), -1)
          << "g|u rank " << r << " differs with minibatch " << cfg.minibatch_rows;
    }
  }
}

MoeDesc fp8_desc(int64_t R, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, std::optional<float> limit = {}) {
  MoeDesc d = desc(R, T, H, I, E, k);
  d.precision = Precision::fp8_block;
  d.swiglu_limit = limit;
  return d;
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, MegakernelFp8,
    ::testing::Values(Case{"R1_balanced", fp8_desc(1, 300, 512, 256, 16, 4), RoutingKind::balanced},
                      Case{"R2_uniform_limit", fp8_desc(2, 300, 512, 256, 16, 4, 7.0f), RoutingKind::uniform},
                      Case{"R2_one_expert_rank1_gets_nothing", fp8_desc(2, 130, 256, 128, 8, 2), RoutingKind::one_expert},
                      Case{"R2_one_token", fp8_desc(2, 1, 256, 128, 8, 2), RoutingKind::uniform},
                      Case{"R4_zipf", fp8_desc(4, 100, 256, 384, 16, 4), RoutingKind::zipf},
                      Case{"R2_wide", fp8_desc(2, 96, 2048, 768, 16, 8), RoutingKind::uniform},
                      Case{"R2_empty_slots", fp8_desc(2, 300, 512, 256, 16, 4), RoutingKind::masked},
                      // One expert, top-1: 300 + 127 rows of capacity, rounded up to 428 for the fp8 dgrad.
                      Case{"R1_one_expert_top1", fp8_desc(1, 300, 512, 256, 1, 1), RoutingKind::uniform}),
    [](const auto& info) { return std::string(info.param.name); });

// The backward's outputs of two runs, bit for bit: dx and d topk_w of every rank, then the weight
// gradients; `label` starts each message.
void expect_same_gradients(const Outputs& want, const Outputs& got, int ranks, const std::string& label) {
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(first_bit_difference(want.dx[r], got.dx[r]), -1) << label << ": dx rank " << r;
    EXPECT_EQ(first_bit_difference(want.d_topk_w[r], got.d_topk_w[r]), -1) << label << ": d topk_w rank " << r;
  }
  EXPECT_EQ(first_bit_difference(want.dwg, got.dwg), -1) << label << ": dW_gate";
  EXPECT_EQ(first_bit_difference(want.dwu, got.dwu), -1) << label << ": dW_up";
  EXPECT_EQ(first_bit_difference(want.dwd, got.dwd), -1) << label << ": dW_down";
}

// y (within y_tolerance), then dx, d topk_w and the weight gradients (within bf16's tolerance) of a
// run against the CPU reference's forward and backward; `label` starts each printed line.
template <class Fwd, class Bwd>
void expect_backward_near(const Outputs& a, const Fwd& fwd, const Bwd& ref, int ranks, double y_tolerance,
                          const std::string& label) {
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(a.errors[r], "") << "rank " << r;
    const Comparison y = compare(from_bits(a.y[r]), fwd.y[r]);
    const Comparison dx = compare(from_bits(a.dx[r]), ref.dx[r]);
    const Comparison dw = compare(a.d_topk_w[r], ref.d_topk_w[r]);
    EXPECT_TRUE(y.within(y_tolerance)) << y.describe("y rank " + std::to_string(r));
    EXPECT_TRUE(dx.within(kBf16RelTolerance)) << dx.describe("dx rank " + std::to_string(r));
    EXPECT_TRUE(dw.within(kBf16RelTolerance)) << dw.describe("d topk_w rank " + std::to_string(r));
    std::printf("[ %s ] rank %d rel error y %.2e dx %.2e d_topk_w %.2e\n", label.c_str(), r, y.rel_error,
                dx.rel_error, dw.rel_error);
  }
  for (const auto& [name, got, want] : {std::tuple{"dW_gate", &a.dwg, &ref.d_routed.gate},
                                        std::tuple{"dW_up", &a.dwu, &ref.d_routed.up},
                                        std::tuple{"dW_down", &a.dwd, &ref.d_routed.down}}) {
    const Comparison cmp = compare(*got, *want);
    EXPECT_TRUE(cmp.within(kBf16RelTolerance)) << cmp.describe(name);
    std::printf("[ %s ] rel error %s %.2e\n", label.c_str(), name, cmp.rel_error);
  }
}

// Segments ending at most 64 rows into their last 128-row block (balanced routing at 160 rows per
// expert: every expert's last block; uniform routing: some): both passes' second warpgroup skips
// those blocks' MMA (reduce_padding_half). y, g|u and the backward's outputs are the same bits as
// with every MMA issued in the static task order, and y matches the reference.
TEST(MegakernelPadding, SkippedHalvesKeepEveryBit) {
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  for (const Case& c : {Case{"R1_balanced_160", desc(1, 640, 512, 256, 16, 4), RoutingKind::balanced},
                        Case{"R2_uniform", desc(2, 300, 512, 256, 16, 4), RoutingKind::uniform}}) {
    const auto in = make_inputs<float>(c.desc, c.routing, 4321, true);
    const auto dy = make_output_grad<float>(c.desc, 4322, true);
    const auto fwd = ref::layer_forward(in, ref::Rounding::bf16);
    RunConfig cfg;
    cfg.backward = true;
    cfg.dy = &dy;
    const Outputs skipped = run_forward(in, cfg, 2);
    cfg.skip_padding_halves = false;
    cfg.claim_tasks = false;
    const Outputs full = run_forward(in, cfg, 1);
    int halves = 0;
    for (int r = 0; r < c.desc.ranks; ++r) {
      ASSERT_EQ(skipped.errors[r], "") << c.name << " rank " << r;
      ASSERT_EQ(full.errors[r], "") << c.name << " rank " << r;
      halves += skipped.padding_halves[r];
      const Comparison y = compare(from_bits(skipped.y[r]), fwd.y[r]);
      EXPECT_TRUE(y.within(kBf16RelTolerance)) << y.describe(std::string(c.name) + " y rank " + std::to_string(r));
      EXPECT_EQ(first_bit_difference(skipped.y[r], full.y[r]), -1) << c.name << " y rank " << r;
      EXPECT_EQ(first_bit_difference(skipped.gu[r], full.gu[r]), -1) << c.name << " g|u rank " << r;
    }
    expect_same_gradients(full, skipped, c.desc.ranks, c.name);
    std::printf("[ %s ] %d row blocks with a padding half\n", c.name, halves);
    EXPECT_GT(halves, 0) << c.name << ": the case has no padding half to skip";
  }
}

// The backward of the fp8 forward (MoeBackwardArgs::fp8_forward: the bf16 backward on the fp8
// forward's g|u and h, its x rows pulled again in bf16), as ref::layer_backward defines the fp8
// layer's: within bf16's tolerance of the CPU reference (its own fp8 forward's rows differ from
// the GPU's within the GEMMs' rounding), bit for bit across a fresh run, the stage kernels and
// another minibatch.
TEST_P(MegakernelFp8, BackwardMatchesTheOracleAndIsBitwiseStable) {
  const Case& c = GetParam();
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const auto in = make_inputs<float>(c.desc, c.routing, 1357, true);
  const auto dy = make_output_grad<float>(c.desc, 1358, true);
  const auto fwd = ref::layer_forward(in, ref::Rounding::bf16);
  const auto ref = ref::layer_backward(in, fwd.context, dy, ref::Rounding::bf16);
  RunConfig cfg;
  cfg.fp8 = true;
  cfg.backward = true;
  cfg.dy = &dy;
  const Outputs a = run_forward(in, cfg, 3);
  expect_backward_near(a, fwd, ref, int(c.desc.ranks), kFp8LayerTolerance, std::string(c.name) + " fp8 backward");
  expect_same_gradients(a, run_forward(in, cfg, 1), c.desc.ranks, "a fresh run");
  RunConfig stages = cfg;
  stages.stage_backward = true;
  expect_same_gradients(a, run_forward(in, stages, 1), c.desc.ranks, "the stage kernels");
  RunConfig other = cfg;
  other.minibatch_rows = 256;
  expect_same_gradients(a, run_forward(in, other, 1), c.desc.ranks, "minibatch 256");
  // The forward keeping only its schedule (a ring of two minibatches) and the backward replaying
  // the rows (pulled, quantized, the fp8 gate|up again): the same g|u and gradients, with the
  // backward megakernel and with the stage kernels.
  for (const bool stage : {false, true}) {
    RunConfig replay = cfg;
    replay.replay = true;
    replay.stage_backward = stage;
    const Outputs o = run_forward(in, replay, 1);
    const std::string how = stage ? "fp8 replay, stage kernels" : "fp8 replay";
    for (int r = 0; r < c.desc.ranks; ++r) {
      ASSERT_EQ(o.errors[r], "") << how << " rank " << r;
      EXPECT_EQ(first_bit_difference(a.y[r], o.y[r]), -1) << how << ": y rank " << r;
      EXPECT_EQ(first_bit_difference(a.gu[r], o.gu[r]), -1) << how << ": replayed g|u rank " << r;
    }
    expect_same_gradients(a, o, c.desc.ranks, how);
  }
}

// Precision::fp8_dgrad's backward (MoeBackwardArgs::fp8_dgrad: the stage kernels with the data
// gradients on e4m3, experts_backward_fp8_dgrad) after the fp8 forward, as ref::layer_backward
// defines that precision's: within bf16's tolerance of the CPU reference, bit for bit across a
// fresh run and with the rows replayed; the fused path refused by name.
TEST_P(MegakernelFp8, Fp8DgradBackwardMatchesTheOracleAndIsBitwiseStable) {
  const Case& c = GetParam();
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  ref::LayerInputs<float> in = make_inputs<float>(c.desc, c.routing, 2468, true);
  in.desc.precision = Precision::fp8_dgrad;
  const auto dy = make_output_grad<float>(in.desc, 2469, true);
  const auto fwd = ref::layer_forward(in, ref::Rounding::bf16);
  const auto ref = ref::layer_backward(in, fwd.context, dy, ref::Rounding::bf16);
  RunConfig cfg;
  cfg.fp8 = true;
  cfg.fp8_dgrad = true;
  cfg.stage_backward = true;
  cfg.backward = true;
  cfg.dy = &dy;
  const Outputs a = run_forward(in, cfg, 3);
  expect_backward_near(a, fwd, ref, int(c.desc.ranks), kFp8LayerTolerance, std::string(c.name) + " fp8_dgrad backward");
  expect_same_gradients(a, run_forward(in, cfg, 1), c.desc.ranks, "a fresh run");
  RunConfig replay = cfg;
  replay.replay = true;
  expect_same_gradients(a, run_forward(in, replay, 1), c.desc.ranks, "fp8_dgrad replay");
  // The fp8 dx GEMM pushes its rows into their slots: the same bits as writing them for the
  // scatter kernel.
  RunConfig scatter = cfg;
  scatter.scatter_kernel = true;
  expect_same_gradients(a, run_forward(in, scatter, 1), c.desc.ranks, "fp8_dgrad with the scatter kernel");
  {  // The fp8 GEMMs unclustered (the push form's other kernel; every case here has even H / 128)
    const SwitchEnv unclustered("MOK_FP8_CLUSTER", "off");
    expect_same_gradients(a, run_forward(in, cfg, 1), c.desc.ranks, "fp8_dgrad without clusters");
  }
  // Against fp8_block's backward (bf16 data gradients): near, and not the same bits.
  RunConfig bf16_dgrad = cfg;
  bf16_dgrad.fp8_dgrad = false;
  const Outputs b = run_forward(in, bf16_dgrad, 1);
  double differs = 0;
  for (int r = 0; r < c.desc.ranks; ++r) {
    const Comparison dx = compare(from_bits(a.dx[r]), from_bits(b.dx[r]));
    EXPECT_TRUE(dx.within(0.1)) << dx.describe("fp8_dgrad dx against fp8_block's, rank " + std::to_string(r));
    differs = std::max(differs, dx.rel_error);
  }
  if (c.desc.tokens_per_rank > 1) EXPECT_GT(differs, 1e-4) << "the fp8_dgrad backward computed fp8_block's";
  RunConfig fused = cfg;
  fused.stage_backward = false;
  const Outputs f = run_forward(in, fused, 1);
  EXPECT_NE(f.errors[0].find("fp8_dgrad runs on the stage kernels"), std::string::npos) << f.errors[0];
}

class MegakernelBackward : public ::testing::TestWithParam<Case> {};

TEST_P(MegakernelBackward, MatchesTheReferenceAndIsBitwiseStable) {
  const Case& c = GetParam();
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const auto in = make_inputs<float>(c.desc, c.routing, 77, true);
  const auto dy = make_output_grad<float>(c.desc, 78, true);
  const auto fwd = ref::layer_forward(in, ref::Rounding::bf16);
  const auto ref = ref::layer_backward(in, fwd.context, dy, ref::Rounding::bf16);
  RunConfig cfg;
  cfg.backward = true;
  cfg.dy = &dy;
  const Outputs a = run_forward(in, cfg, 3);
  expect_backward_near(a, fwd, ref, int(c.desc.ranks), kBf16RelTolerance, std::string(c.name) + " backward");
  // A fresh set of buffers, one run: the same bits.
  expect_same_gradients(a, run_forward(in, cfg, 1), c.desc.ranks, "a fresh run");
  // The stage kernels, the backward megakernel with other minibatches (one in the static task
  // order with every MMA), and both replaying the rows of a forward that kept only its schedule
  // (its ring two minibatches): the same bits.
  for (const auto& [stages, minibatch, replay, fixed] :
       {std::tuple{true, int64_t(128), false, false}, std::tuple{false, int64_t(256), false, false},
        std::tuple{false, int64_t(384), false, false}, std::tuple{false, int64_t(128), true, false},
        std::tuple{true, int64_t(128), true, false}, std::tuple{false, int64_t(256), false, true}}) {
    RunConfig other = cfg;
    other.stage_backward = stages;
    other.minibatch_rows = minibatch;
    other.replay = replay;
    other.claim_tasks = !fixed;
    other.skip_padding_halves = !fixed;
    const Outputs o = run_forward(in, other, 1);
    const std::string how = std::string(stages ? " (stage kernels" : " (minibatch " + std::to_string(minibatch)) +
                            (replay ? ", replay" : "") + (fixed ? ", static order, every MMA)" : ")");
    for (int r = 0; r < c.desc.ranks; ++r) {
      ASSERT_EQ(o.errors[r], "") << "rank " << r << how;
      if (replay) EXPECT_EQ(first_bit_difference(a.gu[r], o.gu[r]), -1) << "replayed g|u rank " << r << how;
    }
    expect_same_gradients(a, o, c.desc.ranks, how);
  }
  // The stage kernels' dx rows written and scattered by the scatter kernel, not pushed by the dx
  // GEMM: the same bits.
  RunConfig scatter = cfg;
  scatter.stage_backward = true;
  scatter.scatter_kernel = true;
  expect_same_gradients(a, run_forward(in, scatter, 1), c.desc.ranks, "the stage kernels with the scatter kernel");
  // Without the caller's dx rows (the handle holds none) that switch is refused by name.
  scatter.dx_rows_given = false;
  const Outputs refused = run_forward(in, scatter, 1);
  EXPECT_NE(refused.errors[0].find("MOK_EXPERIMENT_DX_SCATTER=kernel needs dx_rows"), std::string::npos)
      << refused.errors[0];
  // bf16 weight gradients: the fp32 ones rounded to nearest even, bit for bit; dx and d topk_w as before.
  cfg.bf16_grads = true;
  const Outputs h = run_forward(in, cfg, 1);
  for (int r = 0; r < c.desc.ranks; ++r) {
    ASSERT_EQ(h.errors[r], "") << "rank " << r << " (bf16 weight gradients)";
    EXPECT_EQ(first_bit_difference(a.dx[r], h.dx[r]), -1) << "dx rank " << r << " (bf16 weight gradients)";
  }
  EXPECT_EQ(first_bit_difference(to_bits(a.dwg), to_bits(h.dwg)), -1) << "bf16 dW_gate is not fp32's rounded";
  EXPECT_EQ(first_bit_difference(to_bits(a.dwu), to_bits(h.dwu)), -1) << "bf16 dW_up is not fp32's rounded";
  EXPECT_EQ(first_bit_difference(to_bits(a.dwd), to_bits(h.dwd)), -1) << "bf16 dW_down is not fp32's rounded";
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, MegakernelBackward,
    ::testing::Values(Case{"R1_zipf", desc(1, 300, 512, 256, 16, 4), RoutingKind::zipf},
                      Case{"R2_uniform", desc(2, 257, 256, 384, 8, 2), RoutingKind::uniform},
                      Case{"R2_one_expert", desc(2, 130, 256, 128, 8, 2), RoutingKind::one_expert},
                      Case{"R2_empty_slots", desc(2, 257, 256, 384, 8, 2), RoutingKind::masked}),
    [](const auto& info) { return std::string(info.param.name); });

// The explicit passes' order: a schedule call of its own (moe_schedule: start barrier, schedule,
// end barrier), then the forward on that schedule (schedule_given) and the backward. The same
// bits as the forward that builds its own schedule, on 1 and 2 ranks (sharing one GPU, and on two
// GPUs when there are), on reruns, with a small ring and comm CTAs; with every rank's routing
// replaced after its schedule call, so that a forward building its schedule again would differ.
TEST(MegakernelSchedule, AScheduleCallThenTheForwardOnItGiveTheSameBits) {
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  for (const int R : {1, 2}) {
    for (const bool own_gpus : {false, true}) {
      if (own_gpus && (R == 1 || device_count() < R)) continue;
      const MoeDesc d = desc(R, 300, 512, 256, 16, 4);
      const auto in = make_inputs<float>(d, RoutingKind::zipf, 77, true);
      const auto dy = make_output_grad<float>(d, 78, true);
      RunConfig base;
      base.own_gpus = own_gpus;
      base.backward = true;
      base.dy = &dy;
      const Outputs want = run_forward(in, base, 1);
      const std::string label = "R=" + std::to_string(R) + (own_gpus ? " on own GPUs" : "");
      for (const bool small_ring : {false, true}) {
        RunConfig cfg = base;
        cfg.schedule_first = true;
        cfg.scramble_after_schedule = true;
        if (small_ring) {  // one 256-row minibatch in the ring, comm CTAs, the backward replays the rows
          cfg.minibatch_rows = 256;
          cfg.ring_slots = 1;
          cfg.comm_ctas = 2;
          cfg.replay = true;
        }
        const Outputs got = run_forward(in, cfg, 2);  // a rerun over the same buffers
        for (int r = 0; r < R; ++r) {
          ASSERT_EQ(got.errors[r], "") << label << " rank " << r;
          EXPECT_EQ(first_bit_difference(got.y[r], want.y[r]), -1) << label << ": y rank " << r;
        }
        expect_same_gradients(want, got, R, label + (small_ring ? ", small ring" : "") + ", the schedule given");
      }
    }
  }
}

TEST(MegakernelPeers, TwoGpusMatchOneGpuBitwise) {
  if (device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  int can = 0;
  cudaDeviceCanAccessPeer(&can, 0, 1);
  if (!can) GTEST_SKIP() << "GPUs 0 and 1 have no peer access";
  const MoeDesc d = desc(2, 1000, 1024, 512, 16, 4);
  const auto in = make_inputs<float>(d, RoutingKind::zipf, 99, true);
  const auto ref = ref::layer_forward(in, ref::Rounding::bf16);
  RunConfig two;
  two.own_gpus = true;
  // The peer path itself first: device 1 writes into device 0's memory.
  {
    DeviceBuffer<uint32_t> word(1);
    cudaMemset(word.ptr, 0, 4);
    cudaSetDevice(1);
    const uint32_t one = 1;
    const cudaError_t copy = cudaMemcpy(word.ptr, &one, 4, cudaMemcpyHostToDevice);
    cudaSetDevice(0);
    ASSERT_EQ(copy, cudaSuccess) << cudaGetErrorString(copy);
    ASSERT_EQ(word.download()[0], 1u);
  }
  const Outputs a = run_forward(in, two, 3);
  const Outputs b = run_forward(in, RunConfig{}, 1);
  ASSERT_TRUE(a.errors[0].empty() && a.errors[1].empty())
      << "rank 0: " << a.errors[0] << "\nrank 1: " << a.errors[1];
  for (int r = 0; r < 2; ++r) {
    const Comparison cmp = compare(from_bits(a.y[r]), ref.y[r]);
    EXPECT_TRUE(cmp.within(kBf16RelTolerance)) << cmp.describe("y rank " + std::to_string(r));
    std::printf("[ two GPUs ] rank %d rel error y %.2e\n", r, cmp.rel_error);
    EXPECT_EQ(first_bit_difference(a.y[r], b.y[r]), -1) << "rank " << r;
  }
}

// R = 2, 4 and 8 ranks, one GPU each, as far as the machine has GPUs (nvidia-h200-x4 / -x8 for
// 4 and 8): forward and backward against the reference, the same bits on reruns, as the same
// ranks sharing one GPU, and with the backward replaying its rows.
TEST(MegakernelPeers, EveryGpuCountMatchesTheReferenceAndOneGpuBitwise) {
  const int gpus = device_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs";
  for (const int R : {2, 4, 8}) {
    if (R > gpus) break;
    for (int a = 0; a < R; ++a)
      for (int b = 0; b < R; ++b) {
        int can = 1;
        if (a != b) cudaDeviceCanAccessPeer(&can, a, b);
        if (!can) GTEST_SKIP() << "GPUs " << a << " and " << b << " have no peer access";
      }
    const std::string where = "R = " + std::to_string(R) + " on " + std::to_string(R) + " GPUs";
    const MoeDesc d = desc(R, 300, 512, 256, 2 * R * 4, 4);
    const auto in = make_inputs<float>(d, RoutingKind::zipf, 100 + R, true);
    const auto dy = make_output_grad<float>(d, 200 + R, true);
    const auto fwd = ref::layer_forward(in, ref::Rounding::bf16);
    const auto ref = ref::layer_backward(in, fwd.context, dy, ref::Rounding::bf16);
    RunConfig own;
    own.own_gpus = true;
    own.backward = true;
    own.dy = &dy;
    const Outputs a = run_forward(in, own, 3);
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(a.errors[r], "") << where << ", rank " << r;
      const Comparison y = compare(from_bits(a.y[r]), fwd.y[r]);
      const Comparison dx = compare(from_bits(a.dx[r]), ref.dx[r]);
      EXPECT_TRUE(y.within(kBf16RelTolerance)) << y.describe(where + " y rank " + std::to_string(r));
      EXPECT_TRUE(dx.within(kBf16RelTolerance)) << dx.describe(where + " dx rank " + std::to_string(r));
      std::printf("[ %d GPUs ] rank %d rel error y %.2e dx %.2e\n", R, r, y.rel_error, dx.rel_error);
    }
    for (const auto& [name, got, want] : {std::tuple{"dW_gate", &a.dwg, &ref.d_routed.gate},
                                          std::tuple{"dW_up", &a.dwu, &ref.d_routed.up},
                                          std::tuple{"dW_down", &a.dwd, &ref.d_routed.down}}) {
      const Comparison cmp = compare(*got, *want);
      EXPECT_TRUE(cmp.within(kBf16RelTolerance)) << cmp.describe(where + " " + name);
    }
    RunConfig shared = own;  // the same ranks on GPU 0
    shared.own_gpus = false;
    RunConfig replay = own;  // the forward keeps only its schedule
    replay.replay = true;
    for (const auto& [how, cfg] : {std::pair{"a fresh run", own}, std::pair{"ranks sharing GPU 0", shared},
                                   std::pair{"replay", replay}}) {
      const Outputs o = run_forward(in, cfg, 1);
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(o.errors[r], "") << where << ", " << how << ", rank " << r;
        EXPECT_EQ(first_bit_difference(a.y[r], o.y[r]), -1) << where << ", " << how << ": y rank " << r;
      }
      expect_same_gradients(a, o, R, where + ", " + how);
    }
  }
}

TEST(MegakernelErrors, APeerThatNeverLaunchesIsANamedTimeout) {
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const MoeDesc d = desc(2, 64, 256, 128, 8, 2);
  const auto in = make_inputs<float>(d, RoutingKind::uniform, 5, true);
  RunConfig only0;
  only0.launch = {0};
  only0.timeout_s = 0.2;
  const Outputs out = run_forward(in, only0, 1);
  EXPECT_NE(out.errors[0].find("rank 0 timed out at the start barrier waiting for rank 1"), std::string::npos)
      << out.errors[0];
}

TEST(MegakernelErrors, RanksMakingDifferentCallsAreNamed) {
  // Same buffers and shapes, but rank 1 clamps its SwiGLU and rank 0 does not (then: rank 1's
  // backward replays and rank 0's does not): both name the other instead of computing a layer no
  // rank asked for.
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const MoeDesc d = desc(2, 64, 256, 128, 8, 2);
  const auto in = make_inputs<float>(d, RoutingKind::uniform, 5, true);
  RunConfig cfg;
  cfg.rank1_other_call = true;
  cfg.timeout_s = 1.0;
  const Outputs out = run_forward(in, cfg, 1);
  EXPECT_NE(out.errors[0].find("rank 0 and rank 1 made different calls"), std::string::npos) << out.errors[0];
  EXPECT_NE(out.errors[1].find("rank 1 and rank 0 made different calls"), std::string::npos) << out.errors[1];
  // The same call on both ranks again: no error.
  const Outputs again = run_forward(in, RunConfig{}, 1);
  EXPECT_EQ(again.errors[0], "");
  EXPECT_EQ(again.errors[1], "");
  // A backward that replays its rows and one that does not are different calls too (the replaying
  // rank would pull x rows the other never wrote again).
  // Both backward paths, and fp8_dgrad's: the stage kernels' dx GEMM (bf16 or fp8) of a given-up
  // call pushes nothing.
  const auto dy = make_output_grad<float>(d, 6, true);
  for (const int path_id : {0, 1, 2}) {
    const bool stages = path_id > 0, fp8_dgrad = path_id == 2;
    RunConfig mixed;
    mixed.backward = true;
    mixed.dy = &dy;
    mixed.rank1_replays = true;
    mixed.stage_backward = stages;
    mixed.fp8 = fp8_dgrad;
    mixed.fp8_dgrad = fp8_dgrad;
    mixed.timeout_s = 1.0;
    const Outputs replayed = run_forward(in, mixed, 1);
    const std::string path = fp8_dgrad ? "fp8_dgrad stage kernels: " : stages ? "stage kernels: " : "megakernel: ";
    EXPECT_NE(replayed.errors[0].find("rank 0 and rank 1 made different calls"), std::string::npos)
        << path << replayed.errors[0];
    EXPECT_NE(replayed.errors[1].find("rank 1 and rank 0 made different calls"), std::string::npos)
        << path << replayed.errors[1];
  }
}

TEST(MegakernelErrors, GraphCaptureWithPeersIsRefused) {
  // A replayed graph keeps the arguments it was captured with: with peers and the epoch one of them
  // (no epoch_counter), its barriers would pass without them. Both passes refuse the capture by
  // name before launching anything.
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const MoeDesc d = desc(2, 64, 256, 128, 8, 2);
  const auto in = make_inputs<float>(d, RoutingKind::uniform, 5, true);
  const auto dy = make_output_grad<float>(d, 6, true);
  RunConfig cfg;
  cfg.capture = true;
  cfg.backward = true;
  cfg.dy = &dy;
  const Outputs out = run_forward(in, cfg, 1);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(out.errors[r].find("mok moe_forward: CUDA graph capture of a call with 2 ranks needs an epoch_counter"),
              std::string::npos) << out.errors[r];
    EXPECT_NE(out.errors[r].find("mok moe_backward: CUDA graph capture of a call with 2 ranks"), std::string::npos)
        << out.errors[r];
    EXPECT_EQ(out.errors[r].find("timed out"), std::string::npos) << out.errors[r];  // nothing ran
  }
  const Outputs again = run_forward(in, RunConfig{}, 1);  // outside a capture the same call runs
  EXPECT_EQ(again.errors[0], "");
  EXPECT_EQ(again.errors[1], "");
}

TEST(MegakernelGraphs, ForwardReplaysWithPeersMatchTheCallsBitwise) {
  // Two ranks sharing GPU 0, the training forward (rows kept) captured once into CUDA graphs with
  // the epoch counter and replayed 3 times: the same bits as the calls, every replay a new epoch.
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const MoeDesc d = desc(2, 300, 256, 128, 8, 2);
  const auto in = make_inputs<float>(d, RoutingKind::zipf, 17, true);
  RunConfig calls;
  RunConfig graphs = calls;
  graphs.graph = true;
  const Outputs want = run_forward(in, calls, 1);
  const Outputs got = run_forward(in, graphs, 3);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(want.errors[r], "") << "calls, rank " << r;
    ASSERT_EQ(got.errors[r], "") << "graphs, rank " << r;
    EXPECT_EQ(got.epochs[r], 3u) << "rank " << r << ": 3 replays";
    EXPECT_EQ(first_bit_difference(want.y[r], got.y[r]), -1) << "y rank " << r;
    EXPECT_EQ(first_bit_difference(want.gu[r], got.gu[r]), -1) << "g|u rank " << r;
  }
}

// Forward and backward captured once per rank into CUDA graphs (with the epoch counter) and
// replayed 3 times: the same bits as the calls, and every replay a new epoch. `cfg` picks the
// backward (its megakernel or the stage kernels, kept rows or replay) and where the ranks run.
void expect_training_replays_bitwise(const MoeDesc& d, RunConfig cfg) {
  const auto in = make_inputs<float>(d, RoutingKind::zipf, 17, true);
  const auto dy = make_output_grad<float>(d, 18, true);
  cfg.backward = true;
  cfg.dy = &dy;
  RunConfig graphs = cfg;
  graphs.graph = true;
  const Outputs want = run_forward(in, cfg, 1);
  const Outputs got = run_forward(in, graphs, 3);
  for (int r = 0; r < int(d.ranks); ++r) {
    ASSERT_EQ(want.errors[r], "") << "calls, rank " << r;
    ASSERT_EQ(got.errors[r], "") << "graphs, rank " << r;
    EXPECT_EQ(got.epochs[r], 6u) << "rank " << r << ": 3 replays of a forward and a backward";
    EXPECT_EQ(first_bit_difference(want.y[r], got.y[r]), -1) << "y rank " << r;
  }
  expect_same_gradients(want, got, int(d.ranks), "graph replays");
}

TEST(MegakernelGraphs, TrainingReplaysMatchTheCallsBitwise) {
  // Two ranks sharing GPU 0 (and one rank alone), each backward path.
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  for (const bool stage : {false, true}) {
    SCOPED_TRACE(stage ? "stage kernels" : "backward megakernel");
    RunConfig cfg;
    cfg.stage_backward = stage;
    expect_training_replays_bitwise(desc(2, 300, 256, 128, 8, 2), cfg);
    expect_training_replays_bitwise(desc(1, 300, 256, 128, 8, 2), cfg);
  }
}

TEST(MegakernelGraphs, TrainingReplaysOnTwoGpusMatchTheCallsBitwise) {
  // One GPU per rank over peer access: each backward path at a small shape, the replay backward,
  // and both paths with bf16 weight gradients at 2048 tokens per rank and top-8 (rows past a
  // minibatch, every stage of the weight gradients).
  if (device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  for (const bool stage : {false, true}) {
    SCOPED_TRACE(stage ? "stage kernels" : "backward megakernel");
    RunConfig cfg;
    cfg.own_gpus = true;
    cfg.stage_backward = stage;
    expect_training_replays_bitwise(desc(2, 300, 256, 128, 8, 2), cfg);
    cfg.bf16_grads = true;
    expect_training_replays_bitwise(desc(2, 2048, 1024, 512, 32, 8), cfg);
  }
  RunConfig replay;
  replay.own_gpus = true;
  replay.stage_backward = true;
  replay.replay = true;
  SCOPED_TRACE("replay");
  expect_training_replays_bitwise(desc(2, 300, 256, 128, 8, 2), replay);
}

TEST(MegakernelGraphs, AReplayWithoutItsPeerIsANamedTimeout) {
  // Rank 1 replays its forward once, rank 0 twice: rank 0's second replay must wait for a new
  // epoch from rank 1 (with the epoch frozen in the graph it would pass at once and read rank 1's
  // buffers mid-call) and time out naming it.
  if (device_count() < 1) GTEST_SKIP() << "no GPU";
  const MoeDesc d = desc(2, 64, 256, 128, 8, 2);
  const auto in = make_inputs<float>(d, RoutingKind::uniform, 5, true);
  RunConfig cfg;
  cfg.graph = true;
  cfg.rank1_graph_runs = 1;
  cfg.timeout_s = 0.3;
  const Outputs out = run_forward(in, cfg, 2);
  EXPECT_NE(out.errors[0].find("rank 0 timed out at the start barrier waiting for rank 1 (saw epoch 1, wanted 2)"),
            std::string::npos)
      << out.errors[0];
  EXPECT_EQ(out.errors[1], "");
  EXPECT_EQ(out.epochs[0], 2u);
  EXPECT_EQ(out.epochs[1], 1u);
}

TEST(MegakernelErrors, BadArgumentsAreNamed) {
  cuda::MoeForwardArgs a;
  a.shape = {2, 16, 2, 8};
  a.rank = 2;
  a.hidden = 100;
  a.intermediate = 64;
  a.minibatch_rows = 100;
  const std::string why = cuda::can_implement(a);
  EXPECT_NE(why.find("rank 2 is not in [0, 2)"), std::string::npos) << why;
  EXPECT_NE(why.find("hidden must be a positive multiple of 8, got 100"), std::string::npos) << why;
  EXPECT_NE(why.find("minibatch_rows must be a positive multiple of 128, got 100"), std::string::npos) << why;
  EXPECT_NE(why.find("symmetric layout"), std::string::npos) << why;
}

}  // namespace
}  // namespace mok::test
