#include "server/repository/model_repository.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/metrics/process_metrics.h"
#include "server/util/files.h"
#include "server/util/process_memory.h"
#include "server/util/status_macros.h"

namespace collabserve::repository {
namespace {

namespace fs = std::filesystem;

std::string Join(const std::string& dir, std::string_view name) {
  return (fs::path(dir) / fs::path(std::string(name))).string();
}

std::string ErrnoText(int err) { return std::strerror(err); }

// Debian's abseil has its own string_view, distinct from std::string_view.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A positive decimal integer without sign or leading zeros that fits int64_t.
std::optional<int64_t> ParseVersion(std::string_view name) {
  if (name.empty() || name.size() > 18 || name[0] == '0') return std::nullopt;
  for (char c : name) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(Sv(name), &v) || v <= 0) return std::nullopt;
  return v;
}

// The number in `model_dir`'s kDeletedVersionMark; 0 when there is none. A mark that cannot be
// read or does not hold a version is read as 0 (the numbers on disk still count) and logged once
// for each path and content (NextVersion reads it on every upload).
int64_t HighestDeletedVersion(const std::string& model_dir) {
  const std::string path = Join(model_dir, ModelRepository::kDeletedVersionMark);
  if (!util::FileExists(path)) return 0;
  absl::StatusOr<std::string> text = util::ReadFile(path, 64);
  std::optional<int64_t> v =
      text.ok() ? ParseVersion(std::string(absl::StripAsciiWhitespace(*text))) : std::nullopt;
  if (!v) {
    static absl::Mutex mu(absl::kConstInit);
    static auto* warned = new std::set<std::pair<std::string, size_t>>();  // path, content's hash
    const std::pair<std::string, size_t> what = {
        path, std::hash<std::string>()(text.ok() ? *text : text.status().ToString())};
    bool first;
    {
      absl::MutexLock l(&mu);
      first = warned->insert(what).second;
    }
    LOG_IF(WARNING, first) << "model repository: " << path << " does not hold a version number"
                           << (text.ok() ? "" : absl::StrCat(" (", text.status().message(), ")"))
                           << "; deleted version numbers may be given out again";
    return 0;
  }
  return *v;
}

// Removes the temporary files of kDeletedVersionMark writes that died before their rename (older
// than a minute: a write takes milliseconds, and one in flight on another node is left alone).
// Called under the mark's lock.
void RemoveStaleMarkTemporaries(const std::string& model_dir) {
  const std::string prefix = absl::StrCat(ModelRepository::kDeletedVersionMark, ".tmp.");
  const auto cutoff = fs::file_time_type::clock::now() - std::chrono::minutes(1);
  std::error_code ec;
  for (fs::directory_iterator it(model_dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!absl::StartsWith(it->path().filename().string(), prefix)) continue;
    std::error_code e;
    if (it->is_regular_file(e) && fs::last_write_time(it->path(), e) < cutoff && !e) {
      fs::remove(it->path(), e);
      if (e) LOG(WARNING) << "model repository: cannot remove " << it->path() << ": " << e.message();
    }
  }
}

// Makes the renames in directory `dir` durable (best effort: a failure to open it is ignored).
void SyncDirectory(const std::string& dir) {
  if (int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Raises `model_dir`'s kDeletedVersionMark to `version` (creating the directory if it is gone) and
// makes it durable. Under an flock(2) of the mark's lock file, so that replicas deleting versions
// of one model at once do not lower each other's mark (where flock is node-local, best effort).
absl::Status RecordDeletedVersion(const std::string& model_dir, int64_t version) {
  if (::mkdir(model_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create ", model_dir, ": ", std::strerror(errno)));
  }
  const std::string lock_path = Join(model_dir, absl::StrCat(ModelRepository::kDeletedVersionMark, ".lock"));
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock >= 0) {
    while (::flock(lock, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  absl::Status s;
  RemoveStaleMarkTemporaries(model_dir);
  if (version > HighestDeletedVersion(model_dir)) {
    s = util::WriteFileAtomic(Join(model_dir, ModelRepository::kDeletedVersionMark), absl::StrCat(version, "\n"));
    if (s.ok()) SyncDirectory(model_dir);  // the mark's rename, before the version's
  }
  if (lock >= 0) ::close(lock);  // and with it the flock
  return s;
}

std::optional<struct stat> Stat(const std::string& path, bool follow) {
  struct stat st;
  if ((follow ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st)) != 0) return std::nullopt;
  return st;
}

bool IsDir(const std::string& path) {
  auto st = Stat(path, /*follow=*/true);
  return st && S_ISDIR(st->st_mode);
}

absl::Time MTime(const struct stat& st) {
  return absl::TimeFromTimespec(st.st_mtim);
}

absl::Time CTime(const struct stat& st) {
  return absl::TimeFromTimespec(st.st_ctim);
}

// Whether `path` still names the file open as `fd`: a staging claim's lock is held under its name,
// not on a file that another process has since unlinked.
bool NamesFile(const std::string& path, int fd) {
  struct stat held, named;
  return ::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
         held.st_ino == named.st_ino && held.st_dev == named.st_dev;
}

struct DirState {
  std::string fingerprint;
  absl::Time last_change = absl::InfinitePast();
};

// Names, types, sizes, mtimes and ctimes of the directory's entries, plus its own: changes when a
// file is added, removed, renamed, rewritten or has its mode or times set, which is what "the
// directory changed" means for retrying a failed load and for settling. `last_change` is the
// newest ctime among them (a copy that keeps the source's mtimes still sets ctimes).
DirState ScanDir(const std::string& dir) {
  DirState state;
  std::vector<std::string> parts;
  auto note = [&](const std::string& name, const struct stat& st) {
    parts.push_back(absl::StrCat(name, ":", st.st_mode, ":", st.st_size, ":",
                                 absl::ToUnixNanos(MTime(st)), ":", absl::ToUnixNanos(CTime(st))));
    state.last_change = std::max(state.last_change, CTime(st));
  };
  if (auto st = Stat(dir, true)) note(".", *st);
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) {
    state.fingerprint = absl::StrCat("unreadable:", ec.message());
    return state;
  }
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (auto st = Stat(it->path().string(), /*follow=*/true)) {
      note(name, *st);
    } else {
      parts.push_back(absl::StrCat(name, ":?"));
    }
  }
  if (ec) parts.push_back(absl::StrCat("error:", ec.message()));
  std::sort(parts.begin(), parts.end());
  state.fingerprint = absl::StrJoin(parts, "/");
  return state;
}

// When this process started (from /proc), minus a margin for the one-second resolution of the
// boot time; the time of the first call if /proc does not say.
absl::Time ProcessStartTime() {
  static const absl::Time start = [] {
    const absl::Time now = absl::Now();
    absl::StatusOr<util::ProcessStats> stats = util::ReadProcessStats();
    return stats.ok() && stats->start_time ? std::min(*stats->start_time - absl::Seconds(2), now)
                                           : now;
  }();
  return start;
}

// Removes `path` (a leftover); returns an error naming it on failure.
absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot remove ", path, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

std::string LoadFailureReason(const absl::Status& status) {
  if (status.ok()) return "ok";
  std::string name = absl::StatusCodeToString(status.code());  // "INVALID_ARGUMENT"
  if (name.empty()) return "unknown";
  absl::AsciiStrToLower(&name);
  return name;
}

std::string ServableId::DebugString() const { return absl::StrCat(model, ":", version); }

const char* VersionEventName(VersionEvent event) {
  switch (event) {
    case VersionEvent::kLoading: return "loading";
    case VersionEvent::kAvailable: return "available";
    case VersionEvent::kLoadFailed: return "load_failed";
    case VersionEvent::kUnloaded: return "unloaded";
  }
  return "unknown";
}

const char* ModelRepository::StateName(VersionStatus::State state) {
  switch (state) {
    case State::kLoading: return "loading";
    case State::kAvailable: return "available";
    case State::kFailed: return "failed";
    case State::kUnloaded: return "unloaded";
  }
  return "unknown";
}

const char* ModelRepository::StateName(const VersionStatus& status) {
  return status.settling ? "settling" : StateName(status.state);
}

const std::vector<const char*>& ModelRepository::StateNames() {
  static const auto* names = new std::vector<const char*>{
      StateName(State::kAvailable), StateName(State::kLoading), "settling",
      StateName(State::kFailed), StateName(State::kUnloaded)};
  return *names;
}

absl::Status ModelRepository::ValidateModelName(std::string_view name) {
  const absl::string_view model = Sv(name);
  if (model.empty()) return absl::InvalidArgumentError("model name is empty");
  if (model.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("model name \"", model.substr(0, 32), "...\" is longer than 255 characters"));
  }
  if (model[0] == '.') {
    return absl::InvalidArgumentError(
        absl::StrCat("model name \"", model, "\" must not start with '.'"));
  }
  for (char c : model) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          "model name \"", absl::CHexEscape(model), "\" may contain only letters, digits, '_', "
          "'.' and '-'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ModelRepository::ValidateId(const ServableId& id) {
  RETURN_IF_ERROR(ValidateModelName(id.model));
  if (id.version <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("version ", id.version, " of model \"",
                                                   id.model, "\" is not a positive integer"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Construction, polling thread.

ModelRepository::ModelRepository(RepositoryOptions options, ServableLoader loader)
    : options_(std::move(options)), loader_(std::move(loader)) {}

absl::StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Create(
    RepositoryOptions options, ServableLoader loader) {
  if (options.root.empty()) {
    return absl::InvalidArgumentError("model repository root is empty");
  }
  if (options.versions_to_keep < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "versions_to_keep must be at least 1, got ", options.versions_to_keep));
  }
  if (options.num_load_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_load_threads must be at least 1, got ", options.num_load_threads));
  }
  if (options.poll_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "poll_interval must not be negative, got ", absl::FormatDuration(options.poll_interval)));
  }
  if (options.settle_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "settle_time must not be negative, got ", absl::FormatDuration(options.settle_time)));
  }
  if (!loader) return absl::InvalidArgumentError("the servable loader is empty");
  struct stat st;
  if (::stat(options.root.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("model repository root ", options.root, " does not exist"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("model repository root ", options.root, ": ", ErrnoText(err)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("model repository root ", options.root, " is not a directory"));
  }
  std::unique_ptr<ModelRepository> repo(new ModelRepository(std::move(options), std::move(loader)));
  absl::Status cleaned = repo->CleanLeftovers();
  if (!cleaned.ok()) LOG(WARNING) << "model repository: " << cleaned.message();
  RETURN_IF_ERROR(repo->Poll());
  // Versions still being written when the process starts load before Create() returns, unless
  // they keep changing for a minute (or three settle times, if longer).
  const absl::Time give_up =
      absl::Now() + std::max(absl::Minutes(1), 3 * repo->options_.settle_time);
  for (absl::Time due = repo->NextWantedSettle(); due != absl::InfiniteFuture();
       due = repo->NextWantedSettle()) {
    if (absl::Now() >= give_up) {
      LOG(WARNING) << "model repository: versions are still changing on disk; "
                   << (repo->options_.poll_interval > absl::ZeroDuration()
                           ? "the poller loads them once they have not changed for "
                           : "without polling they load at the next start once unchanged for ")
                   << absl::FormatDuration(repo->options_.settle_time);
      break;
    }
    absl::SleepFor(std::min(due, give_up) - absl::Now());
    RETURN_IF_ERROR(repo->Poll());
  }
  repo->StartPolling();
  return repo;
}

ModelRepository::~ModelRepository() {
  StopPolling();
  // Admin operations in progress on other threads finish before the members go.
  absl::MutexLock ops(&ops_mu_);
}

void ModelRepository::StartPolling() {
  if (options_.poll_interval <= absl::ZeroDuration()) return;
  absl::MutexLock l(&poll_mu_);
  if (poller_.joinable()) return;
  poller_ = std::thread(&ModelRepository::PollLoop, this, poll_generation_);
}

void ModelRepository::StopPolling() {
  std::thread poller;
  {
    absl::MutexLock l(&poll_mu_);
    ++poll_generation_;
    poller = std::move(poller_);
  }
  poll_cv_.SignalAll();
  if (poller.joinable()) poller.join();
}

void ModelRepository::PollLoop(int64_t generation) {
  int64_t seen = 0;
  {
    absl::MutexLock l(&poll_mu_);
    seen = poll_wakeups_;
  }
  for (;;) {
    const absl::Time interval_end = absl::Now() + options_.poll_interval;
    // Sleeps until the interval ends or a version is due to settle; WakePoller() makes it look
    // at the settle time again (a scan outside this loop may have found a version settling).
    for (bool due = false; !due;) {
      const absl::Time deadline = std::min(interval_end, NextSettle());
      absl::MutexLock l(&poll_mu_);
      if (poll_wakeups_ == seen && poll_generation_ == generation) {
        due = poll_cv_.WaitWithDeadline(&poll_mu_, deadline);
      }
      if (poll_generation_ != generation) return;
      seen = poll_wakeups_;
    }
    Poll().IgnoreError();  // Poll() logs its errors (once per distinct error).
  }
}

// ---------------------------------------------------------------------------------------------
// Scanning.

void ModelRepository::LogOnce(const std::string& path, const std::string& why) {
  if (logged_.insert(path).second) {
    LOG(WARNING) << "model repository: ignoring " << path << ": " << why;
  }
}

absl::StatusOr<ModelRepository::DiskModel> ModelRepository::ScanModel(const std::string& model) {
  const std::string dir = Join(options_.root, model);
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) {
      return absl::NotFoundError(absl::StrCat("model directory ", dir, " does not exist"));
    }
    return absl::FailedPreconditionError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  }
  // A checkpoint's files put straight into the model directory (no version directory): one message
  // for the directory, not one per file.
  const std::optional<struct stat> config = Stat(Join(dir, "config.json"), /*follow=*/true);
  const bool flat_checkpoint = config && S_ISREG(config->st_mode);
  if (flat_checkpoint) {
    LogOnce(dir, absl::StrCat("it holds a checkpoint's files (config.json), but each version is a "
                              "directory named by its number: move them into ",
                              Join(dir, "1"), "/"));
  }
  DiskModel versions;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    const std::string path = it->path().string();
    std::optional<int64_t> version = ParseVersion(name);
    if (!version) {
      if (flat_checkpoint && !IsDir(path)) continue;
      LogOnce(path, "a version directory's name must be a positive integer of at most 18 digits, "
                    "without leading zeros");
      continue;
    }
    if (!IsDir(path)) {
      LogOnce(path, "not a directory");
      continue;
    }
    DirState state = ScanDir(path);
    versions[*version] = DiskVersion{path, std::move(state.fingerprint), state.last_change};
  }
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  }
  return versions;
}

