#include "server/util/process_env.h"

#include <dlfcn.h>
#include <sched.h>

#include <cstdlib>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace collabserve::util {
namespace {

// --cpus: the budget replaces the detection, never above the CPUs the process may run on.
TEST(ProcessEnvTest, ACpuBudgetIsWhatUsableCpusAnswers) {
  const int detected = UsableCpus();
  SetCpuBudget(1);
  EXPECT_EQ(UsableCpus(), 1);
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  SetCpuBudget(100000);  // above a CPU quota too: the operator's word
  EXPECT_EQ(UsableCpus(), CPU_COUNT(&set));
  SetCpuBudget(0);
  EXPECT_EQ(UsableCpus(), detected);
}

TEST(ProcessEnvTest, UsableCpusIsPositiveAndAtMostTheMachine) {
  const int n = UsableCpus();
  EXPECT_GE(n, 1);
  EXPECT_LE(n, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

TEST(ProcessEnvTest, ReadsTheCgroupV2CpuLimit) {
  EXPECT_EQ(CpusFromCgroupCpuMax("200000 100000\n"), 2);
  EXPECT_EQ(CpusFromCgroupCpuMax("150000 100000"), 2);  // 1.5 CPUs: round up
  EXPECT_EQ(CpusFromCgroupCpuMax("50000 100000"), 1);
  EXPECT_EQ(CpusFromCgroupCpuMax("max 100000"), 0);  // no limit
  EXPECT_EQ(CpusFromCgroupCpuMax(""), 0);
  EXPECT_EQ(CpusFromCgroupCpuMax("garbage"), 0);
  EXPECT_EQ(CpusFromCgroupCpuMax("-1 100000"), 0);
  EXPECT_EQ(CpusFromCgroupCpuMax("100000 0"), 0);
}

TEST(ProcessEnvTest, SetBlasThreadsChangesOpenBlasWhenPresent) {
  // Touch LibTorch so that its BLAS is loaded and initialised.
  torch::Tensor a = torch::ones({64, 64});
  EXPECT_NEAR(torch::mm(a, a).sum().item<float>(), 64.0f * 64 * 64, 1.0f);
  const bool has_openblas = dlsym(RTLD_DEFAULT, "openblas_set_num_threads") != nullptr;
  ASSERT_EQ(SetBlasThreads(1), has_openblas);
  if (!has_openblas) {
    EXPECT_EQ(BlasThreads(), -1);
    return;  // another BLAS (MKL in the PyTorch wheel): nothing to set, and it said so
  }
  EXPECT_EQ(BlasThreads(), 1);
  ASSERT_TRUE(SetBlasThreads(2));
  EXPECT_EQ(BlasThreads(), 2);
  ASSERT_TRUE(SetBlasThreads(0));  // clamped to 1
  EXPECT_EQ(BlasThreads(), 1);
  // GEMMs still give the right answer single-threaded.
  EXPECT_NEAR(torch::mm(a, a).sum().item<float>(), 64.0f * 64 * 64, 1.0f);
}

TEST(ProcessEnvTest, EnvStringAndEnvInt64) {
  const char* name = "COLLABSERVE_PROCESS_ENV_TEST_VAR";
  ::unsetenv(name);
  EXPECT_EQ(EnvString(name), "");
  EXPECT_EQ(EnvInt64(name, 7), 7);
  ::setenv(name, "", 1);
  EXPECT_EQ(EnvInt64(name, 7), 7);
  ::setenv(name, "256", 1);
  EXPECT_EQ(EnvString(name), "256");
  EXPECT_EQ(EnvInt64(name, 7), 256);
  ::unsetenv(name);
}

}  // namespace
}  // namespace collabserve::util
