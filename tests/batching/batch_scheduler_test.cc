#include "server/batching/batch_scheduler.h"

#include <algorithm>
#include <atomic>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace collabserve::batching {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A guard against hangs, not a timing assumption: every wait below ends as soon as its event occurs.
constexpr absl::Duration kGuard = absl::Seconds(60);

class Recorder;

class TestTask : public BatchTask {
 public:
  TestTask(int id, int64_t size, std::shared_ptr<Recorder> recorder,
           absl::Time deadline = absl::InfiniteFuture(),
           std::shared_ptr<std::atomic<bool>> cancelled = nullptr)
      : id_(id),
        size_(size),
        recorder_(std::move(recorder)),
        deadline_(deadline),
        cancelled_(std::move(cancelled)) {}
  int64_t size() const override { return size_; }
  absl::Time deadline() const override { return deadline_; }
  bool cancelled() const override { return cancelled_ != nullptr && cancelled_->load(); }
  void Fail(const absl::Status& status) override;
  int id() const { return id_; }

 private:
  const int id_;
  const int64_t size_;
  const std::shared_ptr<Recorder> recorder_;
  const absl::Time deadline_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
};

// What the scheduler did with each task: the batches it formed and the tasks it failed.
class Recorder {
 public:
  struct BatchRecord {
    std::vector<int> ids;
    std::vector<int64_t> sizes;
    int64_t padded_size;
    double padding_ratio;
    std::vector<absl::Duration> queue_waits;
  };

  void RecordBatch(const Batch<TestTask>& batch) {
    absl::MutexLock lock(&mu_);
    BatchRecord record;
    for (int64_t i = 0; i < batch.num_tasks(); ++i) {
      record.ids.push_back(batch.task(i).id());
      record.sizes.push_back(batch.task(i).size());
      record.queue_waits.push_back(batch.queue_wait(i));
      ++processed_[batch.task(i).id()];
      ++done_;
    }
    record.padded_size = batch.padded_size();
    record.padding_ratio = batch.padding_ratio();
    batches_.push_back(std::move(record));
  }
  void RecordFail(int id, const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    ++failed_[id];
    fail_codes_[id] = status.code();
    ++done_;
  }
  // Waits until `n` tasks have been processed or failed in all; false after kGuard.
  bool AwaitDone(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kGuard);
  }
  int done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  std::vector<BatchRecord> batches() {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  std::vector<std::vector<int>> batch_ids() {
    absl::MutexLock lock(&mu_);
    std::vector<std::vector<int>> ids;
    for (const BatchRecord& b : batches_) ids.push_back(b.ids);
    return ids;
  }
  int processed(int id) {
    absl::MutexLock lock(&mu_);
    return processed_[id];
  }
  int failed(int id) {
    absl::MutexLock lock(&mu_);
    return failed_[id];
  }
  absl::StatusCode fail_code(int id) {
    absl::MutexLock lock(&mu_);
    return fail_codes_.count(id) ? fail_codes_[id] : absl::StatusCode::kOk;
  }

 private:
  absl::Mutex mu_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<BatchRecord> batches_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> processed_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> failed_ ABSL_GUARDED_BY(mu_);
  std::map<int, absl::StatusCode> fail_codes_ ABSL_GUARDED_BY(mu_);
};

void TestTask::Fail(const absl::Status& status) { recorder_->RecordFail(id_, status); }

using Scheduler = BatchScheduler<TestTask>;

class BatchSchedulerTest : public ::testing::Test {
 protected:
  SchedulerOptions Options() {
    SchedulerOptions options;
    options.clock = &clock_;
    options.name = "test";
    return options;
  }
  std::unique_ptr<Scheduler> Create(const SchedulerOptions& options) {
    std::unique_ptr<Scheduler> scheduler;
    absl::Status status = Scheduler::Create(
        options, [r = recorder_](std::unique_ptr<Batch<TestTask>> batch) { r->RecordBatch(*batch); },
        &scheduler);
    EXPECT_TRUE(status.ok()) << status;
    return scheduler;
  }
  std::unique_ptr<TestTask> Task(int id, int64_t size, absl::Time deadline = absl::InfiniteFuture(),
                                 std::shared_ptr<std::atomic<bool>> cancelled = nullptr) {
    return std::make_unique<TestTask>(id, size, recorder_, deadline, std::move(cancelled));
  }
  void ScheduleOk(Scheduler* scheduler, int id, int64_t size) {
    std::unique_ptr<TestTask> task = Task(id, size);
    absl::Status status = scheduler->Schedule(&task);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_EQ(task, nullptr);
  }
  // Tasks id0, id0+1, ... with the given sizes, scheduled together.
  void ScheduleAllOk(Scheduler* scheduler, int id0, const std::vector<int64_t>& sizes) {
    std::vector<std::unique_ptr<TestTask>> tasks;
    for (size_t i = 0; i < sizes.size(); ++i) tasks.push_back(Task(id0 + static_cast<int>(i), sizes[i]));
    absl::Status status = scheduler->ScheduleAll(&tasks);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_TRUE(tasks.empty());
  }

  FakeClock clock_;
  std::shared_ptr<Recorder> recorder_ = std::make_shared<Recorder>();
};

