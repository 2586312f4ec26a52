// A dynamic batch scheduler: tasks (one tokenized input each) are queued, grouped into batches of
// similar length under a size and a padded-token budget, and handed to a callback on batch threads.
// Modelled on TensorFlow Serving's BasicBatchScheduler: the scheduler's policy decides WHEN a batch
// forms; the process-batch callback decides WHAT is done with it (pad, run the model, split).
//
// Policy. A batch is released when
//   (a) it is full: it holds max_batch_size tasks, or queued tasks had to be left out of it because
//       of the limits (the queue holds more than one batch's worth), or
//   (b) the oldest queued task has waited max_queue_delay_micros (immediately if that is 0), or
//   (c) release_when_idle is set and no batch is being processed (every batch thread is idle):
//       the model would sit idle while the batch waits for company, so a lone request (low load)
//       pays no queue delay; under load a batch is always in flight and batches still fill, or
//   (d) the scheduler is shutting down (draining).
// With fair_share and several batch threads, a batch also takes at most its thread's share of the
// work, ceil(W / num_batch_threads) tasks, where W counts the queued tasks and those in batches
// being processed; a batch that reaches its share counts as full (a). So the threads split what
// is in flight evenly: a closed loop of N clients settles at N / threads tasks a batch on every
// thread, instead of keeping whatever split its first batches took (with two threads and 8
// clients: a lone first request on one thread, the 7 behind it on the other, for ever after, as
// each thread re-batches only the clients it has just answered). A lone task with every thread
// idle is its own share, so fair_share also releases it at once, as release_when_idle does.
// A batch always contains the oldest queued task (no starvation). With length_aware, the rest of it
// is the queued tasks whose lengths are closest to the oldest one's (ties: shorter, then older);
// otherwise the tasks that follow the oldest in arrival order, up to the first that does not fit.
// Limits: num_tasks <= max_batch_size and num_tasks x longest <= max_batch_tokens. Tasks left
// behind keep their arrival order.
//
// Dead tasks (cancelled() or deadline() <= Now()) never enter a batch: a task chosen for a batch
// is checked first, and a dead one is failed with CANCELLED / DEADLINE_EXCEEDED instead. The whole
// queue is also swept for dead tasks whenever the earliest queued deadline has passed (an idle
// batch thread wakes for it) and at most every kSweepInterval otherwise (for cancellations), both
// by batch threads and by Schedule when it finds the queue full, so a queue full of dead tasks
// makes room without costing a full scan on every rejected Schedule.
//
// Cost: Schedule is O(log n) (n = queued tasks); forming a batch of k tasks is O(k log n).
// Schedule wakes a batch thread only when its decision may change (the queue was empty, the batch
// may now be full, or the new task's deadline is the earliest), not on every arrival: a batch
// thread waiting out the delay is not woken 31 times to find its batch still not full.
#ifndef COLLABSERVE_SERVER_BATCHING_BATCH_SCHEDULER_H_
#define COLLABSERVE_SERVER_BATCHING_BATCH_SCHEDULER_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/batching/batch.h"
#include "server/batching/clock.h"

