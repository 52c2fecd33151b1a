#include "mok/core/desc.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "mok/core/error.h"

namespace mok {

const char* to_string(Precision p) {
  switch (p) {
    case Precision::bf16: return "bf16";
    case Precision::fp8_block: return "fp8_block";
    case Precision::fp8_dgrad: return "fp8_dgrad";
  }
  return "unknown";
}

Precision parse_precision(const std::string& name) {
  if (name == "bf16") return Precision::bf16;
  if (name == "fp8_block" || name == "fp8") return Precision::fp8_block;
  if (name == "fp8_dgrad") return Precision::fp8_dgrad;
  throw InvalidArgument("precision '" + name + "' is not one of: bf16, fp8_block (or fp8), fp8_dgrad");
}

void MoeDesc::validate() const {
  // Sizes stay far below int32 row counts times widths so that every int64 product is safe, and
  // the row index of a (token, j) slot, t*k + j, fits in int32 (the GPU schedule stores it so).
  constexpr int64_t kMaxDim = int64_t{1} << 20;
  MOK_REQUIRE(tokens_per_rank >= 0, "tokens_per_rank must be >= 0, got ", tokens_per_rank);
  MOK_REQUIRE(hidden >= 1 && hidden <= kMaxDim, "hidden must be in [1, ", kMaxDim, "], got ", hidden);
  MOK_REQUIRE(intermediate >= 1 && intermediate <= kMaxDim, "intermediate must be in [1, ", kMaxDim,
              "], got ", intermediate);
  MOK_REQUIRE(num_experts >= 1 && num_experts <= 65536, "num_experts must be in [1, 65536], got ",
              num_experts);
  // topk may exceed num_experts: a token may name an expert in several slots (each counts) and
  // leave slots empty (-1); the layer over several domains gives each domain all k slots.
  MOK_REQUIRE(topk >= 1, "topk must be >= 1, got ", topk);
  MOK_REQUIRE(ranks >= 1 && ranks <= 4096, "ranks must be in [1, 4096], got ", ranks);
  MOK_REQUIRE(num_experts % ranks == 0, "num_experts=", num_experts, " must be divisible by ranks=",
              ranks);
  MOK_REQUIRE(shared_intermediate >= 0 && shared_intermediate <= kMaxDim,
              "shared_intermediate must be in [0, ", kMaxDim, "] (0 = no shared expert), got ",
              shared_intermediate);
  MOK_REQUIRE(tokens_per_rank * topk <= std::numeric_limits<int32_t>::max(),
              "tokens_per_rank*topk must fit in int32, got ", tokens_per_rank, "*", topk);
  MOK_REQUIRE(tokens_per_rank * topk * ranks <= std::numeric_limits<int32_t>::max(),
              "tokens_per_rank*topk*ranks (the most rows one rank can receive) must fit in int32, got ",
              tokens_per_rank * topk * ranks);
  if (swiglu_limit) {
    MOK_REQUIRE(std::isfinite(*swiglu_limit) && *swiglu_limit > 0.0f,
                "swiglu_limit must be a finite value > 0, got ", *swiglu_limit);
  }
  if (fp8_forward(precision)) {
    MOK_REQUIRE(hidden % 128 == 0, mok::to_string(precision),
                " needs hidden % 128 == 0 (128-wide scale blocks), got ", hidden);
    MOK_REQUIRE(intermediate % 128 == 0, mok::to_string(precision),
                " needs intermediate % 128 == 0 (128-wide scale blocks), got ", intermediate);
  }
}

std::string MoeDesc::to_string() const {
  std::ostringstream out;
  out << "T=" << tokens_per_rank << " H=" << hidden << " I=" << intermediate << " E=" << num_experts
      << " k=" << topk << " R=" << ranks << " shared=" << shared_intermediate << " limit=";
  if (swiglu_limit) {
    out << *swiglu_limit;
  } else {
    out << "none";
  }
  out << " " << mok::to_string(precision);
  return out.str();
}

}  // namespace mok
