// Process-wide environment fixes that must happen before any library reads its settings.
#ifndef COLLABSERVE_SERVER_UTIL_PROCESS_ENV_H_
#define COLLABSERVE_SERVER_UTIL_PROCESS_ENV_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace collabserve::util {

// libgomp (LibTorch's OpenMP) spins idle worker threads by default; on a shared or small machine
// the spinning steals the cores from OpenBLAS's own threads and made CP-ALS and inference 4-10x
// slower here. libgomp reads OMP_WAIT_POLICY once, when it is loaded, so setting it in main() is too
// late: if it is unset, set it to PASSIVE and re-execute this program (once; an explicit setting
// is always respected). Call first thing in main().
void EnsurePassiveOpenMpWaiting(char** argv);

// OpenBLAS (Debian's libopenblas0-pthread, which LibTorch's CPU GEMMs call) keeps ONE process-wide
// thread pool, separate from ATen's OpenMP threads, and a multi-threaded OpenBLAS call holds a
// global lock: two threads that each run GEMMs (two batch threads, two CP layers at once) serialise
// unless OpenBLAS runs single-threaded. Sets its thread count to n (>= 1) through
// openblas_set_num_threads, found at run time, and returns true; returns false (and does nothing)
// when the process has no OpenBLAS (another BLAS, a CUDA-only build). Thread-safe; process-wide.
bool SetBlasThreads(int n);

// The thread count OpenBLAS uses now, or -1 without OpenBLAS.
int BlasThreads();

// oneDNN's row-major sgemm (dnnl_sgemm, oneDNN >= 1.0): C = alpha · op(A) · op(B) + beta · C,
// returning 0 on success. Looked up once in the libraries already loaded (Debian's LibTorch links
// libdnnl.so.2; the engine's dense layers and attention and CP-ALS's products call it); null where
// no loaded library exports it (a LibTorch that hides its oneDNN). Thread-safe.
using DnnlSgemmFn = int (*)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha,
                            const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                            float* c, int64_t ldc);
DnnlSgemmFn DnnlSgemm();

// The COLLABSERVE_* switches that pin a code path for measurements (read once by their users):
// the value of environment variable `name`, "" when unset; and that value as an integer (atoll),
// `fallback` when unset or empty.
std::string EnvString(const char* name);
int64_t EnvInt64(const char* name, int64_t fallback);

// CPUs this process may use, at least 1: the CPUs it may run on (sched_getaffinity: a cpuset), capped
// by a cgroup CPU quota rounded up (a Kubernetes `resources.limits.cpu: 2` on a 64-core node reads
// 2; cgroup v2 cpu.max, else v1 cpu.cfs_quota_us / cpu.cfs_period_us). Once SetCpuBudget(n) has
// been called: n, at most the CPUs the process may run on.
int UsableCpus();
// Makes UsableCpus() answer `cpus` (at most the affinity mask's count) from now on, process-wide;
// 0 restores the detection. For a container with a CPU request and no limit, where the detection
// sees the whole node (the server's --cpus).
void SetCpuBudget(int cpus);

// The CPU limit a cgroup v2 `cpu.max` text ("QUOTA PERIOD" or "max PERIOD") sets, rounded up;
// 0 when there is none or the text is not of that form.
int CpusFromCgroupCpuMax(absl::string_view text);

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_PROCESS_ENV_H_
