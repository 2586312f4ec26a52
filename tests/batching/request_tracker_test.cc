#include "server/batching/request_tracker.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace collabserve::batching {
namespace {

using ::testing::ElementsAre;

// Records the calls of a DoneCallback.
struct DoneLog {
  std::atomic<int> calls{0};
  absl::StatusOr<std::vector<std::string>> outcome = absl::UnknownError("not called");
  RequestTracker<std::string>::DoneCallback Callback() {
    return [this](absl::StatusOr<std::vector<std::string>> result) {
      outcome = std::move(result);
      ++calls;
    };
  }
};

TEST(RequestTrackerTest, FiresOnceWithResultsInIndexOrder) {
  DoneLog log;
  auto tracker = RequestTracker<std::string>::Create(3, log.Callback());
  ASSERT_TRUE(tracker->SetResult(2, "c").ok());
  ASSERT_TRUE(tracker->SetResult(0, "a").ok());
  EXPECT_EQ(log.calls, 0);
  EXPECT_FALSE(tracker->done());
  ASSERT_TRUE(tracker->SetResult(1, "b").ok());
  EXPECT_EQ(log.calls, 1);
  EXPECT_TRUE(tracker->done());
  ASSERT_TRUE(log.outcome.ok());
  EXPECT_THAT(*log.outcome, ElementsAre("a", "b", "c"));
}

TEST(RequestTrackerTest, ReportsTheFirstErrorInTimeAfterAllTasksFinish) {
  DoneLog log;
  auto tracker = RequestTracker<std::string>::Create(3, log.Callback());
  ASSERT_TRUE(tracker->SetError(2, absl::DeadlineExceededError("task 2 late")).ok());
  EXPECT_TRUE(tracker->failed());
  EXPECT_EQ(log.calls, 0);  // waits for the others, which may still be running
  ASSERT_TRUE(tracker->SetError(0, absl::CancelledError("task 0 cancelled")).ok());
  ASSERT_TRUE(tracker->SetResult(1, "b").ok());
  EXPECT_EQ(log.calls, 1);
  EXPECT_EQ(log.outcome.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(log.outcome.status().message(), "task 2 late");
}

TEST(RequestTrackerTest, RejectsBadAndRepeatedReportsWithoutFiringTwice) {
  DoneLog log;
  auto tracker = RequestTracker<std::string>::Create(1, log.Callback());
  EXPECT_EQ(tracker->SetResult(1, "x").code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(tracker->SetResult(-1, "x").code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(tracker->SetResult(0, "a").ok());
  EXPECT_EQ(tracker->SetResult(0, "again").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(log.calls, 1);
  EXPECT_THAT(*log.outcome, ElementsAre("a"));
}

TEST(RequestTrackerTest, AnErrorReportedWithOkStatusStillFails) {
  DoneLog log;
  auto tracker = RequestTracker<std::string>::Create(1, log.Callback());
  ASSERT_TRUE(tracker->SetError(0, absl::OkStatus()).ok());
  EXPECT_EQ(log.outcome.status().code(), absl::StatusCode::kInternal);
}

TEST(RequestTrackerTest, ZeroTasksFireAtOnceAndNegativeCountsAreAnError) {
  DoneLog empty;
  auto tracker = RequestTracker<std::string>::Create(0, empty.Callback());
  EXPECT_EQ(empty.calls, 1);
  ASSERT_TRUE(empty.outcome.ok());
  EXPECT_TRUE(empty.outcome->empty());
  EXPECT_EQ(tracker->SetResult(0, "x").code(), absl::StatusCode::kOutOfRange);

  DoneLog negative;
  RequestTracker<std::string>::Create(-2, negative.Callback());
  EXPECT_EQ(negative.calls, 1);
  EXPECT_EQ(negative.outcome.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RequestTrackerTest, ConcurrentReportsFireExactlyOnce) {
  constexpr int kTasks = 64;
  constexpr int kThreads = 8;
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> calls{0};
    std::vector<int> values;
    auto tracker = RequestTracker<int>::Create(
        kTasks, [&](absl::StatusOr<std::vector<int>> result) {
          ASSERT_TRUE(result.ok());
          values = *result;
          ++calls;
        });
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([t, tracker] {
        for (int i = t; i < kTasks; i += kThreads) ASSERT_TRUE(tracker->SetResult(i, i * 10).ok());
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_EQ(calls, 1);
    ASSERT_EQ(values.size(), static_cast<size_t>(kTasks));
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(values[i], i * 10);
  }
}

}  // namespace
}  // namespace collabserve::batching