namespace collabserve::batching {

struct SchedulerOptions {
  // Most tasks in one batch. >= 1.
  int64_t max_batch_size = 32;
  // Most padded tokens in one batch: num_tasks x longest task. >= 1. A task longer than this can
  // never be batched and is refused by Schedule.
  int64_t max_batch_tokens = 16384;
  // How long the oldest queued task may wait for its batch to fill. 0: release whatever is queued
  // as soon as a batch thread is free. >= 0.
  int64_t max_queue_delay_micros = 2000;
  // Most tasks waiting (not yet in a batch). Beyond it Schedule fails at once. >= 1.
  int64_t max_queue_size = 1024;
  // Threads that form batches and run the callback; batches are processed concurrently. >= 1.
  int num_batch_threads = 1;
  // Release a batch at once, whatever its size, when no batch is being processed (policy (c)).
  bool release_when_idle = false;
  // Group tasks of similar length (see the policy above) instead of taking them in arrival order.
  bool length_aware = true;
  // Cap each batch at its thread's share of the work in flight, and release it once it holds that
  // share (see the policy above). No effect with one batch thread.
  bool fair_share = false;
  // Time source; nullptr means RealClock::Get(). Must outlive the scheduler's threads.
  Clock* clock = nullptr;
  // Called with the number of queued tasks each time it changes: tasks queued, a batch formed,
  // dead tasks swept out (which happens on a batch thread with no batch), shutdown. Calls may come
  // from several threads but never concurrently, and a value never replaces a newer one. Optional;
  // must be cheap and must not call into the scheduler.
  std::function<void(int64_t queued)> on_queue_size;
  // Called once for every task that leaves the queue, with the time it waited there: when its
  // batch forms (before the callback sees the batch), and when it is failed dead (expired,
  // cancelled) or at shutdown, before its Fail. So a queue-time histogram also counts the inputs
  // that waited until their deadline, which under overload are the longest waits. Calls come from
  // several threads, possibly at once, outside the scheduler's lock. Optional; must be cheap and
  // must not call into the scheduler.
  std::function<void(absl::Duration waited)> on_dequeue;
  // For logs and error messages.
  std::string name;
};

// INVALID_ARGUMENT naming the first out-of-range field as `field_prefix` + its name, else OK. The
// server passes "--": each field is the flag of the same name.
absl::Status ValidateSchedulerOptions(const SchedulerOptions& options,
                                      std::string_view field_prefix = "SchedulerOptions.");

// Cumulative counters since Create; a consistent snapshot (all fields read under one lock).
struct SchedulerStats {
  int64_t tasks_scheduled = 0;            // accepted by Schedule / ScheduleAll
  int64_t tasks_rejected_queue_full = 0;  // RESOURCE_EXHAUSTED (ownership not taken)
  int64_t batches_formed = 0;
  int64_t tasks_batched = 0;              // tasks handed to the callback
  int64_t tokens_batched = 0;             // sum of Batch::size()
  int64_t padded_tokens_batched = 0;      // sum of Batch::padded_size()
  int64_t tasks_failed_deadline = 0;      // Fail(DEADLINE_EXCEEDED)
  int64_t tasks_failed_cancelled = 0;     // Fail(CANCELLED)
  int64_t tasks_failed_shutdown = 0;      // Fail(UNAVAILABLE)
};

enum class ShutdownMode {
  kDrain,       // process everything already queued (released at once, limits still apply)
  kFailQueued,  // fail everything queued with UNAVAILABLE; batches already formed still run
};

namespace internal {

// How often, at most, the whole queue is scanned for cancelled tasks (see the policy above).
inline constexpr absl::Duration kSweepInterval = absl::Milliseconds(1);

std::string SchedulerLabel(const std::string& name);

// The queued tasks as (size, arrival sequence number), ordered by size then arrival.
using LengthIndex = std::set<std::pair<int64_t, uint64_t>>;

// True if `count` tasks padded to `longest` tokens stay within options.max_batch_tokens.
bool FitsTokens(int64_t count, int64_t longest, const SchedulerOptions& options);

// The length-aware rule: starting from `oldest` (the queued task with the smallest sequence
// number, an element of `queue`), adds the tasks closest in length (ties: shorter, then older)
// while the limits allow: at most max_tasks tasks (<= options.max_batch_size) and
// options.max_batch_tokens. Returns the chosen sequence numbers, ascending; sets *full when the
// batch reached max_tasks or a queued task was left out. O(k log n) for a batch of k.
std::vector<uint64_t> SelectLengthAware(const LengthIndex& queue,
                                        std::pair<int64_t, uint64_t> oldest,
                                        const SchedulerOptions& options, int64_t max_tasks,
                                        bool* full);

// The most tasks the next batch may take: options.max_batch_size, or with fair_share and several
// batch threads the batch's share ceil((queued + in_process) / num_batch_threads) when smaller.
// >= 1.
int64_t BatchTaskLimit(const SchedulerOptions& options, int64_t queued, int64_t in_process);

template <typename TaskType>
class SchedulerCore;

}  // namespace internal

// Thread-safe: every method may be called concurrently from any thread, including from inside the
// process-batch callback (except that Shutdown/the destructor called there cannot wait for the
// calling thread itself; see Shutdown). Schedule never blocks on batch processing: it takes a
// mutex for a short, bounded time.
//
// TaskType derives from BatchTask. The callback receives each batch (closed, non-empty) on a batch
// thread and owns it; it must deliver a result to (or Fail) each task, and must not throw.
template <typename TaskType>
class BatchScheduler {
 public:
  static_assert(std::is_base_of_v<BatchTask, TaskType>, "TaskType must derive from BatchTask");
  using ProcessBatchCallback = std::function<void(std::unique_ptr<Batch<TaskType>>)>;

