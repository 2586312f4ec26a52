#include "server/service/admin_jobs.h"

#include <ATen/Parallel.h>
#include <glog/logging.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/compress/collaborative.h"
#include "server/model/config.h"
#include "server/model/device.h"
#include "server/model/engine.h"
#include "server/model/threads.h"
#include "server/service/admin_upload.h"
#include "server/util/files.h"
#include "server/util/process_memory.h"
#include "server/util/status_macros.h"

namespace collabserve::service {
namespace {

int64_t NowMicros() { return absl::ToUnixMicros(absl::Now()); }

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) LOG(WARNING) << "cannot remove " << path << ": " << ec.message();
}

// Lowers the calling worker thread's CPU priority (JobManagerOptions::idle_priority, nice). On
// Linux both are per thread: only the worker and the threads it starts later are lowered, never
// the inference threads.
void LowerWorkerPriority(const JobManagerOptions& o) {
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
#ifdef SCHED_IDLE
  if (o.idle_priority) {
    sched_param param{};
    param.sched_priority = 0;
    if (::sched_setscheduler(tid, SCHED_IDLE, &param) == 0) return;
    LOG(WARNING) << "admin job worker: cannot switch to SCHED_IDLE (" << strerror(errno)
                 << "); using nice " << o.nice;
  }
#endif
  if (o.nice > 0 &&
      ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), std::min(o.nice, 19)) != 0) {
    LOG(WARNING) << "admin job worker: cannot set nice " << o.nice << ": " << strerror(errno);
  }
}

compress::RankSpec ToRankSpec(const v1::CompressionSpec& spec) {
  compress::RankSpec r;
  switch (spec.spec_case()) {
    case v1::CompressionSpec::kRank:
      r.kind = compress::RankSpec::Kind::kRank;
      r.rank = spec.rank();
      break;
    case v1::CompressionSpec::kRatio:
      r.kind = compress::RankSpec::Kind::kRatio;
      r.ratio = spec.ratio();
      break;
    case v1::CompressionSpec::kRanks:
      r.kind = compress::RankSpec::Kind::kPerLayer;
      r.ranks.assign(spec.ranks().ranks().begin(), spec.ranks().ranks().end());
      break;
    case v1::CompressionSpec::kMaxError:
      r.kind = compress::RankSpec::Kind::kMaxError;
      r.max_error = spec.max_error();
      break;
    case v1::CompressionSpec::kTargetAgreement:
      r.kind = compress::RankSpec::Kind::kTargetAgreement;
      r.target_agreement = spec.target_agreement();
      break;
    case v1::CompressionSpec::kMaxKl:
      r.kind = compress::RankSpec::Kind::kMaxKl;
      r.max_kl = spec.max_kl();
      break;
    case v1::CompressionSpec::SPEC_NOT_SET:
      break;
  }
  return r;
}

// What a source's config.json alone decides about a compression request: not already
// collaborative (`already`: what to say if it is), and ranks that fit its layers. An upload's
// validation and a CompressModel call both ask it.
absl::Status CheckCompressionFits(const model::BertConfig& config, const v1::CompressionSpec& spec,
                                  absl::string_view already) {
  if (config.collaborative.present()) return absl::InvalidArgumentError(already);
  absl::StatusOr<std::vector<int>> ranks = compress::ResolveRanks(ToRankSpec(spec), config);
  if (!ranks.ok()) return absl::InvalidArgumentError(ranks.status().message());
  return absl::OkStatus();
}

v1::JobEvent Event(v1::JobEvent::Kind kind, std::string message) {
  v1::JobEvent e;
  e.set_kind(kind);
  e.set_message(std::move(message));
  return e;
}

const char* Outcome(const absl::Status& s) {
  if (s.ok()) return "succeeded";
  return s.code() == absl::StatusCode::kCancelled ? "cancelled" : "failed";
}

// The files of version directory `src`, hard-linked into `dst` (created), so that a job reads the
// version it was given even if DeleteVersion removes it while the job waits or runs (the links
// keep the data; they are removed with the job's staging directory). Returns `dst`, or `src`
// itself when a file cannot be linked there (a filesystem without hard links): the job then reads
// in place, as before, and says so in the log.
std::string SnapshotSource(const std::string& src, const std::string& dst) {
  std::error_code ec;
  if (!std::filesystem::create_directory(dst, ec)) {
    LOG(WARNING) << "cannot create " << dst << " (" << ec.message() << "): the job reads " << src
                 << " in place";
    return src;
  }
  for (std::filesystem::directory_iterator it(src, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code tec;
    if (it->is_directory(tec)) continue;  // nothing reads a version's subdirectories
    if (!it->is_regular_file(tec)) {
      // A dangling link, say: read in place, so that the loader names it as it would there.
      LOG(WARNING) << it->path().string() << " is not a regular file: the job reads " << src
                   << " in place, and deleting that version under it fails the job";
      return src;
    }
    // Follows links: a linked file is linked as its target.
    const std::string name = it->path().filename().string();
    if (::linkat(AT_FDCWD, it->path().c_str(), AT_FDCWD, util::JoinPath(dst, name).c_str(),
                 AT_SYMLINK_FOLLOW) != 0) {
      LOG(WARNING) << "cannot link " << it->path().string() << " into " << dst << " ("
                   << std::strerror(errno) << "): the job reads " << src
                   << " in place, and deleting that version under it fails the job";
      return src;
    }
  }
  if (ec) {
    LOG(WARNING) << "cannot list " << src << " into " << dst << " (" << ec.message()
                 << "): the job reads it in place";
    return src;
  }
  return dst;
}

// root/.staging/<job id>: a job's private directory.
std::string StagingPath(const std::string& root, const std::string& id) {
  return util::JoinPath(util::JoinPath(root, ".staging"), id);
}

}  // namespace

