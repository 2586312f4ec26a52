#include "server/batching/clock.h"

#include <thread>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace collabserve::batching {
namespace {

// A thread that waits on a FakeClock until `deadline` or until `done` is set.
class DeadlineWaiter {
 public:
  DeadlineWaiter(FakeClock* clock, absl::Time deadline)
      : thread_([this, clock, deadline] {
          absl::MutexLock lock(&mu_);
          while (!stop_ && clock->Now() < deadline) clock->WaitWithDeadline(&mu_, &cv_, deadline);
          woke_at_ = clock->Now();
          woke_.Notify();
        }) {}
  ~DeadlineWaiter() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
    }
    thread_.join();
  }
  absl::Notification& woke() { return woke_; }
  absl::Time woke_at() {
    absl::MutexLock lock(&mu_);
    return woke_at_;
  }

 private:
  absl::Mutex mu_;
  absl::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time woke_at_ ABSL_GUARDED_BY(mu_);
  absl::Notification woke_;
  std::thread thread_;
};

TEST(FakeClockTest, TimeMovesOnlyWhenAdvanced) {
  FakeClock clock(absl::FromUnixSeconds(100));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100));
  clock.AdvanceTime(absl::Milliseconds(1500));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100) + absl::Milliseconds(1500));
  clock.AdvanceTime(-absl::Seconds(1));  // ignored: time never goes back
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100) + absl::Milliseconds(1500));
}

TEST(FakeClockTest, WakesWaiterExactlyWhenItsDeadlinePasses) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  DeadlineWaiter waiter(&clock, t0 + absl::Milliseconds(10));
  ASSERT_TRUE(clock.BlockUntilWaiting(1, t0 + absl::Milliseconds(10)));

  clock.AdvanceTime(absl::Milliseconds(9));
  // Not woken: it is still waiting with the same deadline.
  ASSERT_TRUE(clock.BlockUntilWaiting(1, t0 + absl::Milliseconds(10)));
  EXPECT_FALSE(waiter.woke().HasBeenNotified());

  clock.AdvanceTime(absl::Milliseconds(1));
  ASSERT_TRUE(waiter.woke().WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(waiter.woke_at(), t0 + absl::Milliseconds(10));
}

TEST(FakeClockTest, OneAdvanceWakesOnlyTheExpiredWaiters) {
  FakeClock clock;
  const absl::Time t0 = clock.Now();
  DeadlineWaiter early(&clock, t0 + absl::Seconds(1));
  DeadlineWaiter late(&clock, t0 + absl::Seconds(5));
  ASSERT_TRUE(clock.BlockUntilWaiting(1, t0 + absl::Seconds(1)));
  ASSERT_TRUE(clock.BlockUntilWaiting(1, t0 + absl::Seconds(5)));

  clock.AdvanceTime(absl::Seconds(2));
  ASSERT_TRUE(early.woke().WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(clock.BlockUntilWaiting(1, t0 + absl::Seconds(5)));
  EXPECT_FALSE(late.woke().HasBeenNotified());
  EXPECT_EQ(clock.NumWaiters(), 1);

  clock.AdvanceTime(absl::Seconds(3));
  ASSERT_TRUE(late.woke().WaitForNotificationWithTimeout(absl::Seconds(60)));
}

TEST(FakeClockTest, PastDeadlineReturnsAtOnce) {
  FakeClock clock;
  absl::Mutex mu;
  absl::CondVar cv;
  absl::MutexLock lock(&mu);
  clock.WaitWithDeadline(&mu, &cv, clock.Now());  // would hang if it waited
  EXPECT_EQ(clock.NumWaiters(), 0);
}

TEST(FakeClockTest, BlockUntilWaitingTimesOutInsteadOfHanging) {
  FakeClock clock;
  EXPECT_FALSE(clock.BlockUntilWaiting(1, absl::InfiniteFuture(), absl::Milliseconds(1)));
}

TEST(FakeClockTest, SignalStillWakesAWaiter) {
  FakeClock clock;
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    while (!ready) clock.WaitWithDeadline(&mu, &cv, absl::InfiniteFuture());
  });
  ASSERT_TRUE(clock.BlockUntilWaiting(1, absl::InfiniteFuture()));
  {
    absl::MutexLock lock(&mu);
    ready = true;
    cv.Signal();
  }
  waiter.join();
  EXPECT_EQ(clock.NumWaiters(), 0);
}

TEST(RealClockTest, PastDeadlineReturnsAtOnce) {
  RealClock* clock = RealClock::Get();
  EXPECT_EQ(clock, RealClock::Get());
  absl::Mutex mu;
  absl::CondVar cv;
  absl::MutexLock lock(&mu);
  const absl::Time before = clock->Now();
  clock->WaitWithDeadline(&mu, &cv, before - absl::Seconds(1));
  EXPECT_GE(clock->Now(), before);
}

}  // namespace
}  // namespace collabserve::batching
