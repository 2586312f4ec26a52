// Helpers for the overload tests: an in-process Server on 127.0.0.1:0 over the tiny checkpoint
// (the batch thread can be held at a gate), resident memory, and latency percentiles.
#ifndef COLLABSERVE_TESTS_OVERLOAD_OVERLOAD_TEST_UTIL_H_
#define COLLABSERVE_TESTS_OVERLOAD_OVERLOAD_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtest/gtest.h"
#include "server/service/server.h"
#include "server/util/process_memory.h"
#include "tests/service/test_util.h"
#include "tests/service/local_server_options.h"

namespace collabserve::testing {

// VmRSS of this process in bytes (0 if /proc is unreadable).
inline int64_t ResidentBytes() {
  absl::StatusOr<util::ProcessMemory> m = util::ReadProcessMemory();
  return m.ok() ? m->rss_bytes : 0;
}

// The q-quantile (0..1) of `v` in milliseconds; 0 for an empty vector.
inline double PercentileMs(std::vector<absl::Duration> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return absl::ToDoubleMilliseconds(v[i]);
}

inline v1::ClassifyRequest ClassifyRequestFor(const std::string& model,
                                              const std::vector<std::string>& texts) {
  v1::ClassifyRequest r;
  r.set_model_name(model);
  for (const auto& t : texts) r.add_inputs()->set_text(t);
  return r;
}

// A Server over one tiny model ("tiny", version 1) whose batch thread passes `gate`.
class OverloadServer {
 public:
  OverloadServer() { MakeTinyModel(repo_.path() + "/tiny/1", 1); }
  ~OverloadServer() {
    gate_.Open();
    if (server_) server_->Shutdown();
  }

  service::ServerOptions Options() {
    service::ServerOptions o = testing::LocalServerOptions(repo_.path());
    o.drain_timeout = absl::Seconds(10);
    o.servable.batching.max_queue_delay_micros = 500;
    o.servable.before_batch_hook = [this] { gate_.Pass(); };
    o.torch_version = "test";
    return o;
  }

  void Start(service::ServerOptions o) {
    server_ = std::make_unique<service::Server>(std::move(o));
    absl::Status s = server_->Start();
    ASSERT_TRUE(s.ok()) << s;
    stub_ = NewStub();
  }

  // A stub on a channel of its own (its own HTTP/2 connection).
  std::unique_ptr<v1::Inference::Stub> NewStub(const grpc::ChannelArguments& args = {}) {
    return v1::Inference::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args));
  }

  grpc::Status Classify(const v1::ClassifyRequest& req, v1::ClassifyResponse* resp,
                        v1::Inference::Stub* stub = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return (stub != nullptr ? stub : stub_.get())->Classify(&ctx, req, resp);
  }

  service::Server& server() { return *server_; }
  v1::Inference::Stub& stub() { return *stub_; }
  Gate& gate() { return gate_; }
  const std::string& repo() const { return repo_.path(); }

 private:
  TempDir repo_;
  Gate gate_;
  std::unique_ptr<service::Server> server_;
  std::unique_ptr<v1::Inference::Stub> stub_;
};

}  // namespace collabserve::testing

#endif  // COLLABSERVE_TESTS_OVERLOAD_OVERLOAD_TEST_UTIL_H_