absl::Status ParseCompressionSpec(const v1::CompressionSpec& spec, bool* requested) {
  *requested = spec.spec_case() != v1::CompressionSpec::SPEC_NOT_SET;
  switch (spec.spec_case()) {
    case v1::CompressionSpec::kRank:
      if (spec.rank() < 1) {
        return absl::InvalidArgumentError(absl::StrCat("compression.rank must be >= 1, got ", spec.rank()));
      }
      break;
    case v1::CompressionSpec::kRatio:
      if (!(spec.ratio() >= 1) || !std::isfinite(spec.ratio())) {
        return absl::InvalidArgumentError(
            absl::StrCat("compression.ratio must be a finite number >= 1, got ", spec.ratio()));
      }
      break;
    case v1::CompressionSpec::kRanks:
      if (spec.ranks().ranks().empty()) {
        return absl::InvalidArgumentError("compression.ranks is empty");
      }
      for (int r : spec.ranks().ranks()) {
        if (r < 0) return absl::InvalidArgumentError("compression.ranks has a negative rank");
      }
      break;
    case v1::CompressionSpec::kMaxError:
      if (!(spec.max_error() > 0 && spec.max_error() < 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("compression.max_error must be in (0, 1), got ", spec.max_error()));
      }
      break;
    case v1::CompressionSpec::kTargetAgreement:
      if (!(spec.target_agreement() > 0 && spec.target_agreement() <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("compression.target_agreement must be in (0, 1], got ", spec.target_agreement()));
      }
      break;
    case v1::CompressionSpec::kMaxKl:
      if (!(spec.max_kl() > 0) || !std::isfinite(spec.max_kl())) {
        return absl::InvalidArgumentError(
            absl::StrCat("compression.max_kl must be a finite number > 0, got ", spec.max_kl()));
      }
      break;
    case v1::CompressionSpec::SPEC_NOT_SET:
      break;
  }
  if (!(spec.search_seconds() >= 0) || !std::isfinite(spec.search_seconds())) {
    return absl::InvalidArgumentError("compression.search_seconds must be a finite number >= 0");
  }
  // A bound on one layer's CP-ALS (the job's cancellation is checked after every sweep, but a
  // million sweeps of a BERT-base layer would hold a worker for hours).
  if (spec.max_iters() < 0 || spec.max_iters() > kMaxCpIterations) {
    return absl::InvalidArgumentError(absl::StrCat("compression.max_iters must be in [0, ",
                                                   kMaxCpIterations, "], got ", spec.max_iters()));
  }
  if (!v1::CompressionSpec::Init_IsValid(spec.init())) {
    return absl::InvalidArgumentError(absl::StrCat("compression.init: unknown value ", spec.init()));
  }
  if (!(spec.tol() >= 0) || !std::isfinite(spec.tol())) {
    return absl::InvalidArgumentError(
        absl::StrCat("compression.tol must be a finite number >= 0, got ", spec.tol()));
  }
  return absl::OkStatus();
}

namespace {

// Calibration texts as a CompressModel request carries them: each a valid UTF-8 text without NUL
// bytes, at least compress::kMinCalibrationTexts of them (or none), kMaxCalibrationBytes in all.
absl::Status ValidateCalibrationTexts(const std::vector<std::string>& texts) {
  if (texts.empty()) return absl::OkStatus();
  int64_t bytes = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    bytes += static_cast<int64_t>(texts[i].size());
    RETURN_IF_ERROR(compress::ParseCalibrationText(texts[i], absl::StrCat("calibration text ", i + 1)).status());
  }
  if (bytes > UploadSession::kMaxCalibrationBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the calibration texts are ", bytes, " bytes; at most ",
                                                   UploadSession::kMaxCalibrationBytes));
  }
  if (texts.size() < static_cast<size_t>(compress::kMinCalibrationTexts)) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: ", texts.size(), " texts; at least ",
                                                   compress::kMinCalibrationTexts, " are needed"));
  }
  return absl::OkStatus();
}

// An upload's calibration.txt, parsed (none: empty). INVALID_ARGUMENT naming the file for a binary
// or non-UTF-8 file, one without text, or fewer than kMinCalibrationTexts texts.
absl::StatusOr<std::vector<std::string>> ReadCalibrationFile(const std::string& dir) {
  const std::string path = util::JoinPath(dir, UploadSession::kCalibrationFile);
  if (!util::FileExists(path)) return std::vector<std::string>{};
  ASSIGN_OR_RETURN(std::string bytes, util::ReadFile(path, UploadSession::kMaxCalibrationBytes));
  ASSIGN_OR_RETURN(std::vector<std::string> texts,
                   compress::ParseCalibrationText(bytes, UploadSession::kCalibrationFile));
  if (texts.size() < static_cast<size_t>(compress::kMinCalibrationTexts)) {
    return absl::InvalidArgumentError(absl::StrCat(UploadSession::kCalibrationFile, ": ", texts.size(),
                                                   " texts; at least ", compress::kMinCalibrationTexts,
                                                   " are needed"));
  }
  return texts;
}

}  // namespace

// ---------------------------------------------------------------------------------------- Job

Job::Job(v1::Job initial)
    : id_(initial.id()),
      created_unix_micros_(initial.created_unix_micros()),
      job_(std::move(initial)) {}

bool Job::IsTerminal(v1::Job::State s) {
  return s == v1::Job::SUCCEEDED || s == v1::Job::FAILED || s == v1::Job::CANCELLED;
}

v1::Job Job::Snapshot(bool with_events) const {
  absl::MutexLock l(&mu_);
  v1::Job copy = job_;
  if (!with_events) copy.clear_events();
  return copy;
}

v1::Job::State Job::state() const {
  absl::MutexLock l(&mu_);
  return job_.state();
}

bool Job::terminal() const { return IsTerminal(state()); }

absl::Status Job::EndStatus() const {
  absl::MutexLock l(&mu_);
  return end_status_;
}

bool Job::Record(v1::JobEvent event, const std::function<void(v1::Job*)>& mutate) {
  absl::MutexLock l(&mu_);
  // (A CancelJob can end a receiving job between its caller's check and this call.)
  if (IsTerminal(job_.state()) || finishing_) return false;
  if (mutate) mutate(&job_);
  event.set_sequence(job_.events_size());
  event.set_unix_micros(NowMicros());
  *job_.add_events() = event;
  event_states_.push_back(job_.state());
  for (auto& [handle, listener] : listeners_) listener(event, job_.state());
  return true;
}

