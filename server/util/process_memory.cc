#include "server/util/process_memory.h"

#include <dlfcn.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace collabserve::util {

absl::StatusOr<ProcessMemory> ParseProcStatus(absl::string_view text) {
  ProcessMemory m;
  bool have_rss = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    int64_t* field = nullptr;
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "VmRSS:")) {
      field = &m.rss_bytes;
      have_rss = true;
    } else if (absl::ConsumePrefix(&rest, "VmHWM:")) {
      field = &m.hwm_bytes;
    } else if (absl::ConsumePrefix(&rest, "RssAnon:")) {
      field = &m.rss_anon_bytes;
    } else if (absl::ConsumePrefix(&rest, "RssFile:")) {
      field = &m.rss_file_bytes;
    } else {
      continue;
    }
    rest = absl::StripAsciiWhitespace(rest);
    int64_t kib = 0;
    if (!absl::ConsumeSuffix(&rest, "kB") ||
        !absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib) || kib < 0) {
      return absl::InvalidArgumentError(absl::StrCat("process status: malformed line '", line, "'"));
    }
    *field = kib * 1024;
  }
  if (!have_rss) return absl::InvalidArgumentError("process status: no VmRSS line");
  return m;
}

namespace {

// The whole of a /proc file (they report size 0, so read until EOF rather than by size).
absl::StatusOr<std::string> ReadProcFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  std::fclose(f);
  return text;
}

absl::StatusOr<ProcessMemory> ReadStatusFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadProcFile(path);
  if (!text.ok()) return text.status();
  return ParseProcStatus(*text);
}

}  // namespace

absl::Status ParseProcStat(absl::string_view line, int64_t boot_unix_seconds,
                           int64_t ticks_per_second, int64_t page_bytes, ProcessStats* out) {
  // Field 2 (comm) may hold spaces and parentheses: the fields after the last ')' start at 3.
  const size_t close = line.rfind(')');
  if (close == absl::string_view::npos) {
    return absl::InvalidArgumentError("process stat: no ')' after the command name");
  }
  std::vector<absl::string_view> fields =
      absl::StrSplit(line.substr(close + 1), ' ', absl::SkipEmpty());
  auto field = [&](int number, int64_t* value) -> absl::Status {
    const size_t i = static_cast<size_t>(number - 3);
    if (i >= fields.size() || !absl::SimpleAtoi(fields[i], value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("process stat: field ", number, " is missing or not a number"));
    }
    return absl::OkStatus();
  };
  int64_t utime = 0, stime = 0, threads = 0, start_ticks = 0, vsize = 0, rss_pages = 0;
  for (auto [number, value] : {std::pair{14, &utime}, {15, &stime}, {20, &threads},
                               {22, &start_ticks}, {23, &vsize}, {24, &rss_pages}}) {
    if (absl::Status s = field(number, value); !s.ok()) return s;
  }
  if (ticks_per_second <= 0) return absl::InvalidArgumentError("process stat: no clock tick rate");
  const double tps = static_cast<double>(ticks_per_second);
  out->cpu_seconds = static_cast<double>(utime + stime) / tps;
  out->start_time.reset();
  if (boot_unix_seconds >= 0) {
    out->start_time = absl::FromUnixSeconds(boot_unix_seconds) +
                      absl::Seconds(static_cast<double>(start_ticks) / tps);
  }
  out->virtual_bytes = vsize;
  out->resident_bytes = rss_pages * page_bytes;
  out->threads = threads;
  return absl::OkStatus();
}

namespace {

// The boot time in Unix seconds from /proc/stat's btime line, -1 if unknown. Read once: the file
// is large on hosts with many CPUs, and the value only moves when the clock is stepped.
int64_t BootUnixSeconds() {
  static const int64_t boot = [] {
    absl::StatusOr<std::string> system = ReadProcFile("/proc/stat");
    if (!system.ok()) return int64_t{-1};
    for (absl::string_view line : absl::StrSplit(*system, '\n')) {
      int64_t value = -1;
      if (absl::ConsumePrefix(&line, "btime ") &&
          absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &value) && value >= 0) {
        return value;
      }
    }
    return int64_t{-1};
  }();
  return boot;
}

}  // namespace

