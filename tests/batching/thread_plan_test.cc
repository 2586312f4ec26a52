#include "server/batching/thread_plan.h"

#include <gtest/gtest.h>

namespace collabserve::batching {
namespace {

void ExpectPlan(const ThreadPlan& p, int batch, int intra) {
  EXPECT_EQ(p.batch_threads, batch) << p.reason;
  EXPECT_EQ(p.intra_op_threads, intra) << p.reason;
  EXPECT_FALSE(p.reason.empty());
}

TEST(ThreadPlanTest, CpuDefaultRunsOnePassPerCpuUpToFourAndSplitsTheRest) {
  ExpectPlan(PlanInferenceThreads(false, 1, 0, 0), 1, 1);
  ExpectPlan(PlanInferenceThreads(false, 2, 0, 0), 2, 1);
  ExpectPlan(PlanInferenceThreads(false, 4, 0, 0), 4, 1);
  ExpectPlan(PlanInferenceThreads(false, 16, 0, 0), 4, 4);
  ExpectPlan(PlanInferenceThreads(false, 6, 0, 0), 4, 1);  // never more threads than CPUs
}

TEST(ThreadPlanTest, NeverOversubscribesInTheAutomaticPlan) {
  for (int cpus = 1; cpus <= 64; ++cpus) {
    const ThreadPlan p = PlanInferenceThreads(false, cpus, 0, 0);
    EXPECT_LE(p.batch_threads * p.intra_op_threads, cpus) << cpus;
    EXPECT_GE(p.batch_threads, 1);
    EXPECT_GE(p.intra_op_threads, 1);
  }
}

TEST(ThreadPlanTest, AcceleratorRunsOneBatchThread) {
  ExpectPlan(PlanInferenceThreads(true, 8, 0, 0), 1, 8);
  ExpectPlan(PlanInferenceThreads(true, 8, 0, 2), 1, 2);
  ExpectPlan(PlanInferenceThreads(true, 8, 3, 0), 3, 2);  // an explicit flag wins
}

TEST(ThreadPlanTest, ExplicitFlagsAreKeptAndTheOtherIsDerived) {
  ExpectPlan(PlanInferenceThreads(false, 2, 1, 0), 1, 2);  // the old default
  ExpectPlan(PlanInferenceThreads(false, 8, 2, 0), 2, 4);
  ExpectPlan(PlanInferenceThreads(false, 2, 4, 0), 4, 1);  // oversubscribed on request
  ExpectPlan(PlanInferenceThreads(false, 8, 0, 2), 4, 2);
  ExpectPlan(PlanInferenceThreads(false, 64, 0, 2), 4, 2);
  ExpectPlan(PlanInferenceThreads(false, 2, 0, 4), 1, 4);
  ExpectPlan(PlanInferenceThreads(false, 2, 3, 5), 3, 5);
  ExpectPlan(PlanInferenceThreads(false, 0, 0, 0), 1, 1);  // cpus < 1 reads as 1
}

TEST(ThreadPlanTest, FlagsOutOfRangeAreRefusedByName) {
  EXPECT_TRUE(ValidateThreadFlags(0, 0).ok());
  EXPECT_TRUE(ValidateThreadFlags(kMaxThreadsFlag, 1).ok());
  const absl::Status negative = ValidateThreadFlags(-1, 0);
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(negative.message(), "--num_batch_threads=-1 must be 0 (automatic) or 1 to 1024");
  EXPECT_EQ(ValidateThreadFlags(2, kMaxThreadsFlag + 1).message(),
            "--inference_threads=1025 must be 0 (automatic) or 1 to 1024");
}

}  // namespace
}  // namespace collabserve::batching
