// Microbenchmark of the C++ cache path of one training step, without
// TensorFlow: EmbeddingStore::Prepare on a batch's distinct ids, then the
// write-back of the evicted rows (EmbeddingStore::WriteBack), on the reference
// workload of issue 6 (Zipf 1.05 over 1M ids permuted over int64, 4096 x 26
// ids per batch, dim 16 + one Adagrad state row, cache 20% of the ids).
//
//   make bench-core          # builds build/prepare_bench and runs it
//   build/prepare_bench [vocab] [cache_rows] [batches] [alpha] [threads] [dim]
//
// threads=2 (default) gives Prepare a second thread for the host fetch, as
// the TF kernel does with TF's thread pool; threads=1 runs it inline.
//
// Prints ms per batch for each part, median over the timed batches.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_set>
#include <vector>

#include "../../ops/core/embedding_store.h"
#include "../../ops/core/mix.h"

using namespace sfctr;
using Clock = std::chrono::steady_clock;

namespace {

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One worker thread that runs scheduled tasks in order.
class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Schedule(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t vocab = argc > 1 ? std::atoll(argv[1]) : 1000000;
  const int64_t cache = argc > 2 ? std::atoll(argv[2]) : vocab / 5;
  const int batches = argc > 3 ? std::atoi(argv[3]) : 60;
  const double alpha = argc > 4 ? std::atof(argv[4]) : 1.05;
  const int threads = argc > 5 ? std::atoi(argv[5]) : 2;
  const int dim = argc > 6 ? std::atoi(argv[6]) : 16;
  // Host-table size estimate (HostTableOptions::expected_rows); 0: none.
  const int64_t expected = argc > 7 ? std::atoll(argv[7]) : 0;
  // 1: check that the ids are distinct (what a step on ids de-duplicated in
  // the input pipeline asks for).
  const bool require_distinct = argc > 8 && std::atoi(argv[8]) != 0;
  Worker worker;
  const Scheduler schedule = [&worker](std::function<void()> task) {
    worker.Schedule(std::move(task));
  };
  const int64_t per_batch = 4096 * 26;
  const int warmup = 15;

  // Zipf CDF over ranks 0..vocab-1; rank r maps to a permuted int64 id.
  std::vector<double> cdf(vocab);
  double total = 0;
  for (int64_t r = 0; r < vocab; ++r) {
    total += std::pow(static_cast<double>(r + 1), -alpha);
    cdf[r] = total;
  }
  std::mt19937_64 rng(0);
  std::uniform_real_distribution<double> unif(0.0, total);

  StoreOptions options;
  options.table.dim = dim;
  options.table.num_state = 1;
  options.table.state_init = {0.1f};
  options.table.init.seed = 1;
  options.table.expected_rows = expected;
  options.cache_capacity = cache;
  EmbeddingStore store(options);
  const int width = store.table().width();

  std::vector<double> t_prepare, t_write, misses;
  std::vector<int64_t> ids;
  std::vector<float> evicted_rows;
  for (int b = 0; b < warmup + batches; ++b) {
    std::unordered_set<int64_t> seen;
    ids.clear();
    for (int64_t i = 0; i < per_batch; ++i) {
      const int64_t r = std::lower_bound(cdf.begin(), cdf.end(), unif(rng)) - cdf.begin();
      const int64_t id = static_cast<int64_t>(Mix64(static_cast<uint64_t>(r) + 12345));
      if (seen.insert(id).second) ids.push_back(id);
    }
    PrepareResult result;
    const auto t0 = Clock::now();
    CoreStatus st = store.Prepare(ids.data(), ids.size(), &result,
                                  threads > 1 ? &schedule : nullptr, EvictionHints(),
                                  require_distinct);
    const auto t1 = Clock::now();
    if (!st.ok()) {
      std::fprintf(stderr, "prepare failed: %s\n", st.message().c_str());
      return 1;
    }
    // Stand-in for the evicted device rows: any values of the right shape.
    evicted_rows.assign(result.evict_ids.size() * width, 0.5f);
    store.WriteBack(result.evict_ids.data(), result.evict_ids.size(),
                    evicted_rows.data(), result.evict_uses.data());
    const auto t2 = Clock::now();
    if (b >= warmup) {
      t_prepare.push_back(Ms(t0, t1));
      t_write.push_back(Ms(t1, t2));
      misses.push_back(static_cast<double>(result.miss_slots.size()));
    }
  }
  const double distinct = static_cast<double>(ids.size());
  std::printf("vocab %lld, cache %lld rows, %d timed batches of %lld ids "
              "(%.0f distinct in the last), alpha %.2f, dim %d, %d thread(s)%s\n",
              static_cast<long long>(vocab), static_cast<long long>(cache), batches,
              static_cast<long long>(per_batch), distinct, alpha, dim, threads,
              require_distinct ? ", ids checked distinct" : "");
  std::printf("misses/batch %.0f; prepare %.2f ms (%.3f us/miss); write-back %.2f ms; "
              "sum %.2f ms\n",
              Median(misses), Median(t_prepare), 1e3 * Median(t_prepare) / Median(misses),
              Median(t_write), Median(t_prepare) + Median(t_write));
  return 0;
}
