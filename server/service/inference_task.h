// One Classify request's inputs on their way through the batch scheduler: an InferenceTask per
// input, all sharing one CallState whose RequestTracker reassembles the results (they arrive on
// batch threads, in any order) and fires once when the last one is in.
#ifndef COLLABSERVE_SERVER_SERVICE_INFERENCE_TASK_H_
#define COLLABSERVE_SERVER_SERVICE_INFERENCE_TASK_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/batching/batch.h"
#include "server/batching/request_tracker.h"
#include "server/model/engine.h"

namespace collabserve::service {

// What one input's forward pass produced.
struct InputResult {
  model::Prediction prediction;
  absl::Duration queue_wait;  // scheduled -> batch formed
  absl::Duration inference;   // the forward pass it was part of
};

// Shared by the tasks of one call. Immutable after construction except through the atomics.
struct CallState {
  absl::Time deadline = absl::InfiniteFuture();
  // Set by the reactor's OnCancel when the client cancels (or its deadline passes).
  std::shared_ptr<std::atomic<bool>> cancelled;
  std::shared_ptr<batching::RequestTracker<InputResult>> tracker;
};

// One tokenized input. size() is its token count, so the scheduler's token budget and
// length-aware grouping see real lengths. A task whose call was cancelled, or whose sibling already
// failed, reports cancelled() so that it never reaches the model.
class InferenceTask final : public batching::BatchTask {
 public:
  InferenceTask(std::shared_ptr<const CallState> call, int index, model::TokenizedInput input)
      : call_(std::move(call)), index_(index), input_(std::move(input)) {}

  int64_t size() const override { return static_cast<int64_t>(input_.input_ids.size()); }
  absl::Time deadline() const override { return call_->deadline; }
  bool cancelled() const override {
    return call_->cancelled->load(std::memory_order_relaxed) || call_->tracker->failed();
  }
  void Fail(const absl::Status& status) override {
    call_->tracker->SetError(index_, status).IgnoreError();  // only a second report can fail
  }

  void Complete(model::Prediction prediction, absl::Duration queue_wait, absl::Duration inference) {
    call_->tracker->SetResult(index_, InputResult{std::move(prediction), queue_wait, inference})
        .IgnoreError();
  }
  const model::TokenizedInput& input() const { return input_; }

 private:
  const std::shared_ptr<const CallState> call_;
  const int index_;
  const model::TokenizedInput input_;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_INFERENCE_TASK_H_
