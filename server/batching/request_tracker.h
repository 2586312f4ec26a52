// Reassembles a request whose inputs were split into tasks that may land in different batches: each
// task reports its result by index, and the last report fires one completion with all results in
// order, or with the first error.
#ifndef COLLABSERVE_SERVER_BATCHING_REQUEST_TRACKER_H_
#define COLLABSERVE_SERVER_BATCHING_REQUEST_TRACKER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace collabserve::batching {

// Collects the results of `num_tasks` tasks (indices 0..num_tasks-1). When every index has been
// reported, calls `done` exactly once, on the thread that made the last report and without any
// lock held: with the results in index order if all succeeded, else with the first error reported
// (first in time, not by index). Tasks of a failed request may still run and report; their results
// are discarded (failed() lets them skip the work).
//
// Thread-safe. Share it between the tasks with the std::shared_ptr from Create. T must be movable.
template <typename T>
class RequestTracker {
 public:
  using DoneCallback = std::function<void(absl::StatusOr<std::vector<T>>)>;

  // num_tasks == 0 calls `done` with an empty vector before returning; num_tasks < 0 calls it with
  // INVALID_ARGUMENT. Either way the returned tracker then rejects every report.
  static std::shared_ptr<RequestTracker> Create(int64_t num_tasks, DoneCallback done) {
    std::shared_ptr<RequestTracker> tracker(new RequestTracker(num_tasks, std::move(done)));
    if (num_tasks <= 0) {
      DoneCallback callback;
      {
        absl::MutexLock lock(&tracker->mu_);
        callback = std::move(tracker->done_);
        tracker->fired_ = true;
      }
      if (num_tasks == 0) {
        callback(std::vector<T>());
      } else {
        tracker->failed_.store(true, std::memory_order_relaxed);
        callback(absl::InvalidArgumentError(
            absl::StrCat("RequestTracker: num_tasks = ", num_tasks, "; it must be >= 0")));
      }
    }
    return tracker;
  }

  RequestTracker(const RequestTracker&) = delete;
  RequestTracker& operator=(const RequestTracker&) = delete;

  // Reports task `index`'s result: a value, or the error that stopped it. OUT_OF_RANGE for a bad
  // index, FAILED_PRECONDITION if `index` was already reported; such a report changes nothing.
  absl::Status Report(int64_t index, absl::StatusOr<T> result) {
    DoneCallback callback;
    absl::StatusOr<std::vector<T>> outcome = absl::UnknownError("unset");
    {
      absl::MutexLock lock(&mu_);
      if (index < 0 || index >= num_tasks_) {
        return absl::OutOfRangeError(absl::StrCat("RequestTracker: task index ", index,
                                                  " out of range [0, ", num_tasks_, ")"));
      }
      if (reported_[index]) {
        return absl::FailedPreconditionError(
            absl::StrCat("RequestTracker: task ", index, " reported twice"));
      }
      reported_[index] = true;
      ++num_reported_;
      if (!result.ok()) {
        if (first_error_.ok()) first_error_ = result.status();
        failed_.store(true, std::memory_order_relaxed);
      } else if (first_error_.ok()) {
        results_[index] = std::move(result).value();
      }
      if (num_reported_ < num_tasks_) return absl::OkStatus();
      fired_ = true;
      callback = std::move(done_);
      if (!first_error_.ok()) {
        outcome = first_error_;
      } else {
        std::vector<T> values;
        values.reserve(results_.size());
        for (std::optional<T>& r : results_) values.push_back(std::move(*r));
        outcome = std::move(values);
      }
      results_.clear();
    }
    callback(std::move(outcome));
    return absl::OkStatus();
  }

  // Shorthands for Report.
  absl::Status SetResult(int64_t index, T value) { return Report(index, std::move(value)); }
  absl::Status SetError(int64_t index, absl::Status status) {
    if (status.ok()) {
      status = absl::InternalError(
          absl::StrCat("RequestTracker: task ", index, " reported an error with an OK status"));
    }
    return Report(index, std::move(status));
  }

  // True once any task reported an error: remaining tasks of this request may skip their work.
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  // True once `done` has been called (or is being called).
  bool done() const {
    absl::MutexLock lock(&mu_);
    return fired_;
  }
  int64_t num_tasks() const { return num_tasks_; }

 private:
  RequestTracker(int64_t num_tasks, DoneCallback done)
      : num_tasks_(num_tasks < 0 ? 0 : num_tasks),
        done_(std::move(done)),
        results_(static_cast<size_t>(num_tasks_)),
        reported_(static_cast<size_t>(num_tasks_), false) {}

  const int64_t num_tasks_;
  mutable absl::Mutex mu_;
  DoneCallback done_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<T>> results_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> reported_ ABSL_GUARDED_BY(mu_);
  int64_t num_reported_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> failed_{false};
};

}  // namespace collabserve::batching

#endif  // COLLABSERVE_SERVER_BATCHING_REQUEST_TRACKER_H_
