// End-to-end tests of the Server: a real gRPC server on 127.0.0.1:0 with tiny checkpoints, driven
// through the generated stubs. The batch thread can be held at a gate, so that queueing, overflow,
// deadlines, cancellation and draining are tested without timing assumptions.
#include "server/service/server.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/tls.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "server/util/files.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/device.h"
#include "server/model/engine.h"
#include "server/service/model_servable.h"
#include "server/text/bert_tokenizer.h"
#include "tests/service/test_util.h"
#include "tests/service/local_server_options.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::Eventually;
using ::collabserve::testing::Gate;
using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::ParseMetrics;
using ::collabserve::testing::ScrapeMetrics;
using ::collabserve::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;
using HealthResponse = grpc::health::v1::HealthCheckResponse;

v1::ClassifyRequest Request(const std::string& model, std::vector<std::string> texts) {
  v1::ClassifyRequest r;
  r.set_model_name(model);
  for (auto& t : texts) r.add_inputs()->set_text(t);
  return r;
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { MakeTinyModel(repo_.path() + "/tiny/1", 1); }
  void TearDown() override {
    gate_.Open();
    if (server_) server_->Shutdown();
  }

  ServerOptions Options() {
    ServerOptions o = testing::LocalServerOptions(repo_.path());
    o.metrics_host = "127.0.0.1";
    o.metrics_port = 0;
    o.drain_timeout = absl::Seconds(20);
    o.servable.batching.max_queue_delay_micros = 500;
    o.servable.before_batch_hook = [this] { gate_.Pass(); };
    o.torch_version = "test";
    return o;
  }

  void Start(ServerOptions o) {
    server_ = std::make_unique<Server>(std::move(o));
    absl::Status s = server_->Start();
    ASSERT_TRUE(s.ok()) << s;
    Connect();
  }
  void Start() { Start(Options()); }

  void Connect() {
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Inference::NewStub(channel_);
    health_ = grpc::health::v1::Health::NewStub(channel_);
  }

  grpc::Status Classify(const v1::ClassifyRequest& req, v1::ClassifyResponse* resp,
                        absl::Duration deadline = absl::Seconds(30)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub_->Classify(&ctx, req, resp);
  }

  // SERVING / NOT_SERVING, or the RPC error code as a negative number.
  int Health(const std::string& service) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    HealthResponse resp;
    grpc::Status s = health_->Check(&ctx, req, &resp);
    if (!s.ok()) return -static_cast<int>(s.error_code());
    return resp.status();
  }

  std::shared_ptr<ModelServable> Servable(const std::string& model) {
    auto s = server_->repository()->Get(model);
    EXPECT_TRUE(s.ok()) << s.status();
    return std::static_pointer_cast<ModelServable>(*s);
  }

  std::map<std::string, double> Metrics() {
    auto text = ScrapeMetrics(server_->metrics_port());
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? ParseMetrics(*text) : std::map<std::string, double>{};
  }

  // An async unary call; done when `finished` is notified.
  struct AsyncCall {
    grpc::ClientContext ctx;
    v1::ClassifyRequest req;
    v1::ClassifyResponse resp;
    grpc::Status status;
    absl::Notification finished;
  };
  std::unique_ptr<AsyncCall> StartAsync(v1::ClassifyRequest req,
                                        absl::Duration deadline = absl::Seconds(60)) {
    auto call = std::make_unique<AsyncCall>();
    call->req = std::move(req);
    call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    AsyncCall* c = call.get();
    stub_->async()->Classify(&c->ctx, &c->req, &c->resp, [c](grpc::Status s) {
      c->status = std::move(s);
      c->finished.Notify();
    });
    return call;
  }

  TempDir repo_;
  Gate gate_;
  std::unique_ptr<Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

TEST_F(ServerTest, ServedLogitsEqualTheEnginesOwn) {
  Start();
  const std::vector<std::pair<std::string, std::string>> inputs = {
      {"a wonderful, heart-warming film", ""},
      {"The plot was dull and the acting worse.", ""},
      {"Is this a question?", "Yes, it is a question."},
      {"short", ""}};
  v1::ClassifyRequest req;
  req.set_model_name("tiny");
  for (const auto& [a, b] : inputs) {
    v1::Input* in = req.add_inputs();
    in->set_text(a);
    if (!b.empty()) in->set_text_pair(b);
  }
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.results_size(), 4);
  EXPECT_EQ(resp.model_name(), "tiny");
  EXPECT_EQ(resp.model_version(), 1);

  auto engine = model::Engine::Load(repo_.path() + "/tiny/1");
  ASSERT_TRUE(engine.ok()) << engine.status();
  int64_t total_tokens = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::optional<std::string_view> pair;
    if (!inputs[i].second.empty()) pair = inputs[i].second;
    auto enc = (*engine)->tokenizer().Encode(inputs[i].first, pair, (*engine)->info().max_length);
    ASSERT_TRUE(enc.ok());
    model::TokenizedInput in{enc->input_ids, enc->token_type_ids};
    auto pred = (*engine)->Run(std::vector<model::TokenizedInput>{in});
    ASSERT_TRUE(pred.ok()) << pred.status();
    const v1::Result& r = resp.results(i);
    ASSERT_EQ(r.logits_size(), static_cast<int>((*pred)[0].logits.size()));
    for (int j = 0; j < r.logits_size(); ++j) {
      EXPECT_NEAR(r.logits(j), (*pred)[0].logits[j], 1e-5) << "input " << i << " logit " << j;
    }
    EXPECT_EQ(r.label(), (*engine)->info().labels[(*pred)[0].label]);
    EXPECT_NEAR(r.score(), (*pred)[0].probabilities[(*pred)[0].label], 1e-5);
    EXPECT_EQ(r.num_tokens(), static_cast<int>(enc->input_ids.size()));
    total_tokens += r.num_tokens();
  }
  EXPECT_EQ(resp.num_tokens(), total_tokens);
  EXPECT_GE(resp.timings().total_us(), resp.timings().inference_us());
}

TEST_F(ServerTest, TopKAndRawScores) {
  Start();
  v1::ClassifyRequest req = Request("tiny", {"good", "bad"});
  req.mutable_options()->set_top_k(5);  // more than there are labels: all of them
  v1::ClassifyResponse probs;
  ASSERT_TRUE(Classify(req, &probs).ok());
  for (const auto& r : probs.results()) {
    ASSERT_EQ(r.top_k_size(), 2);
    EXPECT_EQ(r.top_k(0).label(), r.label());
    EXPECT_GE(r.top_k(0).score(), r.top_k(1).score());
    EXPECT_NEAR(r.top_k(0).score() + r.top_k(1).score(), 1.0, 1e-5);
  }
  req.mutable_options()->set_raw_scores(true);
  v1::ClassifyResponse raw;
  ASSERT_TRUE(Classify(req, &raw).ok());
  for (const auto& r : raw.results()) {
    const float best = std::max(r.logits(0), r.logits(1));
    EXPECT_FLOAT_EQ(r.score(), best);
    EXPECT_FLOAT_EQ(r.top_k(0).score(), best);
  }
}

