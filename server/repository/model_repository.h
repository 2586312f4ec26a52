// The model repository: the versions of each model found under a directory on disk, which of them
// are loaded, and the atomic swap from one loaded version to the next. It knows nothing about what
// a model is; the service hands it a loader that turns a version directory into a Servable.
//
// Layout: `root/<model>/<version>/` where <model> matches [A-Za-z0-9_.-]+ without a leading '.',
// and <version> is a positive decimal integer without leading zeros, of at most 18 digits. Names
// starting with '.' (`root/.staging/`, `root/.trash-*`, `root/<model>/.highest_deleted_version`
// and its `.lock`) are the repository's own and are never served; files at the root (a README)
// are skipped; any other name that is not a valid model or version is ignored and logged once.
#ifndef COLLABSERVE_SERVER_REPOSITORY_MODEL_REPOSITORY_H_
#define COLLABSERVE_SERVER_REPOSITORY_MODEL_REPOSITORY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace collabserve::repository {

struct ServableId {
  std::string model;
  int64_t version = 0;

  std::string DebugString() const;  // "model:version"
  bool operator==(const ServableId& o) const { return model == o.model && version == o.version; }
  bool operator<(const ServableId& o) const {
    return model != o.model ? model < o.model : version < o.version;
  }
};

// A loaded, warmed-up model version. The service subclasses it (engine, batch scheduler, metric
// labels). The repository holds one shared_ptr while the version is served; callers of Get() hold
// theirs for as long as a request is in flight, so unloading never breaks an in-flight request:
// the destructor runs when the last holder lets go, on that holder's thread.
class Servable {
 public:
  virtual ~Servable() = default;
};

// Loads the version directory `path` (== root/<id.model>/<id.version>). Returns the loaded
// servable, or an error that names what is wrong; it is logged and shown by List(). May be called
// from several threads at once (RepositoryOptions::num_load_threads) and never with the
// repository's lock held. An exception thrown by the loader is caught and recorded as INTERNAL.
using ServableLoader =
    std::function<absl::StatusOr<std::shared_ptr<Servable>>(const ServableId& id,
                                                            const std::string& path)>;

// The `reason` label under which a failed load is counted in
// collabserve_repository_load_failures_total{model,reason}: the error's status code in snake case
// ("invalid_argument" for a corrupt or inconsistent checkpoint, "not_found" for a missing file,
// "internal", ...). Every failed load attempt counts once; a failed version is retried (and can
// count again) only after its directory changes.
std::string LoadFailureReason(const absl::Status& status);

// What happened to a version; passed to RepositoryOptions::on_event.
enum class VersionEvent { kLoading, kAvailable, kLoadFailed, kUnloaded };
const char* VersionEventName(VersionEvent event);  // "loading", "available", ...

struct RepositoryOptions {
  // The directory that holds one directory per model. Must exist.
  std::string root;
  // The newest N (by version number) loadable versions of each model are served; older ones are
  // unloaded once the newer ones are available. Versions pinned with LoadVersion() come on top.
  int versions_to_keep = 1;
  // How often a background thread calls Poll(). Zero: only at Create() and on explicit Poll().
  absl::Duration poll_interval = absl::ZeroDuration();
  // How many versions load in parallel within one Poll(): those of models that unload nothing
  // meanwhile (a start, a new model, a pin), and those of the one model swapping at a time.
  int num_load_threads = 1;
  // A version directory that may still be being written is "settling": the policy ignores it
  // (what is served keeps serving) until it has stopped changing, so a version copied in file by
  // file is not loaded half-copied, or without an optional file that arrives last. A version
  // that appears or changes while the repository runs settles once two scans this far apart
  // (by this process's clock) found its entries' names, sizes, mtimes and ctimes unchanged; one
  // found by the first scan also settles once its newest ctime (its own or any entry's) is this
  // old, so that a start does not wait for what was already on disk. The poller scans again when
  // a version is due, not only every poll_interval, and Create() waits for the versions it found
  // settling that the policy would load (at most a minute, or three settle times if longer).
  // Publish() and LoadVersion() declare a directory complete: no wait. Zero: off.
  absl::Duration settle_time = absl::ZeroDuration();
  // Called after a version starts loading, becomes available, fails to load or is unloaded
  // (health, metrics). The status is the load error for kLoadFailed, OK otherwise. Called without
  // the repository's lock held, from the thread doing the change, one call at a time and in order;
  // it may call List()/Get()/AllLoaded() but not the admin methods (they would deadlock).
  std::function<void(const ServableId& id, VersionEvent event, const absl::Status& status)>
      on_event;
};

