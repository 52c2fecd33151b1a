// A progress line on stderr for long runs: redrawn in place on a terminal, silent otherwise.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace mok::cli {

class Progress {
 public:
  Progress(int64_t total, std::string label)
      : total_(total), label_(std::move(label)), tty_(isatty(fileno(stderr)) != 0),
        start_(std::chrono::steady_clock::now()) {}
  ~Progress() { finish(); }

  void step(const std::string& what) {
    ++done_;
    if (!tty_) return;
    const int width = 30;
    const int filled = total_ > 0 ? static_cast<int>(width * done_ / total_) : width;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld %.1fs %-40s", label_.c_str(),
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), ' ').c_str(),
                 static_cast<long long>(done_), static_cast<long long>(total_), s, what.c_str());
    std::fflush(stderr);
  }
  void finish() {
    if (tty_ && !finished_) std::fprintf(stderr, "\n");
    finished_ = true;
  }

 private:
  int64_t total_, done_ = 0;
  std::string label_;
  bool tty_, finished_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace mok::cli