absl::StatusOr<ModelRepository::DiskScan> ModelRepository::ScanRoot() {
  const std::string& root = options_.root;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) {
      return absl::NotFoundError(absl::StrCat("model repository root ", root, " does not exist"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list model repository root ", root, ": ", ec.message()));
  }
  DiskScan scan;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    const std::string path = it->path().string();
    if (!IsDir(path)) continue;  // READMEs and the like
    absl::Status valid = ValidateModelName(name);
    if (!valid.ok()) {
      LogOnce(path, std::string(valid.message()));
      continue;
    }
    absl::StatusOr<DiskModel> versions = ScanModel(name);
    if (!versions.ok()) {
      // Vanished between the listing and now, or unreadable: leave what is served alone.
      if (!absl::IsNotFound(versions.status())) {
        LogOnce(path, std::string(versions.status().message()));
        scan.unreadable.insert(name);
      }
      continue;
    }
    if (!versions->empty()) scan.models[name] = *std::move(versions);
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list model repository root ", root, ": ", ec.message()));
  }
  return scan;
}

void ModelRepository::ApplyScanLocked(const DiskScan& scan, const std::set<std::string>& models) {
  const absl::Time now = absl::Now();
  for (const std::string& name : models) {
    if (scan.unreadable.count(name)) continue;
    auto disk = scan.models.find(name);
    auto known = models_.find(name);
    if (disk == scan.models.end()) {
      if (known != models_.end()) {
        for (auto& [version, entry] : known->second) entry.on_disk = false;
      }
      continue;
    }
    if (known == models_.end()) known = models_.emplace(name, ModelEntry()).first;
    ModelEntry& model = known->second;
    for (auto& [version, entry] : model) entry.on_disk = disk->second.count(version) > 0;
    for (const auto& [version, found] : disk->second) {
      auto [it, inserted] = model.try_emplace(version);
      Entry& entry = it->second;
      if (inserted) entry.since = now;
      entry.on_disk = true;
      entry.path = found.path;
      if (inserted || entry.fingerprint != found.fingerprint) {
        entry.fingerprint_since = now;
        // Trusting ctimes lets what was on disk at start load at once; a version that appears or
        // changes later must be seen unchanged for settle_time, whatever the filesystem's clock.
        entry.trust_ctime = !first_scan_done_;
      }
      entry.fingerprint = found.fingerprint;
      entry.last_change = found.last_change;
    }
    for (auto& [version, entry] : model) RefreshSettlingLocked(&entry, now);
  }
  first_scan_done_ = true;
  RecomputeNextSettleLocked();
}

