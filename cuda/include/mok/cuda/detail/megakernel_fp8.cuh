// The forward megakernel in block-scaled fp8 (Precision::fp8_block): the bf16 forward's protocol
// (megakernel_forward.cuh: roles, task order, counters, bounded waits, the combine push) on the
// fp8 experts' GEMM (fp8_scaled_gemm_kernel.cuh: 128 x 128 tiles, each k-block's product promoted
// with its scales). What differs:
//   dispatch   the pull copies each row's e4m3 codes (H bytes) and its H / 128 scales, which the
//              ring keeps k-block major ([H / 128, ring_rows]: a tile's 128 row scales of one
//              k-block are one bulk copy); the source ranks quantized their x before the call.
//   gate|up    tiles of 64 W_gate and the same 64 W_up rows (n_first = I / 64); the epilogue
//              stores h (bf16) into the ring and g|u when saved, as the standalone kernel does.
//   h -> e4m3  a row's scale covers 128 columns of h, which two gate|up tiles (columns 2j and
//              2j + 1 of the row block) compute. Each counts itself in the pair's counter once
//              its h is stored; the second to count reads the pair's 128 x 128 h back (32 KiB,
//              from L2), writes its codes and scales into the ring, and counts the pair in h_ready.
//              The codes are a function of h's bits alone, so which tile quantizes changes nothing.
//   down       128 x 128 tiles on h's codes (n_second = H / 128), each waiting for all I / 128
//              pairs of its row block; the push sends 128-column pieces of each row.
// The same tiles, k order and promotions as experts_forward_fp8, so the fused forward equals the
// stage kernels (gather, quantize, experts_forward_fp8, scatter, combine) bit for bit.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mok/cuda/detail/fp8_quantize.cuh"
#include "mok/cuda/detail/fp8_scaled_gemm_kernel.cuh"
#include "mok/cuda/detail/megakernel_forward.cuh"

