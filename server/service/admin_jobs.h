// Admin jobs: an upload or a compression that ends in publishing a new model version, run on a
// small bounded pool so that classification keeps the CPU it needs.
#ifndef COLLABSERVE_SERVER_SERVICE_ADMIN_JOBS_H_
#define COLLABSERVE_SERVER_SERVICE_ADMIN_JOBS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "collabserve/v1/admin.pb.h"
#include "server/repository/model_repository.h"
#include "server/service/admin_metrics.h"

namespace collabserve::service {

// One job. Thread-safe. Its state and history are a v1::Job (what GetJob returns); every change
// appends a v1::JobEvent that watchers receive in order.
class Job {
 public:
  // Receives each new event with the job's state after it; called with the job's lock held, so it
  // must not call back into the Job (copy what it needs and return).
  using Listener = std::function<void(const v1::JobEvent& event, v1::Job::State state)>;

  explicit Job(v1::Job initial);

  const std::string& id() const { return id_; }
  int64_t created_unix_micros() const { return created_unix_micros_; }
  // A copy of the job; without the event list unless `with_events`.
  v1::Job Snapshot(bool with_events) const;
  v1::Job::State state() const;
  bool terminal() const;
  // What the job ended (or is ending) with: OK until then, and for a success.
  absl::Status EndStatus() const;

  // Appends `event` (sequence and time filled in), applying `mutate` to the job first (under the
  // same lock), and tells the listeners.
  // Nothing once the job has ended or is ending (JobManager::Finish has begun): returns false.
  bool Record(v1::JobEvent event, const std::function<void(v1::Job*)>& mutate = nullptr);
  // Applies `mutate` without an event.
  void Update(const std::function<void(v1::Job*)>& mutate);

  // Calls `listener` with every event so far, then with each new one until Unsubscribe (no event
  // is missed or repeated). Returns a handle for Unsubscribe.
  int Subscribe(Listener listener);
  void Unsubscribe(int handle);

  // Set by CancelJob; compression polls it.
  const std::atomic<bool>* cancel_flag() const { return &cancel_; }
  bool cancel_requested() const { return cancel_.load(); }

 private:
  friend class JobManager;
  static bool IsTerminal(v1::Job::State s);

  const std::string id_;
  const int64_t created_unix_micros_;
  std::atomic<bool> cancel_{false};
  mutable absl::Mutex mu_;
  v1::Job job_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::Job::State> event_states_ ABSL_GUARDED_BY(mu_);  // the state after each event
  bool committing_ ABSL_GUARDED_BY(mu_) = false;  // publishing: no longer cancellable
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;   // JobManager::Finish has begun
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);  // what Finish was given
  int next_listener_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, Listener> listeners_ ABSL_GUARDED_BY(mu_);
};

struct JobManagerOptions {
  // Worker threads: jobs that run at once. Keep it below the inference threads.
  int max_concurrent_jobs = 1;
  // Jobs receiving their upload or waiting for a worker; one more is RESOURCE_EXHAUSTED.
  int max_queued_jobs = 4;
  // Torch intra-op threads each worker uses (compression), so that a job takes at most this many
  // cores from classification.
  int intra_op_threads = 1;
  // CPU priority of the worker threads and of every thread they start (CP-ALS's layer workers,
  // their OpenMP teams inherit it). idle_priority (the default): Linux SCHED_IDLE, so a job runs on
  // the cores classification leaves free and any inference thread that wakes up preempts it at
  // once; a job can then use every core (CompressOptions::parallel_layers) without costing
  // classification its latency. Where SCHED_IDLE is refused (not Linux, a seccomp policy), or with
  // idle_priority false: nice value `nice` (0..19; 0 keeps the server's priority), which only
  // weighs the share (a nice-10 thread still gets ~1/10 of a core an inference thread wants).
  bool idle_priority = true;
  int nice = 10;
  // Where a compression job's CP-ALS and model passes run (the server's --device).
  std::string device = "cpu";
  // Called, before the job ends, with the failure of a job whose work found `device` failed for
  // good (model::IsDeviceFailure; a job's INTERNAL error on a GPU is checked with
  // model::WithDeviceCheck): the server then stops serving (AdminServer sets it to
  // Server::OnDeviceFailure). The job fails UNAVAILABLE with that status either way.
  std::function<void(const absl::Status&)> on_device_failure;
  // Asked as a job is created, once its spec is valid: a status it returns refuses the job
  // (AdminServer: InferenceService::Refusal, UNAVAILABLE once the server's GPU failed or while it
  // drains, so that an upload is not sent to a pod that can no longer run it). Null: never.
  std::function<absl::Status()> refusal;
  // For tests, since a CPU cannot fail as a GPU does: called where a job's model work begins
  // (after an upload is verified and the config read); a status it returns ends the job as that
  // work failing would. Null in production.
  std::function<absl::Status()> work_fault_hook;
  // For tests, to reach the moment a CancelJob meets a worker: called on the worker with the job's
  // id once it has taken the job from the queue, before it starts it. Null in production.
  std::function<void(const std::string& job_id)> start_hook;
  // Ended jobs kept for GetJob/ListJobs (the oldest are forgotten first).
  int max_finished_jobs = 100;
};