void Job::Update(const std::function<void(v1::Job*)>& mutate) {
  absl::MutexLock l(&mu_);
  mutate(&job_);
}

int Job::Subscribe(Listener listener) {
  absl::MutexLock l(&mu_);
  for (int i = 0; i < job_.events_size(); ++i) listener(job_.events(i), event_states_[i]);
  const int handle = next_listener_++;
  listeners_.emplace(handle, std::move(listener));
  return handle;
}

void Job::Unsubscribe(int handle) {
  absl::MutexLock l(&mu_);
  listeners_.erase(handle);
}

// ----------------------------------------------------------------------------------- JobManager

JobManager::JobManager(JobManagerOptions options, RepositoryFn repository, AdminMetrics* metrics)
    : options_(std::move(options)), repository_(std::move(repository)), metrics_(metrics) {
  publisher_ = std::thread([this] { PublisherLoop(); });
  const int n = std::max(1, options_.max_concurrent_jobs);
  for (int i = 0; i < n; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

JobManager::~JobManager() { Shutdown(); }

void JobManager::Shutdown() {
  absl::MutexLock sl(&shutdown_mu_);
  std::deque<Work> left;
  std::vector<std::shared_ptr<Job>> all;
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
    left.swap(queue_);
    for (auto& [id, job] : jobs_) all.push_back(job);
  }
  for (auto& job : all) job->cancel_.store(true);
  for (auto& t : workers_) t.join();
  workers_.clear();
  {  // after the workers: a worker may be waiting for a publish
    absl::MutexLock l(&publish_mu_);
    publisher_stopping_ = true;
  }
  if (publisher_.joinable()) publisher_.join();
  for (Work& w : left) {
    Finish(w.job, absl::UnavailableError("the server is shutting down"));
    if (w.on_validated) w.on_validated(w.job->EndStatus());  // CANCELLED if a CancelJob came first
  }
  for (auto& job : all) {
    if (!job->terminal()) Finish(job, absl::UnavailableError("the server is shutting down"));
  }
}

std::string JobManager::StagingDir(const Job& job) const {
  repository::ModelRepository* repo = repository_();
  return StagingPath(repo != nullptr ? repo->root() : "", job.id());
}

absl::StatusOr<std::shared_ptr<Job>> JobManager::Create(const JobSpec& spec) {
  if (absl::Status s = repository::ModelRepository::ValidateModelName(spec.model_name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model_name: ", s.message()));
  }
  bool compress = false;
  RETURN_IF_ERROR(ParseCompressionSpec(spec.compression, &compress));
  if (spec.kind == v1::Job::COMPRESS && !compress) {
    return absl::InvalidArgumentError(
        "CompressModel needs a compression spec (rank, ratio, ranks, max_error, target_agreement or max_kl)");
  }
  RETURN_IF_ERROR(ValidateCalibrationTexts(spec.calibration));
  if (spec.has_min_agreement) {
    if (!(spec.min_agreement >= 0 && spec.min_agreement <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("min_agreement must be in [0, 1], got ", spec.min_agreement));
    }
    if (!compress) {
      return absl::InvalidArgumentError("min_agreement needs a compression request");
    }
  }
  if (!spec.probes.empty() && !compress) {
    return absl::InvalidArgumentError("probes need a compression request (they measure its fidelity)");
  }
  if (spec.version < 0) return absl::InvalidArgumentError("version must be positive");
  if (options_.refusal) RETURN_IF_ERROR(options_.refusal());
  repository::ModelRepository* repo = repository_();
  if (repo == nullptr) return absl::UnavailableError("the model repository is not loaded yet");
  const std::string model_dir = util::JoinPath(repo->root(), spec.model_name);

  int64_t source_version = spec.source_version;
  if (spec.kind == v1::Job::COMPRESS) {
    if (source_version == 0) {
      // The newest version on disk that is not itself collaborative (an earlier compression's
      // output cannot be compressed again); one whose config.json does not parse is the job's to
      // report.
      auto all = repo->List();
      auto it = all.find(spec.model_name);
      bool only_collaborative = false;
      if (it != all.end()) {
        for (auto v = it->second.rbegin(); v != it->second.rend(); ++v) {
          const std::string dir = util::JoinPath(model_dir, absl::StrCat(v->version));
          if (!IsDir(dir)) continue;
          absl::StatusOr<model::BertConfig> c = model::BertConfig::FromFile(util::JoinPath(dir, "config.json"));
          if (c.ok() && c->collaborative.present()) {
            only_collaborative = true;
            continue;
          }
          source_version = v->version;
          break;
        }
      }
      if (source_version == 0) {
        return absl::NotFoundError(absl::StrCat(
            "model '", spec.model_name, "' has ",
            only_collaborative ? "only collaborative versions on disk; compress needs a standard one"
                               : "no version on disk"));
      }
    } else if (!IsDir(util::JoinPath(model_dir, absl::StrCat(source_version)))) {
      return absl::NotFoundError(absl::StrCat("model '", spec.model_name, "' has no version ",
                                              source_version, " on disk"));
    }
    // Refused now rather than by the job; a config.json that does not parse is the job's to report.
    const std::string config_path =
        util::JoinPath(util::JoinPath(model_dir, absl::StrCat(source_version)), "config.json");
    if (absl::StatusOr<model::BertConfig> config = model::BertConfig::FromFile(config_path); config.ok()) {
      RETURN_IF_ERROR(CheckCompressionFits(
          *config, spec.compression,
          absl::StrCat("version ", source_version, " of '", spec.model_name,
                       "' is already collaborative; compress the original version instead")));
    }
  }

  std::shared_ptr<Job> job;
  std::string input_dir;  // a COMPRESS job's: its snapshot of the source version
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (static_cast<int>(pending_.size()) >= options_.max_queued_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the job queue is full (", pending_.size(), " jobs receiving or queued; "
          "--max_queued_jobs=", options_.max_queued_jobs, "): try again later"));
    }
    std::set<int64_t>& reserved = reserved_versions_[spec.model_name];
    int64_t version = spec.version;
    if (version > 0) {
      if (reserved.count(version) > 0 || IsDir(util::JoinPath(model_dir, absl::StrCat(version)))) {
        return absl::AlreadyExistsError(
            absl::StrCat("version ", version, " of model '", spec.model_name, "' already exists"));
      }
    } else {
      version = repo->NextVersion(spec.model_name);
      if (!reserved.empty()) version = std::max(version, *reserved.rbegin() + 1);
    }
    static thread_local std::mt19937 rng(std::random_device{}());
    const std::string id = absl::StrFormat("%d-%06x", next_id_++, rng() & 0xffffff);

    v1::Job j;
    j.set_id(id);
    j.set_kind(spec.kind);
    j.set_state(spec.kind == v1::Job::UPLOAD ? v1::Job::RECEIVING : v1::Job::QUEUED);
    j.set_model_name(spec.model_name);
    j.set_version(version);
    j.set_source_version(source_version);
    *j.mutable_compression() = spec.compression;
    if (spec.has_min_agreement) j.set_min_agreement(spec.min_agreement);
    j.set_activate(spec.activate);
    j.set_created_unix_micros(NowMicros());
    job = std::make_shared<Job>(std::move(j));

    const std::string staging_root = util::JoinPath(repo->root(), ".staging");
    mkdir(staging_root.c_str(), 0755);  // EEXIST is fine; the next mkdir reports real errors
    const std::string dir = StagingPath(repo->root(), id);
    // Claimed before it exists: another process sharing the volume (a replica starting) removes
    // staging entries whose claim it can take, and would otherwise judge this one by its age.
    const int lock = repository::ModelRepository::ClaimStaging(dir);
    if (mkdir(dir.c_str(), 0755) != 0) {
      const int err = errno;
      repository::ModelRepository::ReleaseStaging(dir, lock);
      std::string message = absl::StrCat("cannot create ", dir, ": ", strerror(err));
      // A full disk or quota is RESOURCE_EXHAUSTED, as for the upload's files.
      if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(std::move(message));
      return absl::InternalError(std::move(message));
    }
    if (lock >= 0) staging_locks_[id] = lock;
    // Before the job is visible (a CancelJob's cleanup must not race the links).
    if (spec.kind == v1::Job::COMPRESS) {
      input_dir = SnapshotSource(util::JoinPath(model_dir, absl::StrCat(source_version)),
                                 util::JoinPath(dir, "source"));
    }
    reserved.insert(version);
    pending_.insert(id);
    jobs_[id] = job;
    // Probes travel beside the Job (they can be long, and GetJob need not repeat them).
    probes_[id] = spec.probes;
    if (!spec.calibration.empty()) calibration_[id] = spec.calibration;
  }
  if (spec.kind == v1::Job::COMPRESS) {
    job->Record(Event(v1::JobEvent::QUEUED, "queued"));
    Work w;
    w.job = job;
    w.input_dir = std::move(input_dir);
    absl::MutexLock l(&mu_);
    queue_.push_back(std::move(w));
  }
  return job;
}

