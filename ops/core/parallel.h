// Running independent pieces of work on a caller-supplied scheduler (TF's
// intra-op pool in the kernels) without ever waiting for a busy pool. TF-free.
//
// RunShards(schedule, shards, fn) runs fn(0) .. fn(shards - 1), each once,
// and returns when all have finished. The caller claims and runs shards
// itself; helper tasks handed to the scheduler claim the rest when a pool
// thread picks them up. A helper that starts late finds nothing left and
// returns, so a pool busy with other kernels (the usual case inside a
// training step on a few cores) costs no waiting: the caller has done the
// work. Only the shards a helper claimed are waited for.
//
// An exception thrown by fn (std::bad_alloc, say) never leaves a pool thread
// (that would be std::terminate): every claimed shard still finishes, and
// the first exception is rethrown to RunShards' caller once none runs. A
// scheduler that throws (it could not queue a task) leaves the shards to
// the caller.
#ifndef TF_SFCTR_OPS_CORE_PARALLEL_H_
#define TF_SFCTR_OPS_CORE_PARALLEL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace sfctr {

// Runs a task, possibly on another thread (e.g. a thread pool's Schedule).
using Scheduler = std::function<void(std::function<void()>)>;

// fn(shard) for shard in [0, shards); at most `helpers` tasks go to the
// scheduler (none without one). fn must be safe to call concurrently for
// distinct shards. If fn throws, the other shards still run, and the first
// exception is rethrown when all are done.
inline void RunShards(const Scheduler* schedule, int64_t shards, int64_t helpers,
                      const std::function<void(int64_t)>& fn) {
  if (shards <= 0) return;
  if (schedule == nullptr || !*schedule || helpers <= 0 || shards == 1) {
    std::exception_ptr error;
    for (int64_t s = 0; s < shards; ++s) {
      try {
        fn(s);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
  // Shared with the helpers, which may outlive this call (a late helper
  // touches only this state, never fn or the caller's data).
  struct State {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t finished = 0;
    std::exception_ptr error;  // the first exception of a shard
  };
  auto state = std::make_shared<State>();
  const std::function<void(int64_t)>* work = &fn;
  auto run_claimed = [state, work, shards] {
    int64_t ran = 0;
    std::exception_ptr error;
    for (int64_t s; (s = state->next.fetch_add(1)) < shards; ++ran) {
      try {
        (*work)(s);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    if (ran > 0) {
      std::lock_guard<std::mutex> lock(state->mu);
      if (error && !state->error) state->error = error;
      state->finished += ran;
      state->cv.notify_all();
    }
  };
  const int64_t tasks = helpers < shards - 1 ? helpers : shards - 1;
  for (int64_t t = 0; t < tasks; ++t) {
    try {
      (*schedule)(run_claimed);
    } catch (...) {
      break;  // not queued (e.g. std::bad_alloc): this thread runs the rest
    }
  }
  run_claimed();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->finished == shards; });
  if (state->error) std::rethrow_exception(state->error);
}

}  // namespace sfctr

#endif  // TF_SFCTR_OPS_CORE_PARALLEL_H_
