// The backward megakernel of one rank: the forward's kernel (megakernel_forward.cuh) with the
// backward's GEMMs and epilogues, in one persistent launch:
//   pull     the comm warps copy each row's dy from its source rank (and its router weight) into
//            dy_rows at its schedule position, minibatch by minibatch (x_ready);
//   first    dh = dy W_down per tile, the SwiGLU backward in the epilogue: dg|du, w*h and the
//            row's d topk_w partials, at the row's schedule position (h_ready per row block);
//   second   dx = dg W_gate + du W_up (one accumulator over both planes), each row pushed into
//            its (token, j) slot of the source rank's dx_slots; the column-block-0 tile also sums
//            the row's d topk_w partials in block order and pushes them into dw_slots;
//   wgrad    after every task of the two GEMMs: dW_gate, dW_up, dW_down of each expert over its
//            rows in order (a fixed reduction order, no split-K), once that expert's rows are
//            pulled and their first-GEMM tiles done; stored fp32 or bf16 by TMA.
// The last CTA tells every source rank its slots are written (dx_arrived).
// The rows are kept (training forward): dy_rows, dgu and hw hold every row, so the "ring" has one
// slot per minibatch and no pull waits for a slot. Every tile is computed as the stage kernels
// compute it (the same GEMMs, k order and epilogue arithmetic), so both give the same bits.
#pragma once

#include "mok/cuda/detail/megakernel_forward.cuh"

namespace mok::cuda::detail {

using BackwardDgradMainloop = BackwardMainloop<GMMA::Major::K>;
using BackwardWgradMainloop = BackwardMainloop<GMMA::Major::MN>;

// The pass's ring_x is dy_rows [row_capacity, H], x the ranks' dy, combine their dx_slots and
// arrived their dx_arrived words of this rank.
struct MegaBackwardParams : MegaPassParams {
  static constexpr bool kPullsRowWeights = true;
  static constexpr bool kWeightGradients = true;
  static constexpr int32_t kWaitFirst = kWaitDyRows, kWaitSecond = kWaitDgradTiles;
  BackwardDgradMainloop::Params first_load, second_load;  // dy x W_down; [dg|du] x [W_gate; W_up]
  SwiGluBackwardEpilogue::Params first_store;            // dg|du, hw, d topk_w partials
  // The weight gradients dW_gate = dg^T x, dW_up = du^T x, dW_down = dy^T hw (both operands read
  // transposed), stored fp32 or bf16 (wgrad_bf16_out), 64 rows per consumer warpgroup (turns).
  BackwardWgradMainloop::Params wgrad_load[3];
  StoreF32TurnsEpilogue::Params wgrad_f32[3];
  StoreBf16PlanesTurnsEpilogue::Params wgrad_bf16[3];
  int32_t wgrad_bf16_out;
  int32_t wg_m, wg_n, wd_m, wd_n;  // tiles of dW_gate / dW_up (I x H) and of dW_down (H x I)
  float* row_weight;               // [row_capacity]: topk_w of each row's (token, j), 0 for padding
  const float* topk_w[kMaxRanks];  // [T*k] on each rank
  float* dw_slots[kMaxRanks];      // [T*k] on each rank
};

struct BackwardPass {
  using Params = MegaBackwardParams;
  using Mainloop = BackwardDgradMainloop;
  // (The epilogues take the thread index through an opaque move: opaque_thread, above the forward
  // pass; the backward spilled 196 bytes without it and 52 with this alone, 0 with the 32-bit
  // staging addresses of SwiGluBackwardEpilogue.)
  static __device__ int opaque(int thread) { return opaque_thread(thread); }
  static __device__ auto coords_of(int thread) { return epilogue_coords<Mainloop>(thread); }