void JobManager::Enqueue(const std::shared_ptr<Job>& job, std::string input_dir,
                         std::function<absl::Status()> verify,
                         std::function<void(const absl::Status&)> on_validated) {
  if (!job->Record(Event(v1::JobEvent::QUEUED, "upload received; queued"),
                   [](v1::Job* j) { j->set_state(v1::Job::QUEUED); })) {
    on_validated(job->EndStatus());  // cancelled while receiving
    return;
  }
  bool queued = false;
  {
    absl::MutexLock l(&mu_);
    // A CancelJob sets the flag before it looks for the work in the queue (under mu_): either it
    // finds the work pushed here, or the flag is seen here and nothing is pushed.
    if (!stopping_ && !job->cancel_requested()) {
      Work w;
      w.job = job;
      w.input_dir = std::move(input_dir);
      w.verify = std::move(verify);
      w.on_validated = std::move(on_validated);
      queue_.push_back(std::move(w));
      queued = true;
    }
  }
  if (!queued) {
    Finish(job, CancelledOrStopping(*job));  // nothing when CancelJob has ended it
    on_validated(job->EndStatus());
  }
}

void JobManager::Abandon(const std::shared_ptr<Job>& job, const absl::Status& why) {
  Finish(job, why);
}

std::shared_ptr<Job> JobManager::Get(const std::string& id) const {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Job>> JobManager::List() const {
  std::vector<std::shared_ptr<Job>> out;
  {
    absl::MutexLock l(&mu_);
    for (auto& [id, job] : jobs_) out.push_back(job);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    const int64_t ta = a->created_unix_micros(), tb = b->created_unix_micros();
    return ta != tb ? ta > tb : a->id() > b->id();
  });
  return out;
}

absl::StatusOr<v1::Job> JobManager::Cancel(const std::string& id) {
  std::shared_ptr<Job> job = Get(id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  v1::Job::State state;
  {
    absl::MutexLock l(&job->mu_);
    state = job->job_.state();
    if (Job::IsTerminal(state)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", id, " has already ended (", v1::Job::State_Name(state), ")"));
    }
    if (job->committing_) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id, " is publishing its version; it can no longer be cancelled"));
    }
    job->cancel_.store(true);
  }
  // Not yet on a worker: end it now, and answer the upload call waiting for its validation (a
  // queued job's work leaves the queue, with the upload's open files). A running job notices the
  // flag itself; a worker that took the work meanwhile answers that call itself (Run).
  if (state == v1::Job::RECEIVING || state == v1::Job::QUEUED) {
    std::optional<Work> work;
    {
      absl::MutexLock l(&mu_);
      auto it = std::find_if(queue_.begin(), queue_.end(),
                             [&id](const Work& w) { return w.job->id() == id; });
      if (it != queue_.end()) {
        work = std::move(*it);
        queue_.erase(it);
      }
    }
    Finish(job, absl::CancelledError(absl::StrCat("job ", id, " was cancelled")));
    if (work && work->on_validated) work->on_validated(job->EndStatus());
  }
  return job->Snapshot(false);
}