namespace mok::cuda::detail {

struct MegaFp8ForwardParams : MegaPassParams {
  static constexpr bool kPullsRowWeights = false;
  static constexpr bool kWeightGradients = false;
  static constexpr bool kPullsScales = true;  // pull_scales: each row's scales with its codes
  // ring_x (MegaPassParams) holds the pulled codes [ring_rows, H]: row_vectors = H / 16.
  decltype(fp8_tma_a(nullptr, 1, 1)) tma_x, tma_h;               // a: the ring's x codes, h codes
  decltype(fp8_tma_b(nullptr, 1, 1, 1)) tma_down;                // b of down: W_down's 128-row blocks
  decltype(fp8_tma_b_half(nullptr, 1, 1, 1)) tma_gate, tma_up;   // b of gate|up: 64-row halves
  const float* gate_scales;   // [El, I / 128, H / 128]
  const float* up_scales;     // [El, I / 128, H / 128]
  const float* down_scales;   // [El, H / 128, I / 128]
  float* ring_scales;         // [H / 128, ring_rows]: the pulled rows' scales
  const __nv_bfloat16* ring_h;  // [ring_rows, I]: h as the gate|up epilogue stored it (read back)
  uint8_t* ring_h_codes;      // [ring_rows, I]: h quantized, down's a
  float* ring_h_scales;       // [I / 128, ring_rows]
  StoreTensor h_out, g, u;    // h into the ring; g|u (optional) at global rows
  bool save_gu, has_limit;
  float limit;
  uint32_t* pair_done;        // [row_capacity / 128, I / 128]: gate|up tiles of each column pair stored
  int scale_blocks;           // H / 128: a row's scales
  int intermediate;           // I
  const float* x_scales[kMaxRanks];  // [T, H / 128] on each rank: the scales of its x codes
};

struct MegaFp8SharedStorage {
  alignas(1024) float_e4m3_t a[Fp8GemmConfig::kStageElems * Fp8GemmConfig::kStages];
  alignas(1024) float_e4m3_t b[Fp8GemmConfig::kStageElems * Fp8GemmConfig::kStages];
  alignas(1024) bfloat16_t staging[kEpilogueBuffers][kStagingElems];
  alignas(16) float a_scales[Fp8GemmConfig::kStages][Fp8GemmConfig::kBlockM];
  Fp8GemmConfig::Pipeline::SharedStorage pipeline;
  GroupedTileSchedulerStorage<GemmConfig::kMaxExperts> tiles;
  int task_of_stage[Fp8GemmConfig::kStages];  // the task whose first k-block a stage holds
  int quantizes;                              // the gate|up tile just stored completed its column pair
};

// After a gate|up tile's epilogue: count the tile in its column pair; the pair's tile that counts
// last quantizes the pair's 128 columns of h for the row block (1 x 128 blocks: the codes and
// scales quantize_rows_e4m3_k_major gives) and counts them in h_ready. Consumer thread t takes
// ring row t / 2 of the block and its 64 columns 64 * (t % 2) of the pair (its partner t ^ 1 in
// the warp has the other 64). (Measured against a fixed quantizer, the pair's second tile waiting
// for the first's count: that was 1-3% slower in the same process, session 19.)
__device__ __forceinline__ void quantize_hidden_pair(const MegaFp8ForwardParams& p, const MegaTask& task, int thread,
                                                     int& quantizes) {
  const int pairs = p.intermediate / 128, pair = task.tile.n_block / 2;
  if (MOK_SKIPS(p, kSkipQuantize)) {  // timing only: the pair's odd tile counts it, nothing is quantized
    if (thread == 0 && task.tile.n_block % 2 == 1) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      add_release_gpu(&p.h_ready[task.row_block], 1);
    }
    return;
  }
  if (thread == 0) {
    // The tile's h is in global memory (its bulk stores completed) before the count; the count
    // releases it to the pair's other tile, and acquires that tile's h when it came first.
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    fence_proxy_async();
    __threadfence();
    const uint32_t before = atomicAdd(&p.pair_done[int64_t(task.row_block) * pairs + pair], 1u);
    __threadfence();
    quantizes = before == 1 ? 1 : 0;
  }
  consumers_sync();  // (the flag's next write follows this tile's next epilogue, whose barriers come after this read)
  if (!quantizes) return;
  const int64_t row = int64_t(task.tile.m_block) * GemmConfig::kBlockM + thread / 2;  // ring row
  const int col = 128 * pair + 64 * (thread % 2);
  // Through L2 (ld.global.cg): an earlier pair of this ring slot may sit in this SM's L1.
  const uint4* src = reinterpret_cast<const uint4*>(p.ring_h + row * p.intermediate + col);
  uint4 raw[8];
  CUTE_UNROLL
  for (int j = 0; j < 8; ++j) raw[j] = __ldcg(src + j);
  float amax = 0.0f;
  CUTE_UNROLL
  for (int j = 0; j < 8; ++j) amax = bf16x8_amax(raw[j], amax);
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  const int e = fp8_scale_exponent(amax);
  const float inv = ldexpf(1.0f, -e);
  uint4* dst = reinterpret_cast<uint4*>(p.ring_h_codes + row * p.intermediate + col);
  CUTE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const uint2 lo = bf16x8_codes(raw[2 * j], inv), hi = bf16x8_codes(raw[2 * j + 1], inv);
    dst[j] = make_uint4(lo.x, lo.y, hi.x, hi.y);
  }
  if (thread % 2 == 0) p.ring_h_scales[int64_t(pair) * p.ring_rows + row] = ldexpf(1.0f, e);
  consumers_sync();  // every thread's codes and scales are written
  if (thread == 0) {
    __threadfence();
    fence_proxy_async();  // the down tiles read them with TMA
    add_release_gpu(&p.h_ready[task.row_block], 1);
  }
}

