// Faults (issue 7): build/bin/collabserve as a subprocess, killed with SIGKILL at the worst moments
// the admin tests do not cover (while a repository poll loads a just-dropped version; while a job
// publishes), run on a repository whose disk fills up during staging, and fed corrupt versions by
// hand. After each: no partial version is visible, every previous version still serves, temporary
// files are gone and the other models are unaffected. Outcomes are asserted, never timings.
// (tests/admin/admin_binary_test.cc covers kill -9 mid-upload, mid-compression and after publish.)
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"
#include "server/util/files.h"
#include "tests/admin/admin_test_util.h"
#include "tests/service/test_util.h"
#include "tests/testing/server_process.h"

namespace collabserve {
namespace {

namespace fs = std::filesystem;
using ::collabserve::testing::Authorize;
using ::collabserve::testing::Eventually;
using ::collabserve::testing::HeaderFor;
using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::ParseMetrics;
using ::collabserve::testing::ReadDir;
using ::collabserve::testing::ScrapeMetrics;
using ::collabserve::testing::ServerProcess;
using ::collabserve::testing::TempDir;
using ::collabserve::testing::Upload;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr char kToken[] = "faults-test-token";

void MakeModel(const std::string& dir, const std::string& preset, uint64_t seed) {
  model::MakeOptions o;
  o.preset = preset;
  o.seed = seed;
  absl::Status s = model::MakeCheckpoint(dir, o);
  ASSERT_TRUE(s.ok()) << s;
}

// Copies the regular files of `from` into a new directory `to`.
void CopyDir(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from)) {
    fs::copy_file(e.path(), fs::path(to) / e.path().filename());
  }
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;  // "2" before "10"
  });
  return out;
}

class FaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = repo_.path();
    ASSERT_TRUE(util::WriteFileAtomic(tmp_.path() + "/token", std::string(kToken) + "\n").ok());
  }
  void TearDown() override {
    server_.reset();
    if (mounted_) ::umount2(root_.c_str(), MNT_DETACH);
  }

  std::string log_path() const { return tmp_.path() + "/server.log"; }
  std::string Log() const { return util::ReadFile(log_path()).value_or(""); }

  // Starts collabserve on root_ with the admin API on its port; replaces server_.
  void Start(std::vector<std::string> extra = {}, const std::function<void()>& in_child = nullptr) {
    server_.reset();
    std::vector<std::string> args = {"--host=127.0.0.1", "--port=0", "--metrics_port=0",
                                     "--model_repository=" + root_,
                                     "--admin_token_file=" + tmp_.path() + "/token"};
    args.insert(args.end(), extra.begin(), extra.end());
    server_ = std::make_unique<ServerProcess>(args, log_path(), in_child);
    ASSERT_TRUE(server_->serving()) << Log();
  }
  void Kill() { server_->Kill(); }
  // The repository removes staging leftovers older than its process's start minus a 2 s margin
  // (younger ones may belong to another live process) and reads that start time with one second
  // of rounding; a real restart takes longer than this.
  void WaitOutRestartMargin() { absl::SleepFor(absl::Milliseconds(3500)); }

  std::unique_ptr<v1::Admin::Stub> AdminStub() {
    return v1::Admin::NewStub(grpc::CreateChannel(server_->address(),
                                                  grpc::InsecureChannelCredentials()));
  }
  std::unique_ptr<v1::Inference::Stub> InferenceStub() {
    return v1::Inference::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }
  // ListModels' state of `model` `version` ("" if not listed).
  std::string VersionState(const std::string& model, int64_t version) {
    v1::ListModelsResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = InferenceStub()->ListModels(&ctx, v1::ListModelsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    for (const auto& m : resp.models()) {
      for (const auto& v : m.version_status()) {
        if (m.name() == model && v.version() == version) return v.state();
      }
    }
    return "";
  }
  // How many tokens `model` `version` gives `text` (-1 on error).
  int NumTokens(const std::string& model, int64_t version, const std::string& text) {
    v1::TokenizeRequest req;
    req.set_model_name(model);
    req.set_model_version(version);
    req.add_inputs()->set_text(text);
    v1::TokenizeResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = InferenceStub()->Tokenize(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return s.ok() && resp.results_size() == 1 ? resp.results(0).input_ids_size() : -1;
  }
  // The version that answers a Classify for `model` (pinned to `version` if given), or -1.
  int64_t Served(const std::string& model, std::optional<int64_t> version = std::nullopt,
                 grpc::Status* status = nullptr) {
    auto stub = v1::Inference::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
    v1::ClassifyRequest req;
    req.set_model_name(model);
    if (version) req.set_model_version(*version);
    req.add_inputs()->set_text("still serving");
    v1::ClassifyResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    grpc::Status s = stub->Classify(&ctx, req, &resp);
    if (status != nullptr) *status = s;
    return s.ok() ? resp.model_version() : -1;
  }
  // Sum of collabserve_repository_load_failures_total over reasons for `model`; the reasons seen.
  double LoadFailures(const std::string& model, std::vector<std::string>* reasons = nullptr) {
    auto text = ScrapeMetrics(server_->metrics_port());
    if (!text.ok()) return -1;
    double total = 0;
    const std::string prefix = "collabserve_repository_load_failures_total{";
    for (const auto& [series, value] : ParseMetrics(*text)) {
      if (!absl::StartsWith(series, prefix)) continue;
      if (!absl::StrContains(series, absl::StrCat("model=\"", model, "\""))) continue;
      total += value;
      if (reasons != nullptr) reasons->push_back(series);
    }
    return total;
  }
  // Only an empty .staging may remain besides the models: no staging leftovers, no trash.
  void ExpectNoLeftovers() {
    EXPECT_TRUE(Entries(root_ + "/.staging").empty())
        << absl::StrJoin(Entries(root_ + "/.staging"), ", ") << "\n" << Log();
    for (const std::string& e : Entries(root_)) {
      EXPECT_FALSE(absl::StartsWith(e, ".trash")) << e;
    }
  }
  // Every version directory of `model` is complete: the files a checkpoint needs are there.
  void ExpectCompleteVersions(const std::string& model) {
    for (const std::string& v : Entries(root_ + "/" + model)) {
      for (const char* f : {"config.json", "vocab.txt", "model.safetensors"}) {
        EXPECT_TRUE(fs::exists(fs::path(root_) / model / v / f)) << model << "/" << v << "/" << f;
      }
    }
  }
  // Watches the job to its end; then its final record.
  v1::Job WaitForJob(v1::Admin::Stub* stub, const std::string& job_id) {
    testing::Watch(stub, kToken, job_id);
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::GetJobResponse resp;
    grpc::Status s = stub->GetJob(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.job();
  }
  // Whether the server process has `path` mapped (the checkpoint reader mmaps the weights).
  bool Maps(const std::string& path) {
    // (/proc files report size 0, so they are read as a stream rather than with util::ReadFile.)
    std::ifstream maps(absl::StrCat("/proc/", server_->pid(), "/maps"));
    std::string line;
    while (std::getline(maps, line)) {
      if (absl::EndsWith(line, path)) return true;
    }
    return false;
  }

  TempDir repo_, tmp_;
  std::string root_;
  bool mounted_ = false;
  std::unique_ptr<ServerProcess> server_;
};

// A version dropped into the repository by hand that cannot load is skipped with a logged error
// and counted in collabserve_repository_load_failures_total{model,reason}; the model's previous
// version keeps serving and other models are unaffected. Once fixed, it loads.
TEST_F(FaultsTest, CorruptVersionsDroppedByHandAreSkippedCountedAndFixable) {
  MakeTinyModel(root_ + "/tiny/1", 1);
  MakeTinyModel(root_ + "/other/1", 2);
  MakeTinyModel(tmp_.path() + "/good", 3);
  Start({"--poll_interval_s=0.1"});
  ASSERT_EQ(Served("tiny"), 1);

  struct Corruption {
    const char* what;
    std::function<void(const std::string& dir)> apply;
  };
  const std::vector<Corruption> corruptions = {
      {"truncated safetensors",
       [](const std::string& dir) { fs::resize_file(dir + "/model.safetensors", 4096); }},
      {"safetensors header that is not JSON",
       [](const std::string& dir) {
         std::string w = *util::ReadFile(dir + "/model.safetensors");
         std::fill(w.begin() + 8, w.begin() + 64, '}');
         ASSERT_TRUE(util::WriteFileAtomic(dir + "/model.safetensors", w).ok());
       }},
      {"config.json that is not JSON",
       [](const std::string& dir) {
         ASSERT_TRUE(util::WriteFileAtomic(dir + "/config.json", "{\"hidden_size\": 64,").ok());
       }},
      {"config.json with an impossible shape",
       [](const std::string& dir) {
         std::string c = *util::ReadFile(dir + "/config.json");
         const size_t at = c.find("\"hidden_size\":");
         ASSERT_NE(at, std::string::npos);
         const size_t value = c.find_first_of("0123456789", at);
         const size_t end = c.find_first_not_of("0123456789", value);
         c.replace(value, end - value, "65");  // not divisible by the number of heads
         ASSERT_TRUE(util::WriteFileAtomic(dir + "/config.json", c).ok());
       }},
      {"missing model.safetensors",
       [](const std::string& dir) { fs::remove(dir + "/model.safetensors"); }},
      {"missing vocab.txt", [](const std::string& dir) { fs::remove(dir + "/vocab.txt"); }},
  };
  int64_t version = 1;
  for (const Corruption& c : corruptions) {
    SCOPED_TRACE(c.what);
    ++version;
    const double before = LoadFailures("tiny");
    const std::string scratch = tmp_.path() + "/drop-" + std::to_string(version);
    CopyDir(tmp_.path() + "/good", scratch);
    c.apply(scratch);
    fs::rename(scratch, absl::StrCat(root_, "/tiny/", version));  // appears complete at once
    ASSERT_TRUE(Eventually([&] { return LoadFailures("tiny") >= before + 1; })) << Log();
    EXPECT_EQ(LoadFailures("tiny"), before + 1);
    EXPECT_EQ(Served("tiny"), 1);
    EXPECT_EQ(Served("other"), 1);
    EXPECT_THAT(Log(), HasSubstr(absl::StrCat("cannot load tiny:", version)));
    // Asking for the broken version says why it is not served.
    grpc::Status s;
    EXPECT_EQ(Served("tiny", version, &s), -1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("failed to load")) << s.error_message();
  }
  std::vector<std::string> reasons;
  EXPECT_EQ(LoadFailures("tiny", &reasons), static_cast<double>(corruptions.size()));
  RecordProperty("reasons", absl::StrJoin(reasons, " "));
  EXPECT_EQ(LoadFailures("other"), 0);

  // The newest broken version is repaired in place (each file replaced atomically): it loads.
  const std::string newest = absl::StrCat(root_, "/tiny/", version);
  ASSERT_TRUE(util::WriteFileAtomic(newest + "/vocab.txt",
                                    *util::ReadFile(tmp_.path() + "/good/vocab.txt"))
                  .ok());
  ASSERT_TRUE(Eventually([&] { return Served("tiny") == version; })) << Log();
  // An older broken version replaced by a good one (remove, then drop) loads too.
  fs::remove_all(root_ + "/tiny/2");
  CopyDir(tmp_.path() + "/good", tmp_.path() + "/drop-again");
  fs::rename(tmp_.path() + "/drop-again", root_ + "/tiny/2");
  Start({"--poll_interval_s=0.1", "--versions_to_keep=10"});  // a restart sees the same state
  EXPECT_EQ(Served("tiny", 2), 2);
  EXPECT_EQ(Served("tiny", version), version);
  EXPECT_EQ(Served("tiny", 1), 1);
  EXPECT_EQ(Served("other"), 1);
}

// A version copied into the repository file by file (cp, a sync sidecar) loads only once it has
// stopped changing (--version_settle_s): an optional file that arrives last is not missed, and the
// previous version serves meanwhile.
TEST_F(FaultsTest, AVersionCopiedFileByFileLoadsWithTheFileThatArrivesLast) {
  MakeTinyModel(root_ + "/tiny/1", 1);
  MakeTinyModel(tmp_.path() + "/short", 2);
  ASSERT_TRUE(util::WriteFileAtomic(tmp_.path() + "/short/tokenizer_config.json",
                                    "{\"do_lower_case\": true, \"model_max_length\": 6}")
                  .ok());
  Start({"--poll_interval_s=0.05", "--version_settle_s=5", "--versions_to_keep=2"});
  ASSERT_EQ(Served("tiny"), 1);
  const std::string target = root_ + "/tiny/2";
  fs::create_directories(target);
  for (const auto& e : fs::directory_iterator(tmp_.path() + "/short")) {
    if (e.path().filename() != "tokenizer_config.json") {
      fs::copy_file(e.path(), fs::path(target) / e.path().filename());
    }
  }
  absl::SleepFor(absl::Milliseconds(500));  // ten polls with a loadable version on disk
  EXPECT_EQ(Served("tiny"), 1);
  EXPECT_EQ(VersionState("tiny", 2), "settling");
  fs::copy_file(tmp_.path() + "/short/tokenizer_config.json", target + "/tokenizer_config.json");
  ASSERT_TRUE(Eventually([&] { return Served("tiny") == 2; })) << Log();
  EXPECT_EQ(VersionState("tiny", 2), "available");
  // Version 2 truncates at its model_max_length; version 1 at the default 512.
  EXPECT_EQ(NumTokens("tiny", 2, "one two three four five six seven eight"), 6);
  EXPECT_EQ(NumTokens("tiny", 1, "one two three four five six seven eight"), 10);
}

// kill -9 while a repository poll is loading a version just dropped in: after the restart the
// version loads (nothing was half-done), the previous versions serve, nothing is left behind.
TEST_F(FaultsTest, KillWhileAPollLoadsANewVersionThenRestart) {
  MakeTinyModel(root_ + "/tiny/1", 1);
  MakeModel(root_ + "/big/1", "mini", 1);
  MakeModel(tmp_.path() + "/big2", "mini", 2);
  Start({"--poll_interval_s=0.05", "--versions_to_keep=2"});
  ASSERT_EQ(Served("big"), 1);
  const std::string weights = root_ + "/big/2/model.safetensors";
  fs::rename(tmp_.path() + "/big2", root_ + "/big/2");
  // The loader maps the weights first; the engine, the batch scheduler and the warm-up follow.
  ASSERT_TRUE(Eventually([&] { return Maps(weights); })) << Log();
  Kill();
  EXPECT_EQ(Entries(root_ + "/big"), std::vector<std::string>({"1", "2"}));

  Start({"--poll_interval_s=0.05", "--versions_to_keep=2"});
  EXPECT_EQ(Served("big"), 2);
  EXPECT_EQ(Served("big", 1), 1);
  EXPECT_EQ(Served("tiny"), 1);
  ExpectCompleteVersions("big");
  ExpectNoLeftovers();
  EXPECT_EQ(LoadFailures("big"), 0);
}

// kill -9 the moment a compression job has written its output and measured its fidelity, i.e.
// inside Publish (the rename, then the load of the new version): after the restart the version is
// either absent or complete and serving, the source serves, and staging is clean.
TEST_F(FaultsTest, KillDuringPublishThenRestart) {
  MakeTinyModel(root_ + "/tiny/1", 1);
  MakeTinyModel(root_ + "/other/1", 2);
  Start({"--poll_interval_s=0", "--versions_to_keep=2"});
  {
    auto stub = AdminStub();
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::CompressModelRequest req;
    req.set_model_name("tiny");
    req.set_source_version(1);
    req.mutable_compression()->set_rank(16);
    req.set_activate(true);
    v1::CompressModelResponse resp;
    grpc::Status s = stub->CompressModel(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    grpc::ClientContext wctx;
    Authorize(&wctx, kToken);
    v1::WatchJobRequest wreq;
    wreq.set_job_id(resp.job_id());
    auto reader = stub->WatchJob(&wctx, wreq);
    v1::WatchJobResponse r;
    bool reached = false;
    while (reader->Read(&r)) {
      if (r.event().kind() == v1::JobEvent::FIDELITY_MEASURED) {
        reached = true;
        break;
      }
    }
    ASSERT_TRUE(reached) << Log();
    Kill();
    wctx.TryCancel();
  }
  const std::vector<std::string> after_kill = Entries(root_ + "/tiny");
  EXPECT_THAT(after_kill, AnyOf(std::vector<std::string>({"1"}),
                                std::vector<std::string>({"1", "2"})));
  RecordProperty("published_before_kill", after_kill.size() == 2 ? "yes" : "no");
  WaitOutRestartMargin();
  Start({"--poll_interval_s=0", "--versions_to_keep=2"});
  ExpectNoLeftovers();
  ExpectCompleteVersions("tiny");
  EXPECT_EQ(Served("tiny"), std::stoll(after_kill.back()));
  EXPECT_EQ(Served("tiny", 1), 1);
  EXPECT_EQ(Served("other"), 1);
}

// The repository's disk fills up while an upload is staged, and again while a compression job
// writes its output: each job fails with an error that says so, nothing is published, staging is
// emptied (the space comes back), the server keeps serving, and later jobs that fit succeed.
//
// The disk is a 22 MiB tmpfs mounted on the repository root (the test runs as root in CI). Without
// the privilege to mount, the server runs with RLIMIT_FSIZE = 12 MiB and SIGXFSZ ignored instead,
// so writing a larger file fails with EFBIG through the same write path.
TEST_F(FaultsTest, FullDiskDuringStagingFailsTheJobCleanly) {
  std::function<void()> in_child;
  std::string disk_error = "No space left on device";
  if (::mount("tmpfs", root_.c_str(), "tmpfs", 0, "size=22m,mode=0755") == 0) {
    mounted_ = true;
    RecordProperty("disk", "tmpfs size=22m");
  } else {
    const int err = errno;
    RecordProperty("disk", absl::StrCat("RLIMIT_FSIZE=12MiB (mount failed: ", strerror(err), ")"));
    disk_error = "File too large";
    in_child = [] {
      ::signal(SIGXFSZ, SIG_IGN);
      struct rlimit rl = {12 << 20, 12 << 20};
      ::setrlimit(RLIMIT_FSIZE, &rl);
    };
  }
  auto free_bytes = [&] {
    struct statvfs st;
    return ::statvfs(root_.c_str(), &st) == 0 ? static_cast<int64_t>(st.f_bavail) * st.f_frsize
                                               : -1;
  };
  MakeTinyModel(root_ + "/tiny/1", 1);  // 8.3 MB
  MakeModel(tmp_.path() + "/mini", "mini", 4);  // 43 MB: does not fit
  MakeTinyModel(tmp_.path() + "/tiny2", 5);
  Start({"--poll_interval_s=0"}, in_child);
  const int64_t free_at_start = free_bytes();
  auto stub = AdminStub();

  // 1. An upload that does not fit.
  v1::UploadModelResponse resp;
  auto files = ReadDir(tmp_.path() + "/mini");
  v1::UploadHeader header = HeaderFor("mini", files);
  header.set_activate(true);
  grpc::Status s = Upload(stub.get(), kToken, header, files, &resp);
  ASSERT_FALSE(s.ok());
  RecordProperty("upload_code", s.error_code());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(disk_error)) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("model.safetensors")) << s.error_message();
  EXPECT_FALSE(fs::exists(root_ + "/mini"));
  ExpectNoLeftovers();
  if (mounted_) {
    EXPECT_EQ(free_bytes(), free_at_start);  // the staged part was removed
  }
  EXPECT_EQ(Served("tiny"), 1);

  // 2. An upload that fits still works.
  files = ReadDir(tmp_.path() + "/tiny2");
  header = HeaderFor("tiny", files);
  header.set_activate(true);
  s = Upload(stub.get(), kToken, header, files, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(WaitForJob(stub.get(), resp.job_id()).state(), v1::Job::SUCCEEDED) << Log();
  EXPECT_EQ(Served("tiny"), 2);

  // 3. A compression job whose output does not fit (tmpfs: 5.4 MB left for ~8 MB of output).
  if (mounted_) {
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::CompressModelRequest req;
    req.set_model_name("tiny");
    req.set_source_version(2);
    req.mutable_compression()->set_rank(16);
    req.set_activate(true);
    v1::CompressModelResponse cresp;
    s = stub->CompressModel(&ctx, req, &cresp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::Job job = WaitForJob(stub.get(), cresp.job_id());
    EXPECT_EQ(job.state(), v1::Job::FAILED) << job.DebugString();
    EXPECT_THAT(job.error(), HasSubstr(disk_error));
    RecordProperty("compress_code", job.error_code());
    EXPECT_EQ(Entries(root_ + "/tiny"), std::vector<std::string>({"1", "2"}));
    ExpectNoLeftovers();
    ExpectCompleteVersions("tiny");
    EXPECT_EQ(Served("tiny"), 2);
  }

  // The server survives it all and a restart finds a consistent repository.
  EXPECT_EQ(Served("tiny", 2), 2);
  Start({"--poll_interval_s=0"}, in_child);
  EXPECT_EQ(Served("tiny"), 2);
  ExpectNoLeftovers();
}

}  // namespace
}  // namespace collabserve