absl::Status JobManager::CancelledOrStopping(const Job& job) const {
  {
    absl::MutexLock l(&mu_);
    // Shutdown() sets every job's cancel flag: not the client's doing, and UNAVAILABLE says so
    // (a client may try again on another replica).
    if (stopping_) {
      return absl::UnavailableError(
          absl::StrCat("the server is shutting down; job ", job.id(), " did not finish"));
    }
  }
  return absl::CancelledError(absl::StrCat("job ", job.id(), " was cancelled"));
}

void JobManager::WorkerLoop() {
  model::SetThisThreadIntraOpThreads(std::max(1, options_.intra_op_threads));
  LowerWorkerPriority(options_);
  for (;;) {
    Work w;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](JobManager* m) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return m->stopping_ || !m->queue_.empty();
          },
          this));
      if (stopping_) return;
      w = std::move(queue_.front());
      queue_.pop_front();
      pending_.erase(w.job->id());
    }
    Run(std::move(w));
  }
}

void JobManager::PublisherLoop() {
  for (;;) {
    std::function<void()> fn;
    {
      absl::MutexLock l(&publish_mu_);
      publish_mu_.Await(absl::Condition(
          +[](JobManager* m) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return m->publisher_stopping_ || !m->publish_queue_.empty();
          },
          this));
      if (publish_queue_.empty()) return;  // stopping, nothing left
      fn = std::move(publish_queue_.front());
      publish_queue_.pop_front();
    }
    fn();
  }
}

void JobManager::RunAtServerPriority(const std::function<void()>& fn) {
  absl::Notification done;
  bool queued = false;
  {
    absl::MutexLock l(&publish_mu_);
    // Shutdown() stops the publisher only after joining the workers (our callers), so it is
    // running; the inline call is a safeguard.
    if (!publisher_stopping_) {
      publish_queue_.push_back([&] {
        fn();
        done.Notify();
      });
      queued = true;
    }
  }
  if (!queued) {
    fn();
    return;
  }
  done.WaitForNotification();
}

void JobManager::Run(Work work) {
  std::shared_ptr<Job> job = work.job;
  if (options_.start_hook) options_.start_hook(job->id());
  // QUEUED -> RUNNING under the lock CancelJob reads the state and sets the flag under: a job it
  // found QUEUED never starts, one it finds RUNNING notices the flag. (With the check and the
  // change as two steps, a CancelJob between them ended the job CANCELLED and the worker then set
  // it RUNNING for good.)
  bool start = false;
  {
    absl::MutexLock l(&job->mu_);
    if (!job->cancel_.load() && !Job::IsTerminal(job->job_.state()) && !job->finishing_) {
      job->job_.set_state(v1::Job::RUNNING);
      job->job_.set_started_unix_micros(NowMicros());
      start = true;
    }
  }
  if (!start) {  // cancelled while queued (by CancelJob or Shutdown)
    Finish(job, CancelledOrStopping(*job));  // nothing when CancelJob has ended it
    if (work.on_validated) work.on_validated(job->EndStatus());
    return;
  }
  repository::ModelRepository* repo = repository_();
  absl::Status status = repo == nullptr
                            ? absl::UnavailableError("the model repository is not loaded yet")
                            : Process(work, repo);
  // An INTERNAL error of work on a GPU may be the GPU's (compression reports LibTorch's errors as
  // they come). A device failure stops the server, and is the job's outcome even if it was
  // cancelled meanwhile.
  if (absl::StatusOr<c10::Device> device = model::ParseDevice(options_.device); device.ok()) {
    status = model::WithDeviceCheck(std::move(status), *device);
  }
  if (model::IsDeviceFailure(status)) {
    if (options_.on_device_failure) options_.on_device_failure(status);
  } else if (!status.ok() && job->cancel_requested() && !job->Snapshot(false).published()) {
    status = CancelledOrStopping(*job);
  }
  if (!status.ok()) LOG(WARNING) << "admin job " << job->id() << ": " << status;
  Finish(job, status);
  if (work.on_validated) work.on_validated(status);
}

namespace {

absl::Status Cancelled(const Job& job) {
  return absl::CancelledError(absl::StrCat("job ", job.id(), " was cancelled"));
}

// Whether a failed load blames the checkpoint (a file missing, malformed, inconsistent or of a
// kind the engine does not take) rather than the server (out of memory, an internal error).
bool IsCheckpointError(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
      return false;
    default:
      return true;
  }
}

// Step 1 (an upload): its checksums.
absl::Status VerifyUpload(Job& job, std::function<absl::Status()>& verify, util::MemoryPhases& memory) {
  if (!verify) return absl::OkStatus();
  memory.Begin("verify");
  job.Record(Event(v1::JobEvent::VALIDATING, "verifying checksums"));
  RETURN_IF_ERROR(verify());
  verify = nullptr;
  return absl::OkStatus();
}

// Step 2: config.json, which every later step reads. INVALID_ARGUMENT for a bad one, or for a
// CompressModel of a model that is already collaborative.
absl::StatusOr<model::BertConfig> ReadConfig(const v1::Job& spec, const std::string& input_dir, bool compress) {
  absl::StatusOr<model::BertConfig> config = model::BertConfig::FromFile(util::JoinPath(input_dir, "config.json"));
  if (!config.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the engine rejects the checkpoint: ", config.status().message()));
  }
  if (spec.kind() == v1::Job::COMPRESS && compress && config->collaborative.present()) {
    return absl::InvalidArgumentError(absl::StrCat(input_dir, ": the model is already collaborative"));
  }
  if (spec.has_min_agreement() && config->output_function() == model::OutputFunction::kNone) {
    return absl::InvalidArgumentError(
        "min_agreement needs a classifier: a regression model (problem_type \"regression\") has no "
        "classes to agree on");
  }
  return config;
}