TEST_F(BatchSchedulerTest, CreateRejectsBadOptionsNamingTheField) {
  struct Case {
    void (*mutate)(SchedulerOptions*);
    const char* field;
  };
  const Case cases[] = {
      {[](SchedulerOptions* o) { o->max_batch_size = 0; }, "max_batch_size"},
      {[](SchedulerOptions* o) { o->max_batch_tokens = 0; }, "max_batch_tokens"},
      {[](SchedulerOptions* o) { o->max_queue_delay_micros = -1; }, "max_queue_delay_micros"},
      {[](SchedulerOptions* o) { o->max_queue_size = 0; }, "max_queue_size"},
      {[](SchedulerOptions* o) { o->num_batch_threads = 0; }, "num_batch_threads"},
  };
  for (const Case& c : cases) {
    SchedulerOptions options = Options();
    c.mutate(&options);
    std::unique_ptr<Scheduler> scheduler;
    absl::Status status =
        Scheduler::Create(options, [](std::unique_ptr<Batch<TestTask>>) {}, &scheduler);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.field));
    EXPECT_EQ(scheduler, nullptr);
  }
  std::unique_ptr<Scheduler> scheduler;
  EXPECT_EQ(Scheduler::Create(Options(), nullptr, &scheduler).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::Create(Options(), [](std::unique_ptr<Batch<TestTask>>) {}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(BatchSchedulerTest, RefusesTasksThatCanNeverRunAndKeepsNoOwnership) {
  SchedulerOptions options = Options();
  options.max_batch_tokens = 512;
  auto scheduler = Create(options);

  EXPECT_EQ(scheduler->Schedule(nullptr).code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<TestTask> null_task;
  EXPECT_EQ(scheduler->Schedule(&null_task).code(), absl::StatusCode::kInvalidArgument);

  std::unique_ptr<TestTask> too_long = Task(1, 513);
  absl::Status status = scheduler->Schedule(&too_long);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("513"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("max_batch_tokens"));
  ASSERT_NE(too_long, nullptr);

  std::unique_ptr<TestTask> negative = Task(2, -1);
  EXPECT_EQ(scheduler->Schedule(&negative).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_NE(negative, nullptr);

  auto cancelled = std::make_shared<std::atomic<bool>>(true);
  std::unique_ptr<TestTask> dead = Task(3, 8, absl::InfiniteFuture(), cancelled);
  EXPECT_EQ(scheduler->Schedule(&dead).code(), absl::StatusCode::kCancelled);
  ASSERT_NE(dead, nullptr);

  std::unique_ptr<TestTask> late = Task(4, 8, clock_.Now());
  EXPECT_EQ(scheduler->Schedule(&late).code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_NE(late, nullptr);

  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 0);
  scheduler->Shutdown();
  EXPECT_EQ(recorder_->done(), 0);  // a refused task is never failed by the scheduler
}

TEST_F(BatchSchedulerTest, FullBatchIsReleasedWithoutWaitingForTheDelay) {
  SchedulerOptions options = Options();
  options.max_batch_size = 4;
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  for (int id = 0; id < 4; ++id) ScheduleOk(scheduler.get(), id, 16);
  ASSERT_TRUE(recorder_->AwaitDone(4));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0, 1, 2, 3)));
}

TEST_F(BatchSchedulerTest, TokenBudgetClosesTheBatchAndTheRestWaits) {
  SchedulerOptions options = Options();
  options.max_batch_tokens = 100;
  options.max_queue_delay_micros = 1'000'000;
  auto scheduler = Create(options);
  const absl::Time t0 = clock_.Now();
  for (int id = 0; id < 4; ++id) ScheduleOk(scheduler.get(), id, 30);
  // 3 x 30 fits in 100 tokens, 4 x 30 does not: the first three go at once.
  ASSERT_TRUE(recorder_->AwaitDone(3));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0, 1, 2)));
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Seconds(1)));
  EXPECT_EQ(recorder_->done(), 3);
  clock_.AdvanceTime(absl::Seconds(1));
  ASSERT_TRUE(recorder_->AwaitDone(4));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0, 1, 2), ElementsAre(3)));
  for (const auto& batch : recorder_->batches()) EXPECT_LE(batch.padded_size, 100);
}

TEST_F(BatchSchedulerTest, TimeoutReleasesPartialBatchExactlyAtTheDelay) {
  SchedulerOptions options = Options();
  options.max_batch_size = 8;
  options.max_queue_delay_micros = 2000;
  auto scheduler = Create(options);
  const absl::Time t0 = clock_.Now();
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, absl::InfiniteFuture()));  // idle

  ScheduleOk(scheduler.get(), 0, 8);
  // The batch thread now waits for exactly the oldest task's delay.
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(2000)));
  clock_.AdvanceTime(absl::Microseconds(1000));
  ScheduleOk(scheduler.get(), 1, 8);  // a younger task does not move the release time
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(2000)));
  clock_.AdvanceTime(absl::Microseconds(999));
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(2000)));
  EXPECT_EQ(recorder_->done(), 0);

  clock_.AdvanceTime(absl::Microseconds(1));
  ASSERT_TRUE(recorder_->AwaitDone(2));
  auto batches = recorder_->batches();
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_THAT(batches[0].ids, ElementsAre(0, 1));
  EXPECT_THAT(batches[0].queue_waits,
              ElementsAre(absl::Microseconds(2000), absl::Microseconds(1000)));
}

TEST_F(BatchSchedulerTest, ZeroDelayReleasesWhateverIsQueued) {
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 0;
  auto scheduler = Create(options);
  ScheduleOk(scheduler.get(), 0, 8);
  ASSERT_TRUE(recorder_->AwaitDone(1));  // the clock never moves
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0)));
}

TEST_F(BatchSchedulerTest, FullQueueRefusesAtOnceAndKeepsOwnership) {
  SchedulerOptions options = Options();
  options.max_queue_size = 3;
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  EXPECT_EQ(scheduler->QueueCapacity(), 3);
  for (int id = 0; id < 3; ++id) ScheduleOk(scheduler.get(), id, 8);

  std::unique_ptr<TestTask> extra = Task(3, 8);
  absl::Status status = scheduler->Schedule(&extra);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("queue full"));
  ASSERT_NE(extra, nullptr);
  EXPECT_EQ(extra->id(), 3);
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 3);
  EXPECT_EQ(scheduler->stats().tasks_rejected_queue_full, 1);

  scheduler->Shutdown();
  EXPECT_EQ(recorder_->processed(3) + recorder_->failed(3), 0);
  EXPECT_EQ(recorder_->done(), 3);
}

