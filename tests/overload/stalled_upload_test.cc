// A stalled Admin.UploadModel stream (issue 7, slow clients): the server ends it after
// --upload_idle_timeout_s with a status naming the limit, the job fails saying the same, the
// staging directory is removed, and the server goes on serving. An upload that keeps sending is
// not cut.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"
#include "server/service/admin_server.h"
#include "server/service/server.h"
#include "tests/admin/admin_server_fixture.h"
#include "tests/admin/admin_test_util.h"
#include "tests/overload/overload_test_util.h"
#include "tests/service/test_util.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::Authorize;
using ::collabserve::testing::ClassifyRequestFor;
using ::collabserve::testing::Eventually;
using ::collabserve::testing::HeaderFor;
using ::testing::HasSubstr;

constexpr char kToken[] = "overload-test-token";

class StalledUploadTest : public testing::AdminServerTest {
 protected:
  StalledUploadTest() : AdminServerTest(kToken, /*upload_seed=*/3) {}

  // own_admin_port: the Admin service on its own port (--admin_port) instead of the inference one.
  void Start(absl::Duration upload_idle_timeout, bool own_admin_port = false) {
    ServerOptions o = Options();
    o.upload_idle_timeout = upload_idle_timeout;
    AdminServerOptions ao;
    ao.service.max_upload_bytes = 64 << 20;
    ao.own_port = own_admin_port;
    StartServer(o, ao);
  }

  // Entries under the repository's staging directory (uploads being received or processed).
  int StagingEntries() {
    const std::string dir = repo_.path() + "/.staging";
    std::error_code ec;
    if (!std::filesystem::exists(dir, ec)) return 0;
    int n = 0;
    for (auto it = std::filesystem::directory_iterator(dir, ec);
         !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
      ++n;
    }
    return n;
  }

  void ExpectServing() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::ClassifyResponse r;
    grpc::Status s = inference_->Classify(&ctx, ClassifyRequestFor("tiny", {"still here"}), &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  // Starts an upload, sends half of the weights, then nothing: the server must end the call
  // after the idle limit, end the job and remove its staging directory, and keep serving.
  void ExpectStalledUploadEnded() {
    const std::string weights = files_.count("model.safetensors") ? "model.safetensors"
                                                                  : "pytorch_model.bin";
    ASSERT_GT(files_[weights].size(), 2u);

    grpc::ClientContext ctx;
    Authorize(&ctx, kToken);  // a 60 s deadline: the idle limit must end the call well before
    v1::UploadModelResponse response;
    auto writer = admin_stub_->UploadModel(&ctx, &response);
    v1::UploadModelRequest req;
    *req.mutable_header() = HeaderFor("stalled", files_);
    ASSERT_TRUE(writer->Write(req));
    v1::UploadModelRequest chunk;
    chunk.mutable_chunk()->set_file_name(weights);
    chunk.mutable_chunk()->set_offset(0);
    chunk.mutable_chunk()->set_data(files_[weights].substr(0, files_[weights].size() / 2));
    ASSERT_TRUE(writer->Write(chunk));
    // The upload is being staged...
    ASSERT_TRUE(Eventually([&] { return StagingEntries() > 0; }));
    // ... and then the client sends nothing more (no WritesDone either) and waits for the status.
    grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("--upload_idle_timeout_s"));
    EXPECT_THAT(st.error_message(), HasSubstr("sent no upload data"));
    EXPECT_GE(server_->idle_watchdog().calls_ended(), 1);

    // The job failed, saying why as the client's status does, and its staging directory is gone.
    ASSERT_TRUE(Eventually([&] {
      std::vector<v1::Job> jobs = ListJobs();
      return jobs.size() == 1 &&
             (jobs[0].state() == v1::Job::FAILED || jobs[0].state() == v1::Job::CANCELLED);
    }));
    const v1::Job job = ListJobs()[0];
    EXPECT_EQ(job.state(), v1::Job::FAILED) << job.error();
    EXPECT_THAT(job.error(), HasSubstr("sent no upload data"));
    EXPECT_THAT(job.error(), HasSubstr("--upload_idle_timeout_s"));
    std::printf("stalled upload: client status %d \"%s\"; job %s: %s\n",
                static_cast<int>(st.error_code()), st.error_message().c_str(),
                v1::Job::State_Name(job.state()).c_str(), job.error().c_str());
    EXPECT_TRUE(Eventually([&] { return StagingEntries() == 0; }));
    EXPECT_FALSE(std::filesystem::exists(repo_.path() + "/stalled"));
    ExpectServing();
  }

};

TEST_F(StalledUploadTest, UploadThatStopsSendingIsEndedAndItsStagingRemoved) {
  Start(absl::Seconds(1));
  ExpectStalledUploadEnded();
}

TEST_F(StalledUploadTest, StalledUploadOnTheOwnAdminPortIsEndedToo) {
  Start(absl::Seconds(1), /*own_admin_port=*/true);
  ExpectStalledUploadEnded();
}

TEST_F(StalledUploadTest, UploadThatKeepsSendingIsNotCut) {
  // Chunks every 100 ms for longer than the limit: the clock restarts at every chunk.
  Start(absl::Seconds(3));
  grpc::ClientContext ctx;
  Authorize(&ctx, kToken);
  v1::UploadModelResponse response;
  auto writer = admin_stub_->UploadModel(&ctx, &response);
  v1::UploadModelRequest req;
  *req.mutable_header() = HeaderFor("steady", files_);
  ASSERT_TRUE(writer->Write(req));
  size_t total = 0;
  for (const auto& [name, content] : files_) total += content.size();
  const size_t chunk_size = std::max<size_t>(1, total / 50);
  const absl::Time start = absl::Now();
  for (const auto& [name, content] : files_) {
    for (size_t off = 0; off < content.size(); off += chunk_size) {
      v1::UploadModelRequest c;
      c.mutable_chunk()->set_file_name(name);
      c.mutable_chunk()->set_offset(static_cast<int64_t>(off));
      c.mutable_chunk()->set_data(content.substr(off, chunk_size));
      ASSERT_TRUE(writer->Write(c)) << "the server ended the upload after "
                                    << absl::FormatDuration(absl::Now() - start);
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_GT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(server_->idle_watchdog().calls_ended(), 0);
  ExpectServing();
}

}  // namespace
}  // namespace collabserve::service