// Step 3 (an upload): the engine loads the checkpoint to validate it, and the rank spec must
// resolve for it. Returns the engine when the job compresses (on the CPU, float32, unpacked: the
// model CP conversion reads, so the checkpoint is read once), else null. Records VALIDATED and
// tells the uploading client.
absl::StatusOr<std::unique_ptr<model::Engine>> ValidateUpload(
    Job& job, const v1::Job& spec, const std::string& input_dir, const model::BertConfig& config, bool compress,
    const std::string& serving_device, std::function<void(const absl::Status&)>& on_validated,
    util::MemoryPhases& memory) {
  memory.Begin("validate");
  job.Record(Event(v1::JobEvent::VALIDATING, "loading the checkpoint to validate it"));
  absl::Status valid;
  std::unique_ptr<model::Engine> engine;
  {
    model::EngineOptions eo;
    eo.device = compress ? "cpu" : serving_device;
    eo.pack_weights = false;  // validated, converted and measured here, never served
    eo.cuda_graph_max_tokens = 0;  // a few passes: capturing graphs would cost more than it saves
    absl::StatusOr<std::unique_ptr<model::Engine>> loaded = model::Engine::Load(input_dir, eo);
    if (model::IsDeviceFailure(loaded.status())) {  // the GPU's fault, not the checkpoint's
      valid = util::Prefixed(loaded.status(), "loading the checkpoint to validate it: ");
    } else if (!loaded.ok() && IsCheckpointError(loaded.status())) {
      valid = absl::InvalidArgumentError(absl::StrCat("the engine rejects the checkpoint: ", loaded.status().message()));
    } else if (!loaded.ok()) {  // out of memory, an internal error: the server's, not the checkpoint's
      valid = util::Prefixed(loaded.status(), "loading the checkpoint to validate it: ");
    } else if (compress) {
      valid = CheckCompressionFits(
          config, spec.compression(),
          "the checkpoint is already collaborative; upload it without a compression request");
    }
    if (valid.ok() && compress) engine = std::move(*loaded);
  }  // an engine that only validated is freed here
  // Give the heap's free pages back to the OS (glibc keeps freed chunks otherwise): loading
  // leaves ~350 MiB of freed per-tensor copies behind for BERT-base, and an engine that only
  // validated is gone.
  util::ReleaseFreedMemory();
  RETURN_IF_ERROR(valid);
  // Cancelled meanwhile (CancelJob, or the uploading client gave up): the call is not told OK.
  if (job.cancel_requested()) return Cancelled(job);
  job.Record(Event(v1::JobEvent::VALIDATED, "checkpoint accepted"));
  if (on_validated) {
    on_validated(absl::OkStatus());
    on_validated = nullptr;
  }
  return engine;
}

// Step 4 (compression): what the compressor is asked, from the job's spec, probes and calibration
// text; records CALIBRATED (whitening on or off, and why).
compress::CompressOptions CompressionOptions(Job& job, const v1::Job& spec, std::vector<std::string> probes,
                                             std::vector<std::string> calibration, const std::string& device) {
  compress::CompressOptions o;
  o.spec = ToRankSpec(spec.compression());
  if (spec.compression().max_iters() > 0) o.max_iters = spec.compression().max_iters();
  if (spec.compression().tol() > 0) o.tol = spec.compression().tol();
  if (spec.compression().search_seconds() > 0) o.search_seconds = spec.compression().search_seconds();
  o.seed = spec.compression().seed();
  if (spec.compression().init() == v1::CompressionSpec::RANDOM) o.init = compress::CpAlsOptions::Init::kRandom;
  o.device = device;
  // Automatic: one layer per CPU, since this worker runs ATen single-threaded. The workers are
  // this thread's children, so they run at its idle priority and classification preempts them.
  o.parallel_layers = 0;
  o.probes = std::move(probes);
  o.calibration = std::move(calibration);
  o.source = spec.kind() == v1::Job::UPLOAD ? absl::StrCat("upload ", spec.model_name(), " job ", job.id())
                                            : absl::StrCat(spec.model_name(), "/", spec.source_version());
  job.Record(Event(v1::JobEvent::CALIBRATED,
                   !o.calibration.empty()
                       ? absl::StrFormat("whitening on: %d calibration texts, fitted on the first %.0f%%; "
                                         "fidelity measured on %s",
                                         o.calibration.size(), 100 * o.calibration_fit_fraction,
                                         o.probes.empty() ? "the rest" : "the given probes")
                   : spec.kind() == v1::Job::UPLOAD
                       ? "whitening off: the upload has no calibration.txt (plain weight-space CP)"
                       : "whitening off: the request has no calibration texts (plain weight-space CP)"));
  return o;
}

v1::CompressionReport ReportProto(const compress::CompressReport& report) {
  v1::CompressionReport out;
  for (const compress::LayerReport& lr : report.layers) {
    v1::LayerResult* l = out.add_layers();
    l->set_layer(lr.layer);
    l->set_rank(lr.rank);
    l->set_relative_error(lr.relative_error);
    l->set_iterations(lr.iterations);
    l->set_seconds(lr.seconds);
    if (lr.activation_error >= 0) l->set_activation_error(lr.activation_error);
  }
  out.set_qk_params_before(report.qk_params_before);
  out.set_qk_params_after(report.qk_params_after);
  out.set_total_params_before(report.total_params_before);
  out.set_total_params_after(report.total_params_after);
  v1::FidelityResult* f = out.mutable_fidelity();
  f->set_probes(report.fidelity.probes);
  f->set_top1_agreement(report.fidelity.top1_agreement);
  f->set_max_abs_logit_diff(report.fidelity.max_abs_logit_diff);
  f->set_mean_kl(report.fidelity.mean_kl);
  f->set_top1_agreement_lower95(report.fidelity.agreement_lower95);
  f->set_truncated_probes(static_cast<int32_t>(report.fidelity.truncated));
  out.set_seconds(report.seconds);
  out.set_json(report.ToJson());
  return out;
}