absl::StatusOr<ProcessStats> ReadProcessStats() {
  absl::StatusOr<std::string> stat = ReadProcFile("/proc/self/stat");
  if (!stat.ok()) return stat.status();
  const int64_t boot = BootUnixSeconds();
  ProcessStats stats;
  if (absl::Status s = ParseProcStat(*stat, boot, ::sysconf(_SC_CLK_TCK), ::sysconf(_SC_PAGESIZE),
                                     &stats);
      !s.ok()) {
    return s;
  }
  std::error_code ec;
  int64_t entries = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++entries;
  }
  if (!ec) stats.open_fds = std::max<int64_t>(entries - 1, 0);  // less the listing's own
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    stats.max_fds = limit.rlim_cur == RLIM_INFINITY ? 0 : static_cast<int64_t>(limit.rlim_cur);
  }
  return stats;
}

absl::StatusOr<ProcessMemory> ReadProcessMemory() { return ReadStatusFile("/proc/self/status"); }

absl::StatusOr<ProcessMemory> ReadProcessMemory(int pid) {
  return ReadStatusFile(absl::StrCat("/proc/", pid, "/status"));
}

MemoryPhases::MemoryPhases(absl::Duration interval) : interval_(interval) {}

MemoryPhases::~MemoryPhases() { Finish(); }

void MemoryPhases::Sample() {
  if (!in_phase_) return;
  absl::StatusOr<ProcessMemory> m = ReadProcessMemory();
  if (!m.ok()) return;
  MemoryPhase& p = phases_.back();
  if (m->rss_bytes > p.rss_peak_bytes) {
    p.rss_peak_bytes = m->rss_bytes;
    p.rss_file_peak_bytes = m->rss_file_bytes;
  }
  p.rss_end_bytes = m->rss_bytes;
  p.hwm_end_bytes = m->hwm_bytes;
}

void MemoryPhases::EndPhaseLocked() {
  if (!in_phase_) return;
  Sample();
  phases_.back().seconds = absl::ToDoubleSeconds(absl::Now() - phase_start_);
  in_phase_ = false;
}

void MemoryPhases::Begin(std::string name) {
  absl::MutexLock l(&mu_);
  if (stop_) return;
  EndPhaseLocked();
  MemoryPhase p;
  p.name = std::move(name);
  phases_.push_back(std::move(p));
  in_phase_ = true;
  phase_start_ = absl::Now();
  Sample();
  phases_.back().rss_start_bytes = phases_.back().rss_end_bytes;
  if (!running_) {
    running_ = true;
    sampler_ = std::thread([this] { Loop(); });
  }
}

void MemoryPhases::Loop() {
  absl::MutexLock l(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_);
    if (!stop_) Sample();
  }
}

std::vector<MemoryPhase> MemoryPhases::Finish() {
  {
    absl::MutexLock l(&mu_);
    EndPhaseLocked();
    stop_ = true;
  }
  if (sampler_.joinable()) sampler_.join();
  absl::MutexLock l(&mu_);
  return phases_;
}

std::vector<MemoryPhase> MemoryPhases::phases() const {
  absl::MutexLock l(&mu_);
  std::vector<MemoryPhase> out = phases_;
  if (in_phase_) out.back().seconds = absl::ToDoubleSeconds(absl::Now() - phase_start_);
  return out;
}

std::string MemoryPhases::Format(const std::vector<MemoryPhase>& phases) {
  auto mib = [](int64_t b) { return b / (1024 * 1024); };
  std::string out;
  for (const MemoryPhase& p : phases) {
    absl::StrAppendFormat(&out, "%s: %.1f s, rss %d -> %d MiB, peak %d MiB (file %d), hwm %d MiB\n",
                          p.name, p.seconds, mib(p.rss_start_bytes), mib(p.rss_end_bytes),
                          mib(p.rss_peak_bytes), mib(p.rss_file_peak_bytes), mib(p.hwm_end_bytes));
  }
  return out;
}

bool LimitMallocArenas(int n) {
#if defined(__GLIBC__)
  if (n < 1 || std::getenv("MALLOC_ARENA_MAX") != nullptr) return false;
  return ::mallopt(M_ARENA_MAX, n) == 1;
#else
  (void)n;
  return false;
#endif
}

