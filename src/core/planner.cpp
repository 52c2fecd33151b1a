#include "mok/core/planner.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "mok/core/error.h"
#include "mok/core/schedule.h"
#include "mok/core/symmetric_layout.h"

namespace mok {
namespace {

constexpr int64_t kDefaultRingBudget = int64_t{512} << 20;
// Peer-read rate one SM's bulk copies sustain over NVLink: a lead until the megakernel measures it.
constexpr double kPeerGbpsPerSm = 24.0;
constexpr int kLocalGatherSms = 4;
constexpr int64_t kAlign = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
int64_t aligned(int64_t bytes) { return round_up(bytes, kAlign); }

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

void finish_cost(PassCost& c, const DeviceFacts& dev) {
  c.gemm_ms = dev.bf16_tflops > 0 ? c.flops / (dev.bf16_tflops * 1e12) * 1e3 : 0;
  c.hbm_ms = dev.hbm_gbps > 0 ? c.hbm_bytes / (dev.hbm_gbps * 1e9) * 1e3 : 0;
  c.nvlink_ms = dev.nvlink_gbps > 0 ? c.nvlink_bytes / (dev.nvlink_gbps * 1e9) * 1e3 : 0;
  c.floor_ms = std::max({c.gemm_ms, c.hbm_ms, c.nvlink_ms});
  c.bound_by = c.floor_ms == c.gemm_ms ? "GEMM" : c.floor_ms == c.hbm_ms ? "HBM" : "NVLink";
}

}  // namespace

DeviceFacts DeviceFacts::h200() {
  // 132 SMs, 141 GB HBM3e; rates as measured on this workplace's H200s (KINDS.md, 2026-11):
  // bf16 8192^3 matmul 769-798 TFLOP/s, device copy ~4.3 TB/s, peer read ~372 GB/s.
  return {"h200", 132, int64_t{143771} << 20, 790.0, 4300.0, 372.0};
}
DeviceFacts DeviceFacts::h100() { return {"h100", 132, int64_t{81559} << 20, 790.0, 3000.0, 372.0}; }
DeviceFacts DeviceFacts::cpu() { return {"cpu", 2, int64_t{24} << 30, 0.05, 20.0, 0.0}; }

DeviceFacts find_device(const std::string& name) {
  if (name == "h200") return DeviceFacts::h200();
  if (name == "h100") return DeviceFacts::h100();
  if (name == "cpu") return DeviceFacts::cpu();
  throw InvalidArgument("unknown device '" + name + "'; known devices: h200, h100, cpu");
}

DeviceFacts facts_for_gpu(const std::string& device_name, int sm_count, int64_t memory_bytes) {
  MOK_REQUIRE(sm_count > 0, "a GPU has at least one SM, got sm_count=", sm_count, " for '", device_name, "'");
  // Whole words of the name: "NVIDIA H200 NVL" is an H200, "NVIDIA GH200 480GB" an H200-class
  // GPU (a Grace Hopper superchip's), "NVIDIA H100 80GB HBM3" an H100; "H800" or "H20" match
  // neither and get no rates.
  std::istringstream words(device_name);
  std::string word;
  while (words >> word) {
    std::transform(word.begin(), word.end(), word.begin(), [](unsigned char c) { return std::tolower(c); });
    const char* known = word == "h200" || word == "gh200" ? "h200" : word == "h100" ? "h100" : nullptr;
    if (known != nullptr) {
      DeviceFacts facts = find_device(known);
      facts.sm_count = sm_count;
      if (memory_bytes > 0) facts.memory_bytes = memory_bytes;
      return facts;
    }
  }
  DeviceFacts facts;
  facts.name = device_name;
  facts.sm_count = sm_count;
  facts.memory_bytes = memory_bytes;
  return facts;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

int comm_ctas_for_peer_reads(const MoeDesc& desc, const DeviceFacts& device) {
  // At most a quarter of the SMs, and never all of them (a device of 2 "SMs", the CPU backend's
  // nominal one, keeps 1 for compute).
  const int most = std::max(1, std::min(std::max(2, device.sm_count / 4), device.sm_count - 1));
  if (desc.ranks == 1 || device.nvlink_gbps <= 0) return std::min(kLocalGatherSms, most);
  const int needed = static_cast<int>(std::ceil(device.nvlink_gbps / kPeerGbpsPerSm));
  const int even = (needed + 1) / 2 * 2;
  return std::clamp(even, std::min(4, most), most);
}

int64_t minibatch_rows_for_two_waves(const MoeDesc& desc, const TileShape& tiles, int compute_sms) {
  MOK_REQUIRE(compute_sms >= 1, "compute SMs must be >= 1, got ", compute_sms);
  const int64_t n_gate_up = ceil_div(2 * desc.intermediate, tiles.block_n_gate_up);
  const int64_t n_down = ceil_div(desc.hidden, tiles.block_n_down);
  const int64_t narrowest = std::min(n_gate_up, n_down);
  const int64_t row_tiles = ceil_div(2 * int64_t{compute_sms}, narrowest);
  return row_tiles * tiles.block_m;
}

int64_t ring_row_bytes(const MoeDesc& desc) {
  // What the ring holds per row, as built: the pulled x row and its h row (bf16). g|u, the
  // backward's rows and the combine slots live outside it. (Until session 7 this charged every
  // buffer a row touches, 3.7x kimi's and 5.3x mixtral's real bytes, and the ring came out at 3
  // and 1 minibatches where the budget holds 13 and 6.)
  return 2 * desc.hidden + 2 * desc.intermediate;
}

int64_t symmetric_bytes(const MoeDesc& desc) {
  return SymmetricLayout::make(desc.tokens_per_rank, desc.hidden, desc.topk, desc.ranks).total;
}

PassCost forward_cost(const MoeDesc& desc, const DeviceFacts& device) {
  const double T = static_cast<double>(desc.tokens_per_rank), H = static_cast<double>(desc.hidden);
  const double I = static_cast<double>(desc.intermediate), k = static_cast<double>(desc.topk);
  const double El = static_cast<double>(desc.local_experts()), Is = static_cast<double>(desc.shared_intermediate);
  const double R = static_cast<double>(desc.ranks);
  const double rows = T * k;  // per rank under balanced routing
  PassCost c;
  c.flops = 6.0 * rows * H * I + 6.0 * T * H * Is;
  // The fewest bytes the design must move: weights once, x in and y out once, each routed row
  // landing in the ring once, each combine slot written once and read once.
  c.hbm_bytes = 2.0 * 3.0 * (El * I + Is) * H + 2.0 * T * H * 2.0 + rows * H * 2.0 * 3.0;
  // Per direction: pulled rows come in, pushed results go out, and the peers do the same to us.
  c.nvlink_bytes = 2.0 * rows * H * 2.0 * (R - 1.0) / R;
  finish_cost(c, device);
  return c;
}

PassCost backward_cost(const MoeDesc& desc, const DeviceFacts& device, bool replays) {
  const double T = static_cast<double>(desc.tokens_per_rank), H = static_cast<double>(desc.hidden);
  const double I = static_cast<double>(desc.intermediate), k = static_cast<double>(desc.topk);
  const double El = static_cast<double>(desc.local_experts()), Is = static_cast<double>(desc.shared_intermediate);
  const double R = static_cast<double>(desc.ranks);
  const double rows = T * k;
  PassCost c;
  // dgrad (down: 2MHI, gate+up: 4MHI) + wgrad (6MHI); a replay recomputes gate/up (4MHI).
  c.flops = 12.0 * rows * H * I + 12.0 * T * H * Is + (replays ? 4.0 * rows * H * I : 0.0);
  // Weights read, fp32 weight gradients written, dy in, dx out, dy and x rows land in the ring,
  // dx slots written and read.
  c.hbm_bytes = 2.0 * 3.0 * (El * I + Is) * H + 4.0 * 3.0 * (El * I + Is) * H + 2.0 * T * H * 2.0 +
                rows * H * 2.0 * 4.0;
  c.nvlink_bytes = (2.0 + (replays ? 1.0 : 0.0)) * rows * H * 2.0 * (R - 1.0) / R;
  finish_cost(c, device);
  return c;
}

MoeConfig plan(const MoeDesc& desc, const DeviceFacts& device, const PlanOverrides& ov) {
  desc.validate();
  MOK_REQUIRE(device.sm_count >= 2, "device '", device.name, "' must have >= 2 SMs, got ",
              device.sm_count);
  MoeConfig cfg;
  cfg.desc = desc;
  cfg.device = device;
  const TileShape& t = cfg.tiles;
  std::ostringstream why;
  why << "plan for " << desc.to_string() << " on " << device.name << " (" << device.sm_count
      << " SMs, " << device.bf16_tflops << " TFLOP/s bf16, " << device.hbm_gbps << " GB/s HBM, "
      << device.nvlink_gbps << " GB/s NVLink per direction)\n";

  // Comm SMs: none by default. The three warps of every CTA's producer warpgroup that issue no
  // TMA loads pull the rows (measured on 2 H200s: a 0.4-10% faster forward than 16 comm SMs on
  // every preset tried, bench/results/2026-11-30-h200-session5). Given SMs are comm CTAs.
  if (ov.comm_sms) {
    MOK_REQUIRE(*ov.comm_sms >= 0 && *ov.comm_sms < device.sm_count, "comm_sms must be in [0, ",
                device.sm_count, "), got ", *ov.comm_sms);
    cfg.comm_sms = *ov.comm_sms;
    why << "- comm SMs: " << cfg.comm_sms << " (given)"
        << (cfg.comm_sms == 0 ? ": 3 warps of every CTA pull the rows" : "") << "\n";
  } else {
    cfg.comm_sms = 0;
    why << "- comm SMs: 0: 3 warps of every CTA pull the rows";
    if (desc.ranks == 1 || device.nvlink_gbps <= 0) {
      why << " (" << (desc.ranks == 1 ? "one rank" : "no peer links on this device")
          << ": a local row gather)\n";
    } else {
      why << " (comm CTAs instead would take ~" << comm_ctas_for_peer_reads(desc, device) << " SMs for "
          << device.nvlink_gbps << " GB/s of peer reads at ~" << kPeerGbpsPerSm << " GB/s per SM)\n";
    }
  }
  cfg.compute_sms = device.sm_count - cfg.comm_sms;

  // Minibatch: the smallest whose narrowest grouped GEMM has two full waves of tiles.
  cfg.expected_rows = desc.routed_slots();
  const int64_t n_gate_up = ceil_div(2 * desc.intermediate, t.block_n_gate_up);
  const int64_t n_down = ceil_div(desc.hidden, t.block_n_down);
  if (ov.minibatch_rows) {
    MOK_REQUIRE(*ov.minibatch_rows > 0 && *ov.minibatch_rows % t.block_m == 0,
                "minibatch_rows must be a positive multiple of the row tile ", t.block_m, ", got ",
                *ov.minibatch_rows);
    cfg.minibatch_rows = *ov.minibatch_rows;
    why << "- minibatch: " << cfg.minibatch_rows << " rows (given)\n";
  } else {
    const int64_t two_waves = minibatch_rows_for_two_waves(desc, t, cfg.compute_sms);
    const int64_t all_rows = std::max(t.block_m, round_up(cfg.expected_rows, t.block_m));
    cfg.minibatch_rows = std::min(two_waves, all_rows);
    why << "- minibatch: " << cfg.minibatch_rows << " rows: the narrowest grouped GEMM ("
        << (n_gate_up <= n_down ? "gate|up, 2I=" : "down, H=")
        << (n_gate_up <= n_down ? 2 * desc.intermediate : desc.hidden) << " -> "
        << std::min(n_gate_up, n_down) << " column tiles) needs " << two_waves / t.block_m
        << " row tiles of " << t.block_m << " for two waves over " << cfg.compute_sms
        << " compute SMs";
    if (cfg.minibatch_rows < two_waves) {
      why << "; capped at the " << cfg.expected_rows << " rows a rank expects (T*k)";
    }
    why << "\n";
  }

  // Ring: as many minibatches as the budget holds, at least one, at most every row that can come.
  cfg.ring_row_bytes = ring_row_bytes(desc);
  cfg.schedule_capacity_rows = schedule_capacity_rows(desc, t.block_m);
  const int64_t most_rows = std::max(cfg.minibatch_rows, round_up(cfg.schedule_capacity_rows, cfg.minibatch_rows));
  if (ov.ring_rows) {
    MOK_REQUIRE(*ov.ring_rows > 0 && *ov.ring_rows % cfg.minibatch_rows == 0,
                "ring_rows must be a positive multiple of minibatch_rows=", cfg.minibatch_rows,
                ", got ", *ov.ring_rows);
    cfg.ring_rows = *ov.ring_rows;
    why << "- ring: " << cfg.ring_rows << " rows (given)";
  } else {
    const int64_t budget = ov.ring_budget_bytes.value_or(kDefaultRingBudget);
    MOK_REQUIRE(budget > 0, "ring_budget_bytes must be > 0, got ", budget);
    const int64_t fit = budget / cfg.ring_row_bytes / cfg.minibatch_rows * cfg.minibatch_rows;
    cfg.ring_rows = std::clamp(fit, cfg.minibatch_rows, most_rows);
    why << "- ring: " << cfg.ring_rows << " rows (" << cfg.ring_rows / cfg.minibatch_rows
        << " minibatches) x " << format_bytes(static_cast<double>(cfg.ring_row_bytes))
        << " per row, from a budget of " << format_bytes(static_cast<double>(budget));
    if (fit < cfg.minibatch_rows) why << " (raised to one minibatch)";
  }
  cfg.keeps_forward_context = cfg.ring_rows >= cfg.expected_rows;
  // A training forward keeps every row's x, g|u and h outside the ring, whatever the ring holds;
  // with save_context=False it keeps only x and its schedule, and the backward replays the pull
  // and gate|up of every row (megakernel.h: MoeBackwardArgs::replay).
  const int64_t context_bytes = cfg.expected_rows * (2 * desc.hidden + 6 * desc.intermediate);
  why << "; " << (cfg.keeps_forward_context ? "the expected rows all fit the ring"
                                            : "the expected rows do not all fit the ring")
      << "\n- training context: the forward keeps x, g|u and h of every row for the backward, "
      << format_bytes(static_cast<double>(context_bytes))
      << " per rank under balanced routing (outside the ring; save_context=False keeps only x and the "
         "schedule, and the backward replays the pull and gate|up)\n";
  // Balanced routing gives each expert the floor or the ceiling of the mean; the ceiling is padded.
  cfg.rows_per_expert = static_cast<double>(desc.ranks * desc.tokens_per_rank * desc.topk) /
                        static_cast<double>(desc.num_experts);
  const auto most_per_expert = static_cast<int64_t>(std::ceil(cfg.rows_per_expert));
  cfg.padded_rows_per_expert = round_up(most_per_expert, t.block_m);
  cfg.padding_share = cfg.padded_rows_per_expert > 0
                          ? 1.0 - cfg.rows_per_expert / static_cast<double>(cfg.padded_rows_per_expert)
                          : 0.0;
  why << "- padding: " << fmt("%.1f", cfg.rows_per_expert) << " rows per expert under balanced routing, "
      << cfg.padded_rows_per_expert << " in " << t.block_m << "-row tiles: " << fmt("%.0f", 100.0 * cfg.padding_share)
      << "% of the expert GEMMs' rows are padding (uneven routing pads about half a tile per expert)\n";
  why << "- schedule table: sized for " << cfg.schedule_capacity_rows
      << " rows (R*T*k plus padding): any routing skew fits, nothing is dropped\n";

  cfg.workspace.symmetric = symmetric_bytes(desc);
  cfg.workspace.schedule = aligned(cfg.schedule_capacity_rows * 8) + aligned((desc.local_experts() + 1) * 8) +
                           aligned(desc.local_experts() * desc.ranks * 4);
  cfg.workspace.ring = cfg.ring_rows * cfg.ring_row_bytes;
  why << "- workspace per rank: symmetric " << format_bytes(static_cast<double>(cfg.workspace.symmetric))
      << ", schedule " << format_bytes(static_cast<double>(cfg.workspace.schedule)) << ", ring "
      << format_bytes(static_cast<double>(cfg.workspace.ring)) << ", total "
      << format_bytes(static_cast<double>(cfg.workspace.total())) << "\n";

  cfg.forward = forward_cost(desc, device);
  cfg.backward = backward_cost(desc, device, /*replays=*/false);  // the context is kept (above)

  // The backward's path: the megakernel hides the dy pull and the dx push behind its GEMMs but
  // costs its GEMMs a few percent; it pays where the communication is a large share.
  const double comm_share = cfg.backward.gemm_ms > 0 ? cfg.backward.nvlink_ms / cfg.backward.gemm_ms : 0.0;
  if (ov.fused_backward) {
    cfg.fused_backward = *ov.fused_backward;
    why << "- backward path: " << (cfg.fused_backward ? "one megakernel launch" : "stage kernels") << " (given)\n";
  } else {
    cfg.fused_backward = comm_share >= kFusedBackwardCommShare;
    why << "- backward path: " << (cfg.fused_backward ? "one megakernel launch" : "stage kernels") << ": its NVLink time is "
        << fmt("%.2f", comm_share) << " of its GEMM time (the megakernel from " << kFusedBackwardCommShare << ")\n";
  }
  auto describe = [&](const char* name, const PassCost& c) {
    why << "- " << name << ": " << fmt("%.3g", c.flops / 1e12) << " TFLOP ("
        << fmt("%.3f", c.gemm_ms) << " ms), HBM " << format_bytes(c.hbm_bytes) << " ("
        << fmt("%.3f", c.hbm_ms) << " ms), NVLink " << format_bytes(c.nvlink_bytes) << " ("
        << fmt("%.3f", c.nvlink_ms) << " ms): floor " << fmt("%.3f", c.floor_ms) << " ms, "
        << c.bound_by << "-bound\n";
  };
  describe("forward", cfg.forward);
  describe("backward", cfg.backward);
  cfg.explanation = why.str();
  return cfg;
}

}  // namespace mok