TEST_F(BatchSchedulerTest, ScheduleAllIsAllOrNothing) {
  SchedulerOptions options = Options();
  options.max_queue_size = 5;
  options.max_batch_tokens = 512;
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  ScheduleAllOk(scheduler.get(), 0, {8, 8, 8});

  std::vector<std::unique_ptr<TestTask>> three;
  for (int id = 10; id < 13; ++id) three.push_back(Task(id, 8));
  EXPECT_EQ(scheduler->ScheduleAll(&three).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_EQ(three.size(), 3u);
  for (const auto& t : three) EXPECT_NE(t, nullptr);
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 3);

  std::vector<std::unique_ptr<TestTask>> one_bad;
  one_bad.push_back(Task(20, 8));
  one_bad.push_back(Task(21, 1000));
  absl::Status status = scheduler->ScheduleAll(&one_bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("task 1"));
  EXPECT_NE(one_bad[0], nullptr);
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 3);

  std::vector<std::unique_ptr<TestTask>> too_many;
  for (int id = 30; id < 36; ++id) too_many.push_back(Task(id, 8));
  EXPECT_EQ(scheduler->ScheduleAll(&too_many).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(too_many.size(), 6u);

  std::vector<std::unique_ptr<TestTask>> none;
  EXPECT_TRUE(scheduler->ScheduleAll(&none).ok());

  ScheduleAllOk(scheduler.get(), 3, {8, 8});
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 5);
  scheduler->Shutdown();
  EXPECT_EQ(recorder_->done(), 5);
  for (int id = 0; id < 5; ++id) EXPECT_EQ(recorder_->processed(id), 1) << id;
}

TEST_F(BatchSchedulerTest, ExpiredAndCancelledTasksAreFailedAndNeverProcessed) {
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 2000;
  auto scheduler = Create(options);
  const absl::Time t0 = clock_.Now();
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  std::vector<std::unique_ptr<TestTask>> tasks;
  tasks.push_back(Task(0, 8));
  tasks.push_back(Task(1, 8, t0 + absl::Microseconds(1000)));
  tasks.push_back(Task(2, 8, absl::InfiniteFuture(), cancelled));
  tasks.push_back(Task(3, 8, t0 + absl::Microseconds(5000)));
  ASSERT_TRUE(scheduler->ScheduleAll(&tasks).ok());
  cancelled->store(true);  // e.g. the client went away while the task was queued

  clock_.AdvanceTime(absl::Microseconds(2000));
  ASSERT_TRUE(recorder_->AwaitDone(4));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0, 3)));
  EXPECT_EQ(recorder_->failed(1), 1);
  EXPECT_EQ(recorder_->fail_code(1), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(recorder_->failed(2), 1);
  EXPECT_EQ(recorder_->fail_code(2), absl::StatusCode::kCancelled);
  EXPECT_EQ(recorder_->processed(1) + recorder_->processed(2), 0);
  SchedulerStats stats = scheduler->stats();
  EXPECT_EQ(stats.tasks_scheduled, 4);
  EXPECT_EQ(stats.tasks_batched, 2);
  EXPECT_EQ(stats.tasks_failed_deadline, 1);
  EXPECT_EQ(stats.tasks_failed_cancelled, 1);
}

TEST_F(BatchSchedulerTest, IdleThreadFailsATaskAtItsDeadline) {
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 1'000'000;
  auto scheduler = Create(options);
  const absl::Time t0 = clock_.Now();
  std::unique_ptr<TestTask> task = Task(0, 8, t0 + absl::Milliseconds(5));
  ASSERT_TRUE(scheduler->Schedule(&task).ok());
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Milliseconds(5)));
  clock_.AdvanceTime(absl::Milliseconds(5));
  ASSERT_TRUE(recorder_->AwaitDone(1));  // long before the 1 s batch delay
  EXPECT_EQ(recorder_->fail_code(0), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(recorder_->batches().empty());
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 0);
}

// on_queue_size follows every change, the sweep of an expired task that forms no batch included
// (the queue-depth gauge kept its last value on an idle server when only Schedule and batches set
// it).
TEST_F(BatchSchedulerTest, QueueSizeObserverSeesSchedulesBatchesAndSweeps) {
  absl::Mutex mu;
  std::vector<int64_t> seen;
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 1'000'000;
  options.max_batch_size = 2;
  options.on_queue_size = [&](int64_t queued) {
    absl::MutexLock lock(&mu);
    seen.push_back(queued);
  };
  auto scheduler = Create(options);
  auto last = [&] {
    absl::MutexLock lock(&mu);
    return seen.empty() ? int64_t{-1} : seen.back();
  };
  const absl::Time t0 = clock_.Now();
  std::unique_ptr<TestTask> doomed = Task(0, 8, t0 + absl::Milliseconds(5));
  ASSERT_TRUE(scheduler->Schedule(&doomed).ok());
  EXPECT_EQ(last(), 1);
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Milliseconds(5)));
  clock_.AdvanceTime(absl::Milliseconds(5));
  ASSERT_TRUE(recorder_->AwaitDone(1));
  EXPECT_TRUE(recorder_->batches().empty());
  // Published just after the task is failed: wait for it (real time, bounded).
  auto becomes = [&](int64_t want) {
    for (int i = 0; i < 5000 && last() != want; ++i) absl::SleepFor(absl::Milliseconds(1));
    return last() == want;
  };
  ASSERT_TRUE(becomes(0));  // swept, no batch formed
  ScheduleAllOk(scheduler.get(), 1, {8, 8});  // a full batch of two
  ASSERT_TRUE(recorder_->AwaitDone(3));
  ASSERT_TRUE(becomes(0));
  // (2, right after the ScheduleAll, may never be published: a batch thread can take both tasks
  // and publish 0 first, and an older value never replaces a newer one.)
  absl::MutexLock lock(&mu);
  for (int64_t v : seen) EXPECT_LE(v, 2);
}