// Step 5: compresses `engine`'s model into `out` (LAYER_COMPRESSED per layer, SEARCH_TRIAL per
// trial of a target search, FIDELITY_MEASURED with the report on the job), then applies the
// fidelity gate. The engine is freed before it returns.
absl::Status CompressInto(Job& job, const v1::Job& spec, compress::CompressOptions o,
                          std::unique_ptr<model::Engine> engine, const std::string& input_dir,
                          const std::string& out, int num_layers, util::MemoryPhases& memory) {
  job.Update([&](v1::Job* j) { j->set_num_layers(num_layers); });
  o.on_layer = [&job, num_layers](const compress::LayerReport& lr) {
    v1::JobEvent e = Event(v1::JobEvent::LAYER_COMPRESSED,
                           lr.rank == 0 ? absl::StrFormat("layer %d of %d kept standard (rank 0)",
                                                          lr.layer + 1, num_layers)
                                        : absl::StrFormat("layer %d of %d compressed: rank %d, error %.4g",
                                                          lr.layer + 1, num_layers, lr.rank,
                                                          lr.relative_error));
    e.set_layer(lr.layer);
    e.set_num_layers(num_layers);
    e.set_rank(lr.rank);
    e.set_relative_error(lr.relative_error);
    job.Record(e, [](v1::Job* j) { j->set_layers_done(j->layers_done() + 1); });
    // CP-ALS leaves many freed mid-sized buffers in this thread's malloc arena; return them
    // between layers so they do not add up over the model.
    util::ReleaseFreedMemory();
  };
  int trials = 0;
  o.on_trial = [&job, &trials](const compress::RankSearchReport::Trial& t) {
    job.Record(Event(v1::JobEvent::SEARCH_TRIAL,
                     absl::StrFormat("search trial %d: ranks [%s], %d Q/K parameters: top-1 agreement %.4f, "
                                     "mean KL %.4g: %s",
                                     ++trials, absl::StrJoin(t.ranks, ","), t.qk_params, t.fidelity.top1_agreement,
                                     t.fidelity.mean_kl, t.meets ? "meets the target" : "misses the target")));
  };
  o.cancelled = job.cancel_flag();
  o.on_step = [&memory](const std::string& step) { memory.Begin(step); };
  const int engine_max_length = engine->info().max_length;
  absl::StatusOr<compress::CompressReport> report =
      compress::CompressLoadedModel(engine->classifier(), input_dir, out, o);
  // The original and the compressed model are gone once the engine is: give their pages back
  // before the repository loads the published version.
  engine.reset();
  util::ReleaseFreedMemory();
  if (!report.ok()) return job.cancel_requested() ? Cancelled(job) : report.status();
  const v1::CompressionReport proto = ReportProto(*report);
  const v1::FidelityResult& f = proto.fidelity();
  std::string message = absl::StrFormat(
      "fidelity on %d %s: top-1 agreement %.4f (95%% lower bound %.4f), max |logit diff| %.4g, mean KL %.4g",
      f.probes(), report->fidelity_texts, f.top1_agreement(), f.top1_agreement_lower95(), f.max_abs_logit_diff(),
      f.mean_kl());
  if (f.truncated_probes() > 0) {
    absl::StrAppendFormat(&message, "; %d of them longer than the model's %d tokens, measured cut there as served",
                          f.truncated_probes(), engine_max_length);
  }
  // An agreement that meets the gate or the target on too few probes to say so of other texts.
  std::vector<std::pair<const char*, double>> asked;
  if (spec.has_min_agreement()) asked.emplace_back("min_agreement", spec.min_agreement());
  if (spec.compression().spec_case() == v1::CompressionSpec::kTargetAgreement) {
    asked.emplace_back("target_agreement", spec.compression().target_agreement());
  }
  bool warned = false;
  for (const auto& [name, value] : asked) {
    if (value > 0 && f.top1_agreement() >= value && f.top1_agreement_lower95() < value) {
      absl::StrAppendFormat(&message,
                            "; %s %.4f is met, but %d texts do not show that %.4f of texts like them agree "
                            "(give more probes or calibration text)",
                            name, value, f.probes(), value);
      warned = true;
    }
  }
  if (warned) LOG(WARNING) << "admin job " << spec.id() << ": " << message;
  v1::JobEvent e = Event(v1::JobEvent::FIDELITY_MEASURED, message);
  *e.mutable_fidelity() = f;
  job.Record(e, [&](v1::Job* j) { *j->mutable_report() = proto; });
  if (spec.has_min_agreement() && f.top1_agreement() < spec.min_agreement()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "fidelity gate: top-1 agreement %.4f is below min_agreement %.4f; nothing was published",
        f.top1_agreement(), spec.min_agreement()));
  }
  return absl::OkStatus();
}

}  // namespace

// The job's steps in order: verify (upload), read the config, calibration text, validate (upload)
// or load (CompressModel), compress, publish and load. Each step records its events; the first
// error ends the job (Run turns it into the job's final state).
absl::Status JobManager::Process(Work& work, repository::ModelRepository* repo) {
  Job& job = *work.job;
  const v1::Job spec = job.Snapshot(false);
  bool compress = false;
  RETURN_IF_ERROR(ParseCompressionSpec(spec.compression(), &compress));
  auto cancelled = [&] { return Cancelled(job); };
  // Resident memory of each step, logged when the job ends (bench/admin/RESULTS.md).
  util::MemoryPhases memory;
  struct LogMemory {
    util::MemoryPhases& m;
    const std::string& id;
    ~LogMemory() {
      LOG(INFO) << "admin job " << id << " memory by step:\n" << util::MemoryPhases::Format(m.Finish());
    }
  } log_memory{memory, job.id()};
  memory.Begin("received");

  if (spec.kind() == v1::Job::UPLOAD) RETURN_IF_ERROR(VerifyUpload(job, work.verify, memory));
  if (job.cancel_requested()) return cancelled();
  ASSIGN_OR_RETURN(const model::BertConfig config, ReadConfig(spec, work.input_dir, compress));
  // The calibration text: an upload's calibration.txt (checked before the checkpoint is loaded, so
  // a bad one fails the upload at once), or the CompressModel request's texts; and the probes.
  std::vector<std::string> calibration, probes;
  if (compress && spec.kind() == v1::Job::UPLOAD) {
    ASSIGN_OR_RETURN(calibration, ReadCalibrationFile(work.input_dir));
  }
  {
    absl::MutexLock l(&mu_);
    if (auto it = calibration_.find(job.id()); it != calibration_.end()) calibration = it->second;
    if (auto it = probes_.find(job.id()); it != probes_.end()) probes = it->second;
  }
  if (options_.work_fault_hook) RETURN_IF_ERROR(options_.work_fault_hook());
  std::unique_ptr<model::Engine> engine;
  if (spec.kind() == v1::Job::UPLOAD) {
    ASSIGN_OR_RETURN(engine, ValidateUpload(job, spec, work.input_dir, config, compress, options_.device,
                                            work.on_validated, memory));
  }
  if (job.cancel_requested()) return cancelled();

  std::string publish_dir = work.input_dir;
  if (compress) {
    if (engine == nullptr) {  // COMPRESS: the source version on disk
      memory.Begin("load");
      model::EngineOptions eo;
      eo.pack_weights = false;  // converted and measured here, never served
      ASSIGN_OR_RETURN(engine, model::Engine::Load(work.input_dir, eo));
      util::ReleaseFreedMemory();  // as after validation
      if (job.cancel_requested()) return cancelled();
    }
    publish_dir = util::JoinPath(StagingDir(job), "out");
    compress::CompressOptions o =
        CompressionOptions(job, spec, std::move(probes), std::move(calibration), options_.device);
    RETURN_IF_ERROR(CompressInto(job, spec, std::move(o), std::move(engine), work.input_dir, publish_dir,
                                 config.num_hidden_layers, memory));
  }

  {
    absl::MutexLock l(&job.mu_);
    if (job.cancel_.load()) return cancelled();
    job.committing_ = true;
  }
  memory.Begin("publish+load");
  return PublishAndLoad(job, spec, publish_dir, repo);
}

