// The fixture of the REST endpoint's tests (kserve_http_test, tei_http_test): a real Server on a
// temporary repository with the KServe service attached, every batch passing a gate the test can
// close, and the HTTP server on 127.0.0.1:0 in front of the Server's in-process channel.
#ifndef COLLABSERVE_TESTS_KSERVE_REST_TEST_SERVER_H_
#define COLLABSERVE_TESTS_KSERVE_REST_TEST_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "grpcpp/channel.h"
#include "gtest/gtest.h"
#include "server/service/http_server.h"
#include "server/service/kserve_service.h"
#include "server/service/server.h"
#include "tests/service/local_server_options.h"
#include "tests/service/test_util.h"

namespace collabserve::service {

class RestTestServer : public ::testing::Test {
 protected:
  void TearDown() override {
    gate_.Open();
    http_.reset();
    if (server_) server_->Shutdown();
  }

  // The Server's options: LocalServerOptions on repo_, 8 inputs per request, the gate, KServe.
  ServerOptions BaseOptions() {
    ServerOptions o = testing::LocalServerOptions(repo_.path());
    o.inference.max_inputs_per_request = 8;
    o.torch_version = "test";
    o.servable.before_batch_hook = [this] { gate_.Pass(); };
    o.extra_services.push_back(&kserve_);
    return o;
  }
  // Starts the Server with `o` and the HTTP server (host and port set here) with the handler
  // `handler` makes of the in-process channel; loads the models when `load`.
  void StartWith(ServerOptions o, HttpServerOptions http,
                 const std::function<HttpHandler(std::shared_ptr<grpc::Channel>)>& handler,
                 bool load) {
    server_ = std::make_unique<Server>(std::move(o));
    absl::Status s = server_->StartServing();
    ASSERT_TRUE(s.ok()) << s;
    http.host = "127.0.0.1";
    http.port = 0;
    auto started = HttpServer::Start(http, handler(server_->InProcessChannel()));
    ASSERT_TRUE(started.ok()) << started.status();
    http_ = *std::move(started);
    port_ = http_->port();
    if (load) LoadModels();
  }
  void LoadModels() {
    absl::Status s = server_->LoadModels();
    ASSERT_TRUE(s.ok()) << s;
    kserve_.Attach(&server_->inference_service(), server_->repository(), &server_->metrics());
  }
  std::string GrpcAddress() const { return "127.0.0.1:" + std::to_string(server_->port()); }

  testing::TempDir repo_;
  testing::Gate gate_;  // every batch passes it: closed, it holds forward passes back
  KServeService kserve_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<HttpServer> http_;
  int port_ = 0;
};

}  // namespace collabserve::service

#endif  // COLLABSERVE_TESTS_KSERVE_REST_TEST_SERVER_H_
