// A static parallel-for over the CPU threads. Every index is processed by the same code whatever
// the thread count, so results are bitwise identical for any number of threads.
#pragma once

#include <cstdint>
#include <functional>

namespace mok {

// Threads used by the CPU backend; 0 (the default) means std::thread::hardware_concurrency().
void set_cpu_threads(int threads);
int cpu_threads();

// Calls body(begin, end) on disjoint chunks covering [0, n); blocks until all are done.
// Exceptions thrown by a chunk are rethrown here (the first one).
void parallel_for(int64_t n, const std::function<void(int64_t begin, int64_t end)>& body);

}  // namespace mok