void ModelRepository::RefreshSettlingLocked(Entry* e, absl::Time now) const {
  const absl::Duration settle = options_.settle_time;
  e->settle_due = (e->trust_ctime ? std::min(e->last_change, e->fingerprint_since)
                                  : e->fingerprint_since) +
                  settle;
  e->settling = settle > absl::ZeroDuration() && e->state != State::kAvailable &&
                e->state != State::kLoading && e->on_disk &&
                e->complete_fingerprint != e->fingerprint && now < e->settle_due;
}

void ModelRepository::RecomputeNextSettleLocked() {
  next_settle_ = absl::InfiniteFuture();
  for (const auto& [name, model] : models_) {
    for (const auto& [version, e] : model) {
      if (e.settling) next_settle_ = std::min(next_settle_, e.settle_due);
    }
  }
}

void ModelRepository::WakePoller() {
  {
    absl::MutexLock l(&poll_mu_);
    ++poll_wakeups_;
  }
  poll_cv_.SignalAll();
}

absl::Time ModelRepository::NextSettle() const {
  absl::ReaderMutexLock l(&mu_);
  return next_settle_;
}

absl::Time ModelRepository::NextWantedSettle() const {
  // Computed now, not at the last scan: a load failure since may have made an older, settling
  // version the policy's choice.
  absl::ReaderMutexLock l(&mu_);
  absl::Time due = absl::InfiniteFuture();
  if (next_settle_ == absl::InfiniteFuture()) return due;
  for (const auto& [name, model] : models_) {
    for (int64_t version : DesiredLocked(model, /*as_if_settled=*/true)) {
      const Entry& e = model.at(version);
      if (e.settling) due = std::min(due, e.settle_due);
    }
  }
  return due;
}