// Thread-safe: all methods may be called concurrently. Get(), List(), AllLoaded() and root() never
// wait for a load. Poll() and the admin methods (LoadVersion, UnloadVersion, DeleteVersion,
// Publish) run one at a time; each blocks until the loads it started have finished.
//
// Every change of the served set goes the same way: the versions the policy now wants are loaded
// without the lock (the versions already served keep serving), then installed under the lock, and
// only then are the versions no longer wanted unloaded. So a Get() that races with a swap returns
// either the old or the new version, never an error, as long as one of them loads.
class ModelRepository {
 public:
  struct VersionStatus {
    enum class State {
      kLoading,    // the loader is running
      kAvailable,  // served by Get()
      kFailed,     // the last load failed (`error`); retried when the directory changes
      kUnloaded,   // on disk but not served: older than the newest N, replaced, or unloaded
    };
    int64_t version = 0;
    State state = State::kUnloaded;
    absl::Status error;  // why the last load failed (also a failed reload of a served version)
    std::string path;
    absl::Time since;     // when the version entered `state`
    bool pinned = false;  // loaded with LoadVersion(): served regardless of versions_to_keep
    bool disabled = false;  // unloaded with UnloadVersion(): not loaded again until LoadVersion()
    // Not loaded and changed within RepositoryOptions::settle_time: ignored until it settles.
    bool settling = false;
  };