  // Starts options.num_batch_threads threads. INVALID_ARGUMENT for bad options (the message names
  // the field), a null callback or a null `scheduler`; INTERNAL if threads cannot be started.
  static absl::Status Create(const SchedulerOptions& options, ProcessBatchCallback process_batch,
                             std::unique_ptr<BatchScheduler>* scheduler);

  // Shutdown(ShutdownMode::kDrain).
  ~BatchScheduler();
  BatchScheduler(const BatchScheduler&) = delete;
  BatchScheduler& operator=(const BatchScheduler&) = delete;

  // Queues *task. On OK the scheduler owns it and *task is null; on any error *task is untouched.
  // INVALID_ARGUMENT: null task, negative size, or size > max_batch_tokens (can never fit).
  // UNAVAILABLE: Shutdown has begun. CANCELLED / DEADLINE_EXCEEDED: the task is already dead.
  // RESOURCE_EXHAUSTED: the queue is full (after a sweep for dead tasks, when one is due; see the
  // policy), returned at once.
  absl::Status Schedule(std::unique_ptr<TaskType>* task);

  // All-or-nothing Schedule of several tasks (e.g. the inputs of one request), queued
  // consecutively in vector order. On OK *tasks is empty; on error no task was taken and *tasks is
  // untouched. Errors as Schedule (for the first offending task), and INVALID_ARGUMENT when there
  // are more tasks than QueueCapacity() (they could never all fit). An empty vector is OK.
  absl::Status ScheduleAll(std::vector<std::unique_ptr<TaskType>>* tasks);

  // Tasks waiting for a batch (including dead ones not yet failed).
  int64_t NumEnqueuedTasks() const;
  // options.max_queue_size.
  int64_t QueueCapacity() const;
  SchedulerStats stats() const;

  // Stops accepting tasks (Schedule then returns UNAVAILABLE), disposes of the queued ones per
  // `mode`, waits until every batch has been processed, and joins the threads. May be called
  // again: a later kFailQueued call fails whatever a slow drain has not batched yet; a call made
  // while another is joining the threads does not wait for them. Called from inside the callback
  // (a batch thread), it cannot wait for that thread: that thread finishes the drain after the
  // callback returns, and then exits (the callback must stay valid until then).
  void Shutdown(ShutdownMode mode = ShutdownMode::kDrain);

 private:
  explicit BatchScheduler(std::shared_ptr<internal::SchedulerCore<TaskType>> core)
      : core_(std::move(core)) {}

  // Batch threads hold the core too, so that a thread still running after the scheduler is
  // destroyed from inside the callback touches only live state.
  const std::shared_ptr<internal::SchedulerCore<TaskType>> core_;
  absl::Mutex threads_mu_;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(threads_mu_);
};

// ----------------------------------------------------------------------------------------------
// Implementation.

namespace internal {

template <typename TaskType>
class SchedulerCore {
 public:
  using ProcessBatchCallback = typename BatchScheduler<TaskType>::ProcessBatchCallback;

  SchedulerCore(const SchedulerOptions& options, ProcessBatchCallback process_batch)
      : options_(options),
        clock_(options.clock != nullptr ? options.clock : RealClock::Get()),
        label_(SchedulerLabel(options.name)),
        process_batch_(std::move(process_batch)) {}

