#include "server/batching/thread_plan.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace collabserve::batching {

absl::Status ValidateThreadFlags(int batch_threads_flag, int intra_op_threads_flag) {
  for (const auto& [flag, value] : {std::pair{"num_batch_threads", batch_threads_flag},
                                    std::pair{"inference_threads", intra_op_threads_flag}}) {
    if (value < 0 || value > kMaxThreadsFlag) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, " must be 0 (automatic) or 1 to ",
                                                     kMaxThreadsFlag));
    }
  }
  return absl::OkStatus();
}

ThreadPlan PlanInferenceThreads(bool accelerator, int cpus, int batch_threads_flag,
                                int intra_op_threads_flag) {
  cpus = std::max(1, cpus);
  ThreadPlan p;
  if (batch_threads_flag > 0 && intra_op_threads_flag > 0) {
    p.batch_threads = batch_threads_flag;
    p.intra_op_threads = intra_op_threads_flag;
    p.reason = "both set by flags";
  } else if (batch_threads_flag > 0) {
    p.batch_threads = batch_threads_flag;
    p.intra_op_threads = std::max(1, cpus / batch_threads_flag);
    p.reason = absl::StrCat("intra-op threads = ", cpus, " CPUs / ", batch_threads_flag,
                            " batch threads");
  } else if (accelerator) {
    p.batch_threads = 1;
    p.intra_op_threads = intra_op_threads_flag > 0 ? intra_op_threads_flag : cpus;
    p.reason = "accelerator: one forward pass at a time";
  } else if (intra_op_threads_flag > 0) {
    p.intra_op_threads = intra_op_threads_flag;
    p.batch_threads =
        std::clamp(cpus / intra_op_threads_flag, 1, kMaxAutoCpuBatchThreads);
    p.reason = absl::StrCat("batch threads = ", cpus, " CPUs / ", intra_op_threads_flag,
                            " intra-op threads, at most ", kMaxAutoCpuBatchThreads);
  } else {
    p.batch_threads = std::min(cpus, kMaxAutoCpuBatchThreads);
    p.intra_op_threads = std::max(1, cpus / p.batch_threads);
    p.reason = absl::StrCat("CPU: ", p.batch_threads, " concurrent passes (one per CPU, at most ",
                            kMaxAutoCpuBatchThreads, "), the ", cpus, " CPUs split between them");
  }
  return p;
}

}  // namespace collabserve::batching