// What a job is for: kind, model_name, version (0 = next free), source_version (COMPRESS),
// compression, min_agreement, activate, and the probe texts.
struct JobSpec {
  v1::Job::Kind kind = v1::Job::UPLOAD;
  std::string model_name;
  int64_t version = 0;
  int64_t source_version = 0;
  v1::CompressionSpec compression;
  bool has_min_agreement = false;
  double min_agreement = 0;
  bool activate = false;
  std::vector<std::string> probes;
  // COMPRESS: calibration texts (activation-aware CP); an upload brings calibration.txt instead.
  std::vector<std::string> calibration;
};

// Thread-safe. The destructor cancels every job, waits for the workers and fails what is queued.
//
// A job's life: Create() reserves a queue slot and a version and returns it RECEIVING (an upload)
// or QUEUED; an upload is handed over with Enqueue() once its bytes are verified, or ended with
// Abandon(). A worker then validates the checkpoint (uploads), compresses it into
// root/.staging/<job>/, applies the fidelity gate, publishes with one rename (the commit point:
// CancelJob fails from there on) and loads it if asked. Whatever the outcome, root/.staging/<job>
// is removed when the job ends, and nothing but the final rename ever touches the served versions.
class JobManager {
 public:
  // `repository` returns the server's repository, or null while it does not exist yet (jobs then
  // fail with UNAVAILABLE). `metrics` may be null.
  using RepositoryFn = std::function<repository::ModelRepository*()>;
  JobManager(JobManagerOptions options, RepositoryFn repository, AdminMetrics* metrics);
  ~JobManager();  // Shutdown()

  // Cancels every job, waits for the workers, ends what is queued with UNAVAILABLE; later
  // Create() calls get UNAVAILABLE. Idempotent.
  void Shutdown();
  JobManager(const JobManager&) = delete;
  JobManager& operator=(const JobManager&) = delete;

  // Validates the spec (names, the compression request, min_agreement in [0,1] and only with a
  // compression; COMPRESS: the source version exists), reserves a queue slot and a version (the
  // given one, or the next free one counting versions other jobs have reserved), and creates
  // root/.staging/<job>/. INVALID_ARGUMENT, NOT_FOUND (COMPRESS source), ALREADY_EXISTS (version
  // taken), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (no repository yet / shutting down).
  absl::StatusOr<std::shared_ptr<Job>> Create(const JobSpec& spec);

  // root/.staging/<job id>: the job's private directory.
  std::string StagingDir(const Job& job) const;

