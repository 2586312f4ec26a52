// What one served model version has done, in the terms of Triton's statistics extension
// (ModelStatistics): calls that succeeded and failed, where their time went, inputs answered and
// forward passes run, by batch size. Kept by the version (ModelServable) from its load to its
// unload, as Triton keeps them per loaded version. Thread-safe: one short lock per call or batch.
#ifndef COLLABSERVE_SERVER_SERVICE_SERVABLE_STATISTICS_H_
#define COLLABSERVE_SERVER_SERVICE_SERVABLE_STATISTICS_H_

#include <algorithm>
#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace collabserve::service {

class ServableStatistics {
 public:
  struct Duration {
    uint64_t count = 0;
    uint64_t ns = 0;
    void Add(absl::Duration d) {
      ++count;
      ns += static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(d)));
    }
  };
  // One call (Classify, a ClassifyStream request, ModelInfer) that this version answered: from its
  // arrival to its response, the longest any of its inputs waited in the queue, its tokenization,
  // the longest forward pass any of its inputs was in, and building the response.
  struct Call {
    int64_t inputs = 0;
    absl::Duration total, queue, tokenization, inference, output;
  };
  struct Snapshot {
    int64_t last_inference_ms = 0;  // when the last call succeeded, ms since the epoch; 0: none yet
    uint64_t inference_count = 0;   // inputs answered by successful calls
    uint64_t execution_count = 0;   // forward passes (batches) run
    // Per call: success, fail (from its arrival to its error), queue, compute_input
    // (tokenization), compute_infer, compute_output; each call counted once.
    Duration success, fail, queue, compute_input, compute_infer, compute_output;
    std::map<int64_t, Duration> batches;  // forward passes by batch size (inputs), and their time
  };

  void RecordSuccess(const Call& call, absl::Time end);
  // A call resolved to this version that failed: bad input, overload, deadline, a failed pass.
  void RecordFailure(absl::Duration total);
  // A forward pass over `batch_size` inputs, failed or not.
  void RecordExecution(int64_t batch_size, absl::Duration pass);

  Snapshot Get() const;

 private:
  mutable absl::Mutex mu_;
  Snapshot s_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_SERVABLE_STATISTICS_H_