TEST_F(ServerTest, EveryBadRequestGetsAnActionableError) {
  ServerOptions o = Options();
  o.inference.max_inputs_per_request = 4;
  o.inference.max_text_bytes = 4000;
  Start(o);
  struct Case {
    std::string name;
    v1::ClassifyRequest req;
    grpc::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"no model", Request("", {"x"}), grpc::StatusCode::INVALID_ARGUMENT, "model_name"});
  cases.push_back({"unknown model", Request("nope", {"x"}), grpc::StatusCode::NOT_FOUND, "nope"});
  {
    auto r = Request("tiny", {"x"});
    r.set_model_version(7);
    cases.push_back({"unknown version", r, grpc::StatusCode::NOT_FOUND, "7"});
    r.set_model_version(0);
    cases.push_back({"version 0", r, grpc::StatusCode::INVALID_ARGUMENT, "model_version"});
  }
  cases.push_back({"no inputs", Request("tiny", {}), grpc::StatusCode::INVALID_ARGUMENT, "no inputs"});
  cases.push_back({"too many inputs", Request("tiny", {"a", "b", "c", "d", "e"}),
                   grpc::StatusCode::INVALID_ARGUMENT, "--max_inputs_per_request"});
  cases.push_back({"empty text", Request("tiny", {"a", ""}), grpc::StatusCode::INVALID_ARGUMENT,
                   "inputs[1].text is empty"});
  cases.push_back({"text too large", Request("tiny", {std::string(4001, 'a')}),
                   grpc::StatusCode::INVALID_ARGUMENT, "--max_text_bytes"});
  {
    auto r = Request("tiny", {"a"});
    r.mutable_inputs(0)->set_text_pair(std::string(4001, 'b'));
    cases.push_back({"pair too large", r, grpc::StatusCode::INVALID_ARGUMENT, "text_pair"});
  }
  {
    auto r = Request("tiny", {"a"});
    r.mutable_options()->set_top_k(-1);
    cases.push_back({"negative top_k", r, grpc::StatusCode::INVALID_ARGUMENT, "top_k"});
  }
  {
    std::string long_text;
    for (int i = 0; i < 600; ++i) long_text += "word ";  // 602 tokens with [CLS]/[SEP]
    auto r = Request("tiny", {long_text});
    r.mutable_options()->set_truncate(false);
    cases.push_back({"over-long, truncate=false", r, grpc::StatusCode::INVALID_ARGUMENT, "inputs[0]"});
  }
  const int max_length = Servable("tiny")->info().max_length;
  ASSERT_LT(max_length, 602) << "the over-long case needs a longer text";
  for (const Case& c : cases) {
    v1::ClassifyResponse resp;
    grpc::Status s = Classify(c.req, &resp);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
  }
  // The server still serves.
  v1::ClassifyResponse resp;
  EXPECT_TRUE(Classify(Request("tiny", {"fine"}), &resp).ok());
}

TEST_F(ServerTest, TruncatesOverLongInputsByDefault) {
  Start();
  std::string long_text;
  for (int i = 0; i < 600; ++i) long_text += "word ";
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(Request("tiny", {long_text}), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.results(0).truncated());
  EXPECT_EQ(resp.results(0).num_tokens(), Servable("tiny")->info().max_length);
}

TEST_F(ServerTest, ConcurrentRequestsShareABatch) {
  Start();
  gate_.Close();
  auto first = StartAsync(Request("tiny", {"first"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));  // the batch thread is busy with `first`
  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < 8; ++i) calls.push_back(StartAsync(Request("tiny", {absl::StrCat("text ", i)})));
  auto servable = Servable("tiny");
  ASSERT_TRUE(Eventually([&] { return servable->scheduler_stats().tasks_scheduled == 9; }));
  gate_.Open();
  first->finished.WaitForNotification();
  EXPECT_TRUE(first->status.ok()) << first->status.error_message();
  for (auto& c : calls) {
    c->finished.WaitForNotification();
    EXPECT_TRUE(c->status.ok()) << c->status.error_message();
  }
  auto m = Metrics();
  EXPECT_EQ(m["collabserve_batch_size_count{model=\"tiny\"}"], 2);
  EXPECT_EQ(m["collabserve_batch_size_sum{model=\"tiny\"}"], 9);
  EXPECT_EQ(m["collabserve_requests_total{code=\"OK\",model=\"tiny\",version=\"1\"}"], 9);
}

// A text pair for a model with one token type would fail the forward pass of its whole batch, and
// so other callers' inputs: it is refused on its own, before it is queued.
TEST_F(ServerTest, APairForAModelWithOneTokenTypeIsRefusedAloneNotWithItsBatch) {
  model::MakeOptions single;
  single.type_vocab_size = 1;
  single.seed = 9;
  ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/single/1", single).ok());
  Start();
  gate_.Close();
  auto running = StartAsync(Request("single", {"running"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));  // the next inputs wait together for one batch
  auto good = StartAsync(Request("single", {"a text alone"}));
  v1::ClassifyRequest pair = Request("single", {"a text"});
  pair.mutable_inputs(0)->set_text_pair("and its pair");
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(pair, &resp, absl::Seconds(5));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("inputs[0].text_pair is given, but model single:1 has "
                                           "one token type (type_vocab_size 1)"));
  grpc::ClientContext ctx;
  v1::TokenizeRequest treq;
  treq.set_model_name("single");
  *treq.add_inputs() = pair.inputs(0);
  v1::TokenizeResponse tresp;
  s = stub_->Tokenize(&ctx, treq, &tresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("takes no text pairs"));
  gate_.Open();
  for (auto* c : {running.get(), good.get()}) {
    c->finished.WaitForNotification();
    EXPECT_TRUE(c->status.ok()) << c->status.error_message();
  }
  // The pair works on a model with two token types.
  pair.set_model_name("tiny");
  EXPECT_TRUE(Classify(pair, &resp).ok());
}

// Warm-up runs on the model's own special tokens: a vocabulary of 31 tokens (no id 1996) loads.
TEST_F(ServerTest, AModelWithASmallVocabularyWarmsUpAndServes) {
  std::string vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n";
  for (char c = 'a'; c <= 'z'; ++c) vocab += std::string(1, c) + "\n";
  const std::string vocab_path = repo_.path() + "/small-vocab.txt";
  std::ofstream(vocab_path) << vocab;
  model::MakeOptions small;
  small.vocab_path = vocab_path;
  ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/small/1", small).ok());
  Start();
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(Request("small", {"a b c"}), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.results(0).num_tokens(), 5);
}

