// The in-process server with the Admin service that the admin and stalled-upload tests start: a
// repository holding one tiny model (tiny/1), a tiny checkpoint to upload (files_), the Server on a
// free port of 127.0.0.1 (no polling, no metrics) with the Admin service on it or on its own port,
// and a stub for each service.
#ifndef COLLABSERVE_TESTS_ADMIN_ADMIN_SERVER_FIXTURE_H_
#define COLLABSERVE_TESTS_ADMIN_ADMIN_SERVER_FIXTURE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "collabserve/v1/admin.grpc.pb.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"
#include "server/service/admin_server.h"
#include "server/service/server.h"
#include "tests/admin/admin_test_util.h"
#include "tests/service/test_util.h"
#include "tests/service/local_server_options.h"

namespace collabserve::testing {

class AdminServerTest : public ::testing::Test {
 protected:
  // token: the Admin service's bearer token; upload_seed: the seed of the checkpoint in files_.
  AdminServerTest(std::string token, uint64_t upload_seed)
      : token_(std::move(token)), upload_seed_(upload_seed) {}

  void SetUp() override {
    MakeTinyModel(repo_.path() + "/tiny/1", 1);
    model::MakeOptions mo;
    mo.preset = "tiny";
    mo.seed = upload_seed_;
    mo.label_names = {"negative", "positive"};
    ASSERT_TRUE(model::MakeCheckpoint(src_.path() + "/m", mo).ok());
    files_ = ReadDir(src_.path() + "/m");
  }
  void TearDown() override {
    if (admin_) admin_->Shutdown();
    if (server_) server_->Shutdown();
  }

  // The server's options for this test: LocalServerOptions of the repository, a 5 s drain.
  service::ServerOptions Options() const {
    service::ServerOptions o = LocalServerOptions(repo_.path());
    o.drain_timeout = absl::Seconds(5);
    o.torch_version = "test";
    return o;
  }

  // Starts the server with `o` and the Admin service with `ao` (its token and host set here), and
  // the stubs: the Admin stub on the Admin service's own port when it has one.
  void StartServer(service::ServerOptions o, service::AdminServerOptions ao) {
    ao.token = token_;
    ao.host = "127.0.0.1";
    auto admin = service::AdminServer::Create(ao, &o);
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
    server_ = std::make_unique<service::Server>(o);
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_TRUE(admin_->Start(server_.get()).ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    inference_ = v1::Inference::NewStub(channel);
    admin_stub_ = v1::Admin::NewStub(
        admin_->port() >= 0 ? grpc::CreateChannel(absl::StrCat("127.0.0.1:", admin_->port()),
                                                  grpc::InsecureChannelCredentials())
                            : channel);
  }

  std::vector<v1::Job> ListJobs() {
    grpc::ClientContext ctx;
    Authorize(&ctx, token_);
    v1::ListJobsResponse resp;
    grpc::Status s = admin_stub_->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {resp.jobs().begin(), resp.jobs().end()};
  }

  const std::string token_;
  const uint64_t upload_seed_;
  TempDir repo_, src_;
  std::map<std::string, std::string> files_;
  std::unique_ptr<service::AdminServer> admin_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Admin::Stub> admin_stub_;
};

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_ADMIN_ADMIN_SERVER_FIXTURE_H_
