// This process's resident memory as the kernel reports it (/proc/self/status), and a sampler that
// finds the peak of each phase of a long operation (an admin job) without resetting VmHWM.
#ifndef COLLABSERVE_SERVER_UTIL_PROCESS_MEMORY_H_
#define COLLABSERVE_SERVER_UTIL_PROCESS_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace collabserve::util {

// Figures in bytes. rss = anon + file + shmem; hwm is the process's peak rss since it started (or
// since the last write of "5" to /proc/self/clear_refs).
struct ProcessMemory {
  int64_t rss_bytes = 0;       // VmRSS
  int64_t hwm_bytes = 0;       // VmHWM
  int64_t rss_anon_bytes = 0;  // RssAnon: heap, tensors
  int64_t rss_file_bytes = 0;  // RssFile: mapped file pages touched (e.g. a memory-mapped checkpoint)
};

// Parses the text of a /proc/<pid>/status file. Fields that are absent stay 0 (RssAnon/RssFile
// need Linux 4.5); INVALID_ARGUMENT if VmRSS is missing or a value is malformed.
absl::StatusOr<ProcessMemory> ParseProcStatus(absl::string_view text);

// ParseProcStatus of /proc/self/status. UNAVAILABLE where /proc cannot be read (not Linux).
absl::StatusOr<ProcessMemory> ReadProcessMemory();
// The same for another process (/proc/<pid>/status); UNAVAILABLE if it cannot be read (e.g. gone).
absl::StatusOr<ProcessMemory> ReadProcessMemory(int pid);

// What Prometheus client libraries export as process_* (the server's /metrics, read at each
// scrape): from /proc/self/stat, /proc/stat, /proc/self/fd and getrlimit.
struct ProcessStats {
  double cpu_seconds = 0;  // user + system time
  // To the tick past the boot time (which /proc/stat gives in seconds); absent if the boot time
  // is unknown.
  std::optional<absl::Time> start_time;
  int64_t virtual_bytes = 0;
  int64_t resident_bytes = 0;
  int64_t threads = 0;
  int64_t open_fds = -1;  // -1: /proc/self/fd could not be listed
  int64_t max_fds = 0;    // the RLIMIT_NOFILE soft limit; 0 if unknown or unlimited
};

// Parses one line of /proc/<pid>/stat into `out`'s CPU, start time, memory and thread figures
// (fds are left alone; no start time if `boot_unix_seconds` < 0). INVALID_ARGUMENT names what is
// malformed.
absl::Status ParseProcStat(absl::string_view line, int64_t boot_unix_seconds,
                           int64_t ticks_per_second, int64_t page_bytes, ProcessStats* out);
// This process's figures; UNAVAILABLE where /proc/self/stat cannot be read (not Linux). The boot
// time is read from /proc/stat once per process (a later clock step does not move the start
// time); without it (procfs mounted subset=pid) only the start time is missing.
absl::StatusOr<ProcessStats> ReadProcessStats();

// Gives the allocator's freed-but-kept memory back to the system: jemalloc (when it is the process's
// allocator, as in collabserve) purges every arena's unused pages; glibc runs malloc_trim(0), which
// also drops whole free pages inside every arena, not only the top of the heap. Call after freeing
// something big (a model version, a job's models). Costs a walk over the arenas (milliseconds);
// not for hot paths.
void ReleaseFreedMemory();

