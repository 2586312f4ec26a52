#include "server/util/process_env.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

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

int BlasThreads() {
  using GetFn = int (*)();
  static const auto get = reinterpret_cast<GetFn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get == nullptr ? -1 : get();
}

int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace collabserve::util