  // Schedules tasks[0..n) all-or-nothing.
  absl::Status Schedule(std::unique_ptr<TaskType>* tasks, size_t n) {
    if (n == 0) return absl::OkStatus();
    std::vector<int64_t> sizes(n);
    for (size_t i = 0; i < n; ++i) {
      if (tasks[i] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(label_, ": task ", i, " is null"));
      }
      sizes[i] = tasks[i]->size();
      if (sizes[i] < 0 || sizes[i] > options_.max_batch_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            label_, ": task ", i, " has ", sizes[i], " tokens; a task must have between 0 and ",
            options_.max_batch_tokens, " (max_batch_tokens)"));
      }
    }
    if (static_cast<int64_t>(n) > options_.max_queue_size) {
      return absl::InvalidArgumentError(absl::StrCat(label_, ": ", n,
                                                     " tasks can never be queued together; the "
                                                     "queue holds at most ",
                                                     options_.max_queue_size));
    }
    std::vector<Dropped> dropped;
    absl::Status status;
    QueueSize queued;
    {
      absl::MutexLock lock(&mu_);
      status = ScheduleLocked(tasks, sizes, &dropped);
      queued = QueueSizeLocked();
    }
    FailDropped(&dropped);
    Publish(queued);
    return status;
  }

  // The loop of each batch thread.
  void Run() {
    int64_t processed = -1;  // tasks of the batch this thread has just processed (-1: none)
    for (;;) {
      std::vector<Dropped> dropped;
      std::unique_ptr<Batch<TaskType>> batch;
      bool exit = false;
      QueueSize queued;
      {
        absl::MutexLock lock(&mu_);
        if (processed >= 0) {
          --in_flight_;
          in_flight_tasks_ -= processed;
          // With fair_share the shares shrink as work completes: a waiting thread's batch may be
          // full now.
          if (options_.fair_share && !queue_.empty()) cv_.Signal();
        }
        processed = -1;
        for (;;) {
          const absl::Time now = clock_->Now();
          MaybeSweepLocked(now, &dropped);
          if (queue_.empty()) {
            if (closing_) {
              exit = true;
              break;
            }
            if (!dropped.empty()) break;
            clock_->WaitWithDeadline(&mu_, &cv_, absl::InfiniteFuture());
            continue;
          }
          bool full = false;
          std::vector<uint64_t> chosen = SelectLiveLocked(now, &dropped, &full);
          if (chosen.empty()) continue;  // everything was dead; look again
          const absl::Time release_time = queue_.begin()->second.enqueue_time +
                                          absl::Microseconds(options_.max_queue_delay_micros);
          if (full || closing_ || now >= release_time ||
              (options_.release_when_idle && in_flight_ == 0)) {
            batch = FormBatchLocked(chosen, now);
            ++in_flight_;
            in_flight_tasks_ += batch->num_tasks();
            // Another idle thread may be able to form the next batch right away.
            if (!queue_.empty()) cv_.Signal();
            break;
          }
          if (!dropped.empty()) break;
          clock_->WaitWithDeadline(&mu_, &cv_, std::min(release_time, earliest_deadline_));
        }
        queued = QueueSizeLocked();
      }
      FailDropped(&dropped);
      Publish(queued);
      if (batch != nullptr) {
        VLOG(2) << label_ << ": batch of " << batch->num_tasks() << " tasks, "
                << batch->padded_size() << " padded tokens, padding ratio "
                << batch->padding_ratio();
        processed = batch->num_tasks();
        if (options_.on_dequeue) {
          for (int64_t i = 0; i < batch->num_tasks(); ++i) options_.on_dequeue(batch->queue_wait(i));
        }
        process_batch_(std::move(batch));
      }
      if (exit) return;
    }
  }

  // Stops accepting; with kFailQueued also empties the queue (failing its tasks with UNAVAILABLE).
  void BeginShutdown(ShutdownMode mode) {
    std::vector<Dropped> dropped;
    QueueSize queued;
    {
      absl::MutexLock lock(&mu_);
      if (closing_ && mode == ShutdownMode::kDrain) return;
      closing_ = true;
      if (mode == ShutdownMode::kFailQueued) {
        const absl::Status status =
            absl::UnavailableError(absl::StrCat(label_, " shut down before the task was batched"));
        const absl::Time now = clock_->Now();
        for (auto& [seq, e] : queue_) {
          dropped.push_back(Dropped{std::move(e.task), status, now - e.enqueue_time});
        }
        stats_.tasks_failed_shutdown += static_cast<int64_t>(queue_.size());
        queue_.clear();
        by_length_.clear();
        longest_queued_ = 0;
      }
      cv_.SignalAll();
      queued = QueueSizeLocked();
    }
    VLOG(1) << label_ << ": shutting down ("
            << (mode == ShutdownMode::kDrain ? "draining" : "failing queued tasks") << ")";
    FailDropped(&dropped);
    Publish(queued);
  }

  int64_t NumEnqueuedTasks() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(queue_.size());
  }
  SchedulerStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }
  const SchedulerOptions& options() const { return options_; }
  const std::string& label() const { return label_; }

 private:
  struct Entry {
    std::unique_ptr<TaskType> task;
    int64_t size;
    absl::Time enqueue_time;
  };
  // The queue's size at one moment, numbered so that a later moment's size is never overwritten.
  struct QueueSize {
    uint64_t moment = 0;  // 0: nothing to publish
    int64_t tasks = 0;
  };
  QueueSize QueueSizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return {++queue_moment_, static_cast<int64_t>(queue_.size())};
  }
  void Publish(const QueueSize& q) {
    if (!options_.on_queue_size || q.moment == 0) return;
    absl::MutexLock lock(&publish_mu_);
    if (q.moment <= published_moment_) return;
    published_moment_ = q.moment;
    options_.on_queue_size(q.tasks);
  }

  struct Dropped {
    std::unique_ptr<TaskType> task;
    absl::Status status;
    absl::Duration waited;  // in the queue
  };

  void FailDropped(std::vector<Dropped>* dropped) const {
    for (Dropped& d : *dropped) {
      if (options_.on_dequeue) options_.on_dequeue(d.waited);
      d.task->Fail(d.status);
    }
    dropped->clear();
  }

  absl::Status ScheduleLocked(std::unique_ptr<TaskType>* tasks, const std::vector<int64_t>& sizes,
                              std::vector<Dropped>* dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t n = sizes.size();
    if (closing_) {
      return absl::UnavailableError(absl::StrCat(label_, " is shutting down"));
    }
    const absl::Time now = clock_->Now();
    for (size_t i = 0; i < n; ++i) {
      absl::Status dead = DeadStatus(*tasks[i], now);
      if (!dead.ok()) return dead;
    }
    if (static_cast<int64_t>(queue_.size() + n) > options_.max_queue_size) {
      MaybeSweepLocked(now, dropped);
      if (static_cast<int64_t>(queue_.size() + n) > options_.max_queue_size) {
        stats_.tasks_rejected_queue_full += static_cast<int64_t>(n);
        return absl::ResourceExhaustedError(absl::StrCat(
            label_, ": queue full (", queue_.size(), " of ", options_.max_queue_size,
            " tasks waiting", n > 1 ? absl::StrCat(", ", n, " more requested") : "", ")"));
      }
    }
    // Whether a waiting batch thread could decide differently now (see the class comment): it
    // waits for work while the queue is empty, and otherwise until the oldest task's release time
    // or the earliest deadline, neither of which a younger task moves unless its deadline is
    // earlier; or the batch may have become full.
    bool wake = queue_.empty();
    for (size_t i = 0; i < n; ++i) {
      const absl::Time deadline = tasks[i]->deadline();
      if (deadline < earliest_deadline_) {
        earliest_deadline_ = deadline;
        wake = true;
      }
      const uint64_t seq = next_seq_++;
      if (options_.length_aware) by_length_.emplace(sizes[i], seq);
      queue_.emplace_hint(queue_.end(), seq, Entry{std::move(tasks[i]), sizes[i], now});
      longest_queued_ = std::max(longest_queued_, sizes[i]);
    }
    stats_.tasks_scheduled += static_cast<int64_t>(n);
    // May be full: the limits may leave a queued task out. Conservative (longest_queued_ is an
    // upper bound): an unneeded wake-up costs a context switch, a missed one a whole delay.
    const auto queued = static_cast<int64_t>(queue_.size());
    if (queued >= BatchTaskLimit(options_, queued, in_flight_tasks_) ||
        !FitsTokens(queued, longest_queued_, options_)) {
      wake = true;
    }
    if (wake) cv_.Signal();
    return absl::OkStatus();
  }

  absl::Status DeadStatus(const TaskType& task, absl::Time now) const {
    if (task.cancelled()) {
      return absl::CancelledError(absl::StrCat("task cancelled before ", label_, " batched it"));
    }
    if (task.deadline() <= now) {
      return absl::DeadlineExceededError(
          absl::StrCat("task deadline passed before ", label_, " batched it"));
    }
    return absl::OkStatus();
  }

  void RemoveLocked(typename std::map<uint64_t, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.length_aware) by_length_.erase({it->second.size, it->first});
    queue_.erase(it);
    if (queue_.empty()) longest_queued_ = 0;
  }

  // Moves a dead task out of the queue into *dropped.
  void DropLocked(typename std::map<uint64_t, Entry>::iterator it, absl::Status status,
                  absl::Time now, std::vector<Dropped>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (status.code() == absl::StatusCode::kCancelled) {
      ++stats_.tasks_failed_cancelled;
    } else {
      ++stats_.tasks_failed_deadline;
    }
    dropped->push_back(
        Dropped{std::move(it->second.task), std::move(status), now - it->second.enqueue_time});
    RemoveLocked(it);
  }

  // Scans the whole queue for dead tasks when one may have expired, or when the last scan is
  // kSweepInterval old (cancellations); recomputes earliest_deadline_.
  void MaybeSweepLocked(absl::Time now, std::vector<Dropped>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (now < earliest_deadline_ && now - last_sweep_ < kSweepInterval) return;
    last_sweep_ = now;
    earliest_deadline_ = absl::InfiniteFuture();
    for (auto it = queue_.begin(); it != queue_.end();) {
      auto next = std::next(it);
      absl::Status dead = DeadStatus(*it->second.task, now);
      if (dead.ok()) {
        earliest_deadline_ = std::min(earliest_deadline_, it->second.task->deadline());
      } else {
        DropLocked(it, std::move(dead), now, dropped);
      }
      it = next;
    }
  }

  // Chooses the next batch (see the policy) among live tasks: chosen tasks found dead are dropped
  // and the choice is made again. Empty only if the queue became empty.
  std::vector<uint64_t> SelectLiveLocked(absl::Time now, std::vector<Dropped>* dropped, bool* full)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (;;) {
      if (queue_.empty()) return {};
      std::vector<uint64_t> chosen = SelectLocked(full);
      bool any_dead = false;
      for (uint64_t seq : chosen) {
        auto it = queue_.find(seq);
        absl::Status dead = DeadStatus(*it->second.task, now);
        if (!dead.ok()) {
          DropLocked(it, std::move(dead), now, dropped);
          any_dead = true;
        }
      }
      if (!any_dead) return chosen;
    }
  }

  std::vector<uint64_t> SelectLocked(bool* full) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto oldest = queue_.begin();
    const int64_t max_tasks =
        BatchTaskLimit(options_, static_cast<int64_t>(queue_.size()), in_flight_tasks_);
    if (options_.length_aware) {
      return SelectLengthAware(by_length_, {oldest->second.size, oldest->first}, options_,
                               max_tasks, full);
    }
    // Arrival order: the oldest, then those after it, up to the first that does not fit.
    std::vector<uint64_t> chosen = {oldest->first};
    int64_t longest = oldest->second.size;
    for (auto it = std::next(oldest); it != queue_.end(); ++it) {
      if (static_cast<int64_t>(chosen.size()) >= max_tasks) break;
      const int64_t new_longest = std::max(longest, it->second.size);
      if (!FitsTokens(static_cast<int64_t>(chosen.size()) + 1, new_longest, options_)) break;
      chosen.push_back(it->first);
      longest = new_longest;
    }
    *full = static_cast<int64_t>(chosen.size()) >= max_tasks || chosen.size() < queue_.size();
    return chosen;
  }

  std::unique_ptr<Batch<TaskType>> FormBatchLocked(const std::vector<uint64_t>& chosen,
                                                   absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto batch = std::make_unique<Batch<TaskType>>();
    for (uint64_t seq : chosen) {
      auto it = queue_.find(seq);
      batch->AddTask(std::move(it->second.task), it->second.enqueue_time);
      RemoveLocked(it);
    }
    batch->Close(now);
    ++stats_.batches_formed;
    stats_.tasks_batched += batch->num_tasks();
    stats_.tokens_batched += batch->size();
    stats_.padded_tokens_batched += batch->padded_size();
    return batch;
  }

  const SchedulerOptions options_;
  Clock* const clock_;
  const std::string label_;
  const ProcessBatchCallback process_batch_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // batch threads wait here for work, a release time or shutdown
  std::map<uint64_t, Entry> queue_ ABSL_GUARDED_BY(mu_);  // by arrival sequence number
  LengthIndex by_length_ ABSL_GUARDED_BY(mu_);            // the same tasks; only if length_aware
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // <= every queued deadline (exact after a sweep).
  absl::Time earliest_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  // >= every queued task's size (reset when the queue empties).
  int64_t longest_queued_ ABSL_GUARDED_BY(mu_) = 0;
  // Batches formed whose callback has not returned yet, and the tasks in them.
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t in_flight_tasks_ ABSL_GUARDED_BY(mu_) = 0;
  SchedulerStats stats_ ABSL_GUARDED_BY(mu_);
  uint64_t queue_moment_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex publish_mu_;  // never held with mu_
  uint64_t published_moment_ ABSL_GUARDED_BY(publish_mu_) = 0;
};

}  // namespace internal