  // Checks the options, removes crash leftovers (CleanLeftovers), scans `root` and loads every
  // model's newest versions before returning (a version that fails to load is logged, recorded as
  // kFailed and skipped: the next older version serves instead), waiting first for versions still
  // being written (RepositoryOptions::settle_time). Starts polling when options.poll_interval > 0.
  // Errors: INVALID_ARGUMENT for bad options or a null loader; NOT_FOUND / FAILED_PRECONDITION
  // when the root is missing, not a directory or unreadable.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Create(RepositoryOptions options,
                                                                 ServableLoader loader);

  // Stops polling and waits for the loads in progress. Servables still held by callers live on.
  ~ModelRepository();

  ModelRepository(const ModelRepository&) = delete;
  ModelRepository& operator=(const ModelRepository&) = delete;

  // One scan of the root: loads new versions the policy wants, installs them atomically, then
  // unloads versions that are surplus or whose directory is gone. A version that failed to load
  // is retried only once its directory changed (the names, sizes, mtimes or ctimes of its entries)
  // and settled. A loaded version's files are not watched: publish a new version, or
  // LoadVersion() to reload.
  // Returns an error only if the root cannot be read (nothing is unloaded then).
  absl::Status Poll();

  // Starts / stops the background poller (no-op when poll_interval is zero or it is already in
  // the requested state). StopPolling() wakes the poller at once and waits for a Poll() in progress.
  void StartPolling();
  void StopPolling();

  // The servable for `model` at `version`, or its newest available version if `version` is
  // unset. NOT_FOUND names the model and lists the available versions (or, for an unknown model,
  // the available models), and says why the asked-for version is not served if it is known.
  absl::StatusOr<std::shared_ptr<Servable>> Get(
      std::string_view model, std::optional<int64_t> version = std::nullopt) const;

  // Every known model with its versions on disk (and any still served after their directory went
  // away), oldest version first.
  std::map<std::string, std::vector<VersionStatus>> List() const;
  // Whether List() would list `model`.
  bool Knows(std::string_view model) const;

  // True when no version is loading or settling: every discovered version is available, failed
  // or unloaded.
  bool AllLoaded() const;

  // Admin operations. All validate `id` (INVALID_ARGUMENT for a bad model name or version <= 0).

  // Loads (or reloads, swapping atomically) a version present on disk, even one older than
  // versions_to_keep would pick; it stays "pinned" until UnloadVersion/DeleteVersion. Clears a
  // previous UnloadVersion. Blocks until loaded. NOT_FOUND if the directory does not exist; the
  // loader's error if loading fails (a version already served then keeps serving).
  absl::Status LoadVersion(const ServableId& id);

  // Stops serving a version (it stays on disk) and keeps polling from loading it again until
  // LoadVersion(). Whatever the policy now picks instead is loaded first, so the model is not left
  // without a version while another one can serve. NOT_FOUND if the version is unknown.
  absl::Status UnloadVersion(const ServableId& id);

  // Unloads a version and removes its directory: renamed to root/.trash-<...> first (so a crash
  // never leaves half a version visible), then removed. Loads the replacement the policy picks
  // before the deleted version stops serving. Its number is recorded first (kDeletedVersionMark)
  // so NextVersion never gives it out again. NOT_FOUND if neither on disk nor known;
  // FAILED_PRECONDITION, with nothing removed, if the mark or the move fails.
  absl::Status DeleteVersion(const ServableId& id);

  // 1 + the highest version of `model` on disk, known, or ever removed by DeleteVersion (its mark,
  // below), 1 for a new model: NextVersion never gives a deleted number out again (a caller naming
  // its version explicitly may; a directory removed by hand leaves no mark). For uploads; two
  // concurrent uploads may get the same number, and the second Publish() then fails.
  int64_t NextVersion(std::string_view model) const;
  // root/<model>/ + this: the highest version number DeleteVersion has removed, in decimal; written
  // under an flock of the same name + ".lock" (which also removes the ".tmp.*" files of writes that
  // died over a minute before). One that holds no number is read as none, and logged once.
  static constexpr char kDeletedVersionMark[] = ".highest_deleted_version";

  const std::string& root() const { return options_.root; }

  // Moves a fully written directory `staging_dir` (on the same filesystem as the root, e.g.
  // root/.staging/<x>) to root/<id.model>/<id.version> with one rename(2), creating the model
  // directory if needed, so the version appears complete or not at all. With `load_now`, then
  // applies the policy to the model as Poll() would (the new version loads if it is among the
  // newest N) and returns its load error if it fails; otherwise the next Poll() picks it up.
  // ALREADY_EXISTS if that version exists (nothing is moved); NOT_FOUND if `staging_dir` is not a
  // directory; FAILED_PRECONDITION if it is on another filesystem.
  absl::Status Publish(const std::string& staging_dir, const ServableId& id, bool load_now);

  // Removes leftovers of a crashed process: entries of root/.staging/ and root/.trash-* whose
  // mtime is older than the start of this process. An entry X of root/.staging/ with a claim X.lock
  // (see kStagingClaimSuffix) goes with its claim only when, besides, no process holds the claim's
  // flock(2), and stays, whatever its age, while one does: replicas sharing the volume clean up
  // after one another without removing each other's uploads in progress. Called by Create().
  // Failures are logged; the error returned is the first one.
  absl::Status CleanLeftovers();
  // A process writing root/.staging/X holds an exclusive flock(2) on root/.staging/X + this for
  // as long as X is in use, takes it before creating X, and removes X before the claim.
  static constexpr char kStagingClaimSuffix[] = ".lock";
  // Claims staging directory `dir` (before creating it) for this process: `dir` +
  // kStagingClaimSuffix, created here (O_EXCL) and held with flock(2) until ReleaseStaging (the
  // kernel lets go if the process dies). Returns the lock's descriptor, or -1 (logged) when no
  // claim could be made: the directory is then judged by its age, as entries without a claim are.
  static int ClaimStaging(const std::string& dir);
  // Removes the claim of `dir` (after `dir` itself) and closes `lock`; nothing for lock < 0.
  static void ReleaseStaging(const std::string& dir, int lock);

  // The name rules above. Exposed for the upload path, which validates before writing anything.
  static absl::Status ValidateModelName(std::string_view model);
  static absl::Status ValidateId(const ServableId& id);

  static const char* StateName(VersionStatus::State state);  // "loading", "available", ...
  // StateName, or "settling" for a settling version that is not loading or available.
  static const char* StateName(const VersionStatus& status);
  // Every name StateName(const VersionStatus&) returns, in a fixed order.
  static const std::vector<const char*>& StateNames();

 private:
  using State = VersionStatus::State;

  // One version directory as found on disk.
  struct DiskVersion {
    std::string path;
    std::string fingerprint;  // names, types, sizes, mtimes and ctimes of it and its entries
    absl::Time last_change;   // the newest of those ctimes
  };
  using DiskModel = std::map<int64_t, DiskVersion>;
  struct DiskScan {
    std::map<std::string, DiskModel> models;
    std::set<std::string> unreadable;  // models whose directory could not be listed: left alone
  };

  struct Entry {
    State state = State::kUnloaded;
    absl::Status error;
    std::string path;
    absl::Time since;
    std::shared_ptr<Servable> servable;  // set iff state is kAvailable
    std::string fingerprint;             // as last scanned
    std::string failed_fingerprint;      // the fingerprint the last failed load saw
    absl::Time last_change;              // as last scanned
    absl::Time fingerprint_since;        // when this process first saw `fingerprint`
    bool trust_ctime = false;            // `fingerprint` was first seen by the first scan
    std::string complete_fingerprint;    // declared complete by Publish() or LoadVersion()
    bool settling = false;               // see RepositoryOptions::settle_time
    absl::Time settle_due;               // when it settles if unchanged (as of the last scan)
    bool on_disk = true;
    bool pinned = false;
    bool disabled = false;
  };
  using ModelEntry = std::map<int64_t, Entry>;

  struct Event {
    ServableId id;
    VersionEvent event;
    absl::Status status;
  };
  struct LoadJob {
    ServableId id;
    std::string path;
    std::string fingerprint;
  };
  struct LoadResult {
    LoadJob job;
    absl::StatusOr<std::shared_ptr<Servable>> servable;
  };

  ModelRepository(RepositoryOptions options, ServableLoader loader);

  absl::StatusOr<DiskScan> ScanRoot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Lists root/<model>. NOT_FOUND if it does not exist.
  absl::StatusOr<DiskModel> ScanModel(const std::string& model)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  void LogOnce(const std::string& path, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);

  // Records what `scan` saw for `models` (new versions, fingerprints, vanished directories).
  void ApplyScanLocked(const DiskScan& scan, const std::set<std::string>& models)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recomputes an entry's `settling` and `settle_due` from what its last scan saw; only after a
  // scan of its model (or a declaration of completeness), so that nothing settles unseen.
  void RefreshSettlingLocked(Entry* e, absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void RecomputeNextSettleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the poller look at NextSettle() again. Call without mu_ held.
  void WakePoller() ABSL_LOCKS_EXCLUDED(poll_mu_, mu_);
  // Scans `id.model` (as RescanAndReconcile would, without reconciling), declares version `id`
  // complete (no settling) and wakes the poller. NOT_FOUND naming the directory if the version
  // is not on disk, the scan's error if the model cannot be listed; nothing recorded then.
  absl::Status DeclareComplete(const ServableId& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // When the earliest settling version is due to settle (InfiniteFuture if none).
  absl::Time NextSettle() const;
  // The same, counting only the versions the policy would load once settled (what Create()
  // waits for: an old version being changed beside a newer one it would not load is not).
  absl::Time NextWantedSettle() const;
  // Scans one model and reconciles it (after an admin change).
  void RescanAndReconcile(const std::string& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // Loads what the policy wants for `models`, installs it, and unloads what each model no longer
  // wants as soon as that model's loads have settled. Models that replace a served version swap
  // one at a time (a poll that finds new versions of several models never holds all of them twice).
  void Reconcile(const std::set<std::string>& models) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_);
  // The versions of `model` that should be served; with `as_if_settled`, those that would be
  // if every settling version had settled.
  std::set<int64_t> DesiredLocked(const ModelEntry& model, bool as_if_settled = false) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Unloads `name`'s available versions not in `want`, and forgets those no longer on disk.
  void UnloadUnwantedLocked(const std::string& name, const std::set<int64_t>& want, absl::Time now,
                            std::vector<Event>* events, std::vector<std::shared_ptr<Servable>>* garbage)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InstallLocked(std::vector<LoadResult>* results, std::vector<Event>* events,
                     std::vector<std::shared_ptr<Servable>>* garbage)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::vector<LoadResult> RunLoads(std::vector<LoadJob> jobs) const;
  absl::StatusOr<std::shared_ptr<Servable>> LoadOne(const LoadJob& job) const;
  void FireEvents(std::vector<Event>* events) const;
  void PollLoop(int64_t generation);

  const RepositoryOptions options_;
  const ServableLoader loader_;

  // Serializes Poll() and the admin operations; held while loading (mu_ is not).
  mutable absl::Mutex ops_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::set<std::string> logged_ ABSL_GUARDED_BY(ops_mu_);  // paths already warned about
  std::string last_poll_error_ ABSL_GUARDED_BY(ops_mu_);

  // Guards the served set; held only for short, non-blocking sections.
  mutable absl::Mutex mu_;
  std::map<std::string, ModelEntry, std::less<>> models_ ABSL_GUARDED_BY(mu_);
  absl::Time next_settle_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool first_scan_done_ ABSL_GUARDED_BY(mu_) = false;

  // The poller.
  absl::Mutex poll_mu_;
  // Bumped by StopPolling(); a poller thread exits once it differs from the one it started with.
  int64_t poll_generation_ ABSL_GUARDED_BY(poll_mu_) = 0;
  int64_t poll_wakeups_ ABSL_GUARDED_BY(poll_mu_) = 0;  // bumped by WakePoller()
  absl::CondVar poll_cv_;  // signalled when poll_generation_ or poll_wakeups_ changes
  std::thread poller_ ABSL_GUARDED_BY(poll_mu_);
};

}  // namespace collabserve::repository

#endif  // COLLABSERVE_SERVER_REPOSITORY_MODEL_REPOSITORY_H_