// on_dequeue reports every task's wait once, whatever ends it: a batch, its deadline in the queue,
// or shutdown (the queue-time histogram counted only the inputs that reached a batch, so it read
// low under overload, when inputs wait until their deadline).
TEST_F(BatchSchedulerTest, DequeueObserverSeesTheWaitOfBatchedExpiredAndShutDownTasks) {
  absl::Mutex mu;
  std::vector<absl::Duration> waits;
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 2000;
  options.max_batch_size = 3;  // two tasks do not fill a batch: it waits for the delay
  options.on_dequeue = [&](absl::Duration waited) {
    absl::MutexLock lock(&mu);
    waits.push_back(waited);
  };
  auto scheduler = Create(options);
  auto seen = [&] {
    absl::MutexLock lock(&mu);
    std::vector<absl::Duration> sorted = waits;
    std::sort(sorted.begin(), sorted.end());
    return sorted;
  };
  const absl::Time t0 = clock_.Now();
  std::unique_ptr<TestTask> doomed = Task(0, 8, t0 + absl::Microseconds(1500));
  ASSERT_TRUE(scheduler->Schedule(&doomed).ok());
  ScheduleOk(scheduler.get(), 1, 8);
  // At 1.5 ms task 0 expires in the queue (the batch would have left at 2 ms).
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(1500)));
  clock_.AdvanceTime(absl::Microseconds(1500));
  ASSERT_TRUE(recorder_->AwaitDone(1));
  EXPECT_EQ(recorder_->fail_code(0), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(2000)));
  clock_.AdvanceTime(absl::Microseconds(500));
  ASSERT_TRUE(recorder_->AwaitDone(2));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(1)));
  // The wait is reported before the callback sees the batch, and a failed task's before its Fail.
  EXPECT_THAT(seen(), ElementsAre(absl::Microseconds(1500), absl::Microseconds(2000)));

  std::vector<std::unique_ptr<TestTask>> late;
  late.push_back(Task(2, 8));
  ASSERT_TRUE(scheduler->ScheduleAll(&late).ok());
  clock_.AdvanceTime(absl::Microseconds(700));
  scheduler->Shutdown(ShutdownMode::kFailQueued);
  ASSERT_TRUE(recorder_->AwaitDone(3));
  EXPECT_EQ(recorder_->fail_code(2), absl::StatusCode::kUnavailable);
  EXPECT_THAT(seen(), ElementsAre(absl::Microseconds(700), absl::Microseconds(1500),
                                  absl::Microseconds(2000)));
}

TEST_F(BatchSchedulerTest, AYoungerTaskWithAnEarlierDeadlineIsFailedAtItsDeadline) {
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 1'000'000;
  auto scheduler = Create(options);
  const absl::Time t0 = clock_.Now();
  ScheduleOk(scheduler.get(), 0, 8);  // no deadline: the thread waits for the 1 s delay
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Seconds(1)));
  std::unique_ptr<TestTask> task = Task(1, 8, t0 + absl::Milliseconds(5));
  ASSERT_TRUE(scheduler->Schedule(&task).ok());
  // The arrival moved the earliest deadline, so the waiting thread now waits for it instead.
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Milliseconds(5)));
  clock_.AdvanceTime(absl::Milliseconds(5));
  ASSERT_TRUE(recorder_->AwaitDone(1));
  EXPECT_EQ(recorder_->fail_code(1), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(recorder_->batches().empty());
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 1);
}

TEST_F(BatchSchedulerTest, ReleaseWhenIdleSendsALoneTaskAtOnce) {
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 10'000'000;
  options.release_when_idle = true;
  auto scheduler = Create(options);
  ScheduleOk(scheduler.get(), 0, 8);
  ASSERT_TRUE(recorder_->AwaitDone(1));  // the clock never moves
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0)));
  EXPECT_THAT(recorder_->batches()[0].queue_waits, ElementsAre(absl::ZeroDuration()));
}

TEST_F(BatchSchedulerTest, ReleaseWhenIdleWaitsWhileABatchIsBeingProcessed) {
  SchedulerOptions options = Options();
  options.max_batch_size = 4;
  options.max_queue_delay_micros = 1000;
  options.num_batch_threads = 2;
  options.release_when_idle = true;
  absl::Notification entered, release;
  std::unique_ptr<Scheduler> scheduler;
  ASSERT_TRUE(Scheduler::Create(
                  options,
                  [&, r = recorder_](std::unique_ptr<Batch<TestTask>> batch) {
                    if (batch->task(0).id() == 0) {  // keeps one batch thread busy
                      entered.Notify();
                      release.WaitForNotification();
                    }
                    r->RecordBatch(*batch);
                  },
                  &scheduler)
                  .ok());
  const absl::Time t0 = clock_.Now();
  ScheduleOk(scheduler.get(), 0, 8);
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kGuard));
  // A batch is in flight: the other thread (idle) lets the next batch fill for the delay.
  ScheduleOk(scheduler.get(), 1, 8);
  ScheduleOk(scheduler.get(), 2, 8);
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(1000)));
  EXPECT_EQ(recorder_->done(), 0);
  ScheduleOk(scheduler.get(), 3, 8);
  ScheduleOk(scheduler.get(), 4, 8);
  ScheduleOk(scheduler.get(), 5, 8);
  ScheduleOk(scheduler.get(), 6, 8);  // 1..4 are a full batch; 5 and 6 stay
  ASSERT_TRUE(recorder_->AwaitDone(4));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(1, 2, 3, 4)));
  // Once the first batch is done nothing is in flight, and 5 and 6 go without waiting.
  release.Notify();
  ASSERT_TRUE(recorder_->AwaitDone(7));
  EXPECT_THAT(recorder_->batch_ids(),
              ElementsAre(ElementsAre(1, 2, 3, 4), ElementsAre(0), ElementsAre(5, 6)));
}

// Batches that stay in the callback until the test lets them go, recorded as they are formed.
class HeldBatches {
 public:
  // In the callback: records the batch, then waits until Finish(its first task's id).
  void Hold(const Batch<TestTask>& batch) {
    absl::MutexLock lock(&mu_);
    std::vector<int> ids;
    for (int64_t i = 0; i < batch.num_tasks(); ++i) ids.push_back(batch.task(i).id());
    formed_.push_back(ids);
    const int first = ids[0];
    auto finished = [this, first]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return finish_.count(first) > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&finished), kGuard);
  }
  void Finish(int first_id) {
    absl::MutexLock lock(&mu_);
    finish_.insert(first_id);
  }
  // Waits until `n` batches have been formed; false after kGuard.
  bool AwaitFormed(size_t n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return formed_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kGuard);
  }
  std::vector<std::vector<int>> formed() {
    absl::MutexLock lock(&mu_);
    return formed_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::vector<int>> formed_ ABSL_GUARDED_BY(mu_);
  std::set<int> finish_ ABSL_GUARDED_BY(mu_);
};

