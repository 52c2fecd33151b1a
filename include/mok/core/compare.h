// The one tolerance policy (STYLE.md 8): bitwise for data movement and determinism; relative
// error ||out - ref|| / ||ref|| with a stated bound for arithmetic. NaN never passes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace mok {

// Bound on ||out - ref|| / ||ref|| for a bf16 path against an fp64 (or fp32) computation.
inline constexpr double kBf16RelTolerance = 1e-2;

struct Comparison {
  double rel_error = 0;       // ||out - ref|| / ||ref|| (||out|| when ref is all zeros)
  int64_t non_finite = -1;    // first index where out is NaN/Inf but ref is not, or -1
  int64_t worst = -1;         // index of the largest absolute difference
  double worst_out = 0, worst_ref = 0;

  bool within(double bound) const { return non_finite < 0 && rel_error <= bound; }
  std::string describe(const std::string& what) const {
    std::ostringstream s;
    s << what << ": rel error " << rel_error;
    if (non_finite >= 0) s << ", non-finite at index " << non_finite;
    if (worst >= 0) s << ", worst at index " << worst << " (out " << worst_out << ", ref " << worst_ref << ")";
    return s.str();
  }
};

template <class A, class B>
Comparison compare(const A* out, const B* ref, int64_t n) {
  Comparison c;
  double diff2 = 0, ref2 = 0, out2 = 0, worst = -1;
  for (int64_t i = 0; i < n; ++i) {
    const double o = static_cast<double>(out[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(o) && std::isfinite(r) && c.non_finite < 0) c.non_finite = i;
    const double d = o - r;
    diff2 += d * d;
    ref2 += r * r;
    out2 += o * o;
    if (!(std::fabs(d) <= worst)) {  // also catches NaN
      worst = std::isnan(d) ? INFINITY : std::fabs(d);
      c.worst = i;
      c.worst_out = o;
      c.worst_ref = r;
    }
  }
  c.rel_error = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(out2);
  if (std::isnan(c.rel_error)) c.rel_error = INFINITY;
  return c;
}

template <class A, class B>
Comparison compare(const std::vector<A>& out, const std::vector<B>& ref) {
  if (out.size() != ref.size()) {
    Comparison c;
    c.rel_error = INFINITY;
    return c;
  }
  return compare(out.data(), ref.data(), static_cast<int64_t>(out.size()));
}

// First index whose bits differ, or -1 when the two are bitwise identical.
template <class T>
int64_t first_bit_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace mok
