// The Admin service end to end: a real Server on 127.0.0.1:0 with the Admin service on the same
// port (or its own), tiny checkpoints uploaded through the generated stubs.
#include "server/service/admin_service.h"

#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <atomic>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/compress/collaborative.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/device.h"
#include "server/model/engine.h"
#include "server/service/admin_jobs.h"
#include "server/service/admin_server.h"
#include "server/service/server.h"
#include "tests/admin/admin_server_fixture.h"
#include "tests/admin/admin_test_util.h"
#include "tests/service/test_util.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::Authorize;
using ::collabserve::testing::Eventually;
using ::collabserve::testing::HeaderFor;
using ::collabserve::testing::Sha256Hex;
using ::collabserve::testing::TempDir;
using ::collabserve::testing::Watch;
using ::testing::HasSubstr;

constexpr char kToken[] = "s3cret-admin-token";

// One text per line, `n` of them (calibration.txt).
std::string CalibrationFile(int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    out += absl::StrCat("calibration sentence number ", i, " about ", i % 3 == 0 ? "films" : "weather",
                        " and other things\n");
  }
  return out;
}

std::vector<std::string> Texts() {
  return {"the movie was wonderful", "a dull and tedious evening", "hello world",
          "compression should not change this much"};
}

class AdminServiceTest : public testing::AdminServerTest {
 protected:
  AdminServiceTest() : AdminServerTest(kToken, /*upload_seed=*/7) {}

  // (Two overloads, not a default argument: GCC 12 warned that the default's temporary options
  // "may be used uninitialized" at every Start().)
  void Start() { Start(AdminServerOptions()); }
  void Start(AdminServerOptions ao) {
    ServerOptions o = Options();
    o.servable.batching.max_queue_delay_micros = 200;
    if (ao.service.max_upload_bytes == (int64_t{2} << 30)) ao.service.max_upload_bytes = 64 << 20;
    StartServer(o, ao);
  }

  v1::UploadHeader Header(const std::string& model) { return HeaderFor(model, files_); }

  grpc::Status Upload(const v1::UploadHeader& h, v1::UploadModelResponse* r,
                      const std::string& token = kToken) {
    return testing::Upload(admin_stub_.get(), token, h, files_, r, 256 << 10);
  }
  grpc::Status Upload(const v1::UploadHeader& h, const std::map<std::string, std::string>& files,
                      v1::UploadModelResponse* r) {
    return testing::Upload(admin_stub_.get(), kToken, h, files, r, 256 << 10);
  }

  v1::Job GetJob(const std::string& id) {
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::GetJobResponse resp;
    grpc::Status s = admin_stub_->GetJob(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.job();
  }

  // CancelJob(id); the Job it answers with in `job` when given.
  grpc::Status CancelJob(const std::string& id, v1::Job* job = nullptr) {
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::CancelJobRequest req;
    req.set_job_id(id);
    v1::CancelJobResponse resp;
    grpc::Status s = admin_stub_->CancelJob(&ctx, req, &resp);
    if (job != nullptr) *job = resp.job();
    return s;
  }

  // The job once its watch has ended (a watch that fails is a failure of the test: the job may
  // still be running).
  v1::Job WaitJob(const std::string& id) {
    grpc::Status watched;
    Watch(admin_stub_.get(), kToken, id, &watched);
    EXPECT_TRUE(watched.ok()) << "watching job " << id << ": " << watched.error_code() << ": "
                              << watched.error_message();
    return GetJob(id);
  }

  grpc::Status Classify(const std::string& model, std::optional<int64_t> version,
                        v1::ClassifyResponse* resp) {
    v1::ClassifyRequest req;
    req.set_model_name(model);
    if (version) req.set_model_version(*version);
    for (const auto& t : Texts()) req.add_inputs()->set_text(t);
    req.mutable_options()->set_raw_scores(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return inference_->Classify(&ctx, req, resp);
  }

  // ListModels' status of `model`:`version` (default-constructed when not listed).
  v1::ModelVersionStatus StatusOf(const std::string& model, int64_t version) {
    grpc::ClientContext ctx;
    v1::ListModelsResponse resp;
    EXPECT_TRUE(inference_->ListModels(&ctx, v1::ListModelsRequest(), &resp).ok());
    for (const auto& m : resp.models()) {
      for (const auto& s : m.version_status()) {
        if (m.name() == model && s.version() == version) return s;
      }
    }
    return {};
  }

  std::vector<std::string> VersionDirs(const std::string& model) {
    std::vector<std::string> out;
    const std::string dir = repo_.path() + "/" + model;
    if (!std::filesystem::exists(dir)) return out;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      // Beside the versions, only the mark of deleted version numbers and its lock.
      const std::string name = e.path().filename().string();
      if ((name == ".highest_deleted_version" || name == ".highest_deleted_version.lock") && e.is_regular_file()) {
        continue;
      }
      out.push_back(e.path().filename().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  bool StagingEmpty() {
    const std::string dir = repo_.path() + "/.staging";
    return !std::filesystem::exists(dir) || std::filesystem::is_empty(dir);
  }

  // CompressModel of "tiny" at rank 16: the job and its version.
  v1::CompressModelResponse CompressTiny(bool activate = false) {
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::CompressModelRequest req;
    req.set_model_name("tiny");
    req.mutable_compression()->set_rank(16);
    req.set_activate(activate);
    v1::CompressModelResponse resp;
    const grpc::Status s = admin_stub_->CompressModel(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // Options whose job worker, once it has taken the first job and before it starts it, notifies
  // `taken` and waits for `release` (JobManagerOptions::start_hook).
  static AdminServerOptions HoldFirstJob(absl::Notification* taken, absl::Notification* release) {
    AdminServerOptions ao;
    ao.service.jobs.start_hook = [taken, release](const std::string&) {
      if (taken->HasBeenNotified()) return;
      taken->Notify();
      release->WaitForNotificationWithTimeout(absl::Seconds(60));
    };
    return ao;
  }

};

TEST_F(AdminServiceTest, UploadCompressClassifyMatchesOfflineCompress) {
  Start();
  v1::UploadHeader h = Header("up");
  h.mutable_compression()->set_rank(8);
  h.set_activate(true);
  v1::UploadModelResponse resp;
  grpc::Status s = Upload(h, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.model_name(), "up");
  EXPECT_EQ(resp.version(), 1);

  std::vector<v1::WatchJobResponse> events = Watch(admin_stub_.get(), kToken, resp.job_id());
  std::vector<v1::JobEvent::Kind> kinds;
  for (const auto& e : events) kinds.push_back(e.event().kind());
  EXPECT_THAT(kinds, ::testing::Contains(v1::JobEvent::BYTES_RECEIVED));
  EXPECT_THAT(kinds, ::testing::IsSupersetOf({v1::JobEvent::VALIDATING, v1::JobEvent::VALIDATED,
                                              v1::JobEvent::FIDELITY_MEASURED,
                                              v1::JobEvent::PUBLISHED, v1::JobEvent::LOADED}));
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), v1::JobEvent::LAYER_COMPRESSED), 2);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().event().kind(), v1::JobEvent::SUCCEEDED);
  EXPECT_EQ(events.front().event().kind(), v1::JobEvent::BYTES_RECEIVED);
  EXPECT_EQ(events.front().state(), v1::Job::RECEIVING);  // replayed with the state of the time
  EXPECT_EQ(events.back().state(), v1::Job::SUCCEEDED);
  for (size_t i = 0; i < events.size(); ++i) EXPECT_EQ(events[i].event().sequence(), int64_t(i));
  const v1::WatchJobResponse* bytes_done = nullptr;
  for (const auto& e : events) {
    if (e.event().kind() == v1::JobEvent::BYTES_RECEIVED) bytes_done = &e;
  }
  ASSERT_NE(bytes_done, nullptr);
  EXPECT_EQ(bytes_done->event().bytes_received(), bytes_done->event().bytes_total());

  v1::Job job = GetJob(resp.job_id());
  EXPECT_EQ(job.state(), v1::Job::SUCCEEDED);
  EXPECT_TRUE(job.published());
  EXPECT_TRUE(job.loaded());
  ASSERT_EQ(job.report().layers_size(), 2);
  EXPECT_EQ(job.report().layers(0).rank(), 8);
  EXPECT_GT(job.report().fidelity().probes(), 0);
  EXPECT_LT(job.report().qk_params_after(), job.report().qk_params_before());
  EXPECT_THAT(job.report().json(), HasSubstr("fidelity"));
  EXPECT_TRUE(StagingEmpty());

  // The served version is the compressed one: same logits as compressing the same files offline.
  TempDir offline;
  compress::CompressOptions co;
  co.spec.kind = compress::RankSpec::Kind::kRank;
  co.spec.rank = 8;
  auto report = compress::CompressModelDirectory(src_.path() + "/m", offline.path() + "/out", co);
  ASSERT_TRUE(report.ok()) << report.status();
  auto engine = model::Engine::Load(offline.path() + "/out");
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().collaborative_ranks, std::vector<int>({8, 8}));

  v1::ClassifyResponse cr;
  s = Classify("up", 1, &cr);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(cr.results_size(), static_cast<int>(Texts().size()));

  v1::TokenizeRequest treq;
  treq.set_model_name("up");
  treq.set_model_version(1);
  for (const auto& t : Texts()) treq.add_inputs()->set_text(t);
  v1::TokenizeResponse tresp;
  grpc::ClientContext tctx;
  ASSERT_TRUE(inference_->Tokenize(&tctx, treq, &tresp).ok());
  std::vector<model::TokenizedInput> inputs;
  for (const auto& t : tresp.results()) {
    inputs.push_back({{t.input_ids().begin(), t.input_ids().end()},
                      {t.token_type_ids().begin(), t.token_type_ids().end()}});
  }
  auto offline_pred = (*engine)->Run(inputs);
  ASSERT_TRUE(offline_pred.ok()) << offline_pred.status();
  for (int i = 0; i < cr.results_size(); ++i) {
    ASSERT_EQ(cr.results(i).logits_size(), 2);
    for (int k = 0; k < 2; ++k) {
      EXPECT_NEAR(cr.results(i).logits(k), (*offline_pred)[i].logits[k], 1e-4)
          << "input " << i << " logit " << k;
    }
  }
  // The uncompressed upload is not what serves: the published config is collaborative.
  auto config = util::ReadFile(repo_.path() + "/up/1/config.json");
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(*config, HasSubstr("collaborative"));

  // Admin metrics.
  const std::string text = admin_->metrics().TextFormat();
  EXPECT_THAT(text, HasSubstr("collabserve_jobs_total{outcome=\"succeeded\"} 1"));
  int64_t total = 0;
  for (const auto& [name, content] : files_) total += content.size();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("collabserve_upload_bytes_total ", total)));

  // The version's compression figures are facts of the files it wrote (config.json), exported
  // with the version's other gauges while it is loaded - also by a server started later.
  const std::string agreement = "collabserve_model_fidelity_agreement{model=\"up\",version=\"1\"}";
  const std::string layer1 =
      "collabserve_layer_reconstruction_error{layer=\"1\",model=\"up\",version=\"1\"}";
  auto expect_figures = [&] {
    std::map<std::string, double> m = testing::ParseMetrics(server_->metrics().TextFormat());
    ASSERT_EQ(m.count(agreement), 1u);
    ASSERT_EQ(m.count(layer1), 1u);
    EXPECT_NEAR(m[agreement], job.report().fidelity().top1_agreement(), 1e-6);
    EXPECT_NEAR(m[layer1], job.report().layers(1).relative_error(), 1e-6);
  };
  expect_figures();
  admin_->Shutdown();
  server_->Shutdown();
  admin_.reset();
  server_.reset();
  Start();
  expect_figures();
}

