// build/bin/collabserve with --admin_token_file as a subprocess, killed with SIGKILL in the middle
// of an upload and in the middle of a compression job, then restarted on the same repository: no
// partial version is ever visible, the old versions serve, and root/.staging is cleaned.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"
#include "server/util/files.h"
#include "tests/testing/server_process.h"
#include "tests/admin/admin_test_util.h"
#include "tests/service/test_util.h"

namespace collabserve {
namespace {

using ::collabserve::testing::Authorize;
using ::collabserve::testing::Eventually;
using ::collabserve::testing::HeaderFor;
using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::ReadDir;
using ::collabserve::testing::TempDir;

constexpr char kToken[] = "binary-test-token";


using ::collabserve::testing::ServerProcess;

class AdminBinaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeTinyModel(repo_.path() + "/tiny/1", 1);
    ASSERT_TRUE(util::WriteFileAtomic(tmp_.path() + "/token", std::string(kToken) + "\n").ok());
  }
  // The repository removes staging leftovers older than its process's start minus a 2 s margin
  // (entries newer than that may belong to another live process), and the start time it reads
  // from /proc has one second of rounding; a real restart takes longer than this.
  void WaitOutRestartMargin() { absl::SleepFor(absl::Milliseconds(3500)); }

  std::unique_ptr<ServerProcess> Start() {
    auto p = std::make_unique<ServerProcess>(
        std::vector<std::string>{"--host=127.0.0.1", "--port=0", "--metrics_port=-1",
                                 "--poll_interval_s=0", "--model_repository=" + repo_.path(),
                                 "--admin_token_file=" + tmp_.path() + "/token",
                                 // What is tested here is crash safety, not priority: at SCHED_IDLE
                                 // a job all but stops while other tests keep the CPUs busy.
                                 "--admin_job_idle_priority=false"},
        tmp_.path() + "/server.log");
    EXPECT_TRUE(p->serving()) << "see " << tmp_.path() << "/server.log";
    EXPECT_EQ(p->admin_port(), p->port());  // --admin_port=0: the inference port
    return p;
  }
  std::unique_ptr<v1::Admin::Stub> AdminStub(const ServerProcess& p) {
    return v1::Admin::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", p.admin_port()),
                                                  grpc::InsecureChannelCredentials()));
  }
  // The version the server answers with for `model`, or -1.
  int64_t ServedVersion(const ServerProcess& p, const std::string& model) {
    auto stub = v1::Inference::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", p.port()), grpc::InsecureChannelCredentials()));
    v1::ClassifyRequest req;
    req.set_model_name(model);
    req.add_inputs()->set_text("still serving after a crash");
    v1::ClassifyResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    grpc::Status s = stub->Classify(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return s.ok() ? resp.model_version() : -1;
  }
  std::vector<std::string> Entries(const std::string& rel) {
    std::vector<std::string> out;
    const std::string dir = repo_.path() + "/" + rel;
    if (!std::filesystem::exists(dir)) return out;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      out.push_back(e.path().filename().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  // What the repository root holds besides models: only an empty .staging may remain.
  void ExpectNoLeftovers() {
    EXPECT_TRUE(Entries(".staging").empty())
        << absl::StrJoin(Entries(".staging"), ", ") << "\n"
        << util::ReadFile(tmp_.path() + "/server.log").value_or("");
    for (const std::string& e : Entries("")) EXPECT_FALSE(absl::StartsWith(e, ".trash")) << e;
  }

  TempDir repo_, tmp_;
};

TEST_F(AdminBinaryTest, KillDuringUploadThenRestart) {
  model::MakeOptions mo;
  mo.preset = "tiny";
  mo.seed = 5;
  ASSERT_TRUE(model::MakeCheckpoint(tmp_.path() + "/src", mo).ok());
  auto files = ReadDir(tmp_.path() + "/src");
  {
    auto server = Start();
    auto stub = AdminStub(*server);
    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);
    v1::UploadModelResponse resp;
    auto writer = stub->UploadModel(&ctx, &resp);
    v1::UploadModelRequest req;
    *req.mutable_header() = HeaderFor("tiny", files);
    req.mutable_header()->mutable_compression()->set_rank(8);
    req.mutable_header()->set_activate(true);
    ASSERT_TRUE(writer->Write(req));
    const std::string& w = files["model.safetensors"];
    for (size_t off = 0; off < w.size() / 2; off += 64 << 10) {
      v1::UploadModelRequest c;
      c.mutable_chunk()->set_file_name("model.safetensors");
      c.mutable_chunk()->set_offset(off);
      c.mutable_chunk()->set_data(w.substr(off, 64 << 10));
      ASSERT_TRUE(writer->Write(c));
    }
    // The partial upload is on disk, in staging only: the job's directory and its claim (the
    // claim, held by the server, goes when the killed server's lock does, at the restart).
    ASSERT_TRUE(Eventually([&] { return Entries(".staging").size() == 2; }));
    const std::vector<std::string> staged = Entries(".staging");
    EXPECT_EQ(staged[0] + ".lock", staged[1]);
    EXPECT_EQ(Entries("tiny"), std::vector<std::string>({"1"}));
    server->Kill();
    ctx.TryCancel();
  }
  EXPECT_EQ(Entries("tiny"), std::vector<std::string>({"1"}));
  WaitOutRestartMargin();
  auto server = Start();
  EXPECT_EQ(ServedVersion(*server, "tiny"), 1);
  EXPECT_EQ(Entries("tiny"), std::vector<std::string>({"1"}));
  ExpectNoLeftovers();
}

TEST_F(AdminBinaryTest, KillDuringCompressionAndAfterPublishThenRestart) {
  model::MakeOptions mo;
  mo.preset = "mini";
  mo.seed = 9;
  ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/big/1", mo).ok());
  // Kill after the first layer is compressed (the job is writing into staging), then after the
  // version was published (the rename is done; loading may not be).
  for (v1::JobEvent::Kind kill_at : {v1::JobEvent::LAYER_COMPRESSED, v1::JobEvent::PUBLISHED}) {
    SCOPED_TRACE(v1::JobEvent::Kind_Name(kill_at));
    const std::vector<std::string> before = Entries("big");
    {
      auto server = Start();
      auto stub = AdminStub(*server);
      grpc::ClientContext ctx;
      Authorize(&ctx, kToken);
      v1::CompressModelRequest req;
      req.set_model_name("big");
      req.set_source_version(1);
      req.mutable_compression()->set_rank(64);
      if (kill_at == v1::JobEvent::LAYER_COMPRESSED) {
        req.mutable_compression()->set_max_iters(400);
        req.mutable_compression()->set_tol(1e-30);
      }
      req.set_activate(true);
      v1::CompressModelResponse resp;
      grpc::Status s = stub->CompressModel(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      grpc::ClientContext wctx;
      Authorize(&wctx, kToken);
      // The watch lasts as long as the compression takes to reach `kill_at`: ~5 s here, but over
      // a minute (Authorize's deadline) on 2 cores shared with three busy processes (nice 10).
      wctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
      v1::WatchJobRequest wreq;
      wreq.set_job_id(resp.job_id());
      auto reader = stub->WatchJob(&wctx, wreq);
      v1::WatchJobResponse r;
      bool reached = false;
      std::vector<std::string> seen;  // for the failure message
      while (reader->Read(&r)) {
        seen.push_back(absl::StrCat(v1::JobEvent::Kind_Name(r.event().kind()), " ", r.event().message()));
        if (r.event().kind() == kill_at) {
          reached = true;
          break;
        }
      }
      if (!reached) {
        const grpc::Status watch = reader->Finish();
        FAIL() << "the watch ended (" << watch.error_code() << " " << watch.error_message()
               << ") after: " << absl::StrJoin(seen, "; ") << "\n"
               << util::ReadFile(tmp_.path() + "/server.log").value_or("");
      }
      server->Kill();
      wctx.TryCancel();
    }
    const std::vector<std::string> after_kill = Entries("big");
    if (kill_at == v1::JobEvent::LAYER_COMPRESSED) {
      // Three more layers of 400 iterations were still to go: nothing was published.
      EXPECT_EQ(after_kill, before);
    } else {
      EXPECT_EQ(after_kill.size(), before.size() + 1);
    }
    WaitOutRestartMargin();
    auto server = Start();
    ExpectNoLeftovers();
    // Every version on disk is complete: the newest one serves, and each loads.
    const int64_t served = ServedVersion(*server, "big");
    EXPECT_EQ(served, std::stoll(after_kill.back()));
    for (const std::string& v : after_kill) {
      EXPECT_TRUE(std::filesystem::exists(repo_.path() + "/big/" + v + "/config.json")) << v;
    }
    EXPECT_EQ(ServedVersion(*server, "tiny"), 1);
  }
}

}  // namespace
}  // namespace collabserve