absl::Status ModelRepository::DeclareComplete(const ServableId& id) {
  absl::StatusOr<DiskModel> versions = ScanModel(id.model);
  if (!versions.ok() && !absl::IsNotFound(versions.status())) return versions.status();
  if (!versions.ok() || !versions->count(id.version)) {
    return absl::NotFoundError(absl::StrCat(
        "version ", id.version, " of model \"", id.model, "\" is not on disk (no directory ",
        Join(Join(options_.root, id.model), absl::StrCat(id.version)), ")"));
  }
  {
    absl::MutexLock l(&mu_);
    DiskScan scan;
    scan.models[id.model] = *std::move(versions);
    ApplyScanLocked(scan, {id.model});
    Entry& e = models_[id.model][id.version];
    e.complete_fingerprint = e.fingerprint;
    RefreshSettlingLocked(&e, absl::Now());
    RecomputeNextSettleLocked();
  }
  WakePoller();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Loading and the policy.

std::set<int64_t> ModelRepository::DesiredLocked(const ModelEntry& model,
                                                 bool as_if_settled) const {
  std::set<int64_t> desired;
  int newest = 0;
  for (auto it = model.rbegin(); it != model.rend(); ++it) {
    const Entry& e = it->second;
    if (!e.on_disk || e.disabled || (e.settling && !as_if_settled)) continue;
    if (e.pinned) desired.insert(it->first);
    const bool failed_unchanged =
        e.state == State::kFailed && e.failed_fingerprint == e.fingerprint;
    if (newest < options_.versions_to_keep && !failed_unchanged) {
      desired.insert(it->first);
      ++newest;
    }
  }
  return desired;
}

absl::StatusOr<std::shared_ptr<Servable>> ModelRepository::LoadOne(const LoadJob& job) const {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<Servable>> result;
  try {
    result = loader_(job.id, job.path);
  } catch (const std::exception& e) {
    result = absl::InternalError(absl::StrCat("the loader threw: ", e.what()));
  } catch (...) {
    result = absl::InternalError("the loader threw a non-standard exception");
  }
  if (result.ok() && *result == nullptr) {
    result = absl::InternalError("the loader returned no servable");
  }
  if (!result.ok()) {
    const absl::Status& s = result.status();
    LOG(ERROR) << "model repository: cannot load " << job.id.DebugString() << " from " << job.path
               << ": " << s;
    metrics::CountRepositoryLoadFailure(job.id.model, LoadFailureReason(s));
    return util::Prefixed(s, absl::StrCat("loading ", job.id.DebugString(), " from ", job.path, ": "));
  }
  // The loader logs a load with its details (the server's: parts, times, parameters).
  VLOG(1) << "model repository: loaded " << job.id.DebugString() << " from " << job.path
          << " in " << absl::FormatDuration(absl::Now() - start);
  return result;
}

std::vector<ModelRepository::LoadResult> ModelRepository::RunLoads(
    std::vector<LoadJob> jobs) const {
  std::vector<LoadResult> results;
  results.reserve(jobs.size());
  for (LoadJob& job : jobs) {
    results.push_back(LoadResult{std::move(job), absl::UnknownError("not loaded")});
  }
  const size_t num_threads =
      std::min(results.size(), static_cast<size_t>(options_.num_load_threads));
  if (num_threads <= 1) {
    for (LoadResult& r : results) r.servable = LoadOne(r.job);
    return results;
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < results.size(); i = next++) {
      results[i].servable = LoadOne(results[i].job);
    }
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < num_threads; ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  return results;
}

void ModelRepository::InstallLocked(std::vector<LoadResult>* results, std::vector<Event>* events,
                                    std::vector<std::shared_ptr<Servable>>* garbage) {
  const absl::Time now = absl::Now();
  for (LoadResult& r : *results) {
    const ServableId& id = r.job.id;
    Entry* entry = nullptr;
    if (auto m = models_.find(id.model); m != models_.end()) {
      if (auto v = m->second.find(id.version); v != m->second.end()) entry = &v->second;
    }
    if (entry == nullptr) {  // Cannot happen while operations are serialized; drop the result.
      if (r.servable.ok()) garbage->push_back(*std::move(r.servable));
      continue;
    }
    if (r.servable.ok()) {
      if (entry->servable) garbage->push_back(std::move(entry->servable));
      entry->servable = *std::move(r.servable);
      entry->state = State::kAvailable;
      entry->settling = false;
      entry->error = absl::OkStatus();
      entry->since = now;
      entry->failed_fingerprint.clear();
      events->push_back(Event{id, VersionEvent::kAvailable, absl::OkStatus()});
    } else {
      entry->error = r.servable.status();
      entry->failed_fingerprint = r.job.fingerprint;
      if (!entry->servable) {  // A failed reload leaves the loaded servable serving.
        entry->state = State::kFailed;
        entry->since = now;
      }
      events->push_back(Event{id, VersionEvent::kLoadFailed, r.servable.status()});
    }
  }
  results->clear();
}

void ModelRepository::FireEvents(std::vector<Event>* events) const {
  if (options_.on_event) {
    for (const Event& e : *events) options_.on_event(e.id, e.event, e.status);
  }
  events->clear();
}

void ModelRepository::Reconcile(const std::set<std::string>& models) {
  std::vector<Event> events;
  std::vector<std::shared_ptr<Servable>> garbage;  // released after the lock, every round
  std::vector<LoadResult> results;
  for (bool done = false; !done;) {
    std::vector<LoadJob> jobs;
    {
      absl::MutexLock l(&mu_);
      InstallLocked(&results, &events, &garbage);
      const absl::Time now = absl::Now();
      // Per model, what it wants loaded and what it serves that it no longer wants. A model whose
      // wanted versions have all settled (loaded or failed; a failure makes the next older version
      // wanted on the next round) unloads the rest at once. Of the models that replace a version
      // they serve, one loads per round: each holds its old and new versions together only while
      // its own swap runs, not while the others' do. Models with nothing to replace (a start,
      // a new model) load in the same round, num_load_threads at a time.
      bool swap_admitted = false;
      done = true;
      for (const std::string& name : models) {
        auto m = models_.find(name);
        if (m == models_.end()) continue;
        const std::set<int64_t> want = DesiredLocked(m->second);
        std::vector<int64_t> to_load;
        bool replaces = false;
        for (const auto& [version, e] : m->second) {
          if (want.count(version) > 0 && e.state != State::kAvailable) to_load.push_back(version);
          if (want.count(version) == 0 && e.state == State::kAvailable) replaces = true;
        }
        if (to_load.empty()) {
          UnloadUnwantedLocked(name, want, now, &events, &garbage);
          continue;
        }
        done = false;
        if (replaces) {
          if (swap_admitted) continue;  // its turn comes in a later round
          swap_admitted = true;
        }
        for (int64_t version : to_load) {
          Entry& e = m->second[version];
          e.state = State::kLoading;
          e.since = now;
          jobs.push_back(LoadJob{ServableId{name, version}, e.path, e.fingerprint});
          events.push_back(Event{jobs.back().id, VersionEvent::kLoading, absl::OkStatus()});
        }
      }
      if (done) {
        for (const std::string& name : models) {
          auto m = models_.find(name);
          if (m != models_.end() && m->second.empty()) models_.erase(m);
        }
      }
    }
    FireEvents(&events);
    garbage.clear();  // an in-flight request keeps its servable alive until it finishes
    if (!done) results = RunLoads(std::move(jobs));
  }
}

void ModelRepository::UnloadUnwantedLocked(const std::string& name, const std::set<int64_t>& want,
                                           absl::Time now, std::vector<Event>* events,
                                           std::vector<std::shared_ptr<Servable>>* garbage) {
  ModelEntry& model = models_[name];
  for (auto it = model.begin(); it != model.end();) {
    Entry& e = it->second;
    if (e.state == State::kAvailable && !want.count(it->first)) {
      garbage->push_back(std::move(e.servable));
      e.state = State::kUnloaded;
      e.since = now;
      events->push_back(Event{ServableId{name, it->first}, VersionEvent::kUnloaded, absl::OkStatus()});
      LOG(INFO) << "model repository: unloaded " << name << ":" << it->first
                << (e.on_disk ? "" : " (its directory is gone)");
    }
    it = e.on_disk ? std::next(it) : model.erase(it);
  }
}

void ModelRepository::RescanAndReconcile(const std::string& model) {
  DiskScan scan;
  absl::StatusOr<DiskModel> versions = ScanModel(model);
  if (versions.ok()) {
    scan.models[model] = *std::move(versions);
  } else if (!absl::IsNotFound(versions.status())) {
    LOG(WARNING) << "model repository: " << versions.status().message();
    scan.unreadable.insert(model);
  }
  {
    absl::MutexLock l(&mu_);
    ApplyScanLocked(scan, {model});
  }
  WakePoller();
  Reconcile({model});
}

absl::Status ModelRepository::Poll() {
  absl::MutexLock ops(&ops_mu_);
  absl::StatusOr<DiskScan> scan = ScanRoot();
  if (!scan.ok()) {
    const std::string text = scan.status().ToString();
    if (text != last_poll_error_) LOG(ERROR) << "model repository: " << scan.status().message();
    last_poll_error_ = text;
    {
      // Nothing settles unseen: the next scan is the interval's.
      absl::MutexLock l(&mu_);
      next_settle_ = absl::InfiniteFuture();
    }
    return scan.status();
  }
  if (!last_poll_error_.empty()) LOG(INFO) << "model repository: the root is readable again";
  last_poll_error_.clear();
  std::set<std::string> names;
  {
    absl::MutexLock l(&mu_);
    for (const auto& [name, model] : scan->models) names.insert(name);
    for (const auto& [name, model] : models_) names.insert(name);
    ApplyScanLocked(*scan, names);
  }
  WakePoller();
  Reconcile(names);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Serving.

absl::StatusOr<std::shared_ptr<Servable>> ModelRepository::Get(
    std::string_view name, std::optional<int64_t> version) const {
  const absl::string_view model = Sv(name);
  absl::ReaderMutexLock l(&mu_);
  auto m = models_.find(name);
  std::vector<std::string> available;
  if (m == models_.end()) {
    for (const auto& [other, entries] : models_) {
      for (const auto& [v, e] : entries) {
        if (e.state == State::kAvailable) {
          available.push_back(other);
          break;
        }
      }
    }
    return absl::NotFoundError(absl::StrCat(
        "model \"", model, "\" not found; ",
        available.empty() ? "no model is available"
                          : absl::StrCat("available models: ", absl::StrJoin(available, ", "))));
  }
  const ModelEntry& entries = m->second;
  if (!version) {
    for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
      if (it->second.state == State::kAvailable) return it->second.servable;
    }
  } else if (auto it = entries.find(*version);
             it != entries.end() && it->second.state == State::kAvailable) {
    return it->second.servable;
  }
  std::vector<std::string> why;  // for the versions that are not served
  for (const auto& [v, e] : entries) {
    if (e.state == State::kAvailable) {
      available.push_back(absl::StrCat(v));
    } else if (version ? v == *version
                       : e.state != State::kUnloaded || e.disabled ||
                             e.settling) {  // not the policy's choice
      if (why.size() == 5) {
        why.push_back("...");
        continue;
      }
      if (why.size() > 5) continue;
      std::string reason;
      if (e.settling) {
        reason = absl::StrCat("is still changing on disk (it loads once unchanged for ",
                              absl::FormatDuration(options_.settle_time), ")");
      } else if (e.state == State::kLoading) {
        reason = "is loading";
      } else if (e.state == State::kFailed) {
        reason = absl::StrCat("failed to load: ", e.error.message());
      } else {
        reason = e.disabled ? "was unloaded by an admin"
                            : absl::StrCat("is not loaded (only the newest ",
                                           options_.versions_to_keep, " are served)");
      }
      why.push_back(absl::StrCat("version ", v, " ", reason));
    }
  }
  std::string head = version ? absl::StrCat("version ", *version, " of model \"", model,
                                            "\" is not available")
                             : absl::StrCat("model \"", model, "\" has no available version");
  if (version && !entries.count(*version)) head += " (no such version)";
  if (!why.empty()) absl::StrAppend(&head, " (", absl::StrJoin(why, "; "), ")");
  if (!available.empty()) {
    absl::StrAppend(&head, "; available versions: ", absl::StrJoin(available, ", "));
  } else if (version) {
    absl::StrAppend(&head, "; no version is available");
  }
  return absl::NotFoundError(head);
}

std::map<std::string, std::vector<ModelRepository::VersionStatus>> ModelRepository::List() const {
  absl::ReaderMutexLock l(&mu_);
  std::map<std::string, std::vector<VersionStatus>> out;
  for (const auto& [name, entries] : models_) {
    std::vector<VersionStatus>& versions = out[name];
    for (const auto& [v, e] : entries) {
      versions.push_back(
          VersionStatus{v, e.state, e.error, e.path, e.since, e.pinned, e.disabled, e.settling});
    }
  }
  return out;
}

bool ModelRepository::Knows(std::string_view model) const {
  absl::ReaderMutexLock l(&mu_);
  return models_.find(std::string(model)) != models_.end();
}

bool ModelRepository::AllLoaded() const {
  absl::ReaderMutexLock l(&mu_);
  for (const auto& [name, entries] : models_) {
    for (const auto& [v, e] : entries) {
      if (e.state == State::kLoading || e.settling) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Admin operations.

absl::Status ModelRepository::LoadVersion(const ServableId& id) {
  RETURN_IF_ERROR(ValidateId(id));
  absl::MutexLock ops(&ops_mu_);
  RETURN_IF_ERROR(DeclareComplete(id));  // an admin's explicit load: no settling
  std::vector<Event> events;
  std::vector<LoadJob> jobs;
  {
    absl::MutexLock l(&mu_);
    Entry& e = models_[id.model][id.version];
    e.disabled = false;
    jobs.push_back(LoadJob{id, e.path, e.fingerprint});
    if (e.state != State::kAvailable) {
      e.state = State::kLoading;
      e.since = absl::Now();
    }
    events.push_back(Event{id, VersionEvent::kLoading, absl::OkStatus()});
  }
  FireEvents(&events);
  std::vector<LoadResult> results = RunLoads(std::move(jobs));
  const absl::Status status = results[0].servable.status();
  std::vector<std::shared_ptr<Servable>> garbage;
  {
    absl::MutexLock l(&mu_);
    if (status.ok()) models_[id.model][id.version].pinned = true;
    InstallLocked(&results, &events, &garbage);
  }
  FireEvents(&events);
  garbage.clear();
  Reconcile({id.model});
  return status;
}

absl::Status ModelRepository::UnloadVersion(const ServableId& id) {
  RETURN_IF_ERROR(ValidateId(id));
  absl::MutexLock ops(&ops_mu_);
  {
    absl::MutexLock l(&mu_);
    auto m = models_.find(id.model);
    auto v = m == models_.end() ? ModelEntry::iterator() : m->second.find(id.version);
    if (m == models_.end() || v == m->second.end()) {
      return absl::NotFoundError(absl::StrCat("version ", id.version, " of model \"", id.model,
                                              "\" is not known to the repository"));
    }
    v->second.disabled = true;
    v->second.pinned = false;
  }
  RescanAndReconcile(id.model);
  return absl::OkStatus();
}

absl::Status ModelRepository::DeleteVersion(const ServableId& id) {
  RETURN_IF_ERROR(ValidateId(id));
  absl::MutexLock ops(&ops_mu_);
  const std::string path = Join(Join(options_.root, id.model), absl::StrCat(id.version));
  const bool on_disk = Stat(path, /*follow=*/false).has_value();
  bool known = false;
  {
    absl::MutexLock l(&mu_);
    auto m = models_.find(id.model);
    if (m != models_.end()) {
      known = m->second.count(id.version) > 0;
    }
  }
  if (!on_disk && !known) {
    return absl::NotFoundError(absl::StrCat("version ", id.version, " of model \"", id.model,
                                            "\" does not exist (no directory ", path, ")"));
  }
  // Its number is recorded before it goes (a known version whose directory is already gone too),
  // so that a crash after the move still keeps it from being given out again.
  const std::string model_dir = Join(options_.root, id.model);
  if (absl::Status marked = RecordDeletedVersion(model_dir, id.version); !marked.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot record the deleted version number in ", model_dir,
                                                      " (nothing was deleted): ", marked.message()));
  }
  if (on_disk) {
    // The rename makes the version vanish from the tree at once; the slow removal happens in a
    // dot-directory that scans ignore and CleanLeftovers() finishes after a crash.
    const std::string trash = Join(
        options_.root, absl::StrCat(".trash-", id.model.substr(0, 100), "-", id.version, "-",
                                    ::getpid(), "-", absl::ToUnixNanos(absl::Now())));
    if (::rename(path.c_str(), trash.c_str()) != 0) {
      const int err = errno;
      return absl::FailedPreconditionError(
          absl::StrCat("cannot move ", path, " to ", trash, ": ", ErrnoText(err)));
    }
    // Durable before the caller hears it is deleted: else a power loss could bring the version
    // back at the next start.
    SyncDirectory(Join(options_.root, id.model));
    SyncDirectory(options_.root);
    absl::Status removed = RemoveTree(trash);
    if (!removed.ok()) {
      LOG(WARNING) << "model repository: " << removed.message()
                   << " (removed at the next start)";
    }
    LOG(INFO) << "model repository: deleted " << id.DebugString() << " (" << path << ")";
  }
  {
    // Only now: a delete that failed above leaves an admin's pin in place.
    absl::MutexLock l(&mu_);
    if (auto m = models_.find(id.model); m != models_.end()) {
      if (auto v = m->second.find(id.version); v != m->second.end()) v->second.pinned = false;
    }
  }
  // The deleted version keeps serving until the replacement the policy picks is loaded.
  RescanAndReconcile(id.model);
  return absl::OkStatus();
}

int64_t ModelRepository::NextVersion(std::string_view model) const {
  const std::string model_dir = Join(options_.root, model);
  int64_t highest = HighestDeletedVersion(model_dir);
  std::error_code ec;
  for (fs::directory_iterator it(model_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (auto v = ParseVersion(it->path().filename().string())) highest = std::max(highest, *v);
  }
  absl::ReaderMutexLock l(&mu_);
  if (auto m = models_.find(model); m != models_.end() && !m->second.empty()) {
    highest = std::max(highest, m->second.rbegin()->first);
  }
  return highest + 1;
}

absl::Status ModelRepository::Publish(const std::string& staging_dir, const ServableId& id,
                                      bool load_now) {
  RETURN_IF_ERROR(ValidateId(id));
  if (!IsDir(staging_dir)) {
    return absl::NotFoundError(
        absl::StrCat("staging directory ", staging_dir, " does not exist or is not a directory"));
  }
  absl::MutexLock ops(&ops_mu_);
  {
    absl::MutexLock l(&mu_);
    auto m = models_.find(id.model);
    if (m != models_.end()) {
      auto v = m->second.find(id.version);
      if (v != m->second.end() && v->second.state == State::kAvailable) {
        return absl::AlreadyExistsError(absl::StrCat(
            "version ", id.version, " of model \"", id.model, "\" is already being served"));
      }
    }
  }
  const std::string model_dir = Join(options_.root, id.model);
  if (::mkdir(model_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    const int err = errno;
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create model directory ", model_dir, ": ", ErrnoText(err)));
  }
  if (!IsDir(model_dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat(model_dir, " exists and is not a directory"));
  }
  const std::string target = Join(model_dir, absl::StrCat(id.version));
  auto exists_error = [&] {
    return absl::AlreadyExistsError(absl::StrCat("version ", id.version, " of model \"", id.model,
                                                 "\" already exists at ", target));
  };
  // Its entries first (the writers synced the files' contents), so that the version a power loss
  // leaves visible has all of them.
  SyncDirectory(staging_dir);
  // RENAME_NOREPLACE refuses an existing target even when it is an empty directory, which a
  // plain rename(2) would silently replace.
  int rc = ::renameat2(AT_FDCWD, staging_dir.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {  // a filesystem without the flag
    if (Stat(target, /*follow=*/false)) return exists_error();
    rc = ::rename(staging_dir.c_str(), target.c_str());
  }
  if (rc != 0) {
    const int err = errno;
    if (err == EEXIST || err == ENOTEMPTY) return exists_error();
    if (err == EXDEV) {
      return absl::FailedPreconditionError(absl::StrCat(
          "staging directory ", staging_dir, " is not on the same filesystem as ", target));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot move ", staging_dir, " to ", target, ": ", ErrnoText(err)));
  }
  // Make the rename durable before anyone is told the version exists (the root's entry too, for
  // a model directory created above).
  SyncDirectory(model_dir);
  SyncDirectory(options_.root);
  LOG(INFO) << "model repository: published " << id.DebugString() << " at " << target;
  // It appeared whole: the policy need not wait for it to settle. (This scans the model.)
  const bool scanned = DeclareComplete(id).ok();
  if (!load_now) return absl::OkStatus();
  if (scanned) {
    Reconcile({id.model});
  } else {  // gone again, or its model directory unreadable: rescan to record what is there
    RescanAndReconcile(id.model);
  }
  absl::ReaderMutexLock l(&mu_);
  auto m = models_.find(id.model);
  if (m != models_.end()) {
    auto v = m->second.find(id.version);
    if (v != m->second.end() && v->second.state == State::kFailed) return v->second.error;
  }
  return absl::OkStatus();
}

int ModelRepository::ClaimStaging(const std::string& dir) {
  const std::string path = dir + kStagingClaimSuffix;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(10));
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0644);
    // EEXIST: a process cleaning up holds a claim it took for a dead one's and is removing it.
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) break;
    // That process may also have taken this fresh claim between open and flock, and unlinked it:
    // then the lock held here has no name. Either way the claim is made again.
    const bool locked = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    const int lock_error = errno;
    if (locked && NamesFile(path, fd)) return fd;
    ::close(fd);
    if (!locked && lock_error != EWOULDBLOCK) {  // no flock on this filesystem: no claim
      ::unlink(path.c_str());  // made here: an unheld claim would have its entry removed at once
      errno = lock_error;
      break;
    }
  }
  LOG(WARNING) << "cannot claim " << path << " (" << std::strerror(errno)
               << "): another process starting on this repository may remove " << dir
               << " while the job uses it";
  return -1;
}

void ModelRepository::ReleaseStaging(const std::string& dir, int lock) {
  if (lock < 0) return;
  ::unlink((dir + kStagingClaimSuffix).c_str());
  ::close(lock);
}

absl::Status ModelRepository::CleanLeftovers() {
  const absl::Time cutoff = ProcessStartTime();
  absl::Status first;
  auto remove_if_old = [&](const std::string& path) {
    auto st = Stat(path, /*follow=*/false);
    if (!st || MTime(*st) >= cutoff) return;
    absl::Status s = RemoveTree(path);
    if (s.ok()) {
      LOG(INFO) << "model repository: removed leftover " << path;
    } else {
      LOG(WARNING) << "model repository: " << s.message();
      first.Update(s);
    }
  };
  // A claimed staging entry: gone with its claim once no process holds it, else left alone.
  auto remove_if_unclaimed = [&](const std::string& claim) {
    const int fd = ::open(claim.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return;  // its owner just released it
    struct stat st;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && NamesFile(claim, fd) && ::fstat(fd, &st) == 0 &&
        MTime(st) < cutoff) {
      // Unheld and made before this process started (with flock local to each node, as NFS's
      // local_lock gives, every claim looks unheld from another node: the age rule still holds
      // there). The claim goes first: its owner, if it is only now making it, makes it again.
      ::unlink(claim.c_str());
      const std::string entry = claim.substr(0, claim.size() - std::strlen(kStagingClaimSuffix));
      absl::Status s = Stat(entry, /*follow=*/false) ? RemoveTree(entry) : absl::OkStatus();
      if (s.ok()) {
        LOG(INFO) << "model repository: removed leftover " << entry << " (its owner is gone)";
      } else {
        LOG(WARNING) << "model repository: " << s.message();
        first.Update(s);
      }
    }
    ::close(fd);
  };
  // Collected first: removing entries while a directory is being listed is unspecified.
  std::vector<std::string> candidates, claims;
  std::error_code ec;
  for (fs::directory_iterator it(options_.root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::string path = it->path().string();
    if (absl::StartsWith(name, ".trash-")) {
      candidates.push_back(path);
    } else if (name == ".staging" && IsDir(path)) {
      std::set<std::string> names;
      std::error_code sec;
      for (fs::directory_iterator s(path, sec), send; !sec && s != send; s.increment(sec)) {
        names.insert(s->path().filename().string());
      }
      for (const std::string& n : names) {
        const std::string p = Join(path, n);
        if (absl::EndsWith(n, kStagingClaimSuffix)) {
          claims.push_back(p);
        } else if (names.count(n + kStagingClaimSuffix) == 0) {
          candidates.push_back(p);  // no claim: judged by its age
        }
      }
    }
  }
  for (const std::string& claim : claims) remove_if_unclaimed(claim);
  for (const std::string& path : candidates) remove_if_old(path);
  if (ec) {
    first.Update(absl::FailedPreconditionError(
        absl::StrCat("cannot list ", options_.root, ": ", ec.message())));
  }
  return first;
}

}  // namespace collabserve::repository
