// Shares a kernel's independent work items out over XLA's intra-op thread pool (ffi::ThreadPool).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace grpax {

// Calls item(i) for i in 0..total-1, on the calling thread and up to pool.num_threads() - 1 helpers that
// take items from a shared counter. Returns when every item is done. The caller works too, so a busy pool
// cannot deadlock it; a helper that starts after the last item was taken touches only the shared counter.
// `item` must stay valid until then and be safe to call concurrently for different i.
template <typename Item>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t total, const Item& item) {
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto work = std::make_shared<Work>();
  const Item* fn = &item;
  auto run = [work, fn, total]() {
    for (;;) {
      const int64_t i = work->next.fetch_add(1);
      if (i >= total) return;
      (*fn)(i);
      work->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = run;
    pool.Schedule(std::move(task));
  }
  run();
  while (work->done.load() < total) std::this_thread::yield();
}

}  // namespace grpax
