// The units of dynamic batching: a BatchTask (one input waiting to be run, e.g. one tokenized text)
// and a Batch (tasks that are run together as one padded tensor).
#ifndef COLLABSERVE_SERVER_BATCHING_BATCH_H_
#define COLLABSERVE_SERVER_BATCHING_BATCH_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace collabserve::batching {

// One unit of work. Subclasses carry the payload (token ids) and the way to deliver a result; the
// scheduler only needs the methods below. size(), deadline() and cancelled() are called with the
// scheduler's lock held: they must be cheap, thread-safe, and must not call into the scheduler.
class BatchTask {
 public:
  virtual ~BatchTask() = default;

  // The task's length in tokens (the sequence length including special tokens). Must be >= 0 and
  // must not change while the task is scheduled.
  virtual int64_t size() const = 0;

  // After this instant the task is useless (the client's deadline): a scheduler fails it with
  // DEADLINE_EXCEEDED instead of putting it in a batch.
  virtual absl::Time deadline() const { return absl::InfiniteFuture(); }

  // True once nobody wants the result (the client cancelled): a scheduler fails the task with
  // CANCELLED instead of putting it in a batch.
  virtual bool cancelled() const { return false; }

  // Called by a scheduler exactly once, instead of processing, when it drops a task it had accepted:
  // DEADLINE_EXCEEDED (deadline passed while queued), CANCELLED (cancelled while queued) or
  // UNAVAILABLE (scheduler shut down without draining). Called without any scheduler lock held, on
  // a batch thread or on the thread that called Schedule()/Shutdown(); must not block.
  virtual void Fail(const absl::Status& status) = 0;
};

// A group of tasks that are processed together. It grows monotonically (AddTask) and is then
// closed; the callback that receives it may take the tasks out (RemoveAllTasks). Sizes are in
// tokens: size() counts real tokens, padded_size() the tokens of the padded [num_tasks x longest]
// tensor that runs.
//
// Not thread-safe: a Batch has one owner at a time (the scheduler while it forms the batch, then the
// process-batch callback).
template <typename TaskType>
class Batch {
 public:
  Batch() = default;
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  // Appends `task` (not null). `enqueue_time` is when the task was scheduled; with the close time it
  // gives queue_wait(). Requires !IsClosed().
  void AddTask(std::unique_ptr<TaskType> task, absl::Time enqueue_time = absl::InfinitePast()) {
    DCHECK(!closed_) << "AddTask on a closed Batch";
    DCHECK(task != nullptr);
    const int64_t task_size = task->size();
    size_ += task_size;
    max_task_size_ = std::max(max_task_size_, task_size);
    enqueue_times_.push_back(enqueue_time);
    tasks_.push_back(std::move(task));
  }

  // Marks the batch complete; `close_time` is when it was formed (for queue_wait()).
  void Close(absl::Time close_time = absl::InfinitePast()) {
    closed_ = true;
    close_time_ = close_time;
  }
  bool IsClosed() const { return closed_; }
  absl::Time close_time() const { return close_time_; }

  int64_t num_tasks() const { return static_cast<int64_t>(tasks_.size()); }
  bool empty() const { return tasks_.empty(); }

  // 0 <= i < num_tasks().
  const TaskType& task(int64_t i) const { return *tasks_[CheckedIndex(i)]; }
  TaskType* mutable_task(int64_t i) { return tasks_[CheckedIndex(i)].get(); }

  // Sum of the tasks' sizes (real tokens).
  int64_t size() const { return size_; }
  // The longest task's size: the padded sequence length.
  int64_t max_task_size() const { return max_task_size_; }
  // num_tasks() x max_task_size(): the tokens the model actually processes.
  int64_t padded_size() const { return num_tasks() * max_task_size_; }
  // Padding tokens / padded tokens, in [0, 1); 0 for an empty batch or empty tasks.
  double padding_ratio() const {
    const int64_t padded = padded_size();
    return padded == 0 ? 0.0 : static_cast<double>(padded - size_) / static_cast<double>(padded);
  }

  // How long task i waited between being scheduled and the batch being closed; zero when either
  // time is unknown (the batch was not formed by a scheduler).
  absl::Duration queue_wait(int64_t i) const {
    const absl::Time enqueued = enqueue_times_[CheckedIndex(i)];
    if (enqueued == absl::InfinitePast() || close_time_ == absl::InfinitePast()) {
      return absl::ZeroDuration();
    }
    return close_time_ - enqueued;
  }

  // Takes every task out, in order; the batch is then empty (sizes 0) and stays closed if it was.
  std::vector<std::unique_ptr<TaskType>> RemoveAllTasks() {
    std::vector<std::unique_ptr<TaskType>> tasks = std::move(tasks_);
    tasks_.clear();
    enqueue_times_.clear();
    size_ = 0;
    max_task_size_ = 0;
    return tasks;
  }

 private:
  size_t CheckedIndex(int64_t i) const {
    DCHECK(i >= 0 && i < num_tasks()) << "task index " << i << " out of range [0, " << num_tasks()
                                      << ")";
    return static_cast<size_t>(i);
  }

  std::vector<std::unique_ptr<TaskType>> tasks_;
  std::vector<absl::Time> enqueue_times_;
  int64_t size_ = 0;
  int64_t max_task_size_ = 0;
  bool closed_ = false;
  absl::Time close_time_ = absl::InfinitePast();
};

}  // namespace collabserve::batching

#endif  // COLLABSERVE_SERVER_BATCHING_BATCH_H_
