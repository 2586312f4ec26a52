// An injectable source of time for the batching library: schedulers read the time and wait for
// deadlines through a Clock, so that timeout tests run on a FakeClock, deterministically and fast.
#ifndef COLLABSERVE_SERVER_BATCHING_CLOCK_H_
#define COLLABSERVE_SERVER_BATCHING_CLOCK_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace collabserve::batching {

// A source of time that can also wait for a deadline measured in its own time.
// Implementations are safe for concurrent use from multiple threads.
class Clock {
 public:
  virtual ~Clock() = default;

  virtual absl::Time Now() = 0;

  // Waits on `cv` until it is signalled or until Now() >= `deadline` (absl::InfiniteFuture() for
  // no deadline). The caller holds `*mu`; it is released while waiting and held again on return.
  // Like absl::CondVar, it may return early: callers re-check their condition in a loop.
  virtual void WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

// The wall clock (absl::Now()); waits are absl::CondVar::WaitWithDeadline.
class RealClock final : public Clock {
 public:
  // A process-wide instance that is never destroyed.
  static RealClock* Get();

  absl::Time Now() override { return absl::Now(); }
  void WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

// A clock for tests: time stands still until AdvanceTime() moves it, which wakes every thread
// waiting in WaitWithDeadline() whose deadline has now passed. Thread-safe. It must outlive every
// object that uses it, and no thread may be waiting on it when it is destroyed.
class FakeClock final : public Clock {
 public:
  // Starts at `start` (by default a fixed, arbitrary instant, so that logs are reproducible).
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000));
  ~FakeClock() override;
  FakeClock(const FakeClock&) = delete;
  FakeClock& operator=(const FakeClock&) = delete;

  absl::Time Now() override;
  void WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Moves time forward by `delta` and wakes the waiters whose deadline is now <= Now(). Time never
  // goes back: a negative `delta` is logged and ignored. Returns once every such waiter has been
  // signalled. Must not be called while holding a mutex that a waiter waits with.
  void AdvanceTime(absl::Duration delta);

  // Number of threads currently inside WaitWithDeadline().
  int NumWaiters() const;

  // Blocks (in real time) until at least `n` threads are inside WaitWithDeadline() with exactly
  // `deadline` (absl::InfiniteFuture() for "idle, waiting for work") and not already signalled by
  // AdvanceTime(). Returns false if that did not happen within `timeout` of real time: a test
  // asserts on it instead of hanging.
  bool BlockUntilWaiting(int n, absl::Time deadline, absl::Duration timeout = absl::Seconds(60));

 private:
  struct Waiter {
    absl::Mutex* mu;
    absl::CondVar* cv;
    absl::Time deadline;
    int pending_signals;  // AdvanceTime() calls that may still use mu/cv; guarded by mu_
  };

  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiter*> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collabserve::batching

#endif  // COLLABSERVE_SERVER_BATCHING_CLOCK_H_
