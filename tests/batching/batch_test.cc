#include "server/batching/batch.h"

#include <gtest/gtest.h>

namespace collabserve::batching {
namespace {

class SizedTask : public BatchTask {
 public:
  explicit SizedTask(int64_t size) : size_(size) {}
  int64_t size() const override { return size_; }
  void Fail(const absl::Status&) override {}

 private:
  int64_t size_;
};

TEST(BatchTest, EmptyBatch) {
  Batch<SizedTask> batch;
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(batch.num_tasks(), 0);
  EXPECT_EQ(batch.size(), 0);
  EXPECT_EQ(batch.padded_size(), 0);
  EXPECT_EQ(batch.padding_ratio(), 0.0);
  EXPECT_FALSE(batch.IsClosed());
}

TEST(BatchTest, SizesAndPadding) {
  Batch<SizedTask> batch;
  batch.AddTask(std::make_unique<SizedTask>(3));
  batch.AddTask(std::make_unique<SizedTask>(8));
  batch.AddTask(std::make_unique<SizedTask>(5));
  batch.Close();
  EXPECT_TRUE(batch.IsClosed());
  EXPECT_EQ(batch.num_tasks(), 3);
  EXPECT_EQ(batch.size(), 16);
  EXPECT_EQ(batch.max_task_size(), 8);
  EXPECT_EQ(batch.padded_size(), 24);
  EXPECT_DOUBLE_EQ(batch.padding_ratio(), 8.0 / 24.0);
  EXPECT_EQ(batch.task(1).size(), 8);
  EXPECT_EQ(batch.mutable_task(2)->size(), 5);
}

TEST(BatchTest, EqualLengthsHaveNoPadding) {
  Batch<SizedTask> batch;
  for (int i = 0; i < 4; ++i) batch.AddTask(std::make_unique<SizedTask>(128));
  EXPECT_EQ(batch.padded_size(), batch.size());
  EXPECT_EQ(batch.padding_ratio(), 0.0);
}

TEST(BatchTest, QueueWaitFromEnqueueAndCloseTimes) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  Batch<SizedTask> batch;
  batch.AddTask(std::make_unique<SizedTask>(1), t0);
  batch.AddTask(std::make_unique<SizedTask>(1), t0 + absl::Milliseconds(3));
  batch.AddTask(std::make_unique<SizedTask>(1));  // unknown enqueue time
  batch.Close(t0 + absl::Milliseconds(5));
  EXPECT_EQ(batch.close_time(), t0 + absl::Milliseconds(5));
  EXPECT_EQ(batch.queue_wait(0), absl::Milliseconds(5));
  EXPECT_EQ(batch.queue_wait(1), absl::Milliseconds(2));
  EXPECT_EQ(batch.queue_wait(2), absl::ZeroDuration());
}

TEST(BatchTest, RemoveAllTasksKeepsOrderAndEmptiesTheBatch) {
  Batch<SizedTask> batch;
  batch.AddTask(std::make_unique<SizedTask>(7));
  batch.AddTask(std::make_unique<SizedTask>(2));
  batch.Close();
  std::vector<std::unique_ptr<SizedTask>> tasks = batch.RemoveAllTasks();
  ASSERT_EQ(tasks.size(), 2u);
  EXPECT_EQ(tasks[0]->size(), 7);
  EXPECT_EQ(tasks[1]->size(), 2);
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(batch.size(), 0);
  EXPECT_EQ(batch.padded_size(), 0);
  EXPECT_TRUE(batch.IsClosed());
}

}  // namespace
}  // namespace collabserve::batching
