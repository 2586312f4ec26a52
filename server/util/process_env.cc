#include "server/util/process_env.h"

#include <unistd.h>

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

}  // namespace collabserve::util
