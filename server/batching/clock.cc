#include "server/batching/clock.h"

#include <algorithm>

#include <glog/logging.h>

namespace collabserve::batching {

RealClock* RealClock::Get() {
  static RealClock* const clock = new RealClock;
  return clock;
}

void RealClock::WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) {
    cv->Wait(mu);
  } else {
    cv->WaitWithDeadline(mu, deadline);
  }
}

FakeClock::FakeClock(absl::Time start) : now_(start) {}

FakeClock::~FakeClock() {
  absl::MutexLock lock(&mu_);
  LOG_IF(ERROR, !waiters_.empty())
      << "FakeClock destroyed while " << waiters_.size() << " thread(s) wait on it";
}

absl::Time FakeClock::Now() {
  absl::MutexLock lock(&mu_);
  return now_;
}

// The waiter registers itself while still holding `*mu`, and AdvanceTime() takes `*mu` before it
// signals, so a wake-up cannot fall between the waiter's last look at the time and its wait.
// AdvanceTime() never holds mu_ while it takes `*mu` (the waiter takes them in the other order),
// and the waiter does not return, and so release `mu`/`cv` to their owner, while an AdvanceTime()
// call may still use them (pending_signals).
void FakeClock::WaitWithDeadline(absl::Mutex* mu, absl::CondVar* cv, absl::Time deadline)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Waiter waiter{mu, cv, deadline, 0};
  {
    absl::MutexLock lock(&mu_);
    if (now_ >= deadline) return;
    waiters_.push_back(&waiter);
  }
  cv->Wait(mu);
  mu->Unlock();
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Waiter* w) { return w->pending_signals == 0; }, &waiter));
    waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &waiter));
  }
  mu->Lock();
}

void FakeClock::AdvanceTime(absl::Duration delta) {
  if (delta < absl::ZeroDuration()) {
    LOG(ERROR) << "FakeClock::AdvanceTime(" << delta << "): time cannot go back; ignored";
    return;
  }
  std::vector<Waiter*> to_wake;
  {
    absl::MutexLock lock(&mu_);
    now_ += delta;
    for (Waiter* w : waiters_) {
      if (w->deadline <= now_) {
        ++w->pending_signals;
        to_wake.push_back(w);
      }
    }
  }
  for (Waiter* w : to_wake) {
    w->mu->Lock();
    w->cv->SignalAll();
    w->mu->Unlock();
    absl::MutexLock lock(&mu_);
    --w->pending_signals;
  }
}

int FakeClock::NumWaiters() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(waiters_.size());
}

bool FakeClock::BlockUntilWaiting(int n, absl::Time deadline, absl::Duration timeout) {
  struct Args {
    const std::vector<Waiter*>* waiters;
    int n;
    absl::Time deadline;
  } args{&waiters_, n, deadline};
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(
      absl::Condition(
          +[](Args* a) {
            int count = 0;
            for (const Waiter* w : *a->waiters) {
              if (w->deadline == a->deadline && w->pending_signals == 0) ++count;
            }
            return count >= a->n;
          },
          &args),
      timeout);
}

}  // namespace collabserve::batching