TEST_F(ServerTest, QueueOverflowIsResourceExhaustedAndTheServerRecovers) {
  ServerOptions o = Options();
  o.servable.batching.max_batch_size = 1;
  o.servable.batching.max_queue_size = 2;
  Start(o);
  gate_.Close();
  auto running = StartAsync(Request("tiny", {"running"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  auto q1 = StartAsync(Request("tiny", {"queued one"}));
  auto q2 = StartAsync(Request("tiny", {"queued two"}));
  auto servable = Servable("tiny");
  ASSERT_TRUE(Eventually([&] { return servable->scheduler_stats().tasks_scheduled == 3; }));
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(Request("tiny", {"one too many"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("queue full"));
  EXPECT_THAT(s.error_message(), HasSubstr("--max_queue_size"));
  // Two inputs when one slot is... none free: also refused, all or nothing.
  s = Classify(Request("tiny", {"a", "b"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // More inputs than the whole queue holds can never be queued: the request's own fault.
  s = Classify(Request("tiny", {"a", "b", "c"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("queue holds at most 2 (--max_queue_size)"));
  gate_.Open();
  for (auto* c : {running.get(), q1.get(), q2.get()}) {
    c->finished.WaitForNotification();
    EXPECT_TRUE(c->status.ok()) << c->status.error_message();
  }
  s = Classify(Request("tiny", {"after the storm"}), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  auto m = Metrics();
  EXPECT_EQ(m["collabserve_requests_total{code=\"RESOURCE_EXHAUSTED\",model=\"tiny\",version=\"1\"}"], 2);
}

TEST_F(ServerTest, AnInputWhoseDeadlinePassedNeverReachesTheModel) {
  Start();
  gate_.Close();
  auto running = StartAsync(Request("tiny", {"running"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  auto late = StartAsync(Request("tiny", {"late", "later"}), absl::Milliseconds(300));
  late->finished.WaitForNotification();
  EXPECT_EQ(late->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server learns that the client gave up from the client's cancellation or from its own
  // deadline (the timeout counted from the call's arrival): on a loaded machine, after the client's
  // deadline, and until then it may rightly run the inputs. Let it see the end of the call before
  // the batch thread is free again: the cancellation (OnCancel), or its refusal at Schedule.
  ASSERT_TRUE(Eventually([&] {
    return server_->inference_service().cancellations() == 1 ||
           Metrics()["collabserve_requests_total{code=\"DEADLINE_EXCEEDED\",model=\"tiny\",version=\"1\"}"] == 1;
  }));
  gate_.Open();
  running->finished.WaitForNotification();
  EXPECT_TRUE(running->status.ok());
  auto servable = Servable("tiny");
  // gRPC also cancels the server side of a call whose deadline passed; whichever the scheduler
  // sees first, the two expired inputs are dropped from the queue, not run. On a loaded machine
  // the call may reach Schedule only after its deadline: then the scheduler refuses them (not
  // counted as accepted), which keeps them from the model just the same.
  ASSERT_TRUE(Eventually([&] {
    auto st = servable->scheduler_stats();
    return st.tasks_failed_deadline + st.tasks_failed_cancelled == st.tasks_scheduled - 1;
  }));
  EXPECT_EQ(servable->scheduler_stats().tasks_batched, 1);
  EXPECT_EQ(Metrics()["collabserve_batch_size_sum{model=\"tiny\"}"], 1);
  // The queue-time histogram counts every input that left the queue, the ones dropped there too
  // (those refused at Schedule never entered it). Observed just after the stats count the drop.
  EXPECT_TRUE(Eventually([&] {
    return Metrics()["collabserve_queue_duration_seconds_count{model=\"tiny\"}"] ==
           servable->scheduler_stats().tasks_scheduled;
  }));
  // The queue-depth gauge follows the sweep that dropped them, though no batch came after it.
  EXPECT_TRUE(Eventually([&] { return Metrics()["collabserve_queue_depth{model=\"tiny\",version=\"1\"}"] == 0; }));
}

TEST_F(ServerTest, AnInputWhoseClientCancelledNeverReachesTheModel) {
  Start();
  gate_.Close();
  auto running = StartAsync(Request("tiny", {"running"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  auto cancelled = StartAsync(Request("tiny", {"never mind"}));
  auto servable = Servable("tiny");
  ASSERT_TRUE(Eventually([&] { return servable->scheduler_stats().tasks_scheduled == 2; }));
  cancelled->ctx.TryCancel();
  cancelled->finished.WaitForNotification();
  EXPECT_EQ(cancelled->status.error_code(), grpc::StatusCode::CANCELLED);
  // Let the server see the cancellation (OnCancel) before the batch thread is free again.
  ASSERT_TRUE(Eventually([&] { return server_->inference_service().cancellations() == 1; }));
  gate_.Open();
  running->finished.WaitForNotification();
  EXPECT_TRUE(running->status.ok());
  ASSERT_TRUE(Eventually([&] { return servable->scheduler_stats().tasks_failed_cancelled == 1; }));
  EXPECT_EQ(servable->scheduler_stats().tasks_batched, 1);
  ASSERT_TRUE(Eventually([&] { return Metrics()["collabserve_inflight_requests"] == 0; }));
}

TEST_F(ServerTest, StreamEchoesIdsAndReportsErrorsPerRequest) {
  Start();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto stream = stub_->ClassifyStream(&ctx);
  for (int i = 0; i < 5; ++i) {
    v1::StreamClassifyRequest req;
    req.set_id(absl::StrCat("req-", i));
    *req.mutable_request() = Request(i == 3 ? "nope" : "tiny", {absl::StrCat("text number ", i)});
    ASSERT_TRUE(stream->Write(req));
  }
  stream->WritesDone();
  std::map<std::string, v1::StreamClassifyResponse> got;
  v1::StreamClassifyResponse resp;
  while (stream->Read(&resp)) got[resp.id()] = resp;
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    const auto& r = got[absl::StrCat("req-", i)];
    if (i == 3) {
      EXPECT_EQ(r.error().code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
      EXPECT_THAT(r.error().message(), HasSubstr("nope"));
    } else {
      ASSERT_TRUE(r.has_response()) << r.DebugString();
      EXPECT_EQ(r.response().results_size(), 1);
    }
  }
}

TEST_F(ServerTest, TokenizeListModelsAndGetModel) {
  Start();
  grpc::ClientContext c1;
  v1::TokenizeRequest treq;
  treq.set_model_name("tiny");
  treq.add_inputs()->set_text("Hello world");
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(stub_->Tokenize(&c1, treq, &tresp).ok());
  ASSERT_EQ(tresp.results_size(), 1);
  EXPECT_THAT(std::vector<std::string>(tresp.results(0).tokens().begin(), tresp.results(0).tokens().end()),
              ::testing::ElementsAre("[CLS]", "hello", "world", "[SEP]"));
  // Each token's bytes in its text ((0, 0) for the special tokens added, which the mask marks).
  std::vector<std::pair<int, int>> offsets;
  for (const v1::TokenOffset& o : tresp.results(0).offsets()) offsets.emplace_back(o.start(), o.end());
  EXPECT_THAT(offsets, ::testing::ElementsAre(std::pair(0, 0), std::pair(0, 5), std::pair(6, 11),
                                              std::pair(0, 0)));
  EXPECT_THAT(tresp.results(0).special_tokens_mask(), ::testing::ElementsAre(true, false, false, true));
  // Without the special tokens: the word pieces alone.
  treq.set_add_special_tokens(false);
  grpc::ClientContext c0;
  v1::TokenizeResponse bare;
  ASSERT_TRUE(stub_->Tokenize(&c0, treq, &bare).ok());
  EXPECT_THAT(bare.results(0).input_ids(), ::testing::ElementsAre(7592, 2088));
  EXPECT_THAT(bare.results(0).special_tokens_mask(), ::testing::ElementsAre(false, false));
  // Decode: the ids back to text, the special tokens left out unless asked for.
  v1::DecodeRequest dreq;
  dreq.set_model_name("tiny");
  dreq.add_sequences()->mutable_ids()->Assign(tresp.results(0).input_ids().begin(),
                                              tresp.results(0).input_ids().end());
  dreq.add_sequences();
  v1::DecodeResponse dresp;
  grpc::ClientContext cd;
  ASSERT_TRUE(stub_->Decode(&cd, dreq, &dresp).ok());
  EXPECT_THAT(dresp.texts(), ::testing::ElementsAre("hello world", ""));
  dreq.set_skip_special_tokens(false);
  dreq.mutable_sequences(1)->add_ids(-1);
  grpc::ClientContext cd2;
  grpc::Status ds = stub_->Decode(&cd2, dreq, &dresp);
  EXPECT_EQ(ds.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ds.error_message(), HasSubstr("sequences[1].ids[0] is -1"));
  // A text decoded is bounded as a text sent is (--max_text_bytes).
  v1::DecodeRequest big;
  big.set_model_name("tiny");
  auto* seq = big.add_sequences();
  for (int i = 0; i < 70000; ++i) seq->add_ids(2088);
  grpc::ClientContext cd3;
  ds = stub_->Decode(&cd3, big, &dresp);
  EXPECT_EQ(ds.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ds.error_message(), HasSubstr("70000 ids, more than the limit of 65536"));
  seq->mutable_ids()->Truncate(20000);  // "world" 20,000 times: ~120 KB of text
  grpc::ClientContext cd4;
  ds = stub_->Decode(&cd4, big, &dresp);
  EXPECT_EQ(ds.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(ds.error_message(), HasSubstr("over the limit of 65536"));

  grpc::ClientContext c2;
  v1::ListModelsResponse lresp;
  ASSERT_TRUE(stub_->ListModels(&c2, v1::ListModelsRequest(), &lresp).ok());
  ASSERT_EQ(lresp.models_size(), 1);
  EXPECT_EQ(lresp.models(0).name(), "tiny");
  EXPECT_THAT(std::vector<int64_t>(lresp.models(0).versions().begin(), lresp.models(0).versions().end()),
              ::testing::ElementsAre(1));

  grpc::ClientContext c3;
  v1::GetModelRequest greq;
  greq.set_model_name("tiny");
  v1::ModelMetadata meta;
  ASSERT_TRUE(stub_->GetModel(&c3, greq, &meta).ok());
  EXPECT_THAT(std::vector<std::string>(meta.labels().begin(), meta.labels().end()),
              ::testing::ElementsAre("negative", "positive"));
  EXPECT_EQ(meta.num_layers(), 2);
  EXPECT_FALSE(meta.collaborative());
  EXPECT_DOUBLE_EQ(meta.compression_ratio(), 1.0);
  EXPECT_GT(meta.parameters().total(), 0);
  EXPECT_EQ(meta.device(), Servable("tiny")->info().device);
  EXPECT_EQ(meta.vocab_size(), 30522);

  grpc::ClientContext c4;
  greq.set_model_name("missing");
  EXPECT_EQ(stub_->GetModel(&c4, greq, &meta).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServerTest, VersionSwapUnderLoadFailsNoRequest) {
  Start();
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0}, seen_v2{0};
  std::string first_failure;
  absl::Mutex mu;
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      int i = 0;
      while (!stop.load()) {
        v1::ClassifyResponse resp;
        grpc::Status s = Classify(Request("tiny", {absl::StrCat("client ", t, " request ", i++)}), &resp);
        if (!s.ok()) {
          failures++;
          absl::MutexLock lock(&mu);
          if (first_failure.empty()) first_failure = s.error_message();
        } else if (resp.model_version() == 2) {
          seen_v2++;
        }
      }
    });
  }
  // Write version 2 beside the repository's models and move it in with one rename.
  const std::string staging = repo_.path() + "/.staging-v2";
  MakeTinyModel(staging, 2);
  std::filesystem::rename(staging, repo_.path() + "/tiny/2");
  absl::Status polled = server_->repository()->Poll();
  EXPECT_TRUE(polled.ok()) << polled;
  EXPECT_TRUE(Eventually([&] { return seen_v2.load() >= 20; }));
  stop = true;
  for (auto& c : clients) c.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  // Version 1 is gone, and so are its metric series.
  EXPECT_TRUE(Eventually([&] {
    auto text = ScrapeMetrics(server_->metrics_port());
    return text.ok() && text->find("version=\"1\"") == std::string::npos &&
           text->find("collabserve_model_parameters{model=\"tiny\",part=\"total\",version=\"2\"}") !=
               std::string::npos;
  }));
}

TEST_F(ServerTest, HealthFollowsWarmUpAndDrain) {
  server_ = std::make_unique<Server>(Options());
  ASSERT_TRUE(server_->StartServing().ok());
  Connect();
  EXPECT_EQ(Health(""), HealthResponse::NOT_SERVING);
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(Request("tiny", {"too early"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("loading"));

  ASSERT_TRUE(server_->LoadModels().ok());
  EXPECT_EQ(Health(""), HealthResponse::SERVING);
  EXPECT_EQ(Health("tiny"), HealthResponse::SERVING);
  EXPECT_EQ(Health("nope"), -static_cast<int>(grpc::StatusCode::NOT_FOUND));

  gate_.Close();
  auto inflight = StartAsync(Request("tiny", {"in flight during drain"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  std::thread shutdown([this] { server_->Shutdown(); });
  EXPECT_TRUE(Eventually([&] { return Health("") == HealthResponse::NOT_SERVING; }));
  EXPECT_EQ(Health("tiny"), HealthResponse::NOT_SERVING);
  s = Classify(Request("tiny", {"too late"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("shutting down"));
  gate_.Open();
  inflight->finished.WaitForNotification();
  EXPECT_TRUE(inflight->status.ok()) << inflight->status.error_message();  // drained, not dropped
  shutdown.join();
}

// BeginDrain: the drain's first step alone (the binary takes it before stopping the admin jobs):
// NOT_SERVING and new calls refused at once, while a call in flight goes on to its answer; the
// Shutdown that follows finishes the drain.
TEST_F(ServerTest, BeginDrainRefusesNewCallsWhileThoseInFlightFinish) {
  Start();
  gate_.Close();
  auto inflight = StartAsync(Request("tiny", {"in flight when the drain begins"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  server_->BeginDrain();
  server_->BeginDrain();  // idempotent
  EXPECT_EQ(Health(""), HealthResponse::NOT_SERVING);
  EXPECT_EQ(Health("tiny"), HealthResponse::NOT_SERVING);
  v1::ClassifyResponse resp;
  grpc::Status s = Classify(Request("tiny", {"too late"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("shutting down"));
  gate_.Open();
  inflight->finished.WaitForNotification();
  EXPECT_TRUE(inflight->status.ok()) << inflight->status.error_message();
  server_->Shutdown();
}

// The metrics port's plain-HTTP probes (for a TLS server, whose gRPC health a kubelet cannot ask)
// follow grpc.health.v1: /readyz 503 while loading, 200 when serving, 503 while draining;
// /readyz/<model> for one model; /livez 200 throughout.
TEST_F(ServerTest, HttpProbesFollowGrpcHealth) {
  ServerOptions o = Options();
  o.metrics_port = 0;
  server_ = std::make_unique<Server>(o);
  ASSERT_TRUE(server_->StartServing().ok());
  Connect();
  const int port = server_->metrics_port();
  auto get = [port](const std::string& path) {
    absl::StatusOr<testing::HttpAnswer> a = testing::HttpGet(port, path);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? absl::StrCat(a->code, " ", a->body) : std::string();
  };
  EXPECT_EQ(get("/readyz"), "503 NOT_SERVING: loading its models\n");
  EXPECT_EQ(get("/livez"), "200 LIVE\n");
  ASSERT_TRUE(server_->LoadModels().ok());
  EXPECT_EQ(get("/readyz"), "200 SERVING\n");
  EXPECT_EQ(get("/readyz?verbose"), "200 SERVING\n");
  EXPECT_EQ(get("/readyz/tiny"), "200 SERVING\n");
  EXPECT_EQ(get("/readyz/nope"), "404 no model \"nope\"\n");
  EXPECT_EQ(get("/healthz").substr(0, 4), "404 ");
  EXPECT_EQ(Health(""), HealthResponse::SERVING);

  gate_.Close();
  auto inflight = StartAsync(Request("tiny", {"in flight"}));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  server_->BeginDrain();
  EXPECT_EQ(get("/readyz"), "503 NOT_SERVING: shutting down\n");
  EXPECT_EQ(get("/readyz/tiny"), "503 NOT_SERVING: shutting down\n");
  EXPECT_EQ(get("/livez"), "200 LIVE\n");
  gate_.Open();
  inflight->finished.WaitForNotification();
  server_->Shutdown();
}

// A GPU that fails for good (model::IsDeviceFailure). Injected here through the servable's
// batch_fault_hook, since a CPU cannot fail so; engine_test's AGpuThatFailsForGoodMakesDeviceFailures
// has a GPU make the same status. The failing call gets UNAVAILABLE with the engine's message; by
// then health is NOT_SERVING for "" and the model (Kubernetes' probes: readiness drops the pod,
// liveness restarts it), and stays so when a new version loads; new calls get UNAVAILABLE naming
// the failure even where the engine would answer.
TEST_F(ServerTest, ADeviceFailureStopsServingUntilARestart) {
  std::atomic<bool> fail{false};
  ServerOptions o = Options();
  o.servable.batch_fault_hook = [&fail]() -> absl::Status {
    if (!fail.load()) return absl::OkStatus();
    return model::MarkedDeviceFailure(absl::UnavailableError(
        "forward pass failed: CUDA error: an illegal memory access was encountered; cuda:0 can run "
        "no more work: CUDA error: an illegal memory access was encountered"));
  };
  Start(std::move(o));
  v1::ClassifyResponse resp;
  ASSERT_TRUE(Classify(Request("tiny", {"before the failure"}), &resp).ok());
  EXPECT_EQ(Health(""), HealthResponse::SERVING);
  EXPECT_EQ(Metrics()["collabserve_device_failed{device=\"cpu\"}"], 0);

  fail = true;
  grpc::Status s = Classify(Request("tiny", {"the failing pass"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("model tiny:1: forward pass failed: CUDA error"));
  EXPECT_EQ(Health(""), HealthResponse::NOT_SERVING);
  EXPECT_EQ(Health("tiny"), HealthResponse::NOT_SERVING);
  EXPECT_EQ(Metrics()["collabserve_device_failed{device=\"cpu\"}"], 1);  // for the alert

  fail = false;  // the engine would answer now: the server still refuses
  s = Classify(Request("tiny", {"after the failure"}), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("GPU failed"));
  EXPECT_THAT(s.error_message(), HasSubstr("cuda:0 can run no more work"));
  EXPECT_THAT(s.error_message(), HasSubstr("retry on another replica"));

  MakeTinyModel(repo_.path() + "/tiny/2", 2);
  ASSERT_TRUE(server_->repository()->Poll().ok());
  ASSERT_TRUE(Eventually([&] { return server_->repository()->Get("tiny", 2).ok(); }));
  EXPECT_EQ(Health("tiny"), HealthResponse::NOT_SERVING) << "a version loaded after the failure";
  EXPECT_EQ(Health(""), HealthResponse::NOT_SERVING);
  // The plain-HTTP probes say the same, and liveness fails: only a restart helps.
  for (const std::string path : {"/livez", "/readyz", "/readyz/tiny"}) {
    absl::StatusOr<testing::HttpAnswer> a = testing::HttpGet(server_->metrics_port(), path);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->code, 503) << path;
    EXPECT_THAT(a->body, HasSubstr("the model device failed")) << path;
  }
}

TEST_F(ServerTest, MetricsPageParsesAndPassesPromtool) {
  Start();
  v1::ClassifyResponse resp;
  ASSERT_TRUE(Classify(Request("tiny", {"one", "two"}), &resp).ok());
  ASSERT_FALSE(Classify(Request("nope", {"x"}), &resp).ok());
  v1::ClassifyRequest unserved = Request("tiny", {"x"});
  unserved.set_model_version(9);
  ASSERT_FALSE(Classify(unserved, &resp).ok());
  // A call leaves the in-flight count just after its response is handed to gRPC.
  ASSERT_TRUE(Eventually([&] { return Metrics()["collabserve_inflight_requests"] == 0; }));
  auto text = ScrapeMetrics(server_->metrics_port());
  ASSERT_TRUE(text.ok()) << text.status();
  auto m = ParseMetrics(*text);
  EXPECT_EQ(m["collabserve_requests_total{code=\"OK\",model=\"tiny\",version=\"1\"}"], 1);
  // An unknown model's refusals carry no model label (a client's made-up name is no label); a known
  // model's unserved version is counted under the model, so that per-model alerts see it.
  EXPECT_EQ(m["collabserve_requests_total{code=\"NOT_FOUND\",model=\"\",version=\"\"}"], 1);
  EXPECT_EQ(m["collabserve_requests_total{code=\"NOT_FOUND\",model=\"tiny\",version=\"\"}"], 1);
  // Every call to the model, the refused one included (time from arrival to response).
  EXPECT_EQ(m["collabserve_request_duration_seconds_count{model=\"tiny\"}"], 2);
  EXPECT_EQ(m["collabserve_tokenization_duration_seconds_count{model=\"tiny\"}"], 1);
  EXPECT_EQ(m["collabserve_queue_duration_seconds_count{model=\"tiny\"}"], 2);
  EXPECT_EQ(m["collabserve_batch_tokens_count{model=\"tiny\"}"], 1);
  EXPECT_EQ(m.count("collabserve_inference_duration_seconds_count{model=\"tiny\"}"), 1u);
  EXPECT_EQ(m.count("collabserve_batch_padding_ratio_count{model=\"tiny\"}"), 1u);
  EXPECT_EQ(m["collabserve_queue_depth{model=\"tiny\",version=\"1\"}"], 0);
  EXPECT_EQ(m["collabserve_inflight_requests"], 0);
  EXPECT_EQ(m.count("collabserve_device_failed{device=\"cpu\"}"), 1u);
  EXPECT_EQ(m["collabserve_device_failed{device=\"cpu\"}"], 0);
  EXPECT_GT(m["collabserve_model_parameters{model=\"tiny\",part=\"total\",version=\"1\"}"], 0);
  EXPECT_EQ(m["collabserve_model_layer_rank{layer=\"1\",model=\"tiny\",version=\"1\"}"], 64);
  EXPECT_EQ(m["collabserve_model_compression_ratio{model=\"tiny\",version=\"1\"}"], 1);
  EXPECT_GT(m["collabserve_model_load_seconds{model=\"tiny\",version=\"1\"}"], 0);
  // The repository's versions by state: every state, 0 included (alerts ask for 0 available).
  EXPECT_EQ(m["collabserve_model_versions{model=\"tiny\",state=\"available\"}"], 1);
  for (const char* state : {"loading", "settling", "failed", "unloaded"}) {
    const std::string series = absl::StrCat("collabserve_model_versions{model=\"tiny\",state=\"", state, "\"}");
    EXPECT_EQ(m.count(series), 1u) << series;
    EXPECT_EQ(m[series], 0) << series;
  }
  EXPECT_EQ(m["collabserve_build_info{torch_version=\"test\",version=\"0.1.0\"}"], 1);
  EXPECT_EQ(m.count("collabserve_pass_memory_kept_bytes{part=\"arena\"}"), 1u);  // the server's source
  EXPECT_GE(m["collabserve_pass_memory_kept_bytes{part=\"arena\"}"], 0);
  // A CPU server reads no GPU (the source is set; ReadDeviceMemory reads nothing on the CPU).
  EXPECT_THAT(*text, Not(HasSubstr("collabserve_gpu_memory")));

  // promtool's linter is the reference for the exposition format. The deploy scripts install it.
  TempDir dir;
  const std::string file = dir.path() + "/metrics.txt";
  std::ofstream(file) << *text;
  ASSERT_EQ(std::system("command -v promtool >/dev/null 2>&1"), 0)
      << "promtool is not installed (scripts/install-deps.sh installs it); cannot lint /metrics";
  const std::string cmd = "promtool check metrics < " + file + " > " + dir.path() + "/out.txt 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream out(dir.path() + "/out.txt");
  std::string report((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << report;
}

TEST_F(ServerTest, ShutdownEndsOpenStreamsAndReturns) {
  Start();
  grpc::ClientContext ctx;
  auto stream = stub_->ClassifyStream(&ctx);
  v1::StreamClassifyRequest req;
  req.set_id("only");
  *req.mutable_request() = Request("tiny", {"hello"});
  ASSERT_TRUE(stream->Write(req));
  v1::StreamClassifyResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.id(), "only");
  // The client never half-closes; Shutdown must still finish (the drain does not wait for idle
  // streams, and gRPC cancels them).
  const absl::Time t0 = absl::Now();
  server_->Shutdown();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(15));
  EXPECT_FALSE(stream->Read(&resp));
  EXPECT_FALSE(stream->Finish().ok());
}

// A self-signed certificate for localhost whose subject carries `org`, as dir/<name>.crt and
// dir/<name>.key; its PEM text.
std::string MakeCertificate(const std::string& dir, const std::string& name, const std::string& org) {
  const std::string cert = dir + "/" + name + ".crt", key = dir + "/" + name + ".key";
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost/O=" +
                          org + " -addext subjectAltName=DNS:localhost -keyout " + key + " -out " +
                          cert + " >/dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make a test certificate";
  absl::StatusOr<std::string> pem = util::ReadFile(cert);
  return pem.ok() ? *pem : "";
}

// A mounted Secret as the kubelet lays it out: tls.crt and tls.key are links into ..data, itself a
// link to a directory of the Secret's generation; an update writes a new generation and swaps
// ..data in one rename, so that a reader sees the old pair or the new one, never half of each.
class SecretVolume {
 public:
  explicit SecretVolume(std::string dir) : dir_(std::move(dir)) {}
  std::string cert() const { return dir_ + "/tls.crt"; }
  std::string key() const { return dir_ + "/tls.key"; }

  void Write(const std::string& cert_from, const std::string& key_from) {
    namespace fs = std::filesystem;
    const std::string old = "..gen" + std::to_string(generation_);
    const std::string gen = "..gen" + std::to_string(++generation_);
    fs::create_directory(dir_ + "/" + gen);
    fs::copy_file(cert_from, dir_ + "/" + gen + "/tls.crt");
    fs::copy_file(key_from, dir_ + "/" + gen + "/tls.key");
    fs::create_directory_symlink(gen, dir_ + "/..data_tmp");
    fs::rename(dir_ + "/..data_tmp", dir_ + "/..data");
    if (generation_ == 1) {
      fs::create_symlink("..data/tls.crt", cert());
      fs::create_symlink("..data/tls.key", key());
    } else {
      fs::remove_all(dir_ + "/" + old);
    }
  }

 private:
  const std::string dir_;
  int generation_ = 0;
};

// One TLS call on a connection of its own (no subchannel shared with earlier channels); the
// subject of the certificate the server presented, or the call's error.
absl::StatusOr<std::string> TlsClassifySubject(int port, const std::string& roots) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = roots;
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride("localhost");
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                           grpc::SslCredentials(ssl), args);
  auto stub = v1::Inference::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::ClassifyResponse resp;
  grpc::Status s = stub->Classify(&ctx, Request("tiny", {"over TLS"}), &resp);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  std::vector<grpc::string_ref> subject = ctx.auth_context()->FindPropertyValues("x509_subject");
  if (subject.empty()) return absl::InternalError("no x509_subject in the call's auth context");
  return std::string(subject[0].data(), subject[0].size());
}

TEST_F(ServerTest, ServesTlsWhenGivenACertificate) {
  TempDir certs;
  const std::string pem = MakeCertificate(certs.path(), "server", "first");
  ServerOptions o = Options();
  o.tls.cert_file = certs.path() + "/server.crt";
  o.tls.key_file = certs.path() + "/server.key";
  Start(o);
  absl::StatusOr<std::string> subject = TlsClassifySubject(server_->port(), pem);
  ASSERT_TRUE(subject.ok()) << subject.status();
  EXPECT_THAT(*subject, HasSubstr("first"));
  // A plaintext client cannot talk to it.
  v1::ClassifyResponse plain;
  grpc::Status s = Classify(Request("tiny", {"in the clear"}), &plain, absl::Seconds(3));
  EXPECT_FALSE(s.ok());
}

// cert-manager renews the Secret and the kubelet swaps the files: new connections get the new
// certificate without a restart. /metrics tells the expiry and whether the pair on disk checks. A
// file that goes missing keeps the last pair serving; a key that is not the certificate's fails
// new handshakes (as the docs and the alerts say).
TEST_F(ServerTest, ARenewedCertificateServesNewConnectionsWithoutARestart) {
  TempDir certs, mounted;
  const std::string c = certs.path();
  const std::string first = MakeCertificate(c, "first", "first");
  const std::string second = MakeCertificate(c, "second", "second");
  SecretVolume secret(mounted.path());
  secret.Write(c + "/first.crt", c + "/first.key");
  ServerOptions o = Options();
  o.tls = {secret.cert(), secret.key(), absl::Seconds(1)};
  Start(o);
  const std::string roots = first + second;
  const int port = server_->port();
  absl::StatusOr<std::string> subject = TlsClassifySubject(port, roots);
  ASSERT_TRUE(subject.ok()) << subject.status();
  EXPECT_THAT(*subject, HasSubstr("first"));
  std::map<std::string, double> m = Metrics();
  EXPECT_EQ(m["collabserve_tls_certificate_valid"], 1);
  const double now = absl::ToUnixSeconds(absl::Now());
  EXPECT_NEAR(m["collabserve_tls_certificate_expiry_timestamp_seconds"], now + 86400, 600);
  EXPECT_NEAR(m["collabserve_tls_certificate_not_before_timestamp_seconds"], now, 600);

  secret.Write(c + "/second.crt", c + "/second.key");
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<std::string> s = TlsClassifySubject(port, roots);
    return s.ok() && absl::StrContains(*s, "second");
  }));

  // The key's file goes: the gauge drops, the last pair read keeps serving.
  std::filesystem::remove(secret.key());
  m = Metrics();
  EXPECT_EQ(m["collabserve_tls_certificate_valid"], 0);
  EXPECT_EQ(m.count("collabserve_tls_certificate_expiry_timestamp_seconds"), 0u);
  absl::SleepFor(absl::Seconds(2.5));  // more than two reads
  subject = TlsClassifySubject(port, roots);
  ASSERT_TRUE(subject.ok()) << subject.status();
  EXPECT_THAT(*subject, HasSubstr("second"));

  // A renewal whose key is not its certificate's: new handshakes fail; the call made on a
  // connection from before goes on.
  std::filesystem::create_symlink("..data/tls.key", secret.key());
  secret.Write(c + "/second.crt", c + "/first.key");
  EXPECT_EQ(Metrics()["collabserve_tls_certificate_valid"], 0);
  EXPECT_TRUE(Eventually([&] { return !TlsClassifySubject(port, roots).ok(); }));
}

// dir/<name>.crt and .key: a certificate for `name` that the CA dir/<ca>.crt (made by
// MakeCertificate) signs, as a client's certificate is issued.
void IssueCertificate(const std::string& dir, const std::string& name, const std::string& ca) {
  const std::string d = dir + "/";
  const std::string cmd = "openssl req -new -newkey rsa:2048 -nodes -subj /CN=" + name + " -keyout " +
                          d + name + ".key -out " + d + name + ".csr >/dev/null 2>&1 && openssl x509 -req -in " +
                          d + name + ".csr -CA " + d + ca + ".crt -CAkey " + d + ca + ".key -CAcreateserial -days 1 -out " +
                          d + name + ".crt >/dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "openssl could not issue a test certificate";
}

// --tls_client_ca: a client needs a certificate that one of the CAs issued; without one, or with
// one from another CA, the handshake fails. The CA file is followed: after the Secret swaps in
// another CA, that CA's clients get in and the first one's do not. The C++ clients' ClientTls
// carries the client's certificate.
TEST_F(ServerTest, MutualTlsRefusesClientsWithoutACertificateTheCaSigned) {
  TempDir certs, mounted;
  const std::string c = certs.path();
  const std::string server_pem = MakeCertificate(c, "server", "server");
  MakeCertificate(c, "ca1", "ca1");
  MakeCertificate(c, "ca2", "ca2");
  IssueCertificate(c, "client1", "ca1");
  IssueCertificate(c, "client2", "ca2");
  SecretVolume ca(mounted.path());
  ca.Write(c + "/ca1.crt", c + "/ca1.key");
  ServerOptions o = Options();
  o.tls = {c + "/server.crt", c + "/server.key", absl::Seconds(1), ca.cert()};
  Start(o);
  auto classify = [&](const std::string& who) {
    client::ClientTls tls;
    tls.enabled = true;
    tls.root_certs_pem = server_pem;
    if (!who.empty()) {
      tls.cert_chain_pem = *util::ReadFile(c + "/" + who + ".crt");
      tls.private_key_pem = *util::ReadFile(c + "/" + who + ".key");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = v1::Inference::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), client::ChannelCredentials(tls), args));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::ClassifyResponse resp;
    return stub->Classify(&ctx, Request("tiny", {"over mutual TLS"}), &resp).error_code();
  };
  EXPECT_EQ(classify("client1"), grpc::StatusCode::OK);
  EXPECT_EQ(classify(""), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(classify("client2"), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(classify("ca1"), grpc::StatusCode::OK);  // the CA's own (self-signed) certificate

  ca.Write(c + "/ca2.crt", c + "/ca2.key");
  EXPECT_TRUE(Eventually([&] { return classify("client2") == grpc::StatusCode::OK; }));
  EXPECT_EQ(classify("client1"), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Metrics()["collabserve_tls_certificate_valid"], 1);

  ServerOptions bad = Options();
  bad.tls = {c + "/server.crt", c + "/server.key", absl::Seconds(60), c + "/server.key"};
  Server refused(bad);
  absl::Status s = refused.Start();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("--tls_client_ca " + c + "/server.key: no PEM certificate"));
}

// What is wrong with the files is said at start, naming the flag and the file; before, gRPC took
// any bytes and the server failed later with "cannot listen".
TEST_F(ServerTest, BadCertificateFilesAreRefusedAtStartNamingTheFile) {
  TempDir certs;
  MakeCertificate(certs.path(), "a", "a");
  MakeCertificate(certs.path(), "b", "b");
  const std::string dir = certs.path();
  ASSERT_TRUE(util::WriteFileAtomic(dir + "/garbage.pem", "not a certificate\n").ok());
  // A chain file holds the server's certificate first, then its issuers'.
  ASSERT_EQ(std::system(("cat " + dir + "/a.crt " + dir + "/b.crt > " + dir + "/chain.crt").c_str()), 0);
  ASSERT_EQ(std::system(("cat " + dir + "/b.crt " + dir + "/a.crt > " + dir + "/ca-first.crt").c_str()), 0);
  ASSERT_EQ(std::system(("openssl pkey -in " + dir + "/a.key -aes256 -passout pass:secret -out " + dir +
                         "/encrypted.key >/dev/null 2>&1").c_str()),
            0);
  struct Case {
    TlsFiles files;
    absl::StatusCode code;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{dir + "/missing.crt", dir + "/a.key"}, absl::StatusCode::kNotFound, "--tls_cert: " + dir + "/missing.crt"},
      {{dir + "/garbage.pem", dir + "/a.key"}, absl::StatusCode::kInvalidArgument,
       "--tls_cert " + dir + "/garbage.pem: no PEM certificate in it"},
      {{dir + "/a.crt", dir + "/garbage.pem"}, absl::StatusCode::kInvalidArgument, "no PEM private key in it"},
      {{dir + "/a.crt", dir + "/encrypted.key"}, absl::StatusCode::kInvalidArgument,
       "--tls_key " + dir + "/encrypted.key is encrypted; the server takes an unencrypted key"},
      {{dir + "/a.crt", dir + "/b.key"}, absl::StatusCode::kInvalidArgument,
       "--tls_key " + dir + "/b.key is not the key of the certificate in --tls_cert " + dir + "/a.crt"},
      {{dir + "/ca-first.crt", dir + "/a.key"}, absl::StatusCode::kInvalidArgument,
       "is not the key of the certificate in --tls_cert " + dir + "/ca-first.crt"},
      {{dir + "/a.crt", dir + "/a.key", absl::ZeroDuration()}, absl::StatusCode::kInvalidArgument,
       "--tls_reload_s=0 is not within 1-86400"},
      {{dir + "/a.crt", dir + "/a.key", absl::Hours(48)}, absl::StatusCode::kInvalidArgument,
       "--tls_reload_s=172800 is not within 1-86400"},
  };
  for (const Case& c : cases) {
    ServerOptions o = Options();
    o.tls = c.files;
    Server server(o);
    absl::Status s = server.Start();
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expect));
  }
  absl::StatusOr<CertificateFacts> facts = CheckCertificateFiles({dir + "/chain.crt", dir + "/a.key"});
  ASSERT_TRUE(facts.ok()) << facts.status();
  EXPECT_THAT(facts->subject, HasSubstr("O=a"));
  EXPECT_LT(facts->not_before, absl::Now() + absl::Minutes(1));
  EXPECT_GT(facts->not_after, absl::Now() + absl::Hours(23));
}

TEST_F(ServerTest, RequestLimitsBelowOneAreRefusedAtStartUp) {
  struct Case {
    std::function<void(ServerOptions*)> set;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](ServerOptions* o) { o->inference.max_inputs_per_request = 0; },
       "--max_inputs_per_request=0 and --max_text_bytes=65536 must both be >= 1"},
      {[](ServerOptions* o) { o->inference.max_text_bytes = 0; }, "--max_text_bytes=0"},
  };
  for (const Case& c : cases) {
    ServerOptions o = Options();
    c.set(&o);
    Server server(o);
    absl::Status s = server.Start();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expect));
  }
}

// --max_connection_age_s: a connection that old gets a GOAWAY (the client's channel leaves READY),
// the next call reconnects; a negative age is refused.
TEST_F(ServerTest, ConnectionsOlderThanTheMaxAgeAreAskedToReconnect) {
  ServerOptions o = Options();
  o.max_connection_age = absl::Seconds(1);
  Start(o);
  EXPECT_EQ(Health(""), HealthResponse::SERVING);
  ASSERT_EQ(channel_->GetState(false), GRPC_CHANNEL_READY);
  EXPECT_TRUE(Eventually([&] { return channel_->GetState(false) != GRPC_CHANNEL_READY; }));
  EXPECT_EQ(Health(""), HealthResponse::SERVING);

  ServerOptions bad = Options();
  bad.max_connection_age = absl::Seconds(-1);
  Server refused(bad);
  const absl::Status s = refused.Start();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("--max_connection_age_s"));
}

// A client that sends keepalive pings while idle (as often as gRPC lets it here, once a second;
// behind a load balancer's idle timeout in practice) is sent GOAWAY too_many_pings by gRPC's
// default policy, on its third ping, and loses its connection; with
// --keepalive_min_client_ping_s below its interval and --keepalive_permit_without_calls, the
// connection stays.
TEST_F(ServerTest, KeepaliveAcceptsTheClientPingsItIsToldTo) {
  auto pinging_channel = [this] {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 500);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                             grpc::InsecureChannelCredentials(), args);
    EXPECT_TRUE(channel->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
    return channel;
  };
  Start();  // gRPC's defaults: client pings at most every 5 minutes, none while idle
  auto refused = pinging_channel();
  EXPECT_TRUE(Eventually([&] { return refused->GetState(false) != GRPC_CHANNEL_READY; }));
  server_->Shutdown();

  ServerOptions o = Options();
  o.keepalive.min_client_ping_interval = absl::Milliseconds(250);
  o.keepalive.permit_without_calls = true;
  Start(o);
  auto kept = pinging_channel();
  const absl::Time until = absl::Now() + absl::Seconds(10);  // about 10 pings
  bool stayed = true;
  while (stayed && absl::Now() < until) {
    stayed = kept->GetState(false) == GRPC_CHANNEL_READY;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(stayed);

  for (auto set : {+[](KeepaliveOptions* k) { k->timeout = absl::ZeroDuration(); },
                   +[](KeepaliveOptions* k) { k->time = absl::Seconds(-1); },
                   +[](KeepaliveOptions* k) { k->min_client_ping_interval = absl::Hours(24 * 30); }}) {
    ServerOptions bad = Options();
    set(&bad.keepalive);
    Server server(bad);
    const absl::Status s = server.Start();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("to 2147483 seconds"));
  }
}

// --host=:: (all IPv6 addresses) made ":::8500", which gRPC cannot parse.
TEST(ListeningAddressTest, IPv6LiteralsGoInBrackets) {
  EXPECT_EQ(ListeningAddress("0.0.0.0", 8500), "0.0.0.0:8500");
  EXPECT_EQ(ListeningAddress("localhost", 1), "localhost:1");
  EXPECT_EQ(ListeningAddress("::", 8500), "[::]:8500");
  EXPECT_EQ(ListeningAddress("::1", 0), "[::1]:0");
  EXPECT_EQ(ListeningAddress("[::1]", 7), "[::1]:7");
}

TEST_F(ServerTest, HalfTlsConfigurationIsRejected) {
  ServerOptions o = Options();
  o.tls.cert_file = "/some/cert.pem";
  Server server(o);
  absl::Status s = server.Start();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--tls_key"));
}

}  // namespace
}  // namespace collabserve::service