template <typename TaskType>
absl::Status BatchScheduler<TaskType>::Create(const SchedulerOptions& options,
                                              ProcessBatchCallback process_batch,
                                              std::unique_ptr<BatchScheduler>* scheduler) {
  if (scheduler == nullptr) {
    return absl::InvalidArgumentError("BatchScheduler::Create: output pointer is null");
  }
  absl::Status valid = ValidateSchedulerOptions(options);
  if (!valid.ok()) return valid;
  if (!process_batch) {
    return absl::InvalidArgumentError(absl::StrCat(internal::SchedulerLabel(options.name),
                                                   ": process_batch callback is empty"));
  }
  auto core = std::make_shared<internal::SchedulerCore<TaskType>>(options, std::move(process_batch));
  std::unique_ptr<BatchScheduler> result(new BatchScheduler(core));
  {
    absl::MutexLock lock(&result->threads_mu_);
    try {
      for (int i = 0; i < options.num_batch_threads; ++i) {
        result->threads_.emplace_back([core] { core->Run(); });
      }
    } catch (const std::system_error& e) {
      const std::string message = absl::StrCat(core->label(), ": cannot start batch thread ",
                                                result->threads_.size(), ": ", e.what());
      // The threads already started find the queue empty and exit.
      core->BeginShutdown(ShutdownMode::kDrain);
      for (std::thread& t : result->threads_) t.join();
      result->threads_.clear();
      return absl::InternalError(message);
    }
  }
  VLOG(1) << core->label() << ": started " << options.num_batch_threads << " batch thread(s)";
  *scheduler = std::move(result);
  return absl::OkStatus();
}

