#include "server/repository/model_repository.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "glog/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics.h"

namespace collabserve::repository {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::Pair;
using State = ModelRepository::VersionStatus::State;

// Counts the log messages that contain `text` while it is registered.
class CountingLogSink : public google::LogSink {
 public:
  explicit CountingLogSink(std::string text) : text_(std::move(text)) { google::AddLogSink(this); }
  ~CountingLogSink() override { google::RemoveLogSink(this); }
  using google::LogSink::send;
  void send(google::LogSeverity, const char*, const char*, int, const google::LogMessageTime&, const char* message,
            size_t length) override {
    if (std::string(message, length).find(text_) != std::string::npos) count_.fetch_add(1);
  }
  int count() const { return count_.load(); }

 private:
  const std::string text_;
  std::atomic<int> count_{0};
};

// What the fake loader hands out: remembers which version it is and counts its destruction.
class FakeServable : public Servable {
 public:
  FakeServable(ServableId id, std::string path, std::atomic<int>* destroyed)
      : id(std::move(id)), path(std::move(path)), destroyed_(destroyed) {}
  ~FakeServable() override { destroyed_->fetch_add(1); }
  const ServableId id;
  const std::string path;

 private:
  std::atomic<int>* destroyed_;
};

int64_t VersionOf(const std::shared_ptr<Servable>& s) {
  auto* fake = dynamic_cast<FakeServable*>(s.get());
  return fake == nullptr ? -1 : fake->id.version;
}

// Counts loads; fails a version whose directory holds a file named "broken"; can block one
// version's load until a gate opens.
class FakeLoader {
 public:
  ServableLoader AsLoader() {
    return [this](const ServableId& id, const std::string& path) { return Load(id, path); };
  }

  absl::StatusOr<std::shared_ptr<Servable>> Load(const ServableId& id, const std::string& path) {
    absl::Notification* started = nullptr;
    absl::Notification* gate = nullptr;
    {
      absl::MutexLock l(&mu_);
      ++loads_[id.DebugString()];
      auto it = blocked_.find(id.DebugString());
      if (it != blocked_.end()) {
        std::tie(started, gate) = it->second;
        blocked_.erase(it);
      }
    }
    if (started != nullptr) {
      started->Notify();
      gate->WaitForNotification();
    }
    {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(path)) files.push_back(e.path().filename());
      std::sort(files.begin(), files.end());
      absl::MutexLock l(&mu_);
      files_[id.DebugString()] = std::move(files);
    }
    if (fs::exists(fs::path(path) / "broken")) {
      return absl::DataLossError("config.json: unexpected end of input");
    }
    if (fs::exists(fs::path(path) / "throw")) throw std::runtime_error("bad_alloc in warm-up");
    {
      absl::MutexLock l(&mu_);
      live_at_load_[id.DebugString()] = created - destroyed.load();
      ++created;
    }
    return std::make_shared<FakeServable>(id, path, &destroyed);
  }

  // How many servables were alive when `id` was last loaded (the new one not counted).
  int live_at_load(const std::string& model, int64_t version) {
    absl::MutexLock l(&mu_);
    return live_at_load_[absl::StrCat(model, ":", version)];
  }

  // The next load of `id` notifies `started`, then waits for `gate`.
  void Block(const ServableId& id, absl::Notification* started, absl::Notification* gate) {
    absl::MutexLock l(&mu_);
    blocked_[id.DebugString()] = {started, gate};
  }

  int loads(const std::string& model, int64_t version) {
    absl::MutexLock l(&mu_);
    return loads_[absl::StrCat(model, ":", version)];
  }

  // The names in the version's directory when it last loaded.
  std::vector<std::string> files_at_load(const std::string& model, int64_t version) {
    absl::MutexLock l(&mu_);
    return files_[absl::StrCat(model, ":", version)];
  }

  std::atomic<int> destroyed{0};

 private:
  absl::Mutex mu_;
  std::map<std::string, int> loads_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<std::string>> files_ ABSL_GUARDED_BY(mu_);
  int created ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> live_at_load_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::pair<absl::Notification*, absl::Notification*>> blocked_
      ABSL_GUARDED_BY(mu_);
};

class ModelRepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = (fs::path(::testing::TempDir()) /
             absl::StrCat("repo_", info->name(), "_", ::getpid()))
                .string();
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    repo_.reset();
    fs::remove_all(root_);
  }

  std::string VersionDir(const std::string& model, int64_t version) {
    return (fs::path(root_) / model / std::to_string(version)).string();
  }
  std::string MakeVersion(const std::string& model, int64_t version, bool broken = false) {
    const std::string dir = VersionDir(model, version);
    fs::create_directories(dir);
    std::ofstream(fs::path(dir) / "config.json") << "{\"hidden_size\": 8}";
    if (broken) std::ofstream(fs::path(dir) / "broken") << "";
    return dir;
  }

  RepositoryOptions Options(int keep = 1) {
    RepositoryOptions o;
    o.root = root_;
    o.versions_to_keep = keep;
    o.on_event = [this](const ServableId& id, VersionEvent event, const absl::Status& s) {
      absl::MutexLock l(&events_mu_);
      events_.push_back(absl::StrCat(id.DebugString(), " ", VersionEventName(event)));
    };
    return o;
  }
  void Open(RepositoryOptions options) {
    auto repo = ModelRepository::Create(std::move(options), loader_.AsLoader());
    ASSERT_TRUE(repo.ok()) << repo.status();
    repo_ = *std::move(repo);
  }
  void Open(int keep = 1) { Open(Options(keep)); }

  int64_t Served(const std::string& model, std::optional<int64_t> version = std::nullopt) {
    auto s = repo_->Get(model, version);
    return s.ok() ? VersionOf(*s) : -1;
  }
  // model -> "version:state" for every known version.
  std::map<std::string, std::vector<std::string>> States() {
    std::map<std::string, std::vector<std::string>> out;
    for (const auto& [model, versions] : repo_->List()) {
      for (const auto& v : versions) {
        out[model].push_back(absl::StrCat(v.version, ":", ModelRepository::StateName(v)));
      }
    }
    return out;
  }
  std::vector<std::string> TakeEvents() {
    absl::MutexLock l(&events_mu_);
    return std::exchange(events_, {});
  }

  std::string root_;
  FakeLoader loader_;
  std::unique_ptr<ModelRepository> repo_;
  absl::Mutex events_mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(events_mu_);
};

