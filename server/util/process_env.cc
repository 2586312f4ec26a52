#include "server/util/process_env.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/util/files.h"

#include <cstdio>
#include <cstdlib>

namespace collabserve::util {

void EnsurePassiveOpenMpWaiting(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);
  // Only reached if exec failed: carry on with the default policy.
  std::perror("re-exec with OMP_WAIT_POLICY=PASSIVE failed; continuing");
}

bool SetBlasThreads(int n) {
  using SetFn = void (*)(int);
  static const auto set = reinterpret_cast<SetFn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) return false;
  set(std::max(1, n));
  return true;
}

std::string EnvString(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

int64_t EnvInt64(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

DnnlSgemmFn DnnlSgemm() {
  static const auto fn = reinterpret_cast<DnnlSgemmFn>(::dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
  return fn;
}

int BlasThreads() {
  using GetFn = int (*)();
  static const auto get = reinterpret_cast<GetFn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get == nullptr ? -1 : get();
}

namespace {

// The text of a small /sys file, or "" when it cannot be read.
std::string ReadSysFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path, 4096);
  return text.ok() ? *std::move(text) : std::string();
}

int CeilDiv(int64_t quota, int64_t period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}

}  // namespace

int CpusFromCgroupCpuMax(absl::string_view text) {
  std::vector<absl::string_view> parts =
      absl::StrSplit(absl::StripAsciiWhitespace(text), ' ', absl::SkipEmpty());
  int64_t quota = 0, period = 0;
  if (parts.size() != 2 || parts[0] == "max" || !absl::SimpleAtoi(parts[0], &quota) ||
      !absl::SimpleAtoi(parts[1], &period)) {
    return 0;
  }
  return CeilDiv(quota, period);
}

namespace {
std::atomic<int> cpu_budget{0};
}  // namespace

void SetCpuBudget(int cpus) { cpu_budget.store(std::max(0, cpus)); }

int UsableCpus() {
  int n = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (const int budget = cpu_budget.load(); budget > 0) return std::min(n, budget);
  int limit = CpusFromCgroupCpuMax(ReadSysFile("/sys/fs/cgroup/cpu.max"));
  if (limit == 0) {  // cgroup v1
    int64_t quota = 0, period = 0;
    const std::string q = ReadSysFile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
    const std::string p = ReadSysFile("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(q), &quota) &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(p), &period)) {
      limit = CeilDiv(quota, period);
    }
  }
  if (limit > 0) n = std::min(n, limit);
  return std::max(1, n);
}

}  // namespace collabserve::util
