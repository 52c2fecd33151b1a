// GPU tests of the routing kernels (mok/cuda/routing.h) against the CPU reference: the schedule
// against build_rank_schedule, gather/scatter against the reference's gather/scatter stages, the
// epilogues against combine_epilogue / dispatch_grad_epilogue. Everything is compared bit for bit
// (data movement, and fp32 sums in a fixed order), outputs are poisoned before every run, rows
// past the schedule must stay untouched, and five reruns must give the same bits. A failure names
// the case, the destination rank, the run and the first mismatching index.
// Runs only where a GPU is (tools/gpu.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "mok/core/bf16.h"
#include "mok/core/error.h"
#include "mok/core/problem.h"
#include "mok/core/reference.h"
#include "mok/core/schedule.h"
#include "mok/cuda/routing.h"
#include "gpu_test_util.h"

namespace mok {
namespace {

using test::DeviceBuffer;
using test::from_bits;
using test::random_bf16;
using test::to_bits;

constexpr int kRuns = 5;
constexpr int64_t kGuard = 64;  // extra entries past every output, which must stay poisoned

template <class T>
uint64_t bits_of(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

// Bitwise equality of got[begin, end) and want[begin - want_begin ...]; the message names the first
// mismatching index and how many differ.
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want,
                                     const std::string& what, size_t begin = 0, size_t end = SIZE_MAX) {
  end = std::min(end, got.size());
  if (want.size() < end) {
    return ::testing::AssertionFailure() << what << ": " << want.size() << " expected values, need " << end;
  }
  int64_t first = -1, count = 0;
  for (size_t i = begin; i < end; ++i) {
    if (bits_of(got[i]) != bits_of(want[i])) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++count;
    }
  }
  if (first < 0) return ::testing::AssertionSuccess();
  std::ostringstream s;
  s << what << ": " << count << " of " << end - begin << " differ; first at index " << first << ": got "
    << +got[first] << " (bits 0x" << std::hex << bits_of(got[first]) << "), want " << std::dec << +want[first]
    << " (bits 0x" << std::hex << bits_of(want[first]) << ")";
  return ::testing::AssertionFailure() << s.str();
}

// Every entry of v[begin, end) still holds the poison pattern.
template <class T>
::testing::AssertionResult untouched(const std::vector<T>& v, T poison, size_t begin,
                                     const std::string& what) {
  for (size_t i = begin; i < v.size(); ++i) {
    if (bits_of(v[i]) != bits_of(poison)) {
      return ::testing::AssertionFailure()
             << what << ": entry " << i << " past the end (" << begin << ") was written: " << +v[i];
    }
  }
  return ::testing::AssertionSuccess();
}

int32_t poison_i32() {
  int32_t v;
  std::memset(&v, 0x7f, sizeof v);
  return v;
}

// ---- Routings ----

enum class Gen { balanced, uniform, zipf, one_expert, last_expert, repeated, masked };

struct RoutingCase {
  std::string name;
  int64_t R, T, k, E;
  Gen gen;
  int64_t H = 64;  // width for the gather/scatter tests
};
void PrintTo(const RoutingCase& c, std::ostream* os) {
  *os << c.name << " (R=" << c.R << " T=" << c.T << " k=" << c.k << " E=" << c.E << " H=" << c.H << ")";
}

MoeDesc desc_of(const RoutingCase& c) {
  MoeDesc d;
  d.tokens_per_rank = c.T;
  d.hidden = c.H;
  d.intermediate = 8;
  d.num_experts = c.E;
  d.topk = c.k;
  d.ranks = c.R;
  return d;
}

cuda::RoutingShape shape_of(const RoutingCase& c) { return {c.R, c.T, c.k, c.E}; }

std::vector<std::vector<int32_t>> routing_of(const RoutingCase& c, uint64_t seed) {
  const MoeDesc d = desc_of(c);
  switch (c.gen) {
    case Gen::balanced:
      return make_routing(d, RoutingKind::balanced, seed);
    case Gen::uniform:
      return make_routing(d, RoutingKind::uniform, seed);
    case Gen::zipf:
      return make_routing(d, RoutingKind::zipf, seed);
    case Gen::one_expert:
      return make_routing(d, RoutingKind::one_expert, seed);
    case Gen::masked:  // empty slots (id -1) among the routed ones
      return make_routing(d, RoutingKind::masked, seed);
    case Gen::last_expert:  // every (token, j) to the very last expert: one expert gets R*T*k rows
      return std::vector<std::vector<int32_t>>(
          c.R, std::vector<int32_t>(c.T * c.k, static_cast<int32_t>(c.E - 1)));
    case Gen::repeated: {  // the same expert several times in one token
      std::vector<std::vector<int32_t>> idx(c.R, std::vector<int32_t>(c.T * c.k));
      for (int64_t r = 0; r < c.R; ++r) {
        for (int64_t s = 0; s < c.T * c.k; ++s)
          idx[r][s] = static_cast<int32_t>(((r * c.T + s / c.k) % 3) % c.E);
      }
      return idx;
    }
  }
  return {};
}

std::vector<const int32_t*> host_pointers(const std::vector<std::vector<int32_t>>& idx) {
  std::vector<const int32_t*> p;
  for (const auto& v : idx) p.push_back(v.data());
  return p;
}

// Every rank's topk_idx in its own device buffer.
struct DeviceRouting {
  std::vector<DeviceBuffer<int32_t>> bufs;
  std::vector<const int32_t*> ptrs;
  explicit DeviceRouting(const std::vector<std::vector<int32_t>>& idx) {
    for (const auto& v : idx) {
      bufs.emplace_back(v.size());
      bufs.back().upload(v);
      ptrs.push_back(bufs.back().ptr);
    }
  }
};

// A destination rank's schedule on the device, with kGuard poisoned entries past every table.
struct DeviceSchedule {
  cuda::RoutingShape shape;
  int64_t capacity, El;
  DeviceBuffer<int32_t> offsets, rows, src_rank, src_slot;
  DeviceBuffer<uint8_t> workspace;
  DeviceBuffer<cuda::RoutingStatus> status;
  explicit DeviceSchedule(const cuda::RoutingShape& s)
      : shape(s),
        capacity(cuda::routed_row_capacity(s)),
        El(s.local_experts()),
        offsets(El + 1 + kGuard),
        rows(El + kGuard),
        src_rank(capacity + kGuard),
        src_slot(capacity + kGuard),
        workspace(cuda::schedule_workspace_bytes(s)),
        status(1) {
    cudaMemset(status.ptr, 0, sizeof(cuda::RoutingStatus));
  }
  bool allocated() const {
    return offsets.ptr && rows.ptr && src_rank.ptr && src_slot.ptr && workspace.ptr && status.ptr;
  }
  void poison() {
    offsets.poison(0x7f);
    rows.poison(0x7f);
    src_rank.poison(0x7f);
    src_slot.poison(0x7f);
  }
  cuda::ScheduleArgs args(int64_t dest, const std::vector<const int32_t*>& topk_idx) {
    cuda::ScheduleArgs a;
    a.shape = shape;
    a.dest_rank = dest;
    a.topk_idx = topk_idx.data();
    a.expert_offsets = offsets.ptr;
    a.expert_rows = rows.ptr;
    a.src_rank = src_rank.ptr;
    a.src_slot = src_slot.ptr;
    a.row_capacity = capacity;
    a.workspace = workspace.ptr;
    a.status = status.ptr;
    return a;
  }
  cuda::ScheduleView view() const { return {El, capacity, offsets.ptr, src_rank.ptr, src_slot.ptr}; }
};

struct HostSchedule {
  std::vector<int32_t> offsets, rows, src_rank, src_slot;
};
HostSchedule host_tables(const RankSchedule& s) {
  HostSchedule h;
  h.offsets.assign(s.expert_offsets.begin(), s.expert_offsets.end());
  h.rows.assign(s.expert_rows.begin(), s.expert_rows.end());
  for (const RouteRow& r : s.rows) {
    h.src_rank.push_back(r.src_rank);
    h.src_slot.push_back(r.src_slot);
  }
  return h;
}

class RoutingSchedule : public ::testing::TestWithParam<RoutingCase> {};

// The per-rank totals schedule_totals adds to a schedule: what the host counts in the routing.
struct Totals {
  std::vector<int64_t> send, recv;
};
Totals host_totals(const std::vector<std::vector<int32_t>>& idx, const HostSchedule& schedule, int64_t dest,
                   int64_t E) {
  const int64_t R = int64_t(idx.size()), El = E / R;
  Totals t{std::vector<int64_t>(R, 0), std::vector<int64_t>(R, 0)};
  for (const int32_t v : idx[dest])
    if (v >= 0 && v < E) ++t.send[v / El];
  for (const int32_t s : schedule.src_rank)
    if (s >= 0) ++t.recv[s];  // -1: a padding row
  return t;
}

TEST_P(RoutingSchedule, MatchesTheCpuScheduleBitwiseAndIsDeterministic) {
  const RoutingCase& c = GetParam();
  const MoeDesc desc = desc_of(c);
  const cuda::RoutingShape shape = shape_of(c);
  ASSERT_EQ(cuda::routed_row_capacity(shape), (schedule_capacity_rows(desc, cuda::kRowAlign) + 3) / 4 * 4);
  const auto idx = routing_of(c, std::hash<std::string>{}(c.name));
  const DeviceRouting droute(idx);
  DeviceSchedule ds(shape);
  ASSERT_TRUE(ds.allocated());
  const int32_t poison = poison_i32();
  for (int64_t dest = 0; dest < c.R; ++dest) {
    SCOPED_TRACE("dest rank " + std::to_string(dest));
    const HostSchedule want =
        host_tables(build_rank_schedule(desc, dest, host_pointers(idx), cuda::kRowAlign));
    const size_t M = want.src_rank.size();
    const cuda::ScheduleArgs a = ds.args(dest, droute.ptrs);
    ASSERT_EQ(cuda::can_implement(a), "");
    const Totals want_totals = host_totals(idx, want, dest, c.E);
    DeviceBuffer<int64_t> send(c.R), recv(c.R);
    HostSchedule first;
    for (int run = 0; run < kRuns; ++run) {
      SCOPED_TRACE("run " + std::to_string(run));
      ds.poison();
      send.poison(0x7f);
      recv.poison(0x7f);
      cuda::build_schedule(a, nullptr);
      cuda::schedule_totals(a, send.ptr, recv.ptr, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_EQ(cuda::read_routing_status(ds.status.ptr, shape, nullptr), "");
      EXPECT_EQ(send.download(), want_totals.send) << "send_counts";
      EXPECT_EQ(recv.download(), want_totals.recv) << "recv_counts";
      HostSchedule got{ds.offsets.download(), ds.rows.download(), ds.src_rank.download(),
                       ds.src_slot.download()};
      if (run == 0) {
        ASSERT_TRUE(same_bits(got.offsets, want.offsets, "expert_offsets", 0, c.E / c.R + 1));
        ASSERT_TRUE(same_bits(got.rows, want.rows, "expert_rows", 0, c.E / c.R));
        ASSERT_TRUE(same_bits(got.src_rank, want.src_rank, "src_rank", 0, M));
        ASSERT_TRUE(same_bits(got.src_slot, want.src_slot, "src_slot", 0, M));
        ASSERT_TRUE(untouched(got.offsets, poison, c.E / c.R + 1, "expert_offsets"));
        ASSERT_TRUE(untouched(got.rows, poison, c.E / c.R, "expert_rows"));
        ASSERT_TRUE(untouched(got.src_rank, poison, M, "src_rank"));
        ASSERT_TRUE(untouched(got.src_slot, poison, M, "src_slot"));
        first = std::move(got);
      } else {
        ASSERT_TRUE(same_bits(got.offsets, first.offsets, "expert_offsets vs run 0"));
        ASSERT_TRUE(same_bits(got.rows, first.rows, "expert_rows vs run 0"));
        ASSERT_TRUE(same_bits(got.src_rank, first.src_rank, "src_rank vs run 0"));
        ASSERT_TRUE(same_bits(got.src_slot, first.src_slot, "src_slot vs run 0"));
      }
    }
  }
}

std::vector<RoutingCase> schedule_cases() {
  return {
      {"balanced_R2", 2, 300, 4, 16, Gen::balanced, 136},
      {"zipf_R4", 4, 1000, 8, 64, Gen::zipf, 520},
      {"uniform_R3_chunk_edges", 3, 513, 6, 48, Gen::uniform, 64},
      {"one_expert_R4", 4, 777, 2, 8, Gen::one_expert, 64},
      {"no_tokens_R2", 2, 0, 4, 16, Gen::zipf, 64},
      {"one_token_R3", 3, 1, 2, 6, Gen::uniform, 8},
      {"experts_equal_ranks_R4_k1", 4, 200, 1, 4, Gen::uniform, 64},
      {"topk1_R1", 1, 1000, 1, 8, Gen::zipf, 64},
      {"many_experts_R1", 1, 3000, 10, 512, Gen::zipf, 64},
      {"many_chunks_R2", 2, 4096, 8, 256, Gen::zipf, 64},
      {"last_expert_R2", 2, 700, 3, 8, Gen::last_expert, 64},
      {"repeated_R1", 1, 129, 4, 4, Gen::repeated, 64},
      {"masked_R2", 2, 600, 8, 32, Gen::masked, 64},
      {"wide_El_R1", 1, 512, 8, 4096, Gen::uniform, 64},
      {"widest_El_R1", 1, 64, 2, 12288, Gen::uniform, 64},
      {"R8", 8, 257, 4, 64, Gen::zipf, 64},
      {"kimi_like_R4", 4, 512, 8, 384, Gen::zipf, 7168},
  };
}

INSTANTIATE_TEST_SUITE_P(Gpu, RoutingSchedule, ::testing::ValuesIn(schedule_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- Bad expert ids: reported, skipped, never written out of bounds ----

TEST(RoutingScheduleStatus, OutOfRangeIdIsReportedWithItsFirstPosition) {
  const RoutingCase c{"bad_ids", 3, 700, 4, 12, Gen::uniform, 64};
  const cuda::RoutingShape shape = shape_of(c);
  const MoeDesc desc = desc_of(c);
  auto idx = routing_of(c, 7);
  idx[2][0] = -2;                 // later in (rank, token, j) order (-1 is an empty slot, not an error)
  idx[1][600 * 4 + 3] = INT_MIN;  // later, in another chunk of rank 1
  idx[1][5 * 4 + 1] = 12 + 3;     // the first bad position: rank 1, token 5, j 1
  idx[1][5 * 4 + 2] = INT_MAX;    // same token, later j
  std::string cpu_message;
  try {
    build_rank_schedule(desc, 0, host_pointers(idx), cuda::kRowAlign);
  } catch (const InvalidArgument& e) {
    cpu_message = e.what();
  }
  ASSERT_EQ(cpu_message, "topk_idx[rank 1][token 5][1] = 15 is out of range [0, 12) and not -1 (no expert)");

  // Valid ids only: what the GPU schedule must hold (bad ids are skipped).
  auto valid = idx;
  for (auto& v : valid) {
    for (int32_t& e : v) e = (e < 0 || e >= c.E) ? -7 : e;
  }
  const DeviceRouting droute(idx);
  DeviceSchedule ds(shape);
  ASSERT_TRUE(ds.allocated());
  const int32_t poison = poison_i32();
  for (int64_t dest = 0; dest < c.R; ++dest) {
    SCOPED_TRACE("dest rank " + std::to_string(dest));
    ds.poison();
    cuda::build_schedule(ds.args(dest, droute.ptrs), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    // The status is sticky over the three builds; the first bad position wins every time.
    EXPECT_EQ(cuda::read_routing_status(ds.status.ptr, shape, nullptr), cpu_message);
    const auto offsets = ds.offsets.download(), rows = ds.rows.download();
    const auto src_rank = ds.src_rank.download(), src_slot = ds.src_slot.download();
    const int64_t El = c.E / c.R;
    ASSERT_LE(offsets[El], ds.capacity);
    ASSERT_TRUE(untouched(src_rank, poison, offsets[El], "src_rank"));
    ASSERT_TRUE(untouched(src_slot, poison, offsets[El], "src_slot"));
    // Each placed row is a valid (rank, slot) routed to this rank's expert, in canonical order.
    for (int64_t e = 0; e < El; ++e) {
      int64_t expected_rows = 0;
      for (int64_t r = 0; r < c.R; ++r) {
        for (int32_t v : valid[r]) expected_rows += v == dest * El + e ? 1 : 0;
      }
      EXPECT_EQ(rows[e], expected_rows) << "expert " << e;
      for (int64_t i = offsets[e]; i < offsets[e] + rows[e]; ++i) {
        ASSERT_TRUE(src_rank[i] >= 0 && src_rank[i] < c.R && src_slot[i] >= 0 && src_slot[i] < c.T * c.k)
            << "row " << i;
        ASSERT_EQ(valid[src_rank[i]][src_slot[i]], dest * El + e) << "row " << i;
        if (i > offsets[e]) {
          ASSERT_LT(int64_t{src_rank[i - 1]} * c.T * c.k + src_slot[i - 1],
                    int64_t{src_rank[i]} * c.T * c.k + src_slot[i])
              << "row " << i << " out of canonical order";
        }
      }
    }
  }
  cudaMemset(ds.status.ptr, 0, sizeof(cuda::RoutingStatus));
  idx[0][0] = -3;  // position 0 itself
  const DeviceRouting droute0(idx);
  cuda::build_schedule(ds.args(2, droute0.ptrs), nullptr);
  EXPECT_EQ(cuda::read_routing_status(ds.status.ptr, shape, nullptr),
            "topk_idx[rank 0][token 0][0] = -3 is out of range [0, 12) and not -1 (no expert)");
}

TEST(RoutingStatusCheck, NonFiniteInputsAreNamedOnEveryRankFirstIndexFirst) {
  // x: bf16 [T=5, H=24] (120 values: the 8-wide vectors, no tail); topk_w: fp32 [5, 3] (15 values:
  // three 4-wide vectors and a tail of 3). Two keys, as two ranks' symmetric words: both get the
  // key. Fresh keys each time.
  const cuda::RoutingShape shape{2, 5, 3, 8};
  Rng rng(77);
  std::vector<uint16_t> x = test::to_bits(test::random_bf16(rng, 5 * 24));
  std::vector<float> w(15, 0.5f);
  DeviceBuffer<uint16_t> dx(x.size());
  DeviceBuffer<float> dw(w.size());
  DeviceBuffer<unsigned long long> keys(2);
  unsigned long long* const key_ptrs[2] = {keys.ptr, keys.ptr + 1};
  auto run = [&](const std::vector<uint16_t>& xs, const std::vector<float>& ws) {
    dx.upload(xs);
    dw.upload(ws);
    cudaMemset(keys.ptr, 0, 2 * sizeof(unsigned long long));
    cuda::check_finite(dx.ptr, false, int64_t(xs.size()), cuda::CheckedTensor::x, 1, key_ptrs, 2, nullptr);
    cuda::check_finite(dw.ptr, true, int64_t(ws.size()), cuda::CheckedTensor::topk_w, 1, key_ptrs, 2, nullptr);
    const std::vector<unsigned long long> k = keys.download();
    EXPECT_EQ(k[0], k[1]) << "every rank's key is the same";
    return cuda::describe_non_finite(k[0], shape, 24);
  };
  EXPECT_EQ(run(x, w), "");
  std::vector<uint16_t> bad_x = x;
  bad_x[3 * 24 + 17] = 0xffc0;  // a NaN with the sign bit (x86's default NaN) still reads "nan"
  bad_x[4 * 24 + 2] = 0xff80;   // -inf, later
  EXPECT_EQ(run(bad_x, w), "x[rank 1][token 3][17] is not finite (nan)");
  std::vector<float> bad_w = w;
  bad_w[14] = INFINITY;  // in the tail
  EXPECT_EQ(run(x, bad_w), "topk_w[rank 1][token 4][2] is not finite (inf)");
  bad_w[1] = -INFINITY;  // an earlier index wins
  EXPECT_EQ(run(x, bad_w), "topk_w[rank 1][token 0][1] is not finite (-inf)");
  EXPECT_EQ(run(bad_x, bad_w), "x[rank 1][token 3][17] is not finite (nan)");  // x before topk_w
  std::vector<float> payload_nan = w;
  const uint32_t bits = 0x7f800001u;  // a NaN whose payload is only in the lower half
  std::memcpy(&payload_nan[6], &bits, 4);
  EXPECT_EQ(run(x, payload_nan), "topk_w[rank 1][token 2][0] is not finite (nan)");
}

TEST(RoutingScheduleArgs, CanImplementNamesTheProblem) {
  const cuda::RoutingShape shape{2, 10, 2, 8};
  DeviceSchedule ds(shape);
  DeviceBuffer<int32_t> idx0(20), idx1(20);
  const std::vector<const int32_t*> ptrs{idx0.ptr, idx1.ptr};
  cuda::ScheduleArgs a = ds.args(0, ptrs);
  EXPECT_EQ(cuda::can_implement(a), "");
  auto expect_reason = [](const std::string& why, const std::string& part) {
    EXPECT_NE(why.find(part), std::string::npos) << "'" << why << "' does not mention '" << part << "'";
  };
  cuda::ScheduleArgs b = a;
  b.shape.num_experts = 7;
  expect_reason(cuda::can_implement(b), "num_experts must be a positive multiple of ranks=2");
  b = a;
  b.shape.ranks = cuda::kMaxRanks + 1;
  expect_reason(cuda::can_implement(b), "ranks must be in [1, 128]");
  b = a;
  b.dest_rank = 2;
  expect_reason(cuda::can_implement(b), "dest_rank must be in [0, 2)");
  b = a;
  b.row_capacity -= 1;
  expect_reason(cuda::can_implement(b), "row_capacity must be in [routed_row_capacity=");
  const std::vector<const int32_t*> null_ptrs{idx0.ptr, nullptr};
  b = ds.args(0, null_ptrs);
  expect_reason(cuda::can_implement(b), "topk_idx[1] is null");
  b = a;
  b.shape.tokens_per_rank = int64_t{1} << 30;
  expect_reason(cuda::can_implement(b), "must fit in int32");
  EXPECT_THROW(cuda::build_schedule(b, nullptr), std::invalid_argument);

  cuda::GatherArgs g;
  g.shape = shape;
  g.hidden = 60;
  g.schedule = ds.view();
  expect_reason(cuda::can_implement(g), "hidden must be a positive multiple of 8");
  cuda::CombineArgs cmb;
  cmb.tokens = 4;
  cmb.hidden = 12;
  expect_reason(cuda::can_implement(cmb), "hidden must be a positive multiple of 8");
}

// ---- Dispatch gather and combine scatter ----

class RoutingRows : public ::testing::TestWithParam<RoutingCase> {};

TEST_P(RoutingRows, GatherAndScatterMatchTheCpuBitwise) {
  const RoutingCase& c = GetParam();
  const MoeDesc desc = desc_of(c);
  const cuda::RoutingShape shape = shape_of(c);
  const int64_t R = c.R, T = c.T, k = c.k, H = c.H;
  Rng rng(std::hash<std::string>{}(c.name) ^ 0x51ull);
  const auto idx = routing_of(c, std::hash<std::string>{}(c.name));
  const DeviceRouting droute(idx);
  DeviceSchedule ds(shape);
  ASSERT_TRUE(ds.allocated());
  const int64_t cap = ds.capacity;

  // Every rank's x [T,H] (bf16) and topk_w [T*k] (fp32, not bf16-rounded), separate buffers.
  std::vector<std::vector<float>> x, w;
  std::vector<DeviceBuffer<uint16_t>> dx;
  std::vector<DeviceBuffer<float>> dw;
  std::vector<DeviceBuffer<uint16_t>> dslots;
  std::vector<DeviceBuffer<float>> dslot_values;
  std::vector<const void*> x_ptrs;
  std::vector<const float*> w_ptrs;
  std::vector<void*> slot_ptrs;
  std::vector<float*> slot_value_ptrs;
  for (int64_t r = 0; r < R; ++r) {
    x.push_back(random_bf16(rng, T * H));
    w.emplace_back(static_cast<size_t>(T * k));
    for (float& v : w.back()) v = static_cast<float>(rng.uniform());
    dx.emplace_back(T * H);
    dx.back().upload(to_bits(x.back()));
    dw.emplace_back(T * k);
    dw.back().upload(w.back());
    dslots.emplace_back(T * k * H + kGuard);
    dslot_values.emplace_back(T * k + kGuard);
    x_ptrs.push_back(dx.back().ptr);
    w_ptrs.push_back(dw.back().ptr);
    slot_ptrs.push_back(dslots.back().ptr);
    slot_value_ptrs.push_back(dslot_values.back().ptr);
  }
  std::vector<const float*> x_host, w_host;
  for (int64_t r = 0; r < R; ++r) {
    x_host.push_back(x[r].data());
    w_host.push_back(w[r].data());
  }
  DeviceBuffer<uint16_t> drows(cap * H), dy_rows(cap * H);
  DeviceBuffer<float> drow_w(cap), drow_values(cap);

  // Combine inputs: every row of the row buffer random (padding rows too: they must be skipped).
  const auto y_rows = random_bf16(rng, cap * H);
  std::vector<float> row_values(static_cast<size_t>(cap));
  for (float& v : row_values) v = static_cast<float>(rng.normal());
  dy_rows.upload(to_bits(y_rows));
  drow_values.upload(row_values);

  // The CPU's combine slots, filled by every destination rank's scatter (NaN = never written).
  std::vector<std::vector<float>> slots_ref(R, std::vector<float>(T * k * H, NAN));
  std::vector<std::vector<float>> slot_values_ref(R, std::vector<float>(T * k, NAN));
  std::vector<float*> slots_ref_ptrs, slot_values_ref_ptrs;
  for (int64_t r = 0; r < R; ++r) {
    slots_ref_ptrs.push_back(slots_ref[r].data());
    slot_values_ref_ptrs.push_back(slot_values_ref[r].data());
  }
  for (int64_t dest = 0; dest < R; ++dest) {
    const RankSchedule s = build_rank_schedule(desc, dest, host_pointers(idx), cuda::kRowAlign);
    ref::scatter_slot_rows<float>(s, H, y_rows.data(), slots_ref_ptrs);
    ref::scatter_slot_rows<float>(s, 1, row_values.data(), slot_values_ref_ptrs);
  }

  std::vector<std::vector<uint16_t>> first_slots(R);
  std::vector<std::vector<float>> first_slot_values(R);
  for (int run = 0; run < kRuns; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    for (auto& b : dslots) b.poison(0xff);  // bf16 0xffff is NaN
    for (auto& b : dslot_values) b.poison(0xff);
    for (int64_t dest = 0; dest < R; ++dest) {
      SCOPED_TRACE("dest rank " + std::to_string(dest));
      const RankSchedule s = build_rank_schedule(desc, dest, host_pointers(idx), cuda::kRowAlign);
      const size_t M = s.rows.size();
      std::vector<float> rows_ref(M * H), row_w_ref(M);
      ref::gather_token_rows<float>(s, k, H, x_host, rows_ref.data());
      ref::gather_slot_values<float>(s, w_host, row_w_ref.data());

      ds.poison();
      drows.poison(0xff);
      drow_w.poison(0xff);
      cuda::build_schedule(ds.args(dest, droute.ptrs), nullptr);
      cuda::GatherArgs g;
      g.shape = shape;
      g.hidden = H;
      g.schedule = ds.view();
      g.x = x_ptrs.data();
      g.rows = drows.ptr;
      g.topk_w = w_ptrs.data();
      g.row_weights = drow_w.ptr;
      ASSERT_EQ(cuda::can_implement(g), "");
      cuda::gather_rows(g, nullptr);
      cuda::ScatterArgs sc;
      sc.shape = shape;
      sc.hidden = H;
      sc.schedule = ds.view();
      sc.rows = dy_rows.ptr;
      sc.slots = slot_ptrs.data();
      ASSERT_EQ(cuda::can_implement(sc), "");
      cuda::scatter_rows(sc, nullptr);
      cuda::ScatterValuesArgs sv;
      sv.shape = shape;
      sv.schedule = ds.view();
      sv.values = drow_values.ptr;
      sv.slot_values = slot_value_ptrs.data();
      ASSERT_EQ(cuda::can_implement(sv), "");
      cuda::scatter_row_values(sv, nullptr);
      CUDA_OK(cudaDeviceSynchronize());

      const auto rows = drows.download();
      const auto row_w = drow_w.download();
      ASSERT_TRUE(same_bits(rows, to_bits(rows_ref), "gathered rows", 0, M * H));
      ASSERT_TRUE(untouched(rows, uint16_t{0xffff}, M * H, "gathered rows"));
      ASSERT_TRUE(same_bits(row_w, row_w_ref, "gathered row weights", 0, M));
      float nan_poison;
      std::memset(&nan_poison, 0xff, sizeof nan_poison);
      ASSERT_TRUE(untouched(row_w, nan_poison, M, "gathered row weights"));

      // With the token links, each token is read once and written into all of its rows: the
      // links as the CPU finds them (next row of the same (rank, token) + 1, bit 31 on all but
      // its first row; the first row), and the same rows and weights, on poisoned buffers.
      DeviceBuffer<uint32_t> links(cuda::token_link_words(shape, cap));
      links.poison(0x7f);
      ASSERT_EQ(cuda::can_implement_links(shape, ds.view(), links.ptr), "");
      cuda::link_token_rows(shape, ds.view(), links.ptr, nullptr);
      drows.poison(0xff);
      drow_w.poison(0xff);
      g.schedule.row_link = links.ptr;
      cuda::gather_rows(g, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      std::map<std::pair<int32_t, int32_t>, std::vector<int64_t>> token_rows;  // (rank, token) -> rows, ascending
      for (size_t i = 0; i < M; ++i)
        if (!s.rows[i].is_padding()) token_rows[{s.rows[i].src_rank, int32_t(s.rows[i].src_slot / k)}].push_back(i);
      std::vector<uint32_t> links_ref(M, 0u);
      std::vector<int32_t> first_ref(M, -1);
      int64_t copies = 0;
      for (const auto& [token, rows_of] : token_rows) {
        for (size_t n = 0; n < rows_of.size(); ++n) {
          links_ref[rows_of[n]] = (n + 1 < rows_of.size() ? uint32_t(rows_of[n + 1] + 1) : 0u) |
                                  (n > 0 ? cuda::kLinkNotFirst : 0u);
          first_ref[rows_of[n]] = int32_t(rows_of[0]);
        }
        copies += int64_t(rows_of.size()) - 1;
      }
      const auto got_links = links.download();
      ASSERT_TRUE(same_bits(std::vector<uint32_t>(got_links.begin(), got_links.begin() + M), links_ref, "row links"));
      std::vector<int32_t> got_first(M);
      std::memcpy(got_first.data(), got_links.data() + cap, M * sizeof(int32_t));
      ASSERT_TRUE(same_bits(got_first, first_ref, "token first rows"));
      const auto linked_rows = drows.download();
      const auto linked_w = drow_w.download();
      ASSERT_TRUE(same_bits(linked_rows, to_bits(rows_ref), "gathered rows (token links)", 0, M * H));
      ASSERT_TRUE(untouched(linked_rows, uint16_t{0xffff}, M * H, "gathered rows (token links)"));
      ASSERT_TRUE(same_bits(linked_w, row_w_ref, "gathered row weights (token links)", 0, M));
      ASSERT_TRUE(untouched(linked_w, nan_poison, M, "gathered row weights (token links)"));
      if (run == 0) std::printf("[ %s ] dest %lld: %lld of %zu rows copied from their token's first row\n", c.name.c_str(),
                                static_cast<long long>(dest), static_cast<long long>(copies), M);
    }
    for (int64_t r = 0; r < R; ++r) {
      SCOPED_TRACE("source rank " + std::to_string(r));
      auto slots = dslots[r].download();
      auto slot_values = dslot_values[r].download();
      // Every (token, j) slot written exactly as the CPU's scatter (which leaves no NaN), guards untouched.
      ASSERT_TRUE(same_bits(slots, to_bits(slots_ref[r]), "combine slots", 0, T * k * H));
      ASSERT_TRUE(untouched(slots, uint16_t{0xffff}, T * k * H, "combine slots"));
      ASSERT_TRUE(same_bits(slot_values, slot_values_ref[r], "slot values", 0, T * k));
      if (run == 0) {
        first_slots[r] = std::move(slots);
        first_slot_values[r] = std::move(slot_values);
      } else {
        ASSERT_TRUE(same_bits(slots, first_slots[r], "combine slots vs run 0"));
        ASSERT_TRUE(same_bits(slot_values, first_slot_values[r], "slot values vs run 0"));
      }
    }
  }
}

std::vector<RoutingCase> rows_cases() {
  return {
      {"balanced_R2_H136", 2, 300, 4, 16, Gen::balanced, 136},
      {"zipf_R4_H520", 4, 200, 8, 64, Gen::zipf, 520},
      {"one_expert_R3_H64", 3, 150, 2, 6, Gen::one_expert, 64},
      {"one_token_R3_H8", 3, 1, 2, 6, Gen::uniform, 8},
      {"no_tokens_R2", 2, 0, 4, 16, Gen::zipf, 64},
      {"experts_equal_ranks_R4_k1", 4, 100, 1, 4, Gen::uniform, 24},
      {"last_expert_R2_repeats", 2, 90, 3, 8, Gen::last_expert, 64},
      {"kimi_width_R2", 2, 300, 8, 32, Gen::zipf, 7168},
  };
}

INSTANTIATE_TEST_SUITE_P(Gpu, RoutingRows, ::testing::ValuesIn(rows_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- Epilogues ----

struct EpilogueCase {
  std::string name;
  int64_t T, H, k;
  bool shared;
  bool empty_slots = false;  // about a third of the slots empty (id -1), their rows and weights NaN
};
void PrintTo(const EpilogueCase& c, std::ostream* os) {
  *os << c.name << " (T=" << c.T << " H=" << c.H << " k=" << c.k << " shared=" << c.shared
      << " empty_slots=" << c.empty_slots << ")";
}

class RoutingEpilogues : public ::testing::TestWithParam<EpilogueCase> {};

TEST_P(RoutingEpilogues, MatchTheCpuBitwiseAndAreDeterministic) {
  const EpilogueCase& c = GetParam();
  const int64_t T = c.T, H = c.H, k = c.k;
  Rng rng(std::hash<std::string>{}(c.name) ^ 0xe9ull);
  // Slots of mixed magnitudes (so the fp32 sum rounds, and its bf16 rounding is tested hard),
  // with zeros and negative zeros in the first slot (0 + w*(-0) must give +0, as on the CPU).
  std::vector<float> slots(static_cast<size_t>(T * k * H));
  for (size_t i = 0; i < slots.size(); ++i) {
    const double scale = (i / H) % 3 == 0 ? 1e-3 : ((i / H) % 3 == 1 ? 1.0 : 3e2);
    slots[i] = round_to_bf16(static_cast<float>(rng.normal() * scale));
  }
  for (int64_t i = 0; i < std::min<int64_t>(H, static_cast<int64_t>(slots.size())); ++i)
    slots[i] = i % 2 ? -0.0f : 0.0f;
  std::vector<float> topk_w(static_cast<size_t>(T * k));
  for (float& v : topk_w) v = static_cast<float>(rng.normal());
  const auto shared = c.shared ? random_bf16(rng, T * H, 4.0) : std::vector<float>();
  // Empty slots: no row was written there (NaN rows and weights stand for whatever the buffers
  // hold), and every token of a third of the tokens is empty (y = the shared expert or 0).
  std::vector<int32_t> ids(static_cast<size_t>(T * k), 0);
  std::vector<float> pushed_dw(static_cast<size_t>(T * k));  // d topk_w as the rows pushed it
  for (float& v : pushed_dw) v = static_cast<float>(rng.normal());
  if (c.empty_slots) {
    for (int64_t s = 0; s < T * k; ++s) {
      if ((s / k) % 3 != 0 && rng.next() % 3 != 0) continue;
      ids[static_cast<size_t>(s)] = kNoExpert;
      topk_w[static_cast<size_t>(s)] = std::numeric_limits<float>::quiet_NaN();
      pushed_dw[static_cast<size_t>(s)] = std::numeric_limits<float>::quiet_NaN();
      std::fill_n(slots.begin() + s * H, H, std::numeric_limits<float>::quiet_NaN());
    }
  }
  std::vector<float> dw_want(pushed_dw);
  for (size_t s = 0; s < ids.size(); ++s)
    if (ids[s] == kNoExpert) dw_want[s] = 0.0f;

  std::vector<float> y_ref(static_cast<size_t>(T * H)), dx_ref(static_cast<size_t>(T * H));
  ref::combine_epilogue<float>(T, H, k, c.shared ? shared.data() : nullptr, slots.data(), topk_w.data(), ids.data(),
                               y_ref.data(), ref::Rounding::bf16);
  ref::dispatch_grad_epilogue<float>(T, H, k, c.shared ? shared.data() : nullptr, slots.data(), ids.data(),
                                     dx_ref.data(), ref::Rounding::bf16);

  DeviceBuffer<uint16_t> dslots(slots.size()), dshared(shared.size()), dy(T * H + kGuard),
      ddx(T * H + kGuard);
  DeviceBuffer<float> dw(topk_w.size()), dpushed(pushed_dw.size()), d_topk_w(pushed_dw.size() + kGuard);
  DeviceBuffer<int32_t> dids(ids.size());
  dslots.upload(to_bits(slots));
  dshared.upload(to_bits(shared));
  dw.upload(topk_w);
  dpushed.upload(pushed_dw);
  dids.upload(ids);
  cuda::CombineArgs ca;
  ca.tokens = T;
  ca.hidden = H;
  ca.topk = k;
  ca.y_shared = c.shared ? dshared.ptr : nullptr;
  ca.slots = dslots.ptr;
  ca.topk_w = dw.ptr;
  ca.topk_idx = c.empty_slots ? dids.ptr : nullptr;
  ca.y = dy.ptr;
  ASSERT_EQ(cuda::can_implement(ca), "");
  cuda::DispatchGradArgs da;
  da.tokens = T;
  da.hidden = H;
  da.topk = k;
  da.dx_shared = c.shared ? dshared.ptr : nullptr;
  da.slots = dslots.ptr;
  da.topk_idx = c.empty_slots ? dids.ptr : nullptr;
  da.slot_values = dpushed.ptr;
  da.d_topk_w = d_topk_w.ptr;
  da.dx = ddx.ptr;
  ASSERT_EQ(cuda::can_implement(da), "");

  const auto y_want = to_bits(y_ref), dx_want = to_bits(dx_ref);
  std::vector<uint16_t> first_y, first_dx;
  for (int run = 0; run < kRuns; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    dy.poison(0xff);
    ddx.poison(0xff);
    d_topk_w.poison(0xff);
    cuda::combine_epilogue(ca, nullptr);
    cuda::dispatch_grad_epilogue(da, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    auto y = dy.download(), dx = ddx.download();
    const auto dtw = d_topk_w.download();
    ASSERT_TRUE(same_bits(dtw, dw_want, "d topk_w (index = token*k + j)", 0, T * k));
    float poison_f32;
    std::memset(&poison_f32, 0xff, sizeof poison_f32);
    ASSERT_TRUE(untouched(dtw, poison_f32, T * k, "d topk_w"));
    ASSERT_TRUE(same_bits(y, y_want, "combine y (index = token*H + column)", 0, T * H));
    ASSERT_TRUE(same_bits(dx, dx_want, "dispatch-grad dx (index = token*H + column)", 0, T * H));
    ASSERT_TRUE(untouched(y, uint16_t{0xffff}, T * H, "combine y"));
    ASSERT_TRUE(untouched(dx, uint16_t{0xffff}, T * H, "dispatch-grad dx"));
    if (run == 0) {
      first_y = std::move(y);
      first_dx = std::move(dx);
    } else {
      ASSERT_TRUE(same_bits(y, first_y, "combine y vs run 0"));
      ASSERT_TRUE(same_bits(dx, first_dx, "dispatch-grad dx vs run 0"));
    }
  }
}

std::vector<EpilogueCase> epilogue_cases() {
  return {
      {"no_tokens", 0, 64, 2, true},        {"one_token_k1_no_shared", 1, 8, 1, false},
      {"k4_shared", 300, 520, 4, true},     {"k4_no_shared", 300, 520, 4, false},
      {"k8_kimi_width", 77, 7168, 8, true}, {"k10_qwen_like", 1000, 128, 10, true},
      {"k4_empty_slots", 300, 520, 4, true, true}, {"k8_empty_slots_no_shared", 77, 264, 8, false, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Gpu, RoutingEpilogues, ::testing::ValuesIn(epilogue_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace mok
