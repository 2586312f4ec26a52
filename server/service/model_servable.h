// A served model version: the engine, its batch scheduler and its metric handles. The batch
// callback pads and runs each batch on the engine and completes every task of it.
#ifndef COLLABSERVE_SERVER_SERVICE_MODEL_SERVABLE_H_
#define COLLABSERVE_SERVER_SERVICE_MODEL_SERVABLE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/batching/batch_scheduler.h"
#include "server/metrics/metrics.h"
#include "server/model/engine.h"
#include "server/repository/model_repository.h"
#include "server/service/inference_task.h"
#include "server/service/servable_statistics.h"

namespace collabserve::service {

struct ServableOptions {
  model::EngineOptions engine;
  // Batching (see batching::SchedulerOptions); name and clock are set per version, and
  // release_when_idle from release_batch_when_idle below.
  batching::SchedulerOptions batching;
  // batching::SchedulerOptions::release_when_idle for every version: a request that finds the
  // model idle runs at once instead of waiting max_queue_delay_micros for others to join it (under
  // load a batch is always in flight, so batches still fill).
  bool release_batch_when_idle = true;
  batching::Clock* clock = nullptr;  // nullptr: the real clock
  // Called with the error, on the thread that met it, when the engine finds its GPU unable to run
  // any more work (model::IsDeviceFailure) while loading, warming up or running a batch: the
  // Server then stops serving (Server::OnDeviceFailure).
  std::function<void(const absl::Status&)> on_device_failure;
  // Testing only: runs on the batch thread before each forward pass (e.g. to hold the model busy).
  std::function<void()> before_batch_hook;
  // Testing only: runs after before_batch_hook; an error it returns fails the batch as if the
  // engine's pass had returned it (the pass does not run). A CPU cannot fail as a GPU does.
  std::function<absl::Status()> batch_fault_hook;
};

// Thread-safe. Destruction drains the scheduler (queued tasks still run), so it must not happen on
// one of its own batch threads; Server hands destruction to a separate thread (see ServableReaper).
class ModelServable final : public repository::Servable {
 public:
  // Loads the engine from `path`, starts the scheduler, warms the model up with a few forward
  // passes and publishes the version's gauges. `metrics` must outlive the servable. Errors name the
  // version and the problem (the engine's load error, bad batching options).
  static absl::StatusOr<std::unique_ptr<ModelServable>> Load(const repository::ServableId& id,
                                                             const std::string& path,
                                                             const ServableOptions& options,
                                                             metrics::Metrics* metrics);
  ~ModelServable() override;

  const repository::ServableId& id() const { return id_; }
  const model::Engine& engine() const { return *engine_; }
  const model::ModelInfo& info() const { return engine_->info(); }
  const metrics::ModelMetrics& model_metrics() const { return model_metrics_; }
  double load_seconds() const { return load_seconds_; }
  // Q/K parameters of a standard layer over the actual ones (1 for a standard model).
  double compression_ratio() const { return compression_ratio_; }

  // Queues every task of one request, all or nothing (batching::BatchScheduler::ScheduleAll):
  // RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when shutting down.
  absl::Status Schedule(std::vector<std::unique_ptr<InferenceTask>>* tasks);

  batching::SchedulerStats scheduler_stats() const { return scheduler_->stats(); }
  // The batching this version is served with (its batch size, delay, queue and threads).
  const batching::SchedulerOptions& batching_options() const { return options_.batching; }
  // What this version has done since it loaded (Triton's ModelStatistics): its forward passes are
  // counted here, its calls by InferenceService.
  ServableStatistics& statistics() const { return statistics_; }

 private:
  ModelServable(repository::ServableId id, const ServableOptions& options,
                metrics::Metrics* metrics);
  void ProcessBatch(std::unique_ptr<batching::Batch<InferenceTask>> batch);
  absl::Status WarmUp();
  // util::Prefixed(status, prefix); first tells options_.on_device_failure when `status` is a
  // device failure.
  absl::Status Failed(const absl::Status& status, absl::string_view prefix) const;

  const repository::ServableId id_;
  const ServableOptions options_;
  batching::Clock* const clock_;
  metrics::Metrics* const metrics_;
  metrics::ModelMetrics model_metrics_;
  // Set once loaded; read by the scheduler's on_queue_size (batch threads).
  std::atomic<prometheus::Gauge*> queue_depth_{nullptr};
  mutable ServableStatistics statistics_;
  bool facts_published_ = false;
  double load_seconds_ = 0;
  double compression_ratio_ = 1;
  std::unique_ptr<model::Engine> engine_;
  // Declared after engine_: destroyed (drained) first, while the engine can still run batches.
  std::unique_ptr<batching::BatchScheduler<InferenceTask>> scheduler_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_MODEL_SERVABLE_H_
