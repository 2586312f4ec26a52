#include "server/model/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace collabserve::model {

void SetThisThreadIntraOpThreads(int n) {
  using SetFn = void (*)(int);
  static const auto omp_set = reinterpret_cast<SetFn>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  at::internal::lazy_init_num_threads();
  if (omp_set != nullptr && at::get_num_threads() != n) omp_set(n);
}

}  // namespace collabserve::model