absl::Status JobManager::PublishAndLoad(Job& job, const v1::Job& spec, const std::string& dir,
                                        repository::ModelRepository* repo) {
  const repository::ServableId id{spec.model_name(), spec.version()};
  absl::Status published;
  // Published means moved: the rename takes the staging directory away. Whether the version's
  // directory exists says nothing, since another process (a replica on the same volume, a person)
  // may have made that version, and Publish then refused (ALREADY_EXISTS) and moved nothing; a
  // staging directory gone before the call (NOT_FOUND) was not moved either.
  const bool staged = IsDir(dir);
  RunAtServerPriority([&] { published = repo->Publish(dir, id, spec.activate()); });
  if (!staged || IsDir(dir)) {
    return published.ok() ? absl::InternalError("publish reported success but moved nothing")
                          : published;
  }
  v1::JobEvent pe = Event(v1::JobEvent::PUBLISHED, absl::StrCat("published as ", id.DebugString()));
  pe.set_version(id.version);
  job.Record(pe, [](v1::Job* j) { j->set_published(true); });
  if (!published.ok()) {
    return util::Prefixed(published,
                          absl::StrCat("published as ", id.DebugString(), " but loading it failed: "));
  }
  if (spec.activate()) {
    if (repo->Get(id.model, id.version).ok()) {
      v1::JobEvent le = Event(v1::JobEvent::LOADED, absl::StrCat(id.DebugString(), " is serving"));
      le.set_version(id.version);
      job.Record(le, [](v1::Job* j) { j->set_loaded(true); });
    }
  }
  return absl::OkStatus();
}

void JobManager::Finish(const std::shared_ptr<Job>& job, const absl::Status& status) {
  {
    absl::MutexLock l(&job->mu_);
    if (Job::IsTerminal(job->job_.state()) || job->finishing_) return;
    job->finishing_ = true;
    job->end_status_ = status;
  }
  // Staging goes first, so that whoever sees the job end also sees it cleaned up; its claim after.
  int lock = -1;
  {
    absl::MutexLock l(&mu_);
    if (auto it = staging_locks_.find(job->id()); it != staging_locks_.end()) {
      lock = it->second;
      staging_locks_.erase(it);
    }
  }
  if (repository::ModelRepository* repo = repository_(); repo != nullptr) {
    const std::string dir = StagingPath(repo->root(), job->id());
    RemoveTree(dir);
    repository::ModelRepository::ReleaseStaging(dir, lock);
  } else if (lock >= 0) {
    ::close(lock);
  }
  const int64_t now = NowMicros();
  int64_t created = 0;
  {
    absl::MutexLock l(&job->mu_);
    created = job->job_.created_unix_micros();
  }
  // Counted before the end is published, for the same reason: a client that saw the job succeed
  // and then scraped /metrics found it not yet counted.
  if (metrics_ != nullptr) metrics_->JobEnded(Outcome(status), (now - created) / 1e6);
  {
    absl::MutexLock l(&job->mu_);
    v1::Job::State state = status.ok() ? v1::Job::SUCCEEDED
                           : status.code() == absl::StatusCode::kCancelled ? v1::Job::CANCELLED
                                                                            : v1::Job::FAILED;
    job->job_.set_state(state);
    job->job_.set_finished_unix_micros(now);
    v1::JobEvent e;
    if (status.ok()) {
      e = Event(v1::JobEvent::SUCCEEDED, "succeeded");
    } else {
      job->job_.set_error_code(static_cast<int>(status.code()));
      job->job_.set_error(std::string(status.message()));
      e = Event(state == v1::Job::CANCELLED ? v1::JobEvent::CANCELLED : v1::JobEvent::FAILED,
                std::string(status.message()));
      e.set_code(static_cast<int>(status.code()));
    }
    e.set_sequence(job->job_.events_size());
    e.set_unix_micros(now);
    *job->job_.add_events() = e;
    job->event_states_.push_back(state);
    for (auto& [handle, listener] : job->listeners_) listener(e, state);
  }
  absl::MutexLock l(&mu_);
  ReleaseLocked(*job);
  finished_order_.push_back(job->id());
  while (static_cast<int>(finished_order_.size()) > options_.max_finished_jobs) {
    jobs_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
}

void JobManager::ReleaseLocked(const Job& job) {
  pending_.erase(job.id());
  probes_.erase(job.id());
  calibration_.erase(job.id());
  const v1::Job j = job.Snapshot(false);
  auto it = reserved_versions_.find(j.model_name());
  if (it != reserved_versions_.end()) {
    it->second.erase(j.version());
    if (it->second.empty()) reserved_versions_.erase(it);
  }
}

}  // namespace collabserve::service
