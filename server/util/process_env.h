// Process-wide environment fixes that must happen before any library reads its settings.
#ifndef COLLABSERVE_SERVER_UTIL_PROCESS_ENV_H_
#define COLLABSERVE_SERVER_UTIL_PROCESS_ENV_H_

namespace collabserve::util {

// libgomp (LibTorch's OpenMP) spins idle worker threads by default; on a shared or small machine
// the spinning steals the cores from OpenBLAS's own threads and made CP-ALS and inference 4-10x
// slower here. libgomp reads OMP_WAIT_POLICY once, when it is loaded, so setting it in main() is too
// late: if it is unset, set it to PASSIVE and re-execute this program (once; an explicit setting
// is always respected). Call first thing in main().
void EnsurePassiveOpenMpWaiting(char** argv);

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_PROCESS_ENV_H_