  template <class Acc, class Coords>
  static __device__ void first_epilogue(const Params& p, const MegaTask& task, Acc& acc, const Coords&, int thread,
                                        bfloat16_t* staging) {
    // The row weights were written by comm warps of any CTA; this thread reads them after the
    // minibatch's count. (The producer acquired it before this tile's loads, and this thread
    // waited on those loads, so the count is already complete; this acquire orders this thread's
    // own loads after it.)
    (void)ld_acquire_gpu(&p.x_ready[task.minibatch]);
    const int t = opaque(thread);
    SwiGluBackwardEpilogue::apply(p.first_store, task.tile, acc, coords_of(t), t, staging);
    // dg|du (read by the second GEMM's TMA loads on any CTA), hw and the partials: generic stores
    // of every consumer thread, then one release of the row block's count.
    fence_proxy_async();
    consumers_sync();
    if (thread == 0) {
      __threadfence();
      add_release_gpu(&p.h_ready[task.row_block], 1);
    }
  }

  template <class Acc, class Coords>
  static __device__ void second_epilogue(const Params& p, const MegaTask& task, Acc& acc, const Coords&, int thread,
                                         bfloat16_t* staging) {
    const int t = opaque(thread);
    push_rows(PushTarget{p}, task.row_block, task.tile.n_block, acc, coords_of(t), t, staging);
    if (task.tile.n_block != 0 || t >= GemmConfig::kBlockM) return;
    // d topk_w of the tile's rows: the partials of every first-GEMM column block, in block order
    // (as the stage kernels' reduce_row_partials), pushed into the row's (token, j) slot.
    const int row = task.row_block * GemmConfig::kBlockM + t;
    const int rank = p.src_rank[row], slot = p.src_slot[row];
    if (rank < 0 || rank >= p.ranks || slot < 0 || slot >= p.slots) return;  // padding row
    (void)ld_acquire_gpu(&p.h_ready[task.row_block]);  // the partials' writers counted there
    const float* partial = p.first_store.dw_partial + int64_t(row) * p.n_first;
    float sum = 0.0f;
    for (int b = 0; b < p.n_first; ++b) sum = __fadd_rn(sum, partial[b]);
    p.dw_slots[rank][slot] = sum;
  }

  // Producer (one thread): a weight gradient tile of expert e reads dy, x, dg|du and hw of all of
  // e's rows: it waits until every row block of e was pulled and its first-GEMM tiles are done,
  // once per expert (ready_expert; tiles come expert by expert): one acquire per row block and
  // tile held mixtral's tiles back (4096 rows per expert), 10% slower than separate launches.
  // An empty expert's tiles (no k-block) wait for nothing: their stage holds only the id.
  template <class Storage, class Pipeline, class State>
  static __device__ void load_wgrad(const Params& p, const MegaTask& task, int linear, Storage& smem,
                                    Pipeline& pipeline, State& state, int& ready_expert) {
    if (task.tile.expert != ready_expert && !MOK_SKIPS(p, kSkipWaits)) {
      const int mb = p.mb_rows / GemmConfig::kBlockM;
      constexpr int kPerBlock = GemmConfig::kBlockM / BackwardWgradMainloop::kBlockK;  // k-blocks per row block
      for (int rb = task.tile.k_begin / kPerBlock; rb < task.tile.k_end / kPerBlock; ++rb) {
        wait_at_least<false>(&p.x_ready[rb / mb], pulling_teams(p), p.status, kWaitDyRows, rb / mb);
        wait_at_least<false>(&p.h_ready[rb], uint32_t(p.n_first), p.status, kWaitDgradTiles, rb);
      }
      fence_proxy_async();  // what the counters announced is read by TMA
      ready_expert = task.tile.expert;
    }
    load_task<BackwardWgradMainloop>(p.wgrad_load[task.wgrad - 1], smem, task.tile, linear, pipeline, state);
  }