TEST_F(AdminServiceTest, EveryRefusalIsInvalidArgumentAndLeavesNothing) {
  AdminServerOptions ao;
  ao.service.max_upload_bytes = 32 << 20;
  Start(ao);
  struct Case {
    std::string what;
    v1::UploadHeader header;
    std::map<std::string, std::string> files;
    std::string message;
  };
  std::vector<Case> cases;
  {
    auto files = files_;
    files["../config.json"] = files["config.json"];
    files.erase("config.json");
    cases.push_back({"path separator", HeaderFor("up", files), files, "path separators"});
  }
  {
    auto files = files_;
    files["run.sh"] = "#!/bin/sh\n";
    cases.push_back({"unknown file", HeaderFor("up", files), files, "unknown file 'run.sh'"});
  }
  {
    auto files = files_;
    files.erase("vocab.txt");
    cases.push_back({"missing vocab", HeaderFor("up", files), files, "no vocab.txt"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_files(0)->set_size(40 << 20);
    cases.push_back({"too large", h, files_, "--max_upload_bytes"});
  }
  {
    v1::UploadHeader h = Header("up");
    for (auto& f : *h.mutable_files()) {
      if (f.name() == "config.json") f.set_sha256(Sha256Hex("something else"));
    }
    cases.push_back({"checksum", h, files_, "checksum mismatch for 'config.json'"});
  }
  {
    auto files = files_;
    std::string& w = files["model.safetensors"];
    w.resize(w.size() / 2);
    cases.push_back({"truncated weights", HeaderFor("up", files), files, "the engine rejects"});
  }
  {
    auto files = files_;
    files["config.json"] = "{\"hidden_size\": \"big\"}";
    cases.push_back({"bad config", HeaderFor("up", files), files, "the engine rejects"});
  }
  cases.push_back({"bad model name", Header("a/b"), files_, "model_name"});
  {
    v1::UploadHeader h = Header("up");
    h.set_min_agreement(0.9);
    cases.push_back({"gate without compression", h, files_, "min_agreement needs"});
  }
  {
    v1::UploadHeader h = Header("p");
    h.add_probes("a probe nothing would measure");
    cases.push_back({"probes without compression", h, files_, "probes need a compression request"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_rank(0);
    cases.push_back({"rank 0", h, files_, "compression.rank"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_rank(1000);
    h.mutable_compression()->set_rank(-3);
    cases.push_back({"negative rank", h, files_, "compression.rank"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_target_agreement(1.5);
    cases.push_back({"target above 1", h, files_, "compression.target_agreement must be in (0, 1]"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_max_kl(-1);
    cases.push_back({"negative max_kl", h, files_, "compression.max_kl"});
  }
  // Values that would pass a plain comparison: refused before the upload, not failed in the job.
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_ratio(std::numeric_limits<double>::infinity());
    cases.push_back({"infinite ratio", h, files_, "compression.ratio must be a finite number >= 1"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_rank(16);
    h.mutable_compression()->set_tol(std::nan(""));
    cases.push_back({"NaN tol", h, files_, "compression.tol must be a finite number >= 0"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_rank(16);
    h.mutable_compression()->set_max_iters(kMaxCpIterations + 1);
    cases.push_back({"too many iterations", h, files_, "compression.max_iters must be in [0, 10000]"});
  }
  {
    v1::UploadHeader h = Header("up");
    h.mutable_compression()->set_rank(16);
    h.mutable_compression()->set_init(static_cast<v1::CompressionSpec::Init>(7));
    cases.push_back({"unknown init", h, files_, "compression.init: unknown value 7"});
  }
  // calibration.txt: only with a compression request, at most 16 MiB, text of >= 16 lines.
  auto with_calibration = [&](const std::string& what, const std::string& text, const std::string& message,
                              bool compress = true) {
    auto files = files_;
    files["calibration.txt"] = text;
    v1::UploadHeader h = HeaderFor("up", files);
    if (compress) h.mutable_compression()->set_rank(8);
    cases.push_back({what, h, files, message});
  };
  with_calibration("calibration without compression", CalibrationFile(20), "only read to compress", false);
  with_calibration("binary calibration", CalibrationFile(20) + std::string("\0\x01\x02", 3),
                   "calibration.txt: a NUL byte");
  with_calibration("empty calibration", "", "calibration.txt: no text lines");
  with_calibration("calibration of blank lines", "\n \n\t\n", "calibration.txt: no text lines");
  with_calibration("non-UTF-8 calibration", CalibrationFile(20) + "caf\xe9\n", "line 21 is not valid UTF-8");
  with_calibration("too little calibration", CalibrationFile(5), "calibration.txt: 5 texts; at least 16");
  {
    auto files = files_;
    files["calibration.txt"] = CalibrationFile(20);
    v1::UploadHeader h = HeaderFor("up", files);
    h.mutable_compression()->set_rank(8);
    for (auto& f : *h.mutable_files()) {
      if (f.name() == "calibration.txt") f.set_size((16 << 20) + 1);
    }
    cases.push_back({"calibration too large", h, files, "'calibration.txt' is 16777217 bytes; at most 16777216"});
  }
  for (const Case& c : cases) {
    v1::UploadModelResponse r;
    grpc::Status s = Upload(c.header, c.files, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.what;
  }
  // A chunk out of order.
  {
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::UploadModelResponse r;
    auto w = admin_stub_->UploadModel(&ctx, &r);
    v1::UploadModelRequest req;
    *req.mutable_header() = Header("up");
    w->Write(req);
    v1::UploadModelRequest c;
    c.mutable_chunk()->set_file_name("config.json");
    c.mutable_chunk()->set_offset(5);
    c.mutable_chunk()->set_data("xyz");
    w->Write(c);
    w->WritesDone();
    grpc::Status s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("offset 5, expected 0"));
  }
  // Nothing was published, nothing is left in staging, and the failures are recorded.
  EXPECT_TRUE(VersionDirs("up").empty());
  EXPECT_TRUE(Eventually([&] { return StagingEmpty(); }));
  int failed = 0;
  for (const v1::Job& j : ListJobs()) {
    EXPECT_NE(j.state(), v1::Job::SUCCEEDED);
    if (j.state() == v1::Job::FAILED) {
      ++failed;
      EXPECT_EQ(j.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    }
  }
  EXPECT_GE(failed, 4);  // the ones refused after the header (checksum, engine, order)
  // The existing model still serves.
  v1::ClassifyResponse cr;
  EXPECT_TRUE(Classify("tiny", std::nullopt, &cr).ok());
}

TEST_F(AdminServiceTest, UploadWithCalibrationAndATargetSearchesWhitenedRanks) {
  Start();
  auto files = files_;
  // The last text, held out, is longer than the model's 512 tokens: measured cut there.
  files["calibration.txt"] = CalibrationFile(59);
  for (int i = 0; i < 600; ++i) files["calibration.txt"] += i ? " weather" : "long";
  files["calibration.txt"] += "\n";
  v1::UploadHeader h = HeaderFor("cal", files);
  h.mutable_compression()->set_target_agreement(0.9);
  h.set_activate(true);
  v1::UploadModelResponse r;
  grpc::Status s = Upload(h, files, &r);
  ASSERT_TRUE(s.ok()) << s.error_message();
  grpc::Status watched;
  std::vector<v1::WatchJobResponse> events = Watch(admin_stub_.get(), kToken, r.job_id(), &watched);
  ASSERT_TRUE(watched.ok()) << watched.error_code() << ": " << watched.error_message();
  v1::Job job = GetJob(r.job_id());
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.error();
  std::vector<std::string> calibrated, trials, measured;
  for (const auto& e : events) {
    if (e.event().kind() == v1::JobEvent::CALIBRATED) calibrated.push_back(e.event().message());
    if (e.event().kind() == v1::JobEvent::SEARCH_TRIAL) trials.push_back(e.event().message());
    if (e.event().kind() == v1::JobEvent::FIDELITY_MEASURED) measured.push_back(e.event().message());
  }
  ASSERT_EQ(calibrated.size(), 1u);
  EXPECT_THAT(calibrated[0], HasSubstr("whitening on: 60 calibration texts"));
  EXPECT_THAT(calibrated[0], HasSubstr("fidelity measured on the rest"));
  ASSERT_EQ(measured.size(), 1u);
  EXPECT_THAT(measured[0], HasSubstr("fidelity on 12 held-out calibration texts"));
  ASSERT_FALSE(trials.empty());
  EXPECT_THAT(trials[0], HasSubstr("search trial 1: ranks ["));
  auto report = nlohmann::json::parse(job.report().json());
  EXPECT_TRUE(report["whitening"]["on"].get<bool>());
  EXPECT_EQ(report["whitening"]["fit_texts"], 48);
  EXPECT_EQ(report["whitening"]["heldout_texts"], 12);
  ASSERT_TRUE(report.contains("search"));
  EXPECT_EQ(report["search"]["texts"], 12);
  EXPECT_EQ(report["search"]["trials"].size(), trials.size());
  EXPECT_EQ(job.report().fidelity().probes(), 12);  // measured on the held-out part
  EXPECT_EQ(job.report().fidelity().truncated_probes(), 1);
  EXPECT_THAT(measured[0], HasSubstr("1 of them longer than the model's 512 tokens"));
  for (const auto& t : report["search"]["trials"]) EXPECT_EQ(t["fidelity"]["truncated_probes"], 1);
  EXPECT_GE(job.report().fidelity().top1_agreement(), 0.9);
  // 12 texts cannot show that 90 % of texts like them agree: the bound is reported and the event
  // says so (at most 0.816, what 12 of 12 gives).
  EXPECT_LE(job.report().fidelity().top1_agreement_lower95(), 0.8165);
  EXPECT_NEAR(job.report().fidelity().top1_agreement_lower95(),
              compress::WilsonLower95(std::lround(job.report().fidelity().top1_agreement() * 12), 12), 1e-9);
  EXPECT_THAT(measured[0], HasSubstr("(95% lower bound 0."));
  EXPECT_THAT(measured[0], HasSubstr("target_agreement 0.9000 is met, but 12 texts do not show that 0.9000 of texts like them agree"));
  for (const auto& l : job.report().layers()) {
    if (l.rank() > 0) {
      EXPECT_TRUE(l.has_activation_error());
    }
  }
  // calibration.txt is read, not published.
  const std::string version_dir = repo_.path() + "/cal/1";
  ASSERT_TRUE(std::filesystem::exists(version_dir + "/config.json"));
  EXPECT_FALSE(std::filesystem::exists(version_dir + "/calibration.txt"));
  v1::ClassifyResponse cr;
  EXPECT_TRUE(Classify("cal", std::nullopt, &cr).ok());
  EXPECT_TRUE(StagingEmpty());
}

TEST_F(AdminServiceTest, WithoutCalibrationTheJobSaysWhiteningIsOff) {
  Start();
  v1::UploadHeader h = Header("plain");
  h.mutable_compression()->set_rank(8);
  v1::UploadModelResponse r;
  ASSERT_TRUE(Upload(h, &r).ok());
  std::vector<v1::WatchJobResponse> events = Watch(admin_stub_.get(), kToken, r.job_id());
  bool said = false;
  for (const auto& e : events) {
    if (e.event().kind() == v1::JobEvent::CALIBRATED) {
      said = true;
      EXPECT_THAT(e.event().message(), HasSubstr("whitening off: the upload has no calibration.txt"));
    }
  }
  EXPECT_TRUE(said);
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](const v1::WatchJobResponse& e) {
    return e.event().kind() == v1::JobEvent::FIDELITY_MEASURED &&
           absl::StrContains(e.event().message(), "built-in probes");
  }));
  v1::Job job = GetJob(r.job_id());
  ASSERT_EQ(job.state(), v1::Job::SUCCEEDED) << job.error();
  EXPECT_FALSE(nlohmann::json::parse(job.report().json())["whitening"]["on"].get<bool>());
  for (const auto& l : job.report().layers()) EXPECT_FALSE(l.has_activation_error());
}

TEST_F(AdminServiceTest, CompressModelTakesCalibrationTextsAndRefusesBadOnes) {
  Start();
  auto compress = [&](const std::vector<std::string>& texts, v1::CompressModelResponse* resp,
                      const std::vector<std::string>& probes = {}) {
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::CompressModelRequest req;
    req.set_model_name("tiny");
    req.mutable_compression()->set_rank(8);
    for (const auto& t : texts) req.add_calibration(t);
    for (const auto& t : probes) req.add_probes(t);
    return admin_stub_->CompressModel(&ctx, req, resp);
  };
  std::vector<std::string> texts;
  for (int i = 0; i < 20; ++i) texts.push_back(absl::StrCat("a calibration text, number ", i));
  v1::CompressModelResponse resp;
  grpc::Status s = compress(texts, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::Job j = WaitJob(resp.job_id());
  ASSERT_EQ(j.state(), v1::Job::SUCCEEDED) << j.error();
  EXPECT_TRUE(nlohmann::json::parse(j.report().json())["whitening"]["on"].get<bool>());
  EXPECT_EQ(j.report().fidelity().probes(), 4);
  // Probes given: the fidelity runs on them, not on the held-out calibration texts, and the job's
  // events say so. One is longer than the model's 512 tokens: measured cut there, as served.
  std::string long_probe = "probe";
  for (int i = 0; i < 600; ++i) long_probe += " three";
  s = compress(texts, &resp, {"probe one", "probe two", long_probe});
  ASSERT_TRUE(s.ok()) << s.error_message();
  j = WaitJob(resp.job_id());
  ASSERT_EQ(j.state(), v1::Job::SUCCEEDED) << j.error();
  EXPECT_EQ(j.report().fidelity().probes(), 3);
  EXPECT_EQ(j.report().fidelity().truncated_probes(), 1);
  EXPECT_EQ(j.source_version(), 1) << "the newest standard version; 2 is collaborative";
  int said = 0;
  for (const auto& e : j.events()) {
    if (e.kind() == v1::JobEvent::CALIBRATED) said += absl::StrContains(e.message(), "fidelity measured on the given probes");
    if (e.kind() == v1::JobEvent::FIDELITY_MEASURED) {
      said += absl::StrContains(e.message(), "fidelity on 3 given probes");
      said += absl::StrContains(e.message(), "1 of them longer than the model's 512 tokens, measured cut there");
    }
  }
  EXPECT_EQ(said, 3);

  auto refused = [&](std::vector<std::string> bad, const std::string& message) {
    v1::CompressModelResponse r;
    grpc::Status st = compress(bad, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_THAT(st.error_message(), HasSubstr(message));
  };
  auto with = [&](int i, std::string t) {
    auto b = texts;
    b[i] = std::move(t);
    return b;
  };
  refused(with(3, std::string("bin\0ary", 7)), "calibration text 4: a NUL byte");
  // (Invalid UTF-8 cannot travel: protobuf refuses to serialize it into a string field.)
  refused(with(0, "   "), "calibration text 1: no text lines");
  refused({texts.begin(), texts.begin() + 3}, "calibration: 3 texts; at least 16");
  EXPECT_EQ(VersionDirs("tiny"), (std::vector<std::string>{"1", "2", "3"}));
}

// CompressModel without a source version takes the newest standard one (the test above: 1, not the
// collaborative 2); a model with only collaborative versions has none, and the call says so.
TEST_F(AdminServiceTest, CompressModelWithOnlyCollaborativeVersionsSaysSo) {
  compress::CompressOptions o;
  o.spec.rank = 8;
  ASSERT_TRUE(compress::CompressModelDirectory(repo_.path() + "/tiny/1", repo_.path() + "/only/1", o).ok());
  Start();
  grpc::ClientContext ctx;
  Authorize(&ctx, kToken);
  v1::CompressModelRequest req;
  req.set_model_name("only");
  req.mutable_compression()->set_rank(4);
  v1::CompressModelResponse resp;
  grpc::Status s = admin_stub_->CompressModel(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("model 'only' has only collaborative versions on disk"));
  EXPECT_EQ(VersionDirs("only"), std::vector<std::string>({"1"}));
}

TEST_F(AdminServiceTest, FidelityGateFailsAndPublishesNothing) {
  Start();
  v1::UploadHeader h = Header("gated");
  h.mutable_compression()->set_rank(1);
  h.set_min_agreement(1.0);
  h.add_probes("one");
  for (int i = 0; i < 40; ++i) h.add_probes(absl::StrCat("probe sentence number ", i, " of many"));
  v1::UploadModelResponse r;
  grpc::Status s = Upload(h, &r);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::Job job = WaitJob(r.job_id());
  // Deterministic (seeded weights, fixed probes): rank 1 changes some top-1 labels.
  ASSERT_LT(job.report().fidelity().top1_agreement(), 1.0);
  EXPECT_EQ(job.state(), v1::Job::FAILED);
  EXPECT_THAT(job.error(), HasSubstr("fidelity gate"));
  EXPECT_FALSE(job.published());
  EXPECT_TRUE(VersionDirs("gated").empty());
  EXPECT_TRUE(StagingEmpty());
}

// A job whose work finds the GPU failed for good (model::IsDeviceFailure) fails UNAVAILABLE and
// stops the server as a failing batch does (server_test's ADeviceFailureStopsServingUntilARestart):
// health NOT_SERVING for "" and every model, new Classify calls UNAVAILABLE, nothing published.
// Injected through JobManagerOptions::work_fault_hook, since a CPU cannot fail so; on a GPU,
// engine_test's AGpuThatFailsForGoodMakesDeviceFailures checks that model::WithDeviceCheck marks a
// job's INTERNAL error so.
TEST_F(AdminServiceTest, AJobThatFindsTheGpuFailedStopsServing) {
  AdminServerOptions ao;
  ao.service.jobs.work_fault_hook = [] {
    return model::MarkedDeviceFailure(absl::UnavailableError(
        "compression failed: CUDA error: an illegal memory access was encountered; cuda:0 can run no "
        "more work: CUDA error: an illegal memory access was encountered"));
  };
  Start(ao);
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  auto status_of = [&](const std::string& service) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = health->Check(&ctx, req, &resp);
    return s.ok() ? resp.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  };
  v1::ClassifyResponse cr;
  ASSERT_TRUE(Classify("tiny", std::nullopt, &cr).ok());
  EXPECT_EQ(status_of(""), grpc::health::v1::HealthCheckResponse::SERVING);

  v1::UploadHeader h = Header("up");
  h.mutable_compression()->set_rank(16);
  v1::UploadModelResponse r;
  grpc::Status s = Upload(h, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("cuda:0 can run no more work"));
  const std::vector<v1::Job> jobs = ListJobs();  // the failed call returned no job id
  ASSERT_EQ(jobs.size(), 1u);
  const v1::Job& job = jobs[0];
  EXPECT_EQ(job.state(), v1::Job::FAILED);
  EXPECT_EQ(job.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  EXPECT_THAT(job.error(), HasSubstr("compression failed: CUDA error"));
  EXPECT_FALSE(job.published());
  EXPECT_TRUE(VersionDirs("up").empty());
  EXPECT_TRUE(StagingEmpty());

  EXPECT_EQ(status_of(""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(status_of("tiny"), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  s = Classify("tiny", std::nullopt, &cr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("GPU failed"));
  EXPECT_THAT(s.error_message(), HasSubstr("compression failed: CUDA error"));

  // New jobs are refused as new calls are, before an upload's bytes are kept.
  grpc::ClientContext ctx;
  Authorize(&ctx, kToken);
  v1::CompressModelRequest req;
  req.set_model_name("tiny");
  req.mutable_compression()->set_rank(16);
  v1::CompressModelResponse resp;
  s = admin_stub_->CompressModel(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("GPU failed"));
  s = Upload(Header("again"), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("GPU failed"));
  EXPECT_EQ(ListJobs().size(), 1u);
  EXPECT_TRUE(VersionDirs("again").empty());
  EXPECT_TRUE(StagingEmpty());
}

TEST_F(AdminServiceTest, MissingOrWrongTokenIsUnauthenticated) {
  Start();
  for (const std::string token : {"", "wrong-token", "s3cret-admin-toke", "s3cret-admin-token2"}) {
    {
      grpc::ClientContext ctx;
      Authorize(&ctx, token);
      v1::ListJobsResponse resp;
      EXPECT_EQ(admin_stub_->ListJobs(&ctx, v1::ListJobsRequest(), &resp).error_code(),
                grpc::StatusCode::UNAUTHENTICATED)
          << token;
    }
    {
      grpc::ClientContext ctx;
      Authorize(&ctx, token);
      v1::DeleteVersionRequest req;
      req.set_model_name("tiny");
      req.set_version(1);
      v1::DeleteVersionResponse resp;
      EXPECT_EQ(admin_stub_->DeleteVersion(&ctx, req, &resp).error_code(),
                grpc::StatusCode::UNAUTHENTICATED);
    }
    v1::UploadModelResponse r;
    EXPECT_EQ(Upload(Header("up"), &r, token).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::Status ws;
    testing::Watch(admin_stub_.get(), token, "1", &ws);
    EXPECT_EQ(ws.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {  // Not a bearer token.
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", kToken);
    v1::ListJobsResponse resp;
    EXPECT_EQ(admin_stub_->ListJobs(&ctx, v1::ListJobsRequest(), &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_TRUE(ListJobs().empty());
  EXPECT_TRUE(VersionDirs("up").empty());
  EXPECT_EQ(VersionDirs("tiny"), std::vector<std::string>({"1"}));
}

TEST_F(AdminServiceTest, TwoConcurrentUploadsGetTwoVersions) {
  Start();
  v1::UploadModelResponse r1, r2;
  grpc::Status s1, s2;
  std::thread t1([&] {
    v1::UploadHeader h = Header("both");
    h.mutable_compression()->set_rank(16);
    s1 = Upload(h, &r1);
  });
  std::thread t2([&] {
    v1::UploadHeader h = Header("both");
    s2 = Upload(h, &r2);
  });
  t1.join();
  t2.join();
  ASSERT_TRUE(s1.ok()) << s1.error_message();
  ASSERT_TRUE(s2.ok()) << s2.error_message();
  EXPECT_NE(r1.version(), r2.version());
  EXPECT_EQ(WaitJob(r1.job_id()).state(), v1::Job::SUCCEEDED);
  EXPECT_EQ(WaitJob(r2.job_id()).state(), v1::Job::SUCCEEDED);
  EXPECT_EQ(VersionDirs("both"), std::vector<std::string>({"1", "2"}));
  // An explicit version that exists is refused before any byte is taken.
  v1::UploadHeader h = Header("both");
  h.set_version(2);
  v1::UploadModelResponse r3;
  EXPECT_EQ(Upload(h, &r3).error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

TEST_F(AdminServiceTest, CancelDuringUploadLeavesNothing) {
  AdminServerOptions ao;
  ao.service.jobs.max_queued_jobs = 1;
  Start(ao);
  grpc::ClientContext ctx;
  Authorize(&ctx, kToken);
  v1::UploadModelResponse r;
  auto w = admin_stub_->UploadModel(&ctx, &r);
  v1::UploadModelRequest req;
  *req.mutable_header() = Header("cancelled");
  ASSERT_TRUE(w->Write(req));
  v1::UploadModelRequest c;
  c.mutable_chunk()->set_file_name("config.json");
  c.mutable_chunk()->set_offset(0);
  c.mutable_chunk()->set_data(files_["config.json"].substr(0, 10));
  ASSERT_TRUE(w->Write(c));
  std::string id;
  ASSERT_TRUE(Eventually([&] {
    auto jobs = ListJobs();
    if (jobs.empty() || jobs[0].bytes_received() == 0) return false;
    id = jobs[0].id();
    return jobs[0].state() == v1::Job::RECEIVING;
  }));
  // The queue (one slot) is full while this upload is receiving.
  {
    v1::UploadModelResponse r2;
    grpc::Status s = Upload(Header("other"), &r2);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--max_queued_jobs=1")) << "the flag that limits it";
  }
  {
    v1::Job cancelled;
    ASSERT_TRUE(CancelJob(id, &cancelled).ok());
    EXPECT_EQ(cancelled.state(), v1::Job::CANCELLED);
  }
  c.mutable_chunk()->set_offset(10);
  c.mutable_chunk()->set_data(files_["config.json"].substr(10));
  w->Write(c);
  w->WritesDone();
  grpc::Status s = w->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_EQ(GetJob(id).state(), v1::Job::CANCELLED);
  EXPECT_TRUE(VersionDirs("cancelled").empty());
  EXPECT_TRUE(StagingEmpty());
  // An ended job cannot be cancelled.
  EXPECT_EQ(CancelJob(id).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // The slot is free again.
  v1::UploadModelResponse r3;
  EXPECT_TRUE(Upload(Header("other"), &r3).ok());
}

TEST_F(AdminServiceTest, CancelRunningCompressionKeepsServing) {
  // A bigger model so that compression runs long enough to be cancelled between layers.
  model::MakeOptions mo;
  mo.preset = "mini";
  mo.layers = 4;
  mo.seed = 3;
  ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/big/1", mo).ok());
  Start();
  grpc::ClientContext ctx;
  Authorize(&ctx, kToken);
  v1::CompressModelRequest req;
  req.set_model_name("big");
  req.mutable_compression()->set_rank(200);
  req.mutable_compression()->set_max_iters(400);
  req.mutable_compression()->set_tol(1e-30);
  v1::CompressModelResponse resp;
  ASSERT_TRUE(admin_stub_->CompressModel(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.version(), 2);
  // Classification keeps answering while the job runs.
  int answered_while_running = 0;
  while (true) {
    v1::Job j = GetJob(resp.job_id());
    if (j.state() != v1::Job::RUNNING && j.state() != v1::Job::QUEUED) break;
    v1::ClassifyResponse cr;
    grpc::Status s = Classify("tiny", std::nullopt, &cr);
    ASSERT_TRUE(s.ok()) << s.error_message();
    if (GetJob(resp.job_id()).state() == v1::Job::RUNNING) ++answered_while_running;
    if (answered_while_running >= 3) break;
  }
  EXPECT_GE(answered_while_running, 3);
  grpc::Status cs = CancelJob(resp.job_id());
  ASSERT_TRUE(cs.ok()) << cs.error_message();
  v1::Job j = WaitJob(resp.job_id());
  EXPECT_EQ(j.state(), v1::Job::CANCELLED) << j.error();
  EXPECT_EQ(VersionDirs("big"), std::vector<std::string>({"1"}));
  EXPECT_TRUE(StagingEmpty());
  v1::ClassifyResponse cr;
  EXPECT_TRUE(Classify("big", 1, &cr).ok());
}

// A CancelJob that finds a job QUEUED while a worker is taking it: the job ends CANCELLED, never
// starts, and stays so (the worker used to set it RUNNING for good when the cancel came between its
// check and its start). JobManagerOptions::start_hook holds the worker at that moment.
TEST_F(AdminServiceTest, ACancelAsAWorkerTakesTheJobEndsItForGood) {
  absl::Notification taken, cancelled;
  std::string held;  // the job the worker is held on (written before `taken`)
  AdminServerOptions ao;
  ao.service.jobs.start_hook = [&](const std::string& id) {
    if (taken.HasBeenNotified()) return;  // only the first job
    held = id;
    taken.Notify();
    cancelled.WaitForNotificationWithTimeout(absl::Seconds(60));
  };
  Start(ao);
  auto compress = [&]() { return CompressTiny().job_id(); };
  const std::string id = compress();
  ASSERT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_EQ(held, id);
  EXPECT_EQ(GetJob(id).state(), v1::Job::QUEUED);
  const grpc::Status s = CancelJob(id);
  ASSERT_TRUE(s.ok()) << s.error_message();
  cancelled.Notify();
  EXPECT_EQ(WaitJob(id).state(), v1::Job::CANCELLED);
  // The next job runs on the same (only) worker, so the first one's Run has returned by its end.
  const std::string next = compress();
  EXPECT_EQ(WaitJob(next).state(), v1::Job::SUCCEEDED);
  const v1::Job j = GetJob(id);
  EXPECT_EQ(j.state(), v1::Job::CANCELLED);
  EXPECT_EQ(j.started_unix_micros(), 0) << "it started";
  ASSERT_GT(j.events_size(), 0);
  EXPECT_EQ(j.events(j.events_size() - 1).kind(), v1::JobEvent::CANCELLED);
  EXPECT_FALSE(j.published());
  EXPECT_TRUE(StagingEmpty());
}

// A CancelJob of an upload queued behind a running job answers the upload's call at once (it
// waited for a worker to take the work off the queue) and frees its staging then.
TEST_F(AdminServiceTest, CancellingAQueuedUploadAnswersItsCallAtOnce) {
  absl::Notification taken, release;
  Start(HoldFirstJob(&taken, &release));
  const std::string held = CompressTiny().job_id();
  ASSERT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(60)));
  v1::UploadModelResponse r;
  grpc::Status s;
  absl::Notification answered;
  std::thread upload([&] {
    s = Upload(Header("queued"), &r);
    answered.Notify();
  });
  std::string id;
  EXPECT_TRUE(Eventually([&] {
    for (const v1::Job& j : ListJobs()) {
      if (j.model_name() == "queued" && j.state() == v1::Job::QUEUED) id = j.id();
    }
    return !id.empty();
  }));
  if (!id.empty()) {
    const grpc::Status cs = CancelJob(id);
    EXPECT_TRUE(cs.ok()) << cs.error_message();
    // While the worker is still held.
    EXPECT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_FALSE(std::filesystem::exists(repo_.path() + "/.staging/" + id));
  }
  release.Notify();
  upload.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_EQ(WaitJob(held).state(), v1::Job::SUCCEEDED);
  EXPECT_TRUE(VersionDirs("queued").empty());
  EXPECT_TRUE(StagingEmpty());
}

// An uploading client that gives up while its job waits to be validated (its deadline here) never
// learns the job's id: the job is cancelled, not compressed and published behind its back.
TEST_F(AdminServiceTest, AnUploadWhoseClientGivesUpIsCancelledNotPublished) {
  absl::Notification taken, release;
  Start(HoldFirstJob(&taken, &release));
  const std::string held = CompressTiny().job_id();
  ASSERT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(60)));
  v1::UploadHeader h = Header("gave-up");
  h.mutable_compression()->set_rank(16);
  v1::UploadModelResponse r;
  const grpc::Status s =
      testing::Upload(admin_stub_.get(), kToken, h, files_, &r, 256 << 10, absl::Seconds(10));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  v1::Job job;
  EXPECT_TRUE(Eventually([&] {
    for (const v1::Job& j : ListJobs()) {
      if (j.model_name() == "gave-up") job = j;
    }
    return job.state() == v1::Job::CANCELLED;
  })) << v1::Job::State_Name(job.state());
  release.Notify();
  EXPECT_EQ(WaitJob(held).state(), v1::Job::SUCCEEDED);
  EXPECT_TRUE(VersionDirs("gave-up").empty());
  EXPECT_TRUE(StagingEmpty());
}

// A job that the server's shutdown stops ends UNAVAILABLE, "shutting down", not CANCELLED: nobody
// cancelled it, and a client may try again elsewhere.
TEST_F(AdminServiceTest, AJobStoppedByTheShutdownIsUnavailableNotCancelled) {
  absl::Notification taken, release;
  Start(HoldFirstJob(&taken, &release));
  const std::string id = CompressTiny().job_id();
  ASSERT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(60)));
  JobManager& jobs = admin_->service().jobs();
  std::shared_ptr<Job> job = jobs.Get(id);
  ASSERT_NE(job, nullptr);
  std::thread shutdown([this] { admin_->Shutdown(); });
  EXPECT_TRUE(Eventually([&] { return job->cancel_requested(); }));
  release.Notify();
  shutdown.join();
  const v1::Job j = job->Snapshot(false);
  EXPECT_EQ(j.state(), v1::Job::FAILED);
  EXPECT_EQ(j.error_code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_THAT(j.error(), HasSubstr("shutting down"));
}

// The same for a job already running: its work returns the cancellation it noticed, and the job
// still ends UNAVAILABLE (work_fault_hook stands for the compression's own cancel check).
TEST_F(AdminServiceTest, AJobRunningWhenTheServerStopsIsUnavailableNotCancelled) {
  absl::Notification running, stopping;
  AdminServerOptions ao;
  ao.service.jobs.work_fault_hook = [&]() -> absl::Status {
    running.Notify();
    stopping.WaitForNotificationWithTimeout(absl::Seconds(60));
    return absl::CancelledError("the work noticed its cancel flag");
  };
  Start(ao);
  const std::string id = CompressTiny().job_id();
  ASSERT_TRUE(running.WaitForNotificationWithTimeout(absl::Seconds(60)));
  std::shared_ptr<Job> job = admin_->service().jobs().Get(id);
  ASSERT_NE(job, nullptr);
  std::thread shutdown([this] { admin_->Shutdown(); });
  EXPECT_TRUE(Eventually([&] { return job->cancel_requested(); }));
  stopping.Notify();
  shutdown.join();
  const v1::Job j = job->Snapshot(false);
  EXPECT_EQ(j.state(), v1::Job::FAILED);
  EXPECT_EQ(j.error_code(), static_cast<int>(absl::StatusCode::kUnavailable)) << j.error();
  EXPECT_THAT(j.error(), HasSubstr("shutting down"));
  EXPECT_TRUE(VersionDirs("tiny") == std::vector<std::string>({"1"}));
}

// A version made by someone else while the job ran (another replica on the same volume, a person)
// is not the job's: the job fails ALREADY_EXISTS, reports nothing published and leaves that
// version as it is (it used to record PUBLISHED, since the version's directory existed).
TEST_F(AdminServiceTest, AVersionMadeElsewhereWhileTheJobRanIsNotReportedAsPublished) {
  absl::Notification taken, made;
  Start(HoldFirstJob(&taken, &made));
  const v1::CompressModelResponse resp = CompressTiny();
  ASSERT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(60)));
  const std::string other = repo_.path() + "/tiny/" + std::to_string(resp.version());
  model::MakeOptions mo;
  mo.seed = 11;
  ASSERT_TRUE(model::MakeCheckpoint(other, mo).ok());
  made.Notify();
  const v1::Job j = WaitJob(resp.job_id());
  EXPECT_EQ(j.state(), v1::Job::FAILED);
  EXPECT_THAT(j.error(), HasSubstr("already exists"));
  EXPECT_FALSE(j.published());
  for (const v1::JobEvent& e : j.events()) EXPECT_NE(e.kind(), v1::JobEvent::PUBLISHED);
  // The other version is untouched: still a standard checkpoint (no collaborative ranks).
  auto config = util::ReadFile(other + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->find("collaborative"), std::string::npos);
  EXPECT_TRUE(Eventually([&] { return StagingEmpty(); }));
}

// The version a job compresses may be deleted while the job waits: the job keeps its own links
// to the files and succeeds (it used to fail "the engine rejects the checkpoint", or with a target
// search publish a version without its vocabulary).
TEST_F(AdminServiceTest, DeletingTheSourceOfAQueuedJobDoesNotFailIt) {
  absl::Notification taken, deleted;
  Start(HoldFirstJob(&taken, &deleted));
  const v1::CompressModelResponse resp = CompressTiny(/*activate=*/true);
  ASSERT_TRUE(taken.WaitForNotificationWithTimeout(absl::Seconds(60)));
  {
    grpc::ClientContext c;
    Authorize(&c, kToken);
    v1::DeleteVersionRequest r;
    r.set_model_name("tiny");
    r.set_version(1);
    v1::DeleteVersionResponse out;
    const grpc::Status s = admin_stub_->DeleteVersion(&c, r, &out);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(VersionDirs("tiny").empty());
  deleted.Notify();
  const v1::Job j = WaitJob(resp.job_id());
  ASSERT_EQ(j.state(), v1::Job::SUCCEEDED) << j.error();
  EXPECT_EQ(VersionDirs("tiny"), std::vector<std::string>({"2"}));
  EXPECT_TRUE(std::filesystem::is_regular_file(repo_.path() + "/tiny/2/vocab.txt"));
  v1::ClassifyResponse cr;
  ASSERT_TRUE(Classify("tiny", 2, &cr).ok());
  EXPECT_TRUE(Eventually([&] { return StagingEmpty(); }));
}

TEST_F(AdminServiceTest, CompressLoadUnloadDeleteOnOwnPort) {
  AdminServerOptions ao;
  ao.own_port = true;
  ao.host = "127.0.0.1";
  ao.port = 0;
  Start(ao);
  ASSERT_GT(admin_->port(), 0);
  ASSERT_NE(admin_->port(), server_->port());
  {  // The inference port does not serve Admin when it has its own.
    auto other = v1::Admin::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::ListJobsResponse resp;
    EXPECT_EQ(other->ListJobs(&ctx, v1::ListJobsRequest(), &resp).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  grpc::ClientContext ctx;
  Authorize(&ctx, kToken);
  v1::CompressModelRequest req;
  req.set_model_name("tiny");
  req.mutable_compression()->set_ratio(4);
  req.set_activate(true);
  v1::CompressModelResponse resp;
  grpc::Status s = admin_stub_->CompressModel(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.version(), 2);
  v1::Job j = WaitJob(resp.job_id());
  ASSERT_EQ(j.state(), v1::Job::SUCCEEDED) << j.error();
  EXPECT_EQ(j.source_version(), 1);
  EXPECT_EQ(j.report().layers(0).rank(), 16);
  v1::ClassifyResponse cr;
  ASSERT_TRUE(Classify("tiny", std::nullopt, &cr).ok());
  EXPECT_EQ(cr.model_version(), 2);
  {  // What the source's config.json decides is refused by the call, and no job is made.
    auto refused = [&](int64_t source, const v1::CompressionSpec& spec) {
      grpc::ClientContext c;
      Authorize(&c, kToken);
      v1::CompressModelRequest r;
      r.set_model_name("tiny");
      r.set_source_version(source);
      *r.mutable_compression() = spec;
      v1::CompressModelResponse out;
      const grpc::Status st = admin_stub_->CompressModel(&c, r, &out);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
      return st.error_message();
    };
    const size_t jobs = ListJobs().size();
    v1::CompressionSpec three;  // tiny has 2 layers
    for (int r : {8, 8, 8}) three.mutable_ranks()->add_ranks(r);
    EXPECT_EQ(refused(1, three), "ranks has 3 entries but the model has 2 layers");
    v1::CompressionSpec rank4;
    rank4.set_rank(4);
    EXPECT_EQ(refused(2, rank4),
              "version 2 of 'tiny' is already collaborative; compress the original version instead");
    EXPECT_EQ(ListJobs().size(), jobs);
  }

  {  // Unload 2: 1 serves again (loaded first, so the model is never without a version).
    grpc::ClientContext c;
    Authorize(&c, kToken);
    v1::UnloadModelRequest r;
    r.set_model_name("tiny");
    r.set_version(2);
    v1::UnloadModelResponse out;
    ASSERT_TRUE(admin_stub_->UnloadModel(&c, r, &out).ok());
    ASSERT_TRUE(Classify("tiny", std::nullopt, &cr).ok());
    EXPECT_EQ(cr.model_version(), 1);
    // ListModels says why 2 is not served, and that nothing else holds 1.
    const v1::ModelVersionStatus two = StatusOf("tiny", 2), one = StatusOf("tiny", 1);
    EXPECT_EQ(two.state(), "unloaded");
    EXPECT_TRUE(two.unloaded_by_admin());
    EXPECT_FALSE(two.pinned());
    EXPECT_FALSE(one.pinned() || one.unloaded_by_admin());
  }
  {  // Load 2 again.
    grpc::ClientContext c;
    Authorize(&c, kToken);
    v1::LoadModelRequest r;
    r.set_model_name("tiny");
    r.set_version(2);
    v1::LoadModelResponse out;
    ASSERT_TRUE(admin_stub_->LoadModel(&c, r, &out).ok());
    ASSERT_TRUE(Classify("tiny", 2, &cr).ok());
    const v1::ModelVersionStatus two = StatusOf("tiny", 2);
    EXPECT_EQ(two.state(), "available");
    EXPECT_TRUE(two.pinned());
    EXPECT_FALSE(two.unloaded_by_admin());
  }
  EXPECT_THAT(server_->metrics().TextFormat(),
              HasSubstr("collabserve_model_fidelity_agreement{model=\"tiny\",version=\"2\"}"));
  {  // Delete 2: gone from disk, its metrics removed, 1 serves.
    grpc::ClientContext c;
    Authorize(&c, kToken);
    v1::DeleteVersionRequest r;
    r.set_model_name("tiny");
    r.set_version(2);
    v1::DeleteVersionResponse out;
    ASSERT_TRUE(admin_stub_->DeleteVersion(&c, r, &out).ok());
    EXPECT_EQ(VersionDirs("tiny"), std::vector<std::string>({"1"}));
    ASSERT_TRUE(Classify("tiny", std::nullopt, &cr).ok());
    EXPECT_EQ(cr.model_version(), 1);
    EXPECT_TRUE(Eventually([&] {  // the version's gauges go when its servable is unloaded
      return server_->metrics().TextFormat().find(
                 "collabserve_model_fidelity_agreement{model=\"tiny\",version=\"2\"}") ==
             std::string::npos;
    }));
    // The next job's version is 3: the deleted 2 names another checkpoint to whoever knew it.
    grpc::ClientContext c3;
    Authorize(&c3, kToken);
    v1::CompressModelResponse again;
    ASSERT_TRUE(admin_stub_->CompressModel(&c3, req, &again).ok());
    EXPECT_EQ(again.version(), 3);
    EXPECT_EQ(WaitJob(again.job_id()).state(), v1::Job::SUCCEEDED);
  }
  {  // Unknown things.
    grpc::ClientContext c;
    Authorize(&c, kToken);
    v1::LoadModelRequest r;
    r.set_model_name("tiny");
    r.set_version(9);
    v1::LoadModelResponse out;
    EXPECT_EQ(admin_stub_->LoadModel(&c, r, &out).error_code(), grpc::StatusCode::NOT_FOUND);
    grpc::ClientContext c2;
    Authorize(&c2, kToken);
    v1::CompressModelRequest cr2;
    cr2.set_model_name("nope");
    cr2.mutable_compression()->set_rank(4);
    v1::CompressModelResponse out2;
    EXPECT_EQ(admin_stub_->CompressModel(&c2, cr2, &out2).error_code(),
              grpc::StatusCode::NOT_FOUND);
    grpc::ClientContext c3;
    Authorize(&c3, kToken);
    v1::GetJobRequest g;
    g.set_job_id("no-such-job");
    v1::GetJobResponse gr;
    EXPECT_EQ(admin_stub_->GetJob(&c3, g, &gr).error_code(), grpc::StatusCode::NOT_FOUND);
  }
}

// Threads of this process by Linux scheduling policy and nice value: (policy, nice) per thread.
std::vector<std::pair<int, int>> ThreadPriorities() {
  std::vector<std::pair<int, int>> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const pid_t tid = static_cast<pid_t>(std::stoi(e.path().filename().string()));
    const int policy = ::sched_getscheduler(tid);
    errno = 0;
    const int nice = ::getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
    if (policy >= 0 && errno == 0) out.emplace_back(policy, nice);
  }
  return out;
}

int CountThreads(int policy, int nice) {
  const auto all = ThreadPriorities();
  return static_cast<int>(std::count(all.begin(), all.end(), std::make_pair(policy, nice)));
}

TEST_F(AdminServiceTest, JobWorkersRunAtIdlePriorityAndInferenceDoesNot) {
  ASSERT_EQ(CountThreads(SCHED_IDLE, 0), 0);
  AdminServerOptions ao;
  ao.service.jobs.max_concurrent_jobs = 2;
  Start(ao);
  // Both job workers switch to SCHED_IDLE when they start; nothing else does.
  EXPECT_TRUE(Eventually([] { return CountThreads(SCHED_IDLE, 0) == 2; }))
      << CountThreads(SCHED_IDLE, 0);
  EXPECT_EQ(::sched_getscheduler(0), SCHED_OTHER);
  // A job on those workers (validate, compress with CP-ALS, fidelity, publish, load) ends as usual
  // and classification still answers at normal priority.
  v1::UploadHeader h = Header("idle");
  h.mutable_compression()->set_rank(4);
  h.set_activate(true);
  v1::UploadModelResponse r;
  ASSERT_TRUE(Upload(h, &r).ok());
  v1::Job j = WaitJob(r.job_id());
  EXPECT_EQ(j.state(), v1::Job::SUCCEEDED) << j.error();
  v1::ClassifyResponse cr;
  grpc::Status s = Classify("idle", std::nullopt, &cr);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(CountThreads(SCHED_IDLE, 0), 2);
}

TEST_F(AdminServiceTest, JobWorkersUseNiceWithoutIdlePriority) {
  const int nice10_before = CountThreads(SCHED_OTHER, 10);
  AdminServerOptions ao;
  ao.service.jobs.idle_priority = false;
  ao.service.jobs.nice = 10;
  Start(ao);
  EXPECT_TRUE(Eventually([&] { return CountThreads(SCHED_OTHER, 10) == nice10_before + 1; }));
  EXPECT_EQ(CountThreads(SCHED_IDLE, 0), 0);
}

}  // namespace
}  // namespace collabserve::service