  // Hands a RECEIVING upload (its files in `input_dir`, inside StagingDir) to the workers.
  // A worker first runs `verify` (the upload's checksums and fsync: slow I/O kept off the gRPC
  // threads; may be null), then validates the checkpoint. `on_validated` is called once, from a
  // worker: OK once the engine accepted the checkpoint, otherwise the reason the job ended before
  // that (INVALID_ARGUMENT for a bad checksum or a rejected checkpoint, CANCELLED, ...). A COMPRESS
  // job is enqueued by Create() itself.
  void Enqueue(const std::shared_ptr<Job>& job, std::string input_dir,
               std::function<absl::Status()> verify,
               std::function<void(const absl::Status&)> on_validated);

  // Ends a job that never reached a worker (its upload failed or was abandoned by the client).
  void Abandon(const std::shared_ptr<Job>& job, const absl::Status& why);

  std::shared_ptr<Job> Get(const std::string& id) const;
  std::vector<std::shared_ptr<Job>> List() const;  // newest first

  // Requests cancellation: a RECEIVING or QUEUED job ends at once, a RUNNING one at the next
  // check (between layers, CP-ALS sweeps, and batches of the calibration, search and fidelity passes). NOT_FOUND for an unknown id; FAILED_PRECONDITION once it has ended
  // or is publishing.
  absl::StatusOr<v1::Job> Cancel(const std::string& id);

 private:
  struct Work {
    std::shared_ptr<Job> job;
    std::string input_dir;
    std::function<absl::Status()> verify;
    std::function<void(const absl::Status&)> on_validated;
  };

  void WorkerLoop();
  // Runs `fn` on publisher_, a thread at the server's own priority, and waits for it. The workers
  // run at idle priority (or nice), which every thread they start inherits: the repository load of
  // a published version starts the version's batch threads, which must not.
  void RunAtServerPriority(const std::function<void()>& fn);
  void PublisherLoop();
  void Run(Work work);
  // The pipeline after validation; returns how the job ended (OK: published).
  absl::Status Process(Work& work, repository::ModelRepository* repo);
  // The last step: publishes `dir` as the job's version (one atomic rename into the repository, at
  // the server's priority), records PUBLISHED, and with spec.activate() LOADED once it serves.
  absl::Status PublishAndLoad(Job& job, const v1::Job& spec, const std::string& dir,
                              repository::ModelRepository* repo);
  // Ends `job` with `status` (OK = succeeded, CANCELLED = cancelled, else failed): the final event,
  // metrics, staging removed, slot and version released. Only the first call has an effect.
  void Finish(const std::shared_ptr<Job>& job, const absl::Status& status);
  // UNAVAILABLE naming the shutdown while Shutdown() stops the jobs, else CANCELLED.
  absl::Status CancelledOrStopping(const Job& job) const ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseLocked(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobManagerOptions options_;
  const RepositoryFn repository_;
  AdminMetrics* const metrics_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> finished_order_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> pending_ ABSL_GUARDED_BY(mu_);  // RECEIVING or QUEUED: slots taken
  std::map<std::string, std::set<int64_t>> reserved_versions_ ABSL_GUARDED_BY(mu_);
  std::deque<Work> queue_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<std::string>> probes_ ABSL_GUARDED_BY(mu_);  // job -> probes
  std::map<std::string, std::vector<std::string>> calibration_ ABSL_GUARDED_BY(mu_);  // job -> texts
  // job -> the flock(2) descriptor of its staging claim (root/.staging/<job>.lock).
  std::map<std::string, int> staging_locks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
  absl::Mutex publish_mu_;
  bool publisher_stopping_ ABSL_GUARDED_BY(publish_mu_) = false;
  std::deque<std::function<void()>> publish_queue_ ABSL_GUARDED_BY(publish_mu_);
  std::thread publisher_;  // started before the workers, stopped after them
  absl::Mutex shutdown_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // serializes Shutdown()
};

// CompressionSpec.max_iters above this is refused.
inline constexpr int kMaxCpIterations = 10000;

// Converts the proto compression request to the compressor's; INVALID_ARGUMENT naming the field.
// Returns false in `*requested` (and OK) when no spec is set.
absl::Status ParseCompressionSpec(const v1::CompressionSpec& spec, bool* requested);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_ADMIN_JOBS_H_
