// Client against a real in-process server: retries with backoff on RESOURCE_EXHAUSTED and
// UNAVAILABLE, inside the caller's deadline, and no retry of other errors; the load generator.
#include "client/client.h"

#include "client/bench.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/service/model_servable.h"
#include "server/service/server.h"
#include "tests/service/test_util.h"
#include "tests/service/local_server_options.h"

namespace collabserve::client {
namespace {

using ::collabserve::testing::Eventually;
using ::collabserve::testing::Gate;
using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::TempDir;
using std::chrono::milliseconds;

v1::ClassifyRequest Request(const std::string& model, const std::string& text) {
  v1::ClassifyRequest r;
  r.set_model_name(model);
  r.add_inputs()->set_text(text);
  return r;
}

// Counts the retries a client makes.
RetryOptions CountingRetries(std::atomic<int>* retries, int max_attempts) {
  RetryOptions r;
  r.max_attempts = max_attempts;
  r.initial_backoff = milliseconds(5);
  r.max_backoff = milliseconds(40);
  r.on_retry = [retries](const absl::Status&, int) { retries->fetch_add(1); };
  return r;
}

class ClientRetryTest : public ::testing::Test {
 protected:
  void SetUp() override { MakeTinyModel(repo_.path() + "/tiny/1", 1); }
  void TearDown() override {
    gate_.Open();
    if (server_) server_->Shutdown();
  }

  void Start() {
    service::ServerOptions o = testing::LocalServerOptions(repo_.path());
    o.servable.batching.max_batch_size = 1;
    o.servable.batching.max_queue_size = 1;
    o.servable.batching.max_queue_delay_micros = 500;
    o.servable.before_batch_hook = [this] { gate_.Pass(); };
    server_ = std::make_unique<service::Server>(o);
    absl::Status s = server_->Start();
    ASSERT_TRUE(s.ok()) << s;
  }