// The /metrics gauge exports one series per name in StateNames(), so every name a version can
// be listed under must be there, once.
TEST(ModelRepositoryStateNames, ListEveryNameAVersionCanHaveOnce) {
  std::vector<std::string> names(ModelRepository::StateNames().begin(),
                                 ModelRepository::StateNames().end());
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("available", "loading", "settling", "failed",
                                                    "unloaded"));
  for (State state : {State::kLoading, State::kAvailable, State::kFailed, State::kUnloaded}) {
    for (bool settling : {false, true}) {
      ModelRepository::VersionStatus status;
      status.state = state;
      status.settling = settling;
      EXPECT_THAT(names, ::testing::Contains(std::string(ModelRepository::StateName(status))));
    }
  }
}

TEST_F(ModelRepositoryTest, DiscoversModelsAndServesTheNewestVersion) {
  MakeVersion("sst2", 1);
  MakeVersion("sst2", 2);
  MakeVersion("imdb", 7);
  Open();
  EXPECT_EQ(Served("sst2"), 2);
  EXPECT_EQ(Served("imdb"), 7);
  EXPECT_EQ(Served("imdb", 7), 7);
  EXPECT_THAT(States()["sst2"], ElementsAre("1:unloaded", "2:available"));
  EXPECT_THAT(States()["imdb"], ElementsAre("7:available"));
  EXPECT_EQ(loader_.loads("sst2", 1), 0);
  EXPECT_TRUE(repo_->AllLoaded());
  auto s = repo_->Get("sst2");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(dynamic_cast<FakeServable*>(s->get())->path, VersionDir("sst2", 2));
  EXPECT_EQ(repo_->List()["sst2"][1].path, VersionDir("sst2", 2));
}

TEST_F(ModelRepositoryTest, IgnoresDotDirectoriesAndNonIntegerVersions) {
  MakeVersion("sst2", 3);
  fs::create_directories(fs::path(root_) / ".staging" / "upload-1" / "1");
  fs::create_directories(fs::path(root_) / ".hidden" / "1");
  fs::create_directories(fs::path(root_) / "sst2" / ".partial");
  fs::create_directories(fs::path(root_) / "sst2" / "latest");
  fs::create_directories(fs::path(root_) / "sst2" / "007");
  fs::create_directories(fs::path(root_) / "sst2" / "0");
  fs::create_directories(fs::path(root_) / "sst2" / "-4");
  fs::create_directories(fs::path(root_) / "sst2" / "99999999999999999999999");
  std::ofstream(fs::path(root_) / "sst2" / "12") << "a file, not a directory";
  std::ofstream(fs::path(root_) / "README") << "not a model";
  fs::create_directories(fs::path(root_) / "bad name" / "1");
  fs::create_directories(fs::path(root_) / "empty-model");
  Open();
  EXPECT_THAT(States(), ElementsAre(Pair("sst2", ElementsAre("3:available"))));
  EXPECT_EQ(Served("sst2"), 3);
  ASSERT_TRUE(repo_->Poll().ok());  // logged once; still ignored
  EXPECT_EQ(repo_->List().size(), 1u);
}

TEST_F(ModelRepositoryTest, ServesTheNewestNVersions) {
  for (int v = 1; v <= 4; ++v) MakeVersion("m", v);
  Open(/*keep=*/2);
  EXPECT_THAT(States()["m"], ElementsAre("1:unloaded", "2:unloaded", "3:available", "4:available"));
  EXPECT_EQ(Served("m"), 4);
  EXPECT_EQ(Served("m", 3), 3);
  EXPECT_EQ(Served("m", 2), -1);
  EXPECT_EQ(loader_.loads("m", 1) + loader_.loads("m", 2), 0);
}

TEST_F(ModelRepositoryTest, NewVersionIsServedAfterPollAndTheOldOneUnloaded) {
  MakeVersion("m", 1);
  Open();
  EXPECT_THAT(TakeEvents(), ElementsAre("m:1 loading", "m:1 available"));
  MakeVersion("m", 2);
  EXPECT_EQ(Served("m"), 1);  // not yet polled
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 2);
  EXPECT_THAT(States()["m"], ElementsAre("1:unloaded", "2:available"));
  EXPECT_THAT(TakeEvents(), ElementsAre("m:2 loading", "m:2 available", "m:1 unloaded"));
  EXPECT_EQ(loader_.destroyed.load(), 1);
  // A second poll changes nothing.
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(loader_.loads("m", 2), 1);
  EXPECT_THAT(TakeEvents(), IsEmpty());
}

