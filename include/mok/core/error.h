// Errors raised by MoK's host code. Every message names the offending field and value.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace mok {

// Bad input from the caller (shape, value, configuration). Python maps it to ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A request that is valid but that this build cannot serve (e.g. a precision not implemented yet).
class NotSupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace mok

// MOK_REQUIRE(cond, parts...): throws mok::InvalidArgument with the concatenated parts.
#define MOK_REQUIRE(cond, ...)                                            \
  do {                                                                    \
    if (!(cond)) throw ::mok::InvalidArgument(::mok::detail::concat(__VA_ARGS__)); \
  } while (0)