// Two batch threads, eight closed-loop clients: the first request finds both threads idle and runs
// alone; the seven behind it arrive while it runs. Without fair_share the idle thread takes all
// seven (after the delay) and the threads keep that 1 / 7 split: each re-batches only the clients
// it has just answered. With fair_share the idle thread takes its share of the eight in flight
// (four), at once, and the first thread, when done, takes the other three with its own client
// back: four and four. The clock never moves, so only the fair-share rule releases these batches.
TEST_F(BatchSchedulerTest, FairShareSplitsTheTasksInFlightOverTheBatchThreads) {
  SchedulerOptions options = Options();
  options.max_batch_size = 16;
  options.max_queue_delay_micros = 10'000'000;
  options.num_batch_threads = 2;
  options.release_when_idle = true;
  options.fair_share = true;
  HeldBatches held;
  std::unique_ptr<Scheduler> scheduler;
  ASSERT_TRUE(Scheduler::Create(
                  options,
                  [&, r = recorder_](std::unique_ptr<Batch<TestTask>> batch) {
                    held.Hold(*batch);
                    r->RecordBatch(*batch);
                  },
                  &scheduler)
                  .ok());
  ScheduleOk(scheduler.get(), 0, 8);  // every thread idle: its own share, sent at once
  ASSERT_TRUE(held.AwaitFormed(1));
  ScheduleAllOk(scheduler.get(), 1, {8, 8, 8, 8, 8, 8, 8});  // 8 in flight: a share is 4
  ASSERT_TRUE(held.AwaitFormed(2));
  EXPECT_THAT(held.formed(), ElementsAre(ElementsAre(0), ElementsAre(1, 2, 3, 4)));
  held.Finish(0);  // client 0 is answered and comes back
  ASSERT_TRUE(recorder_->AwaitDone(1));
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 3);  // 5, 6, 7 are below a share: they wait
  ScheduleOk(scheduler.get(), 8, 8);
  ASSERT_TRUE(held.AwaitFormed(3));
  EXPECT_THAT(held.formed()[2], ElementsAre(5, 6, 7, 8));
  held.Finish(1);
  held.Finish(5);
  ASSERT_TRUE(recorder_->AwaitDone(9));
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 0);
}

TEST(BatchTaskLimitTest, IsTheThreadsShareOfTheWorkInFlight) {
  SchedulerOptions options;
  options.max_batch_size = 16;
  options.num_batch_threads = 2;
  EXPECT_EQ(internal::BatchTaskLimit(options, 7, 1), 16);  // fair_share off
  options.fair_share = true;
  EXPECT_EQ(internal::BatchTaskLimit(options, 7, 1), 4);
  EXPECT_EQ(internal::BatchTaskLimit(options, 6, 1), 4);   // rounded up
  EXPECT_EQ(internal::BatchTaskLimit(options, 1, 0), 1);
  EXPECT_EQ(internal::BatchTaskLimit(options, 0, 0), 1);   // never 0
  EXPECT_EQ(internal::BatchTaskLimit(options, 40, 16), 16);  // at most max_batch_size
  options.num_batch_threads = 3;
  EXPECT_EQ(internal::BatchTaskLimit(options, 9, 3), 4);
  options.num_batch_threads = 1;
  EXPECT_EQ(internal::BatchTaskLimit(options, 7, 1), 16);  // one thread: nothing to share
}

TEST_F(BatchSchedulerTest, QueueFullOfDeadTasksMakesRoomForANewOne) {
  SchedulerOptions options = Options();
  options.max_queue_size = 2;
  options.max_batch_size = 1;
  options.max_queue_delay_micros = 0;
  absl::Notification entered, release;
  std::unique_ptr<Scheduler> scheduler;
  ASSERT_TRUE(Scheduler::Create(
                  options,
                  [&, r = recorder_](std::unique_ptr<Batch<TestTask>> batch) {
                    if (batch->task(0).id() == 0) {  // keeps the only batch thread busy
                      entered.Notify();
                      release.WaitForNotification();
                    }
                    r->RecordBatch(*batch);
                  },
                  &scheduler)
                  .ok());
  const absl::Time t0 = clock_.Now();
  ScheduleOk(scheduler.get(), 0, 8);
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kGuard));
  for (int id = 1; id <= 2; ++id) {
    std::unique_ptr<TestTask> task = Task(id, 8, t0 + absl::Milliseconds(1));
    ASSERT_TRUE(scheduler->Schedule(&task).ok());
  }
  std::unique_ptr<TestTask> task = Task(3, 8);
  EXPECT_EQ(scheduler->Schedule(&task).code(), absl::StatusCode::kResourceExhausted);

  clock_.AdvanceTime(absl::Milliseconds(1));  // tasks 1 and 2 are now dead, still queued
  ASSERT_TRUE(scheduler->Schedule(&task).ok());
  // Failed by Schedule itself, while the batch thread is still busy.
  EXPECT_EQ(recorder_->fail_code(1), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(recorder_->fail_code(2), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(scheduler->NumEnqueuedTasks(), 1);

  release.Notify();
  ASSERT_TRUE(recorder_->AwaitDone(4));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0), ElementsAre(3)));
}