// A poll that finds new versions of several served models swaps them one at a time: each old
// version goes as soon as its replacement serves, so memory holds one model twice, not all of them
// (it held every old and new version until the last load ended).
TEST_F(ModelRepositoryTest, ModelsSwapOneAtATimeAndUnloadAsSoonAsTheirReplacementServes) {
  for (const char* m : {"a", "b", "c"}) MakeVersion(m, 1);
  Open();
  for (const char* m : {"a", "b", "c"}) MakeVersion(m, 2);
  TakeEvents();
  ASSERT_TRUE(repo_->Poll().ok());
  for (const char* m : {"a", "b", "c"}) EXPECT_EQ(Served(m), 2) << m;
  // Each swap loads beside the two other models and nothing else (it was 3, 4, 5).
  for (const char* m : {"a", "b", "c"}) EXPECT_EQ(loader_.live_at_load(m, 2), 3) << m;
  EXPECT_EQ(loader_.destroyed.load(), 3);
  std::vector<std::string> events = TakeEvents();
  const auto at = [&](const std::string& e) {
    return static_cast<size_t>(std::find(events.begin(), events.end(), e) - events.begin());
  };
  EXPECT_LT(at("a:1 unloaded"), at("b:2 loading"));
  EXPECT_LT(at("b:1 unloaded"), at("c:2 loading"));

  // Models with nothing to replace load beside the first swap, in parallel.
  RepositoryOptions o = Options();
  o.num_load_threads = 3;
  Open(o);
  MakeVersion("a", 3);
  MakeVersion("b", 3);
  MakeVersion("fresh", 1);
  MakeVersion("fresh2", 1);
  TakeEvents();
  ASSERT_TRUE(repo_->Poll().ok());
  events = TakeEvents();
  EXPECT_LT(at("fresh:1 loading"), at("a:3 available"));
  EXPECT_LT(at("fresh2:1 loading"), at("a:3 available"));
  EXPECT_LT(at("a:2 unloaded"), at("b:3 loading"));
  EXPECT_LT(at("b:3 available"), events.size());
  EXPECT_EQ(Served("fresh"), 1);
  EXPECT_EQ(Served("fresh2"), 1);

  // A swap whose new version fails keeps its old one serving, and the next model's swap follows.
  MakeVersion("a", 4, /*broken=*/true);
  MakeVersion("b", 4);
  TakeEvents();
  ASSERT_TRUE(repo_->Poll().ok());
  events = TakeEvents();
  EXPECT_LT(at("a:4 load_failed"), at("b:4 loading"));
  EXPECT_EQ(at("a:3 unloaded"), events.size());  // never
  EXPECT_EQ(Served("a"), 3);
  EXPECT_EQ(Served("b"), 4);
}

TEST_F(ModelRepositoryTest, RemovedVersionIsUnloadedAndTheNextNewestServes) {
  MakeVersion("m", 1);
  MakeVersion("m", 2);
  Open();
  EXPECT_EQ(Served("m"), 2);
  fs::remove_all(VersionDir("m", 2));
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 1);
  EXPECT_THAT(States()["m"], ElementsAre("1:available"));
  TakeEvents();
  // The whole model directory goes: the model is gone.
  fs::remove_all(fs::path(root_) / "m");
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(repo_->List(), IsEmpty());
  EXPECT_EQ(repo_->Get("m").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(TakeEvents(), ElementsAre("m:1 unloaded"));
}

TEST_F(ModelRepositoryTest, FailingVersionIsSkippedAndRetriedOnlyWhenItsDirectoryChanges) {
  MakeVersion("m", 1);
  MakeVersion("m", 2, /*broken=*/true);
  Open();
  EXPECT_EQ(Served("m"), 1);
  auto list = repo_->List();
  ASSERT_EQ(list["m"].size(), 2u);
  EXPECT_EQ(list["m"][1].state, State::kFailed);
  EXPECT_THAT(list["m"][1].error.message(), HasSubstr("config.json: unexpected end of input"));
  EXPECT_THAT(list["m"][1].error.message(), HasSubstr(VersionDir("m", 2)));
  EXPECT_EQ(list["m"][1].error.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(repo_->AllLoaded());
  EXPECT_THAT(repo_->Get("m", 2).status().message(), HasSubstr("failed to load"));
  EXPECT_EQ(loader_.loads("m", 2), 1);

  ASSERT_TRUE(repo_->Poll().ok());
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(loader_.loads("m", 2), 1);  // unchanged directory: not retried
  EXPECT_EQ(Served("m"), 1);

  fs::remove(fs::path(VersionDir("m", 2)) / "broken");  // fixed
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(loader_.loads("m", 2), 2);
  EXPECT_EQ(Served("m"), 2);
  EXPECT_THAT(States()["m"], ElementsAre("1:unloaded", "2:available"));
}

// The value of collabserve_repository_load_failures_total{model,reason} (0 if absent). The
// family is process-wide, so tests compare before and after.
double LoadFailures(const std::string& model, const std::string& reason) {
  metrics::Metrics m("test", "test");
  const std::string text = m.TextFormat();
  const std::string series = absl::StrCat("collabserve_repository_load_failures_total{model=\"",
                                          model, "\",reason=\"", reason, "\"} ");
  const size_t at = text.find(series);
  return at == std::string::npos ? 0 : std::stod(text.substr(at + series.size()));
}

TEST_F(ModelRepositoryTest, EachFailedLoadIsCountedByModelAndReason) {
  EXPECT_EQ(LoadFailureReason(absl::DataLossError("x")), "data_loss");
  EXPECT_EQ(LoadFailureReason(absl::InvalidArgumentError("x")), "invalid_argument");
  EXPECT_EQ(LoadFailureReason(absl::NotFoundError("x")), "not_found");
  const double before = LoadFailures("counted", "data_loss");
  const double other_before = LoadFailures("other", "data_loss");
  MakeVersion("counted", 1);
  MakeVersion("counted", 2, /*broken=*/true);
  MakeVersion("other", 1);
  Open();
  EXPECT_EQ(Served("counted"), 1);
  EXPECT_EQ(LoadFailures("counted", "data_loss"), before + 1);
  ASSERT_TRUE(repo_->Poll().ok());  // unchanged: not retried, not counted again
  EXPECT_EQ(LoadFailures("counted", "data_loss"), before + 1);
  std::ofstream(fs::path(VersionDir("counted", 2)) / "still-broken") << "x";  // changed, still bad
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(LoadFailures("counted", "data_loss"), before + 2);
  EXPECT_EQ(LoadFailures("other", "data_loss"), other_before);
  fs::remove(fs::path(VersionDir("counted", 2)) / "broken");  // fixed
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("counted"), 2);
  EXPECT_EQ(LoadFailures("counted", "data_loss"), before + 2);
}