// One rank's fp8 forward (see the top of this file and megakernel_forward.cuh's).
__global__ void __launch_bounds__(GemmConfig::kThreads, 1)
    megakernel_fp8_forward_kernel(const __grid_constant__ MegaFp8ForwardParams p) {
  using Config = Fp8GemmConfig;
  using Pipeline = Config::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  if (int(blockIdx.x) < p.comm_ctas) {
    dispatch_role(p);
    return;
  }
  MegaFp8SharedStorage& smem = *reinterpret_cast<MegaFp8SharedStorage*>(smem_raw);
  const int warp = threadIdx.x / 32;
  const int warpgroup = threadIdx.x / 128;
  const int cta = blockIdx.x - p.comm_ctas, ctas = gridDim.x - p.comm_ctas;

  if (warp == 0) {
    init_pass_schedule(p, smem.tiles, cta);
    if (threadIdx.x == 0) {
      prefetch_tma_descriptor(p.tma_x.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_gate.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_up.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_h.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_down.get_tma_descriptor());
    }
  }
  typename Pipeline::Params pp;
  pp.transaction_bytes = Config::kStageBytes;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = 256;
  Pipeline pipeline(smem.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  const MegaTasks<MegaFp8ForwardParams> tasks{p, smem.tiles};

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp != 0) {
      if (p.comm_warps) dispatch_warps(p, smem.tiles.status == 0 ? smem.tiles.offsets[p.experts] : 0, cta, ctas);
    } else if (cute::elect_one_sync()) {
      const int total = tasks.total();
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int linear = take_task(p, cta); linear < total; linear = take_task(p, linear + ctas)) {
        const MegaTask task = tasks.at(linear);
        if (MOK_SKIPS(p, kSkipWaits)) {
        } else if (task.second) {  // every column pair of the row block's h quantized
          wait_at_least<false>(&p.h_ready[task.row_block], uint32_t(p.n_first / 2), p.status, kWaitHidden,
                               task.row_block);
        } else {
          wait_at_least<false>(&p.x_ready[task.minibatch], pulling_teams(p), p.status, kWaitRows, task.minibatch);
        }
        fence_proxy_async();  // the rows (or h) the counter announced are read by TMA
        announce_task(state, smem, linear);
        for (int kb = 0; kb < task.tile.k_end; ++kb) {
          pipeline.producer_acquire(state);
          uint64_t* bar = pipeline.producer_get_barrier(state);
          if (task.second) {
            load_fp8_k_block<false>(p.tma_h, p.tma_down, p.tma_gate, p.tma_up, p.ring_rows, p.intermediate, p.hidden,
                                    p.experts, p.ring_h_scales, p.ring_rows, smem, bar, state.index(), task.tile, kb);
          } else {
            load_fp8_k_block<true>(p.tma_x, p.tma_down, p.tma_gate, p.tma_up, p.ring_rows, p.hidden, p.intermediate,
                                   p.experts, p.ring_scales, p.ring_rows, smem, bar, state.index(), task.tile, kb);
          }
          ++state;
        }
      }
      announce_without_bytes(state, smem, total);  // no more tasks
      pipeline.producer_tail(state);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int total = tasks.total();
    const int thread = threadIdx.x - 128;
    Config::TiledMma mma;
    auto thr = mma.get_thread_slice(thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), Config::SmemLayout{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), Config::SmemLayout{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    Tensor cC = make_identity_tensor(Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{});
    Tensor tCcC = thr.partition_C(cC);
    Tensor acc = partition_fragment_C(mma, Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{});
    Tensor tmp = partition_fragment_C(mma, Shape<Int<Config::kBlockM>, Int<Config::kBlockN>>{});
    const int r0 = get<0>(tCcC(0));  // the thread's first row of a tile (reduce_scaled_k_blocks)

    cutlass::PipelineState<Config::kStages> state;
    int chunk = 0;  // the gate|up epilogue's staging tile: chunk % 2 (an odd count of chunks per tile)
    for (;;) {
      // The producer's choice, in the stage of the task's first k-block.
      pipeline.consumer_wait(state);
      const int linear = *reinterpret_cast<volatile int*>(&smem.task_of_stage[state.index()]);
      if (linear >= total) {  // no more tasks: the stage holds no bytes
        pipeline.consumer_release(state);
        ++state;
        break;
      }
      {
        // The tile's weight scale row: W_gate's and W_up's blocks of its 64-row halves (gate|up),
        // or W_down's 128-row block (down: one scale for all its values).
        const MegaTask task = tasks.at(linear);
        const int k_blocks = task.tile.k_end;
        const int64_t scale_row = int64_t(task.tile.expert) * (task.second ? p.n_second : p.n_first / 2) +
                                  (task.second ? task.tile.n_block : task.tile.n_block / 2);
        const float* sb = (task.second ? p.down_scales : p.gate_scales) + scale_row * k_blocks;
        const float* su = task.second ? sb : p.up_scales + scale_row * k_blocks;
        reduce_scaled_k_blocks<true>(mma, tCrA, tCrB, acc, tmp, pipeline, state, smem.a_scales, r0, sb, su, 0,
                                     k_blocks);
      }
      // The task again for the epilogue (registers: only its id lived through the mainloop).
      const MegaTask task = tasks.at(linear);
      if (!task.second) {
        fp8_swiglu_epilogue(smem.staging[0], chunk, p.h_out, p.g, p.u, p.save_gu, p.has_limit, p.limit, acc, tCcC,
                            task.tile.m_block, task.tile.save_m_block, task.tile.n_block, thread);
        quantize_hidden_pair(p, task, thread, smem.quantizes);
      } else {
        // The tile frees its ring rows for the minibatch S later (megakernel_kernel says why relaxed).
        if (p.ring_rows < p.row_capacity && thread == 0) add_relaxed_gpu(&p.y_done[task.minibatch], 1);
        push_rows<1>(PushTarget{p}, task.row_block, task.tile.n_block, acc, tCcC, thread, smem.staging[0]);
      }
    }
    announce_pushes(p, thread, ctas);
  }
}

}  // namespace mok::cuda::detail
