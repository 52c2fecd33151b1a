#include "mok/core/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "mok/core/error.h"

namespace mok {
namespace {
std::atomic<int> g_threads{0};
}

void set_cpu_threads(int threads) {
  MOK_REQUIRE(threads >= 0 && threads <= 1024, "cpu threads must be in [0, 1024], got ", threads);
  g_threads.store(threads);
}

int cpu_threads() {
  const int t = g_threads.load();
  if (t > 0) return t;
  return std::max(1u, std::thread::hardware_concurrency());
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(cpu_threads(), n);
  if (workers == 1) {
    body(0, n);
    return;
  }
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto run = [&](int64_t w) {
    const int64_t begin = n * w / workers;
    const int64_t end = n * (w + 1) / workers;
    try {
      body(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(run, w);
  run(0);
  for (std::thread& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace mok