TEST_F(ModelRepositoryTest, FailedNewestVersionWhileOlderWasUnloadedLoadsTheOlder) {
  MakeVersion("m", 1);
  Open();
  MakeVersion("m", 2);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 2);
  // v2 disappears and v3 arrives broken: v1 must come back.
  fs::remove_all(VersionDir("m", 2));
  MakeVersion("m", 3, /*broken=*/true);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 1);
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "3:failed"));
}

TEST_F(ModelRepositoryTest, LoaderExceptionsAndNullServablesAreRecordedAsFailures) {
  MakeVersion("m", 1);
  const std::string v2 = MakeVersion("m", 2);
  std::ofstream(fs::path(v2) / "throw") << "";
  Open();
  EXPECT_EQ(Served("m"), 1);
  auto list = repo_->List();
  EXPECT_EQ(list["m"][1].error.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(list["m"][1].error.message(), HasSubstr("bad_alloc in warm-up"));

  std::unique_ptr<ModelRepository> null_repo;
  auto r = ModelRepository::Create(Options(), [](const ServableId&, const std::string&) {
    return absl::StatusOr<std::shared_ptr<Servable>>(nullptr);
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT((*r)->Get("m").status().message(), HasSubstr("returned no servable"));
}

TEST_F(ModelRepositoryTest, GetDuringABlockedLoadReturnsTheOldVersion) {
  MakeVersion("m", 1);
  Open();
  MakeVersion("m", 2);
  absl::Notification started, gate;
  loader_.Block({"m", 2}, &started, &gate);
  std::thread poller([&] { EXPECT_TRUE(repo_->Poll().ok()); });
  started.WaitForNotification();
  EXPECT_EQ(Served("m"), 1);
  EXPECT_EQ(Served("m", 1), 1);
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:loading"));
  EXPECT_FALSE(repo_->AllLoaded());
  EXPECT_THAT(repo_->Get("m", 2).status().message(), HasSubstr("is loading"));
  gate.Notify();
  poller.join();
  EXPECT_EQ(Served("m"), 2);
  EXPECT_TRUE(repo_->AllLoaded());
}

TEST_F(ModelRepositoryTest, InFlightServableOutlivesItsUnload) {
  MakeVersion("m", 1);
  Open();
  std::shared_ptr<Servable> in_flight = *repo_->Get("m");
  MakeVersion("m", 2);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(States()["m"], ElementsAre("1:unloaded", "2:available"));
  EXPECT_EQ(loader_.destroyed.load(), 0);  // still held by the request
  EXPECT_EQ(VersionOf(in_flight), 1);
  in_flight.reset();
  EXPECT_EQ(loader_.destroyed.load(), 1);
}

TEST_F(ModelRepositoryTest, NotFoundMessagesNameTheModelAndWhatIsAvailable) {
  MakeVersion("sst2", 1);
  MakeVersion("sst2", 2);
  MakeVersion("imdb", 1);
  Open(/*keep=*/2);
  absl::Status s = repo_->Get("qnli").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model \"qnli\" not found"));
  EXPECT_THAT(s.message(), HasSubstr("available models: imdb, sst2"));

  s = repo_->Get("sst2", 9).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("version 9 of model \"sst2\""));
  EXPECT_THAT(s.message(), HasSubstr("no such version"));
  EXPECT_THAT(s.message(), HasSubstr("available versions: 1, 2"));

  MakeVersion("sst2", 3);
  ASSERT_TRUE(repo_->Poll().ok());
  s = repo_->Get("sst2", 1).status();
  EXPECT_THAT(s.message(), HasSubstr("version 1 is not loaded (only the newest 2 are served)"));
  EXPECT_THAT(s.message(), HasSubstr("available versions: 2, 3"));

  fs::remove_all(fs::path(root_) / "imdb");
  fs::remove_all(fs::path(root_) / "sst2");
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(repo_->Get("imdb").status().message(), HasSubstr("no model is available"));
}

TEST_F(ModelRepositoryTest, ModelWithOnlyFailedVersionsSaysWhy) {
  MakeVersion("m", 1, /*broken=*/true);
  Open();
  absl::Status s = repo_->Get("m").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model \"m\" has no available version"));
  EXPECT_THAT(s.message(), HasSubstr("(version 1 failed to load: loading m:1 from "));
  // Said once: not again as "; no version is available".
  EXPECT_THAT(s.message(), Not(HasSubstr("no version is available")));
  s = repo_->Get("m", 1).status();
  EXPECT_THAT(s.message(), HasSubstr("version 1 of model \"m\" is not available (version 1 failed"));
  EXPECT_THAT(s.message(), HasSubstr("; no version is available"));
}

