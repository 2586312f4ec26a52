// How the CPUs are split between concurrent forward passes (batch threads) and the intra-op threads
// of each pass. No torch: the caller applies the plan (at::set_num_threads, util::SetBlasThreads).
#ifndef COLLABSERVE_SERVER_BATCHING_THREAD_PLAN_H_
#define COLLABSERVE_SERVER_BATCHING_THREAD_PLAN_H_

#include <string>

#include "absl/status/status.h"

namespace collabserve::batching {

struct ThreadPlan {
  int batch_threads = 1;     // concurrent forward passes per model version
  int intra_op_threads = 1;  // threads of each forward pass
  std::string reason;        // one line for the start-up log: which rule chose this
};

// Most batch threads the automatic CPU plan uses; bigger machines give each pass more threads.
inline constexpr int kMaxAutoCpuBatchThreads = 4;

// Most threads either flag may ask for: thousands would only be a typo (and OpenMP would start them).
inline constexpr int kMaxThreadsFlag = 1024;

// --num_batch_threads and --inference_threads: 0 (choose) or 1 to kMaxThreadsFlag; else
// INVALID_ARGUMENT naming the flag and its value.
absl::Status ValidateThreadFlags(int batch_threads_flag, int intra_op_threads_flag);

// batch_threads_flag / intra_op_threads_flag: the user's values, 0 = choose. cpus: usable CPUs
// (>= 1). On CPU the automatic plan favours throughput: small transformer passes scale poorly over
// intra-op threads (their OpenMP barriers and short GEMMs; measured here, 2 cores: one pass with two
// threads 648 inputs/s, two single-threaded passes 911), so it runs min(cpus, 4) passes at once and
// splits the CPUs between them. On an accelerator the device runs one pass at a time, so one batch
// thread, and its CPU-side work gets the CPUs. An explicit flag is always kept; the other value is
// derived from it (intra = cpus / batch threads, at least 1; batch threads = cpus / intra, at most 4).
ThreadPlan PlanInferenceThreads(bool accelerator, int cpus, int batch_threads_flag,
                                int intra_op_threads_flag);

}  // namespace collabserve::batching

#endif  // COLLABSERVE_SERVER_BATCHING_THREAD_PLAN_H_