TEST_F(BatchSchedulerTest, LengthAwareGroupingKeepsShortAndLongApart) {
  SchedulerOptions options = Options();
  options.max_batch_size = 4;
  options.max_batch_tokens = 4 * 512;
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 16; ++i) sizes.push_back(i % 2 == 0 ? 8 : 512);
  ScheduleAllOk(scheduler.get(), 0, sizes);  // every batch is full: released without waiting
  ASSERT_TRUE(recorder_->AwaitDone(16));
  auto batches = recorder_->batches();
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_THAT(batches[0].ids, ElementsAre(0, 2, 4, 6));  // starts from the oldest
  for (const auto& batch : batches) {
    EXPECT_THAT(batch.sizes, ::testing::Each(batch.sizes[0]));
    EXPECT_EQ(batch.padding_ratio, 0.0);
  }
  SchedulerStats stats = scheduler->stats();
  EXPECT_EQ(stats.padded_tokens_batched, stats.tokens_batched);
}

TEST_F(BatchSchedulerTest, ArrivalOrderBatchingMixesLengthsAndPadsMore) {
  SchedulerOptions options = Options();
  options.max_batch_size = 4;
  options.max_batch_tokens = 4 * 512;
  options.max_queue_delay_micros = 10'000'000;
  options.length_aware = false;
  auto scheduler = Create(options);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 16; ++i) sizes.push_back(i % 2 == 0 ? 8 : 512);
  ScheduleAllOk(scheduler.get(), 0, sizes);
  ASSERT_TRUE(recorder_->AwaitDone(16));
  auto batches = recorder_->batches();
  ASSERT_EQ(batches.size(), 4u);
  EXPECT_THAT(batches[0].ids, ElementsAre(0, 1, 2, 3));
  // Two 8s and two 512s padded to 4 x 512.
  for (const auto& batch : batches) EXPECT_DOUBLE_EQ(batch.padding_ratio, (2048.0 - 1040.0) / 2048.0);
}

TEST_F(BatchSchedulerTest, OldestTaskIsAlwaysInTheNextBatchAndTheRestKeepTheirOrder) {
  SchedulerOptions options = Options();
  options.max_batch_size = 4;
  options.max_queue_delay_micros = 1000;
  auto scheduler = Create(options);
  const absl::Time t0 = clock_.Now();
  // The oldest is long; the only other long one is the youngest.
  ScheduleAllOk(scheduler.get(), 0, {512, 8, 8, 8, 8, 8, 512});
  ASSERT_TRUE(recorder_->AwaitDone(4));
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, t0 + absl::Microseconds(1000)));
  clock_.AdvanceTime(absl::Microseconds(1000));
  ASSERT_TRUE(recorder_->AwaitDone(7));
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0, 1, 2, 6), ElementsAre(3, 4, 5)));
}

TEST_F(BatchSchedulerTest, RandomWorkloadsNeverExceedTheLimits) {
  for (bool length_aware : {true, false}) {
    SCOPED_TRACE(length_aware ? "length-aware" : "arrival order");
    recorder_ = std::make_shared<Recorder>();
    SchedulerOptions options = Options();
    options.max_batch_size = 8;
    options.max_batch_tokens = 1024;
    options.max_queue_size = 4096;
    options.num_batch_threads = 3;
    options.length_aware = length_aware;
    auto scheduler = Create(options);
    std::mt19937 rng(7);
    int id = 0;
    while (id < 600) {
      std::vector<int64_t> sizes(std::uniform_int_distribution<int>(1, 12)(rng));
      for (int64_t& s : sizes) s = std::uniform_int_distribution<int>(1, 512)(rng);
      ScheduleAllOk(scheduler.get(), id, sizes);
      id += static_cast<int>(sizes.size());
    }
    scheduler->Shutdown();  // drains the rest
    EXPECT_EQ(recorder_->done(), id);
    for (int i = 0; i < id; ++i) ASSERT_EQ(recorder_->processed(i), 1) << i;
    for (const auto& batch : recorder_->batches()) {
      EXPECT_LE(batch.ids.size(), 8u);
      EXPECT_LE(batch.padded_size, 1024);
    }
  }
}

TEST_F(BatchSchedulerTest, ShutdownDrainsTheQueueAndThenRefuses) {
  SchedulerOptions options = Options();
  options.max_batch_size = 2;
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  ScheduleOk(scheduler.get(), 0, 8);
  // None of these would be released before the delay without the shutdown.
  ASSERT_TRUE(clock_.BlockUntilWaiting(1, clock_.Now() + absl::Seconds(10)));
  EXPECT_EQ(recorder_->done(), 0);
  scheduler->Shutdown();
  EXPECT_EQ(recorder_->processed(0), 1);

  std::unique_ptr<TestTask> late = Task(1, 8);
  EXPECT_EQ(scheduler->Schedule(&late).code(), absl::StatusCode::kUnavailable);
  ASSERT_NE(late, nullptr);
  scheduler->Shutdown();  // idempotent
}

TEST_F(BatchSchedulerTest, DrainStillRespectsTheLimits) {
  SchedulerOptions options = Options();
  options.max_batch_size = 8;
  options.max_batch_tokens = 64;
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  ScheduleAllOk(scheduler.get(), 0, {16, 16, 16});
  scheduler.reset();  // the destructor drains
  EXPECT_EQ(recorder_->done(), 3);
  for (const auto& batch : recorder_->batches()) EXPECT_LE(batch.padded_size, 64);
}

TEST_F(BatchSchedulerTest, ShutdownCanFailQueuedTasksInstead) {
  SchedulerOptions options = Options();
  options.max_queue_delay_micros = 10'000'000;
  auto scheduler = Create(options);
  ScheduleAllOk(scheduler.get(), 0, {8, 8, 8, 8, 8});
  scheduler->Shutdown(ShutdownMode::kFailQueued);
  EXPECT_EQ(recorder_->done(), 5);
  EXPECT_TRUE(recorder_->batches().empty());
  for (int id = 0; id < 5; ++id) EXPECT_EQ(recorder_->fail_code(id), absl::StatusCode::kUnavailable);
  EXPECT_EQ(scheduler->stats().tasks_failed_shutdown, 5);
}

