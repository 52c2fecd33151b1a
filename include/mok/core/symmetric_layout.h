// The layout of one rank's symmetric buffer: the memory every rank of the expert-parallel group
// can address on every other rank (torch symmetric memory, or peer-mapped allocations). One struct
// for the host (sizes, offsets) and the device (typed pointers on any rank's base), so neither
// Python nor a kernel does offset arithmetic of its own (STYLE.md 5). Every rank has the same
// layout: the same offsets address a peer's buffer from its base pointer.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_HOST_DEVICE __host__ __device__
#else
#define MOK_HOST_DEVICE
#endif

namespace mok {

struct SymmetricLayout {
  static constexpr int64_t kAlign = 256;       // every region starts on a 256-byte boundary
  static constexpr int64_t kSignalLine = 128;  // one signal word per 128-byte line (no false sharing)
  static constexpr int64_t kMaxRanks = 128;    // the signal lines are sized for this many ranks

  // Sizes it was made for.
  int64_t tokens = 0, hidden = 0, topk = 0, ranks = 1;

  // Byte offsets from the base of a rank's buffer: the signal lines, then the data.
  int64_t x = 0;         // [T, H] bf16: the tokens the owners of their experts pull (dispatch)
  int64_t topk_idx = 0;  // [T, k] int32: read by every rank to build its schedule
  int64_t topk_w = 0;    // [T, k] fp32: router weights, read with the rows
  int64_t combine = 0;   // [T*k, H] bf16: expert outputs pushed here, one slot per (token, j)
  int64_t dy = 0;        // [T, H] bf16: output gradients the owners pull (backward dispatch)
  int64_t dx_slots = 0;  // [T*k, H] bf16: input gradients pushed here, one slot per (token, j)
  int64_t dw_slots = 0;  // [T*k] fp32: d topk_w pushed here, one slot per (token, j)
  // The block-scaled fp8 forward's dispatch (Precision::fp8_block): x quantized by its rank before
  // the call, the codes and scales the owners pull (half the bytes of the bf16 rows).
  int64_t x_codes = 0;   // [T, H] e4m3
  int64_t x_scales = 0;  // [T, ceil(H / 128)] fp32: one power-of-two scale per row and 128 columns
  // Signal lines (at offset 0, [signals, x)), one 32-bit word at the start of each: for each of
  // kMaxRanks source ranks s, combine_arrived[s] and dx_arrived[s] (counters a pushing rank adds to
  // with release semantics after its slots), barrier[s] (epoch flags for a barrier with no
  // multicast; 8 bytes on, the caller's call word), then one status line (its first 8 bytes: the
  // non-finite key every rank's input check writes into, cuda/routing.h).
  int64_t signals = 0;
  int64_t total = 0;  // bytes of one rank's buffer

  static constexpr int64_t align_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

  static SymmetricLayout make(int64_t tokens, int64_t hidden, int64_t topk, int64_t ranks) {
    SymmetricLayout l;
    l.tokens = tokens;
    l.hidden = hidden;
    l.topk = topk;
    l.ranks = ranks;
    int64_t at = 0;
    auto take = [&](int64_t bytes) {
      const int64_t offset = at;
      at += align_up(bytes);
      return offset;
    };
    const int64_t T = tokens, H = hidden, k = topk;
    // The signal lines first, sized for the most ranks: their offsets depend on no shape, so a
    // rank called with other shapes than its peers still writes its flags and call word where
    // they look (and is named, not left to a timeout or a stray write).
    l.signals = take(signal_lines(kMaxRanks) * kSignalLine);
    l.x = take(T * H * 2);
    l.topk_idx = take(T * k * 4);
    l.topk_w = take(T * k * 4);
    l.combine = take(T * k * H * 2);
    l.dy = take(T * H * 2);
    l.dx_slots = take(T * k * H * 2);
    l.dw_slots = take(T * k * 4);
    l.x_codes = take(T * H);
    l.x_scales = take(T * scale_blocks(H) * 4);
    l.total = at;
    return l;
  }
  static constexpr int64_t signal_lines(int64_t ranks) { return 3 * ranks + 1; }
  // Scales of a row of `cols` values in 1 x 128 blocks.
  static constexpr int64_t scale_blocks(int64_t cols) { return (cols + 127) / 128; }

  // Signal words on a rank's buffer (at offsets that depend on no shape).
  MOK_HOST_DEVICE int64_t combine_arrived(int64_t source_rank) const { return signals + source_rank * kSignalLine; }
  MOK_HOST_DEVICE int64_t dx_arrived(int64_t source_rank) const {
    return signals + (kMaxRanks + source_rank) * kSignalLine;
  }
  MOK_HOST_DEVICE int64_t barrier(int64_t source_rank) const {
    return signals + (2 * kMaxRanks + source_rank) * kSignalLine;
  }
  MOK_HOST_DEVICE int64_t status() const { return signals + 3 * kMaxRanks * kSignalLine; }

  // A typed pointer into the buffer whose base is `base` (this rank's or a peer's).
  template <class T>
  MOK_HOST_DEVICE static T* at(void* base, int64_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }
};

}  // namespace mok