template <typename TaskType>
BatchScheduler<TaskType>::~BatchScheduler() {
  Shutdown(ShutdownMode::kDrain);
}

template <typename TaskType>
absl::Status BatchScheduler<TaskType>::Schedule(std::unique_ptr<TaskType>* task) {
  if (task == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(core_->label(), ": Schedule(nullptr)"));
  }
  return core_->Schedule(task, 1);
}

template <typename TaskType>
absl::Status BatchScheduler<TaskType>::ScheduleAll(std::vector<std::unique_ptr<TaskType>>* tasks) {
  if (tasks == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(core_->label(), ": ScheduleAll(nullptr)"));
  }
  absl::Status status = core_->Schedule(tasks->data(), tasks->size());
  if (status.ok()) tasks->clear();
  return status;
}

template <typename TaskType>
int64_t BatchScheduler<TaskType>::NumEnqueuedTasks() const {
  return core_->NumEnqueuedTasks();
}

template <typename TaskType>
int64_t BatchScheduler<TaskType>::QueueCapacity() const {
  return core_->options().max_queue_size;
}

template <typename TaskType>
SchedulerStats BatchScheduler<TaskType>::stats() const {
  return core_->stats();
}

template <typename TaskType>
void BatchScheduler<TaskType>::Shutdown(ShutdownMode mode) {
  core_->BeginShutdown(mode);
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&threads_mu_);
    threads.swap(threads_);
  }
  // Only locals from here on: a batch thread that calls Shutdown may be destroying *this.
  const std::thread::id self = std::this_thread::get_id();
  for (std::thread& t : threads) {
    if (t.get_id() == self) {
      t.detach();
    } else {
      t.join();
    }
  }
}

}  // namespace collabserve::batching

#endif  // COLLABSERVE_SERVER_BATCHING_BATCH_SCHEDULER_H_