TEST_F(BatchSchedulerTest, FailQueuedAfterADrainBeganFailsWhatIsLeft) {
  SchedulerOptions options = Options();
  options.max_batch_size = 1;
  absl::Notification entered, release;
  std::unique_ptr<Scheduler> scheduler;
  ASSERT_TRUE(Scheduler::Create(
                  options,
                  [&, r = recorder_](std::unique_ptr<Batch<TestTask>> batch) {
                    if (batch->task(0).id() == 0) {  // a slow batch holds up the drain
                      entered.Notify();
                      release.WaitForNotification();
                    }
                    r->RecordBatch(*batch);
                  },
                  &scheduler)
                  .ok());
  ScheduleAllOk(scheduler.get(), 0, {8, 8, 8});
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kGuard));
  // Both calls wait for the slow batch, so they run on their own threads; in either order, tasks
  // 1 and 2, still queued behind the slow batch, are given up on.
  std::thread drain([&] { scheduler->Shutdown(ShutdownMode::kDrain); });
  std::thread fail([&] { scheduler->Shutdown(ShutdownMode::kFailQueued); });
  ASSERT_TRUE(recorder_->AwaitDone(2));
  EXPECT_EQ(recorder_->fail_code(1), absl::StatusCode::kUnavailable);
  EXPECT_EQ(recorder_->fail_code(2), absl::StatusCode::kUnavailable);
  release.Notify();
  drain.join();
  fail.join();
  EXPECT_THAT(recorder_->batch_ids(), ElementsAre(ElementsAre(0)));
}

TEST_F(BatchSchedulerTest, BatchThreadsProcessBatchesConcurrently) {
  SchedulerOptions options = Options();
  options.max_batch_size = 1;
  options.num_batch_threads = 2;
  absl::Mutex mu;
  int inside = 0;
  bool both_inside = false;
  std::unique_ptr<Scheduler> scheduler;
  ASSERT_TRUE(Scheduler::Create(
                  options,
                  [&, r = recorder_](std::unique_ptr<Batch<TestTask>> batch) {
                    absl::MutexLock lock(&mu);
                    ++inside;
                    // Each batch waits until the other one is being processed too.
                    if (mu.AwaitWithTimeout(absl::Condition(
                                                +[](int* n) { return *n == 2; }, &inside),
                                            kGuard)) {
                      both_inside = true;
                    }
                    r->RecordBatch(*batch);
                  },
                  &scheduler)
                  .ok());
  ScheduleAllOk(scheduler.get(), 0, {8, 8});  // each batch holds one task: both are full
  ASSERT_TRUE(recorder_->AwaitDone(2));
  absl::MutexLock lock(&mu);
  EXPECT_TRUE(both_inside);
}

// The length-aware rule on its own, over (size, arrival sequence number) pairs.
TEST(SelectLengthAwareTest, ClosestLengthsFirstShorterThenOlderOnTies) {
  SchedulerOptions options;
  options.max_batch_size = 2;
  internal::LengthIndex queue = {{100, 0}, {110, 1}, {90, 2}, {90, 3}};
  bool full = false;
  EXPECT_THAT(internal::SelectLengthAware(queue, {100, 0}, options, 2, &full), ElementsAre(0, 2));
  EXPECT_TRUE(full);
  options.max_batch_size = 4;
  EXPECT_THAT(internal::SelectLengthAware(queue, {100, 0}, options, 4, &full),
              ElementsAre(0, 1, 2, 3));
  EXPECT_TRUE(full);  // max_batch_size reached
  // A smaller max_tasks (a fair share) caps the batch the same way and makes it full.
  options.max_batch_size = 8;
  EXPECT_THAT(internal::SelectLengthAware(queue, {100, 0}, options, 3, &full), ElementsAre(0, 2, 3));
  EXPECT_TRUE(full);
}

TEST(SelectLengthAwareTest, SkipsALongerTaskThatBreaksTheBudgetButTakesShorterOnes) {
  SchedulerOptions options;
  options.max_batch_tokens = 1000;
  internal::LengthIndex queue = {{500, 0}, {520, 1}, {10, 2}, {12, 3}};
  bool full = false;
  // 2 x 520 > 1000; 2 x 500 fits, with the closer of the short ones; a third would need 3 x 500.
  EXPECT_THAT(internal::SelectLengthAware(queue, {500, 0}, options, options.max_batch_size, &full),
              ElementsAre(0, 3));
  EXPECT_TRUE(full);
}

TEST(SelectLengthAwareTest, NotFullWhenEverythingFits) {
  SchedulerOptions options;
  options.max_batch_size = 4;
  internal::LengthIndex queue = {{8, 3}, {300, 5}, {16, 4}};
  bool full = true;
  EXPECT_THAT(internal::SelectLengthAware(queue, {8, 3}, options, options.max_batch_size, &full),
              ElementsAre(3, 4, 5));
  EXPECT_FALSE(full);
}

TEST(BatchSchedulerLifetimeTest, MayBeDestroyedFromInsideItsOwnCallback) {
  // A model version that owns its scheduler may be released by the last batch that holds it.
  struct State {
    std::unique_ptr<BatchScheduler<TestTask>> scheduler;
    absl::Notification all_scheduled;
    std::atomic<int> batches{0};
  };
  auto state = std::make_shared<State>();
  auto recorder = std::make_shared<Recorder>();
  SchedulerOptions options;
  options.max_batch_size = 1;
  options.max_queue_delay_micros = 0;  // real clock: it may outlive this test by a few instructions
  ASSERT_TRUE(BatchScheduler<TestTask>::Create(
                  options,
                  [state, recorder](std::unique_ptr<Batch<TestTask>> batch) {
                    if (state->batches++ == 0) {
                      state->all_scheduled.WaitForNotification();
                      state->scheduler.reset();  // Shutdown from a batch thread
                    }
                    recorder->RecordBatch(*batch);
                  },
                  &state->scheduler)
                  .ok());
  for (int id = 0; id < 3; ++id) {
    auto task = std::make_unique<TestTask>(id, 8, recorder);
    ASSERT_TRUE(state->scheduler->Schedule(&task).ok());
  }
  state->all_scheduled.Notify();
  // The batch thread drains the two queued tasks after its callback returns.
  ASSERT_TRUE(recorder->AwaitDone(3));
  for (int id = 0; id < 3; ++id) EXPECT_EQ(recorder->processed(id), 1);
}

