// The backward's dgrad megakernel of one rank: the forward's kernel (megakernel_forward.cuh) with
// the backward's GEMMs and epilogues, in one persistent launch:
//   pull     the comm warps copy each row's dy from its source rank (and its router weight) into
//            dy_rows at its schedule position, minibatch by minibatch (x_ready);
//   first    dh = dy W_down per tile, the SwiGLU backward in the epilogue: dg|du, w*h and the
//            row's d topk_w partials, at the row's schedule position (h_ready per row block);
//   second   dx = dg W_gate + du W_up (one accumulator over both planes), each row pushed into
//            its (token, j) slot of the source rank's dx_slots; the column-block-0 tile also sums
//            the row's d topk_w partials in block order and pushes them into dw_slots.
// The last CTA tells every source rank its slots are written (dx_arrived). The weight gradients
// run after it as their own launches, while the peers' pushes land.
// The rows are kept (training forward): dy_rows, dgu and hw hold every row, so the "ring" has one
// slot per minibatch and no pull waits for a slot. Every tile is computed as the stage kernels
// compute it (the same GEMMs, k order and epilogue arithmetic), so both give the same bits.
#pragma once

#include "mok/cuda/detail/megakernel_forward.cuh"

namespace mok::cuda::detail {

using BackwardDgradMainloop = BackwardMainloop<GMMA::Major::K>;

struct MegaBackwardParams {
  static constexpr bool kPullsRowWeights = true;
  BackwardDgradMainloop::Params first_load, second_load;  // dy x W_down; [dg|du] x [W_gate; W_up]
  SwiGluBackwardEpilogue::Params first_store;            // dg|du, hw, d topk_w partials
  int32_t experts, row_capacity;
  int32_t ring_rows, mb_rows;  // ring_rows >= every minibatch's rows: one slot per minibatch
  int32_t n_first, n_second, k_first, k_second;
  int32_t comm_ctas;   // 0: comm warps pull (the only mode the backward uses)
  int32_t comm_warps;  // 1
  int32_t ranks, rank, topk, slots, hidden, row_vectors;
  const int32_t* offsets;
  const int32_t* src_rank;
  const int32_t* src_slot;
  uint4* ring_x;      // dy_rows [row_capacity, H]
  float* row_weight;  // [row_capacity]: topk_w of each row's (token, j), 0 for padding
  uint32_t* x_ready;
  uint32_t* y_done;
  uint32_t* h_ready;
  uint32_t* done_ctas;
  uint32_t epoch;
  WaitStatus status;
  const uint4* x[kMaxRanks];          // dy [T, H] on each rank
  const float* topk_w[kMaxRanks];     // [T*k] on each rank
  __nv_bfloat16* combine[kMaxRanks];  // dx_slots [T*k, H] on each rank
  float* dw_slots[kMaxRanks];         // [T*k] on each rank
  uint32_t* arrived[kMaxRanks];       // rank s's dx_arrived word of this rank
};

// Where the dx rows go: as CombineTarget, into dx_slots.
struct DxTarget {
  const MegaBackwardParams& p;
  __device__ __nv_bfloat16* dest(int rank) const { return p.combine[rank]; }
  __device__ const int32_t* src_rank() const { return p.src_rank; }
  __device__ const int32_t* src_slot() const { return p.src_slot; }
  __device__ int ranks() const { return p.ranks; }
  __device__ int slots() const { return p.slots; }
  __device__ int width() const { return p.hidden; }
};

struct BackwardPass {
  using Params = MegaBackwardParams;
  using Mainloop = BackwardDgradMainloop;

  // The epilogues take the thread index through an opaque move and derive their accumulator
  // coordinates from it (the kernel's own `coords` go unused): their shared-memory addresses are
  // then computed per tile instead of hoisted out of the task loop, where they did not fit the
  // consumers' 232 registers (ptxas spilled 196 bytes; 52 with this alone, 0 with the 32-bit
  // staging addresses of SwiGluBackwardEpilogue).
  static __device__ int opaque(int thread) {
    int t;
    asm volatile("mov.b32 %0, %1;" : "=r"(t) : "r"(thread));
    return t;
  }
  static __device__ auto coords_of(int thread) {
    ExpertTiledMma<Mainloop::Element, Mainloop::kMajorA, Mainloop::kMajorB> mma;
    return mma.get_thread_slice(thread).partition_C(
        make_identity_tensor(Shape<Int<GemmConfig::kBlockM>, Int<GemmConfig::kBlockN>>{}));
  }

  template <class Acc, class Coords>
  static __device__ void first_epilogue(const Params& p, const MegaTask& task, Acc& acc, const Coords&, int thread,
                                        bfloat16_t* staging) {
    // The row weights were written by comm warps of any CTA; this thread reads them after the
    // minibatch's count (the producer's acquire covers its TMA loads, not this thread's loads).
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
    push_rows(DxTarget{p}, task.row_block, task.tile.n_block, acc, coords_of(t), t, staging);
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
};

}  // namespace mok::cuda::detail