// The allocator arena of forward passes. A pass frees what it allocated before the next one
// needs the same sizes again, and jemalloc's defaults give those pages back to the system at once
// (8 MiB and larger: its "huge" arena purges eagerly) or over ~10 s (the rest), so the next pass
// faults them in anew: on this Firecracker-like VM ~4 ms per MiB, up to half of a BERT-base pass's
// time at 8 x 128 on one thread. BindThreadToRetainingArena makes the calling thread allocate from
// one arena that all such threads share, which never purges its freed pages by itself (its decay
// is off; large allocations stay in it): the next pass reuses them resident. PurgeRetainingArena
// gives them back (PassArena does after 10 s without a pass). Returns whether the thread is on that
// arena: false where jemalloc is not the process's allocator (glibc: the tests, sanitizer builds)
// or it refused to make the arena (then nothing changes). Cheap after a thread's first call.
// For the thread's life: jemalloc purges an arena when the last thread on it moves away or exits,
// so a thread that visited it for one pass would take the pages with it.
bool BindThreadToRetainingArena();
// Gives the retaining arena's freed pages back to the system now. No-op without one.
void PurgeRetainingArena();
// The bytes of freed pages the retaining arena keeps for the next pass (jemalloc's dirty and muzzy
// pages of it); 0 while there is no such arena (none made yet, or jemalloc refused one). nullopt
// where jemalloc is not the allocator or its statistics cannot be read. Refreshes jemalloc's
// statistics (microseconds; for a metrics scrape, not a hot path).
std::optional<size_t> RetainingArenaFreeBytes();

// The allocator in use, for the start-up log: "jemalloc 5.3.0-0-g..." or "glibc malloc 2.36".
std::string AllocatorName();

// Caps glibc's malloc arenas at n (mallopt(M_ARENA_MAX); default 8 per core) unless the
// MALLOC_ARENA_MAX environment variable already sets it. Each arena keeps its own freed memory, and
// a server whose threads take turns allocating and freeing models (loads, swaps, jobs) fragments
// every one of them: the 10-minute soak's RSS grew 31% with the default and stayed within 5% with
// 2 arenas on 2 cores (collabserve now links jemalloc, which fragments less still; this is the
// fallback where it is absent). Call at the start of main(), before threads exist. Returns whether
// it applied the cap (false: env set, n < 1, or not glibc).
bool LimitMallocArenas(int n);

// Figures of one phase. Peaks are sampled (every `interval`): a spike shorter than that can be
// missed, and hwm_end (exact, but process-wide and monotonic) bounds it from above.
struct MemoryPhase {
  std::string name;
  double seconds = 0;
  int64_t rss_start_bytes = 0;
  int64_t rss_end_bytes = 0;
  int64_t rss_peak_bytes = 0;       // max of the samples, the start and the end
  int64_t rss_file_peak_bytes = 0;  // RssFile at the sample where rss peaked
  int64_t hwm_end_bytes = 0;        // VmHWM when the phase ended
};

// Splits a long operation into named phases and records each one's memory: Begin("load") ...
// Begin("convert") ... Finish(). A background thread samples /proc/self/status every `interval`
// between the first Begin and Finish. Thread-safe; Begin/Finish are meant for one thread. Where
// /proc cannot be read, every figure is 0.
class MemoryPhases {
 public:
  explicit MemoryPhases(absl::Duration interval = absl::Milliseconds(5));
  ~MemoryPhases();  // Finish()
  MemoryPhases(const MemoryPhases&) = delete;
  MemoryPhases& operator=(const MemoryPhases&) = delete;

  // Ends the current phase (if any) and starts `name`; starts the sampler on the first call.
  void Begin(std::string name);
  // Ends the current phase and stops the sampler. Idempotent. Returns every phase, in order.
  std::vector<MemoryPhase> Finish();
  // The phases so far (the current one with its figures up to now).
  std::vector<MemoryPhase> phases() const;

  // One line per phase: "name: 1.2 s, rss 400 -> 812 MiB, peak 900 MiB (file 300), hwm 950 MiB".
  static std::string Format(const std::vector<MemoryPhase>& phases);

 private:
  void Sample() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndPhaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time phase_start_ ABSL_GUARDED_BY(mu_);
  std::vector<MemoryPhase> phases_ ABSL_GUARDED_BY(mu_);
  bool in_phase_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sampler_;
};

}  // namespace collabserve::util

#endif  // COLLABSERVE_SERVER_UTIL_PROCESS_MEMORY_H_