// Many producers, several batch threads, a small queue, real time, tasks that get cancelled or
// expire while queued: every accepted task is processed or failed exactly once, and every batch
// respects the limits.
TEST(BatchSchedulerStressTest, EveryTaskIsProcessedOrFailedExactlyOnce) {
  constexpr int kProducers = 8;
  constexpr int kTasksPerProducer = 400;
  constexpr int kTasks = kProducers * kTasksPerProducer;
  constexpr int64_t kMaxBatchSize = 16;
  constexpr int64_t kMaxTokens = 2048;

  struct Counters {
    std::atomic<int> processed[kTasks];
    std::atomic<int> failed[kTasks];
    std::atomic<int> limit_violations{0};
    Counters() {
      for (int i = 0; i < kTasks; ++i) {
        processed[i] = 0;
        failed[i] = 0;
      }
    }
  };
  auto counters = std::make_shared<Counters>();

  class StressTask : public BatchTask {
   public:
    StressTask(int id, int64_t size, absl::Time deadline, std::shared_ptr<std::atomic<bool>> cancel,
               std::shared_ptr<Counters> counters)
        : id_(id),
          size_(size),
          deadline_(deadline),
          cancel_(std::move(cancel)),
          counters_(std::move(counters)) {}
    int64_t size() const override { return size_; }
    absl::Time deadline() const override { return deadline_; }
    bool cancelled() const override { return cancel_->load(); }
    void Fail(const absl::Status&) override { counters_->failed[id_]++; }
    int id() const { return id_; }

   private:
    const int id_;
    const int64_t size_;
    const absl::Time deadline_;
    const std::shared_ptr<std::atomic<bool>> cancel_;
    const std::shared_ptr<Counters> counters_;
  };

  SchedulerOptions options;
  options.max_batch_size = kMaxBatchSize;
  options.max_batch_tokens = kMaxTokens;
  options.max_queue_delay_micros = 200;
  options.max_queue_size = 128;
  options.num_batch_threads = 4;
  options.name = "stress";
  std::unique_ptr<BatchScheduler<StressTask>> scheduler;
  ASSERT_TRUE(BatchScheduler<StressTask>::Create(
                  options,
                  [counters](std::unique_ptr<Batch<StressTask>> batch) {
                    if (batch->num_tasks() > kMaxBatchSize || batch->padded_size() > kMaxTokens) {
                      counters->limit_violations++;
                    }
                    for (auto& task : batch->RemoveAllTasks()) counters->processed[task->id()]++;
                  },
                  &scheduler)
                  .ok());

  std::vector<std::atomic<bool>> accepted(kTasks);
  std::atomic<int> refused_dead{0};
  std::atomic<int> given_up{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      std::mt19937 rng(p);
      int i = 0;
      while (i < kTasksPerProducer) {
        const int group = std::min(kTasksPerProducer - i, std::uniform_int_distribution<int>(1, 4)(rng));
        std::vector<std::unique_ptr<StressTask>> tasks;
        std::vector<int> ids;
        std::vector<std::shared_ptr<std::atomic<bool>>> to_cancel;
        for (int k = 0; k < group; ++k) {
          const int id = p * kTasksPerProducer + i + k;
          const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
          // One in ten expires soon, one in ten is cancelled right after it is queued.
          const absl::Time deadline =
              kind == 0 ? absl::Now() + absl::Microseconds(300) : absl::InfiniteFuture();
          auto cancel = std::make_shared<std::atomic<bool>>(false);
          if (kind == 1) to_cancel.push_back(cancel);
          tasks.push_back(std::make_unique<StressTask>(
              id, std::uniform_int_distribution<int>(1, 256)(rng), deadline, cancel, counters));
          ids.push_back(id);
        }
        // A full queue is normal here; retry a little, as a client would, then give up.
        absl::Status status;
        for (int attempt = 0; attempt < 100; ++attempt) {
          status = group == 1 ? scheduler->Schedule(&tasks[0]) : scheduler->ScheduleAll(&tasks);
          if (status.code() != absl::StatusCode::kResourceExhausted) break;
          std::this_thread::yield();
        }
        if (status.ok()) {
          for (int id : ids) accepted[id] = true;
          for (auto& cancel : to_cancel) cancel->store(true);
        } else if (status.code() == absl::StatusCode::kDeadlineExceeded) {
          refused_dead += group;  // a 300 us deadline can pass before Schedule on a busy machine
        } else {
          EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
          given_up += group;
        }
        i += group;
      }
    });
  }
  for (std::thread& t : producers) t.join();
  scheduler->Shutdown();

  int num_accepted = 0;
  for (int id = 0; id < kTasks; ++id) {
    const int outcomes = counters->processed[id] + counters->failed[id];
    if (accepted[id]) {
      ++num_accepted;
      ASSERT_EQ(outcomes, 1) << "task " << id;
    } else {
      ASSERT_EQ(outcomes, 0) << "task " << id;
    }
  }
  EXPECT_EQ(counters->limit_violations, 0);
  SchedulerStats stats = scheduler->stats();
  EXPECT_EQ(stats.tasks_scheduled, num_accepted);
  EXPECT_EQ(stats.tasks_batched + stats.tasks_failed_deadline + stats.tasks_failed_cancelled,
            num_accepted);
  EXPECT_EQ(stats.tasks_scheduled + given_up + refused_dead, kTasks);
  EXPECT_GE(stats.tasks_rejected_queue_full, given_up);
  EXPECT_GT(stats.tasks_batched, 0);
  std::cout << "stress: " << stats.tasks_scheduled << " scheduled, " << stats.tasks_rejected_queue_full
            << " rejections (queue full), " << given_up << " given up, " << refused_dead << " refused (dead), "
            << stats.batches_formed << " batches, " << stats.tasks_batched << " tasks batched, "
            << stats.tasks_failed_deadline << " expired, " << stats.tasks_failed_cancelled
            << " cancelled in queue\n";
}

}  // namespace
}  // namespace collabserve::batching