  std::unique_ptr<Client> Connect(RetryOptions retry, milliseconds deadline = milliseconds(60000)) {
    ClientOptions co;
    co.address = absl::StrCat("127.0.0.1:", server_->port());
    co.default_deadline = deadline;
    co.retry = std::move(retry);
    auto c = Client::Create(co);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  TempDir repo_;
  Gate gate_;
  std::unique_ptr<service::Server> server_;
};

TEST_F(ClientRetryTest, RetriesAFullQueueUntilItDrains) {
  Start();
  std::atomic<int> retries{0};
  auto client = Connect(CountingRetries(&retries, 1000));
  // One input held in the model, one queued: the queue (size 1) is full.
  auto stub = client->stub();
  struct Held {
    grpc::ClientContext ctx;
    v1::ClassifyRequest req;
    v1::ClassifyResponse resp;
    grpc::Status status;
    absl::Notification done;
  } running, queued;
  for (Held* h : {&running, &queued}) {
    h->req = Request("tiny", h == &running ? "running" : "queued");
    h->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }
  gate_.Close();
  stub->async()->Classify(&running.ctx, &running.req, &running.resp, [&](grpc::Status s) {
    running.status = std::move(s);
    running.done.Notify();
  });
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  stub->async()->Classify(&queued.ctx, &queued.req, &queued.resp, [&](grpc::Status s) {
    queued.status = std::move(s);
    queued.done.Notify();
  });
  auto servable = std::static_pointer_cast<service::ModelServable>(*server_->repository()->Get("tiny"));
  ASSERT_TRUE(Eventually([&] { return servable->scheduler_stats().tasks_scheduled == 2; }));

  absl::StatusOr<v1::ClassifyResponse> result;
  std::thread caller([&] { result = client->Classify(Request("tiny", "retried until it fits")); });
  ASSERT_TRUE(Eventually([&] { return retries.load() >= 2; }));  // refused, waited, refused again
  gate_.Open();
  caller.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->results_size(), 1);
  running.done.WaitForNotification();
  queued.done.WaitForNotification();
  EXPECT_TRUE(running.status.ok());
  EXPECT_TRUE(queued.status.ok());
}

TEST_F(ClientRetryTest, OtherErrorsAreNotRetried) {
  Start();
  std::atomic<int> retries{0};
  auto client = Connect(CountingRetries(&retries, 1000));
  auto r = client->Classify(Request("nope", "x"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  v1::ClassifyRequest empty;
  empty.set_model_name("tiny");
  r = client->Classify(empty);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(retries.load(), 0);
}

TEST(ClientRetryDeadlineTest, AnUnreachableServerIsRetriedOnlyWithinTheDeadline) {
  std::atomic<int> retries{0};
  ClientOptions co;
  co.address = "127.0.0.1:1";  // nothing listens on port 1
  co.default_deadline = milliseconds(500);
  co.retry = CountingRetries(&retries, 1000000);
  auto client = Client::Create(co);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time start = absl::Now();
  auto r = (*client)->ListModels();
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(r.status().code() == absl::StatusCode::kUnavailable ||
              r.status().code() == absl::StatusCode::kDeadlineExceeded)
      << r.status();
  EXPECT_GE(retries.load(), 1);
  // The deadline bounds the whole call, not each attempt (a million attempts would take hours).
  EXPECT_LT(took, absl::Seconds(10));

  retries = 0;
  co.retry = CountingRetries(&retries, 1);
  client = Client::Create(co);
  ASSERT_TRUE(client.ok());
  EXPECT_FALSE((*client)->IsServing().ok());
  EXPECT_EQ(retries.load(), 0);
}

TEST(ClientRetryDeadlineTest, BadRetryOptionsAreRejected) {
  ClientOptions co;
  co.retry.max_attempts = 0;
  EXPECT_EQ(Client::Create(co).status().code(), absl::StatusCode::kInvalidArgument);
  co.retry.max_attempts = 3;
  co.retry.max_backoff = milliseconds(1);
  co.retry.initial_backoff = milliseconds(10);
  EXPECT_EQ(Client::Create(co).status().code(), absl::StatusCode::kInvalidArgument);
  co.retry.max_backoff = milliseconds(100);
  co.retry.backoff_multiplier = 0.5;
  EXPECT_EQ(Client::Create(co).status().code(), absl::StatusCode::kInvalidArgument);
}

// The load generator against a real server, with each API (kStream: 8 workers over the default one
// stream, and over 3 streams of 3, 3 and 2): every request it was allowed is sent and answered, and the figures it reports are
// consistent.
TEST(BenchAgainstServerTest, EveryRequestIsAnsweredWithEitherApi) {
  TempDir repo;
  MakeTinyModel(repo.path() + "/tiny/1", 1);
  service::ServerOptions o = testing::LocalServerOptions(repo.path());
  service::Server server(o);
  absl::Status s = server.Start();
  ASSERT_TRUE(s.ok()) << s;
  ClientOptions co;
  co.address = absl::StrCat("127.0.0.1:", server.port());
  co.retry.max_attempts = 1;
  auto client = Client::Create(co);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::pair<BenchApi, int> apis[] = {
      {BenchApi::kCallback, 0}, {BenchApi::kThreads, 0}, {BenchApi::kStream, 0}, {BenchApi::kStream, 3}};
  for (const auto& [api, streams] : apis) {
    SCOPED_TRACE(absl::StrCat("api ", static_cast<int>(api), ", streams ", streams));
    BenchOptions b;
    b.model = "tiny";
    b.api = api;
    b.streams = streams;
    b.concurrency = 8;
    b.duration_s = 120;  // the request count ends the run
    b.max_requests = 64;
    b.inputs_per_request = 2;
    b.lengths = {8, 16};
    auto r = RunBench(**client, b);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->requests, 64) << r->first_error;
    EXPECT_EQ(r->errors, 0) << r->first_error;
    EXPECT_DOUBLE_EQ(r->inputs_per_s, 2 * r->requests_per_s);
    EXPECT_GT(r->p50_ms, 0);
    EXPECT_LE(r->p50_ms, r->p90_ms);
    EXPECT_LE(r->p90_ms, r->p99_ms);
    EXPECT_GE(r->client_cpu_s, 0);
  }
  server.Shutdown();
}

}  // namespace
}  // namespace collabserve::client