  // Consumers: the tile's reduction over the expert's rows in order (zero for an empty expert),
  // then its fp32 or bf16 store (TMA, asynchronous). The two warpgroups take turns as in the
  // grouped GEMM's weight gradients (grouped_gemm_kernel.cuh): warpgroup c hands over once it has
  // issued the tile's first kStages k-blocks and stores its own 64 rows, so one warpgroup's
  // epilogue runs under the other's mainloop. Warpgroup 1 waits for its turn on every tile,
  // warpgroup 0 on every tile after its first and once more at the end (end_turns: warpgroup 1
  // cannot know its tile was the last, so it always hands over). `turns` is set at the first
  // weight-gradient tile; every later task of the CTA is one too (they come last).
  template <class Acc, class Coords, class Storage, class Pipeline, class State>
  static __device__ void wgrad_task(const Params& p, const MegaTask& task, Acc& acc, const Coords&, int thread,
                                    Storage& smem, Pipeline& pipeline, State& read_state, State& release_state,
                                    bool& turns) {
    using Mainloop = BackwardWgradMainloop;
    ExpertTiledMma<Mainloop::Element, Mainloop::kMajorA, Mainloop::kMajorB> mma;
    auto thr = mma.get_thread_slice(thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), Mainloop::SmemLayoutB{});
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    const int g = task.wgrad - 1;
    const int c = thread / 128;  // consumer warpgroup
    const bool take_turns = !MOK_SKIPS(p, kSkipTurns);  // (timing builds: both reduce at once)
    if (!turns) {
      // From here on each warpgroup writes only its own staging tiles (staging[c]), and warpgroup
      // 1's thread cannot wait for bulk stores thread 0 issued: the last two-GEMM epilogue's
      // staging reads and bulk stores end before either warpgroup goes on.
      if (thread == 0) tma_store_wait<0>();
      consumers_sync();
      turns = true;
    } else if (c == 0 && take_turns) {
      wait_turn(0);
    }
    if (c == 1 && take_turns) wait_turn(1);
    const int k_blocks = task.tile.k_end - task.tile.k_begin;
    const int give_after = hand_over_k_block(task.tile);
    const int t = opaque(thread);
    if (k_blocks <= 0) {
      // An empty expert's gradient is zero. Stored from a stand-in accumulator: clearing the real
      // one here made ptxas serialize every wgmma of the kernel (C7515). Its stage held only its id.
      if (take_turns) give_turn(1 - c);
      pipeline.consumer_release(release_state);
      ++read_state;
      store(p, g, task.tile, ZeroAccumulator{}, t, smem.staging[c]);
      return;
    }
    reduce_k_blocks(mma, tCrA, tCrB, acc, pipeline, read_state, release_state, task.tile.k_begin, task.tile.k_end,
                    false, [&](int kb) {
                      if (take_turns && kb == give_after) give_turn(1 - c);
                    });
    store(p, g, task.tile, acc, t, smem.staging[c]);
  }
  // Warpgroup 0's last wait (after the CTA's last task, when it did weight-gradient tiles).
  static __device__ void end_turns(const Params& p, bool turns, int thread) {
    if (turns && thread < 128 && !MOK_SKIPS(p, kSkipTurns)) wait_turn(0);
  }

  struct ZeroAccumulator {
    __device__ float operator()(int) const { return 0.0f; }
  };
  // Warpgroup thread / 128's 64 rows of the tile: row block 2 m + c of 64 rows.
  template <class Acc>
  static __device__ void store(const Params& p, int g, const GroupedTile& tile, const Acc& acc, int thread,
                               bfloat16_t* staging) {
    const int c = thread / 128;
    GroupedTile half = tile;
    half.m_block = 2 * tile.m_block + c;
    const auto all = coords_of(thread);
    const auto coords = [&](int i) { return make_tuple(get<0>(all(i)) - 64 * c, get<1>(all(i))); };
    if (p.wgrad_bf16_out) {
      StoreBf16PlanesTurnsEpilogue::apply(p.wgrad_bf16[g], half, acc, coords, thread % 128, staging);
    } else {
      StoreF32TurnsEpilogue::apply(p.wgrad_f32[g], half, acc, coords, thread % 128, staging);
    }
  }
};

}  // namespace mok::cuda::detail