TEST_F(ModelRepositoryTest, LoadVersionPinsAnOlderVersionUntilUnloaded) {
  MakeVersion("m", 1);
  MakeVersion("m", 2);
  Open();
  EXPECT_EQ(Served("m", 1), -1);
  ASSERT_TRUE(repo_->LoadVersion({"m", 1}).ok());
  EXPECT_EQ(Served("m", 1), 1);
  EXPECT_EQ(Served("m"), 2);  // the newest stays the default
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m", 1), 1);  // pinned: polling keeps it
  EXPECT_TRUE(repo_->List()["m"][0].pinned);

  ASSERT_TRUE(repo_->UnloadVersion({"m", 1}).ok());
  EXPECT_EQ(Served("m", 1), -1);
  EXPECT_THAT(repo_->Get("m", 1).status().message(), HasSubstr("unloaded by an admin"));
  EXPECT_EQ(Served("m"), 2);

  EXPECT_EQ(repo_->LoadVersion({"m", 5}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(repo_->LoadVersion({"m", 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(repo_->LoadVersion({"../etc", 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(repo_->UnloadVersion({"m", 5}).code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelRepositoryTest, LoadVersionReloadsAServedVersionAndReportsFailures) {
  MakeVersion("m", 1);
  Open();
  std::shared_ptr<Servable> before = *repo_->Get("m");
  ASSERT_TRUE(repo_->LoadVersion({"m", 1}).ok());
  std::shared_ptr<Servable> after = *repo_->Get("m");
  EXPECT_NE(before.get(), after.get());
  EXPECT_EQ(loader_.loads("m", 1), 2);

  // A failed reload keeps the loaded one serving and returns the loader's error.
  std::ofstream(fs::path(VersionDir("m", 1)) / "broken") << "";
  absl::Status s = repo_->LoadVersion({"m", 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("loading m:1"));
  EXPECT_EQ(repo_->Get("m")->get(), after.get());
}

TEST_F(ModelRepositoryTest, UnloadingTheNewestServesTheNextAndPollingDoesNotReloadIt) {
  MakeVersion("m", 1);
  MakeVersion("m", 2);
  Open();
  ASSERT_TRUE(repo_->UnloadVersion({"m", 2}).ok());
  EXPECT_EQ(Served("m"), 1);
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:unloaded"));
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(loader_.loads("m", 2), 1);
  EXPECT_EQ(Served("m"), 1);
  // Until LoadVersion.
  ASSERT_TRUE(repo_->LoadVersion({"m", 2}).ok());
  EXPECT_EQ(Served("m"), 2);
  EXPECT_THAT(States()["m"], ElementsAre("1:unloaded", "2:available"));
}

TEST_F(ModelRepositoryTest, DeleteVersionRemovesItFromDiskAndServesTheNext) {
  MakeVersion("m", 1);
  MakeVersion("m", 2);
  Open();
  std::shared_ptr<Servable> in_flight = *repo_->Get("m");
  ASSERT_TRUE(repo_->DeleteVersion({"m", 2}).ok());
  EXPECT_FALSE(fs::exists(VersionDir("m", 2)));
  EXPECT_EQ(Served("m"), 1);
  EXPECT_THAT(States()["m"], ElementsAre("1:available"));
  for (const auto& e : fs::directory_iterator(root_)) {
    EXPECT_NE(e.path().filename().string().rfind(".trash-", 0), 0u) << e.path();
  }
  EXPECT_EQ(VersionOf(in_flight), 2);  // still usable by the request that holds it

  ASSERT_TRUE(repo_->DeleteVersion({"m", 1}).ok());
  EXPECT_EQ(repo_->Get("m").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(repo_->DeleteVersion({"m", 1}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(repo_->DeleteVersion({"nope", 3}).code(), absl::StatusCode::kNotFound);
}

// A deleted version's number is never given out again, across restarts and when the model has no
// version left: a client pinned to "m:3", a cache keyed by it or a dashboard's history would
// otherwise meet another checkpoint under the same name. An explicit number may still reuse it.
TEST_F(ModelRepositoryTest, DeletedVersionNumbersAreNotGivenOutAgain) {
  MakeVersion("m", 1);
  MakeVersion("m", 2);
  MakeVersion("m", 3);
  Open();
  ASSERT_TRUE(repo_->DeleteVersion({"m", 3}).ok());
  EXPECT_EQ(repo_->NextVersion("m"), 4);
  ASSERT_TRUE(repo_->DeleteVersion({"m", 1}).ok());  // a lower one does not lower the mark
  EXPECT_EQ(repo_->NextVersion("m"), 4);
  ASSERT_TRUE(repo_->DeleteVersion({"m", 2}).ok());
  EXPECT_EQ(repo_->NextVersion("m"), 4);
  EXPECT_FALSE(repo_->Knows("m"));  // the mark alone is no model
  Open();                           // a restart reads the mark
  EXPECT_EQ(repo_->NextVersion("m"), 4);
  EXPECT_FALSE(repo_->Knows("m"));
  MakeVersion("m", 3);  // an operator (or an upload naming its version) may put one back
  Open();
  EXPECT_EQ(Served("m"), 3);
  EXPECT_EQ(repo_->NextVersion("m"), 4);

  // A mark that holds no number is read as none, and logged once for each content; the numbers
  // on disk still count.
  {
    CountingLogSink warnings("does not hold a version number");
    std::ofstream(fs::path(root_) / "m" / ModelRepository::kDeletedVersionMark) << "x\n";
    for (int i = 0; i < 3; ++i) EXPECT_EQ(repo_->NextVersion("m"), 4);
    EXPECT_EQ(warnings.count(), 1);
    std::ofstream(fs::path(root_) / "m" / ModelRepository::kDeletedVersionMark) << "y\n";
    for (int i = 0; i < 3; ++i) EXPECT_EQ(repo_->NextVersion("m"), 4);
    EXPECT_EQ(warnings.count(), 2);
  }
  // The next delete rewrites it, and removes what writes of it that died left behind (not one
  // that may be in flight).
  const fs::path stale = fs::path(root_) / "m" / absl::StrCat(ModelRepository::kDeletedVersionMark, ".tmp.1.2");
  const fs::path fresh = fs::path(root_) / "m" / absl::StrCat(ModelRepository::kDeletedVersionMark, ".tmp.3.4");
  std::ofstream(stale) << "9\n";
  std::ofstream(fresh) << "9\n";
  fs::last_write_time(stale, fs::file_time_type::clock::now() - std::chrono::hours(1));
  ASSERT_TRUE(repo_->DeleteVersion({"m", 3}).ok());
  EXPECT_EQ(repo_->NextVersion("m"), 4);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(fresh));
  fs::remove(fresh);

  // A known version whose directory went by hand is marked when it is deleted (it served).
  MakeVersion("gone", 7);
  Open();
  fs::remove_all(VersionDir("gone", 7));
  ASSERT_EQ(Served("gone"), 7);  // still served: the repository has not scanned since
  ASSERT_TRUE(repo_->DeleteVersion({"gone", 7}).ok());
  EXPECT_EQ(repo_->NextVersion("gone"), 8);
  fs::remove_all(fs::path(root_) / "gone");  // and where the model's directory went too
  MakeVersion("gone2", 4);
  Open();
  fs::remove_all(fs::path(root_) / "gone2");
  ASSERT_TRUE(repo_->DeleteVersion({"gone2", 4}).ok());
  EXPECT_EQ(repo_->NextVersion("gone2"), 5);
  EXPECT_FALSE(repo_->Knows("gone2"));

  // Where the mark cannot be written (here a directory is in its way), nothing is deleted.
  MakeVersion("ro", 1);
  fs::create_directories(fs::path(root_) / "ro" / ModelRepository::kDeletedVersionMark);
  Open();
  absl::Status s = repo_->DeleteVersion({"ro", 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("cannot record the deleted version number"));
  EXPECT_TRUE(fs::exists(VersionDir("ro", 1)));
  EXPECT_EQ(Served("ro"), 1);
}

TEST_F(ModelRepositoryTest, PublishMovesAStagingDirectoryAtomicallyAndLoadsIt) {
  MakeVersion("m", 1);
  MakeVersion("m", 2);
  Open();
  EXPECT_EQ(repo_->NextVersion("m"), 3);
  EXPECT_EQ(repo_->NextVersion("new-model"), 1);

  const fs::path staging = fs::path(root_) / ".staging" / "upload-a";
  fs::create_directories(staging);
  std::ofstream(staging / "config.json") << "{\"v\": 3}";
  ASSERT_TRUE(repo_->Publish(staging.string(), {"m", 3}, /*load_now=*/true).ok());
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_TRUE(fs::exists(fs::path(VersionDir("m", 3)) / "config.json"));
  EXPECT_EQ(Served("m"), 3);
  EXPECT_EQ(repo_->NextVersion("m"), 4);

  // An existing version is refused and nothing moves, even onto an empty directory.
  const fs::path second = fs::path(root_) / ".staging" / "upload-b";
  fs::create_directories(second);
  std::ofstream(second / "config.json") << "{\"v\": \"other\"}";
  absl::Status s = repo_->Publish(second.string(), {"m", 3}, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("version 3 of model \"m\""));
  EXPECT_TRUE(fs::exists(second / "config.json"));
  fs::create_directories(VersionDir("m", 9));
  EXPECT_EQ(repo_->Publish(second.string(), {"m", 9}, false).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(fs::is_empty(VersionDir("m", 9)));
  fs::remove(VersionDir("m", 9));

  // Without load_now the next poll picks it up; a new model directory is created.
  ASSERT_TRUE(repo_->Publish(second.string(), {"fresh", 1}, /*load_now=*/false).ok());
  EXPECT_EQ(Served("fresh"), -1);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("fresh"), 1);

  EXPECT_EQ(repo_->Publish((fs::path(root_) / ".staging" / "gone").string(), {"m", 5}, true).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(repo_->Publish(staging.string(), {".hidden", 1}, true).code(),
            absl::StatusCode::kInvalidArgument);
}

// A version copied in file by file must not load half-copied: one that changed within
// settle_time is ignored (what is served keeps serving) until it stops changing. Publish() and
// LoadVersion() declare a directory complete and skip the wait.
TEST_F(ModelRepositoryTest, AVersionStillChangingOnDiskIsIgnoredUntilItSettles) {
  RepositoryOptions o = Options();
  o.settle_time = absl::Hours(1);  // nothing written here settles while the test runs
  Open(o);
  MakeVersion("m", 1);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(States()["m"], ElementsAre("1:settling"));
  EXPECT_FALSE(repo_->AllLoaded());
  EXPECT_EQ(loader_.loads("m", 1), 0);
  auto got = repo_->Get("m");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(),
              HasSubstr("version 1 is still changing on disk (it loads once unchanged for 1h)"));

  ASSERT_TRUE(repo_->LoadVersion({"m", 1}).ok());
  EXPECT_EQ(Served("m"), 1);
  EXPECT_TRUE(repo_->AllLoaded());

  MakeVersion("m", 2);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:settling"));
  EXPECT_EQ(Served("m"), 1);
  EXPECT_THAT(repo_->Get("m", 2).status().message(), HasSubstr("still changing on disk"));
  EXPECT_EQ(loader_.loads("m", 2), 0);

  // Published: complete, unless it changes afterwards.
  for (int v : {3, 4}) {
    const fs::path staging = fs::path(root_) / ".staging" / absl::StrCat("upload-", v);
    fs::create_directories(staging);
    std::ofstream(staging / "config.json") << "{}";
    ASSERT_TRUE(repo_->Publish(staging.string(), {"m", v}, /*load_now=*/false).ok());
  }
  std::ofstream(fs::path(VersionDir("m", 4)) / "added-later") << "";
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 3);
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:settling", "3:available", "4:settling"));
}

// Create() waits for a version still being written when the process starts; the poller wakes
// when a version is due to settle instead of waiting out its interval.
TEST_F(ModelRepositoryTest, CreateAndThePollerWaitForAVersionToSettle) {
  MakeVersion("m", 1);
  absl::Notification v2_available;
  RepositoryOptions o = Options();
  o.settle_time = absl::Seconds(2);
  o.poll_interval = absl::Hours(1);
  o.on_event = [&](const ServableId& id, VersionEvent event, const absl::Status&) {
    if (id.version == 2 && event == VersionEvent::kAvailable) v2_available.Notify();
  };
  Open(o);
  EXPECT_EQ(Served("m"), 1);
  MakeVersion("m", 2);
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 1);
  // A file arriving late keeps it settling; the load sees it.
  std::ofstream(fs::path(VersionDir("m", 2)) / "tokenizer_config.json") << "{}";
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:settling"));
  ASSERT_TRUE(v2_available.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(Served("m"), 2);
  EXPECT_EQ(loader_.loads("m", 2), 1);
  EXPECT_THAT(loader_.files_at_load("m", 2), ElementsAre("config.json", "tokenizer_config.json"));

  o.settle_time = -absl::Seconds(1);
  EXPECT_EQ(ModelRepository::Create(o, loader_.AsLoader()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Create() waits only for settling versions the policy would load: an old version being changed
// beside a newer one does not hold up a start, a newer one being written does.
TEST_F(ModelRepositoryTest, CreateWaitsOnlyForSettlingVersionsThePolicyWouldLoad) {
  MakeVersion("m", 2);
  MakeVersion("n", 1);
  MakeVersion("f", 2, /*broken=*/true);
  RepositoryOptions o = Options();
  o.settle_time = absl::Seconds(3);
  absl::SleepFor(o.settle_time + absl::Milliseconds(300));  // settled by their ctimes
  MakeVersion("m", 1);
  Open(o);
  // Without a poller nothing is rescanned after Create(): had it waited, m:1 would have settled.
  EXPECT_THAT(States()["m"], ElementsAre("1:settling", "2:available"));
  EXPECT_EQ(Served("n"), 1);

  repo_.reset();
  MakeVersion("n", 2);
  Open(o);
  EXPECT_EQ(Served("n"), 2);
  EXPECT_EQ(loader_.loads("n", 2), 1);

  // A failed load can make a settling version the policy's choice while Create() runs.
  repo_.reset();
  MakeVersion("f", 1);  // f:2 fails to load
  Open(o);
  EXPECT_EQ(Served("f"), 1);
}

// A version that appears while the repository runs is not trusted by its ctimes (a filesystem
// whose clock is behind this one would make a copy in progress look old): two scans settle_time
// apart must find it unchanged. What the first scan found may settle by its ctimes.
TEST_F(ModelRepositoryTest, AVersionThatAppearsLaterMustBeSeenUnchangedForTheSettleTime) {
  MakeVersion("m", 1);
  absl::SleepFor(absl::Milliseconds(600));
  RepositoryOptions o = Options();
  o.settle_time = absl::Milliseconds(500);
  Open(o);
  EXPECT_EQ(Served("m"), 1);  // its ctimes are older than the settle time: loaded by Create()
  MakeVersion("m", 2);
  absl::SleepFor(absl::Milliseconds(600));  // its ctimes are as old now
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:settling"));
  absl::SleepFor(absl::Milliseconds(600));
  ASSERT_TRUE(repo_->Poll().ok());
  EXPECT_EQ(Served("m"), 2);
}

TEST_F(ModelRepositoryTest, PublishReturnsTheLoadErrorOfABrokenUpload) {
  MakeVersion("m", 1);
  Open();
  const fs::path staging = fs::path(root_) / ".staging" / "u";
  fs::create_directories(staging);
  std::ofstream(staging / "broken") << "";
  absl::Status s = repo_->Publish(staging.string(), {"m", 2}, /*load_now=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Served("m"), 1);
  EXPECT_THAT(States()["m"], ElementsAre("1:available", "2:failed"));
}

TEST_F(ModelRepositoryTest, CreateRemovesCrashLeftoversOlderThanTheProcess) {
  MakeVersion("m", 1);
  const fs::path old_upload = fs::path(root_) / ".staging" / "old-upload";
  const fs::path live_upload = fs::path(root_) / ".staging" / "live-upload";
  const fs::path old_trash = fs::path(root_) / ".trash-m-7-123-456";
  for (const auto& p : {old_upload, live_upload, old_trash}) {
    fs::create_directories(p);
    std::ofstream(p / "model.safetensors") << "partial";
  }
  const auto an_hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  fs::last_write_time(old_upload, an_hour_ago);
  fs::last_write_time(old_trash, an_hour_ago);
  Open();
  EXPECT_FALSE(fs::exists(old_upload));
  EXPECT_FALSE(fs::exists(old_trash));
  EXPECT_TRUE(fs::exists(live_upload / "model.safetensors"));  // may belong to a live upload
  EXPECT_EQ(Served("m"), 1);
}

// Replicas share the volume: a claimed staging entry (X.lock held with flock) is another
// process's upload in progress and stays, however old; one whose claim nobody holds and that is
// older than this process is a dead process's and goes with its claim. (Judged by age alone, a replica starting removed the
// uploads and compressions of the replicas already running.)
TEST_F(ModelRepositoryTest, CreateKeepsClaimedStagingAndRemovesWhatADeadOwnerClaimed) {
  MakeVersion("m", 1);
  const fs::path staging = fs::path(root_) / ".staging";
  const fs::path held = staging / "7-aaaaaa", dead = staging / "8-bbbbbb", fresh = staging / "9-cccccc";
  const auto an_hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (const auto& p : {held, dead, fresh}) {
    fs::create_directories(p / "upload");
    std::ofstream(p / "upload" / "model.safetensors") << "partial";
    std::ofstream(p.string() + ModelRepository::kStagingClaimSuffix) << "";
    if (p == fresh) continue;  // unheld but newer than this process: its age keeps it
    fs::last_write_time(p, an_hour_ago);
    fs::last_write_time(p.string() + ModelRepository::kStagingClaimSuffix, an_hour_ago);
  }
  // Another open file description: flock conflicts with it as with another process's.
  const int lock = ::open((held.string() + ModelRepository::kStagingClaimSuffix).c_str(), O_RDWR);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX | LOCK_NB), 0);
  Open();
  EXPECT_TRUE(fs::exists(held / "upload" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(held.string() + ModelRepository::kStagingClaimSuffix));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::exists(dead.string() + ModelRepository::kStagingClaimSuffix));
  EXPECT_TRUE(fs::exists(fresh / "upload" / "model.safetensors"));
  ::close(lock);
  EXPECT_EQ(Served("m"), 1);
}

TEST_F(ModelRepositoryTest, CreateRejectsBadOptionsAndAMissingRoot) {
  auto loader = loader_.AsLoader();
  RepositoryOptions o = Options();
  o.root = (fs::path(root_) / "missing").string();
  auto r = ModelRepository::Create(o, loader);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(o.root));

  std::ofstream(fs::path(root_) / "file") << "";
  o.root = (fs::path(root_) / "file").string();
  EXPECT_EQ(ModelRepository::Create(o, loader).status().code(),
            absl::StatusCode::kFailedPrecondition);

  o = Options();
  o.versions_to_keep = 0;
  EXPECT_EQ(ModelRepository::Create(o, loader).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = Options();
  o.num_load_threads = 0;
  EXPECT_EQ(ModelRepository::Create(o, loader).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ModelRepository::Create(Options(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelRepositoryTest, PollFailsWithoutUnloadingWhenTheRootDisappears) {
  MakeVersion("m", 1);
  Open();
  const std::string moved = root_ + ".moved";
  fs::rename(root_, moved);
  EXPECT_EQ(repo_->Poll().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Served("m"), 1);
  fs::rename(moved, root_);
  EXPECT_TRUE(repo_->Poll().ok());
}

TEST_F(ModelRepositoryTest, LoadsInParallelWithSeveralLoadThreads) {
  MakeVersion("a", 1);
  MakeVersion("b", 1);
  // Each load waits until the other one has started: only completes if both run at once.
  absl::Notification a_started, b_started;
  std::atomic<bool> both_ran{true};
  RepositoryOptions o = Options();
  o.num_load_threads = 2;
  auto r = ModelRepository::Create(
      o, [&](const ServableId& id,
             const std::string& path) -> absl::StatusOr<std::shared_ptr<Servable>> {
        (id.model == "a" ? a_started : b_started).Notify();
        if (!(id.model == "a" ? b_started : a_started)
                 .WaitForNotificationWithTimeout(absl::Seconds(30))) {
          both_ran = false;
        }
        return std::make_shared<FakeServable>(id, path, &loader_.destroyed);
      });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(both_ran);
  EXPECT_TRUE((*r)->Get("a").ok());
  EXPECT_TRUE((*r)->Get("b").ok());
}

TEST_F(ModelRepositoryTest, BackgroundPollerPicksUpNewVersionsAndStopsPromptly) {
  MakeVersion("m", 1);
  absl::Notification v2_available;
  RepositoryOptions o = Options();
  o.poll_interval = absl::Milliseconds(5);
  o.on_event = [&](const ServableId& id, VersionEvent event, const absl::Status&) {
    if (id.version == 2 && event == VersionEvent::kAvailable) v2_available.Notify();
  };
  Open(o);
  MakeVersion("m", 2);
  ASSERT_TRUE(v2_available.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(Served("m"), 2);
  repo_->StopPolling();
  repo_->StopPolling();  // idempotent
  repo_->StartPolling();

  // An hour-long interval: the destructor must wake the poller instead of waiting it out
  // (the test would time out otherwise).
  o.poll_interval = absl::Hours(1);
  o.on_event = nullptr;
  auto slow = ModelRepository::Create(o, loader_.AsLoader());
  ASSERT_TRUE(slow.ok());
  slow->reset();
}

// Many readers while the served version changes under them (polls, uploads, deletes): no Get ever
// fails, and each reader sees versions only move forward.
TEST_F(ModelRepositoryTest, ConcurrentGetsDuringRepeatedPollsNeverFail) {
  MakeVersion("m", 1);
  RepositoryOptions o = Options(/*keep=*/1);
  o.num_load_threads = 2;
  o.on_event = nullptr;
  Open(o);
  constexpr int kReaders = 6;
  constexpr int kVersions = 40;
  std::atomic<bool> done{false};
  std::atomic<int> failures{0}, regressions{0};
  std::atomic<int64_t> gets{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < kReaders; ++t) {
    readers.emplace_back([&, t] {
      int64_t last = 0;
      while (!done.load()) {
        auto s = (t % 2 == 0) ? repo_->Get("m") : repo_->Get("m", std::nullopt);
        if (!s.ok()) {
          ++failures;
          continue;
        }
        const int64_t v = VersionOf(*s);
        if (v < last) ++regressions;
        last = v;
        ++gets;
        if (t == 0) repo_->List();
        if (t == 1) repo_->AllLoaded();
      }
    });
  }
  for (int v = 2; v <= kVersions; ++v) {
    if (v % 2 == 0) {  // an upload
      const fs::path staging = fs::path(root_) / ".staging" / absl::StrCat("u", v);
      fs::create_directories(staging);
      std::ofstream(staging / "config.json") << "{}";
      ASSERT_TRUE(repo_->Publish(staging.string(), {"m", v}, /*load_now=*/true).ok());
    } else {  // a copy into the tree, found by polling
      MakeVersion("m", v);
    }
    if (v % 3 == 0) fs::remove_all(VersionDir("m", v - 2));  // old ones vanish as well
    if (v % 5 == 0) {
      ASSERT_TRUE(repo_->DeleteVersion({"m", v - 1}).ok());
    }
    ASSERT_TRUE(repo_->Poll().ok());
  }
  done = true;
  for (auto& t : readers) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(regressions.load(), 0);
  EXPECT_GT(gets.load(), 0);
  EXPECT_EQ(Served("m"), kVersions);
  for (int v = 1; v < kVersions; ++v) EXPECT_LE(loader_.loads("m", v), 1) << v;
}

}  // namespace
}  // namespace collabserve::repository
