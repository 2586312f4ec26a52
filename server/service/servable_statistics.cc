#include "server/service/servable_statistics.h"

#include <algorithm>

namespace collabserve::service {

void ServableStatistics::RecordSuccess(const Call& call, absl::Time end) {
  absl::MutexLock l(&mu_);
  s_.last_inference_ms = std::max(s_.last_inference_ms, absl::ToUnixMillis(end));  // calls end out of order
  s_.inference_count += static_cast<uint64_t>(std::max<int64_t>(0, call.inputs));
  s_.success.Add(call.total);
  s_.queue.Add(call.queue);
  s_.compute_input.Add(call.tokenization);
  s_.compute_infer.Add(call.inference);
  s_.compute_output.Add(call.output);
}

void ServableStatistics::RecordFailure(absl::Duration total) {
  absl::MutexLock l(&mu_);
  s_.fail.Add(total);
}

void ServableStatistics::RecordExecution(int64_t batch_size, absl::Duration pass) {
  absl::MutexLock l(&mu_);
  ++s_.execution_count;
  s_.batches[batch_size].Add(pass);
}

ServableStatistics::Snapshot ServableStatistics::Get() const {
  absl::MutexLock l(&mu_);
  return s_;
}

}  // namespace collabserve::service