namespace {

// jemalloc's control interface when jemalloc is the process's allocator (collabserve links it),
// found at run time so that nothing here depends on it.
using MallctlFn = int (*)(const char*, void*, size_t*, void*, size_t);
MallctlFn Mallctl() {
  static const auto fn = reinterpret_cast<MallctlFn>(::dlsym(RTLD_DEFAULT, "mallctl"));
  return fn;
}

}  // namespace

std::string AllocatorName() {
  if (MallctlFn mallctl = Mallctl()) {
    const char* version = nullptr;
    size_t len = sizeof(version);
    if (mallctl("version", &version, &len, nullptr, 0) == 0 && version != nullptr) {
      return absl::StrCat("jemalloc ", version);
    }
    return "jemalloc";
  }
#if defined(__GLIBC__)
  return absl::StrCat("glibc malloc ", __GLIBC__, ".", __GLIBC_MINOR__);
#else
  return "the C library's malloc";
#endif
}

namespace {

// The retaining arena's index once a thread has asked for it; -1 until then, and when there is none
// (not jemalloc, or it failed). Every thread shares the one arena.
std::atomic<int> retaining_arena{-1};

int MakeRetainingArena() {
  static const int index = [] {
    MallctlFn mallctl = Mallctl();
    if (mallctl == nullptr) return -1;
    unsigned ind = 0;
    size_t len = sizeof(ind);
    if (mallctl("arenas.create", &ind, &len, nullptr, 0) != 0) return -1;
    // Decay off: freed pages stay in the arena until a purge. (Set on the arena alone: the
    // process-wide defaults would also reach the automatic arenas made later.)
    ssize_t never = -1;
    for (const char* kind : {"dirty_decay_ms", "muzzy_decay_ms"}) {
      const std::string name = absl::StrCat("arena.", ind, ".", kind);
      if (mallctl(name.c_str(), nullptr, nullptr, &never, sizeof(never)) != 0) return -1;
    }
    retaining_arena.store(static_cast<int>(ind), std::memory_order_release);
    return static_cast<int>(ind);
  }();
  return index;
}

}  // namespace

bool BindThreadToRetainingArena() {
  thread_local bool bound = false;
  if (bound) return true;
  const int index = MakeRetainingArena();
  if (index < 0) return false;
  unsigned ind = static_cast<unsigned>(index);
  bound = Mallctl()("thread.arena", nullptr, nullptr, &ind, sizeof(ind)) == 0;
  return bound;
}

void PurgeRetainingArena() {
  const int index = retaining_arena.load(std::memory_order_acquire);
  if (index < 0) return;
  const std::string name = absl::StrCat("arena.", index, ".purge");
  Mallctl()(name.c_str(), nullptr, nullptr, nullptr, 0);
}

std::optional<size_t> RetainingArenaFreeBytes() {
  MallctlFn mallctl = Mallctl();
  if (mallctl == nullptr) return std::nullopt;
  const int index = retaining_arena.load(std::memory_order_acquire);
  if (index < 0) return 0;
  uint64_t epoch = 1;
  size_t len = sizeof(epoch);
  if (mallctl("epoch", &epoch, &len, &epoch, len) != 0) return std::nullopt;  // refresh stats
  size_t page = 0;
  len = sizeof(page);
  if (mallctl("arenas.page", &page, &len, nullptr, 0) != 0) return std::nullopt;
  size_t pages = 0;
  for (const char* kind : {"pdirty", "pmuzzy"}) {
    const std::string name = absl::StrCat("stats.arenas.", index, ".", kind);
    size_t n = 0;
    len = sizeof(n);
    if (mallctl(name.c_str(), &n, &len, nullptr, 0) != 0) return std::nullopt;
    pages += n;
  }
  return pages * page;
}

void ReleaseFreedMemory() {
  if (MallctlFn mallctl = Mallctl()) {
    // MALLCTL_ARENAS_ALL (4096): purge the unused dirty pages of every arena now.
    mallctl("arena.4096.purge", nullptr, nullptr, nullptr, 0);
    return;
  }
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
}

}  // namespace collabserve::util
