// The Open Inference Protocol service end to end: a real Server on 127.0.0.1:0 with tiny
// checkpoints and the KServe service registered next to Inference, driven through stubs generated
// from proto/kserve/grpc_predict_v2.proto. ModelInfer must agree with Classify and with the engine.
#include "server/service/kserve_service.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "server/compress/collaborative.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/device.h"
#include "server/model/engine.h"
#include "server/service/model_servable.h"
#include "server/service/server.h"
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
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using InferRequest = inference::ModelInferRequest;
using InferResponse = inference::ModelInferResponse;

// BYTES elements in the raw layout: 4-byte little-endian length, then the bytes.
std::string RawBytes(const std::vector<std::string>& elements) {
  std::string raw;
  for (const auto& e : elements) {
    const uint32_t n = static_cast<uint32_t>(e.size());
    raw.push_back(static_cast<char>(n & 0xff));
    raw.push_back(static_cast<char>((n >> 8) & 0xff));
    raw.push_back(static_cast<char>((n >> 16) & 0xff));
    raw.push_back(static_cast<char>((n >> 24) & 0xff));
    raw += e;
  }
  return raw;
}

std::vector<std::string> ParseRawBytes(const std::string& raw) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos + 4 <= raw.size()) {
    const auto* p = reinterpret_cast<const unsigned char*>(raw.data() + pos);
    const uint32_t n = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
    out.emplace_back(raw, pos + 4, n);
    pos += 4 + n;
  }
  EXPECT_EQ(pos, raw.size()) << "malformed raw BYTES output";
  return out;
}

std::vector<float> ParseRawFloats(const std::string& raw) {
  EXPECT_EQ(raw.size() % 4, 0u);
  std::vector<float> out(raw.size() / 4);
  std::memcpy(out.data(), raw.data(), out.size() * 4);
  return out;
}

// A BYTES input tensor with typed contents.
void AddInput(InferRequest* r, const std::string& name, const std::vector<std::string>& values,
              std::vector<int64_t> shape = {}) {
  auto* in = r->add_inputs();
  in->set_name(name);
  in->set_datatype("BYTES");
  if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
  for (int64_t d : shape) in->add_shape(d);
  for (const auto& v : values) in->mutable_contents()->add_bytes_contents(v);
}

// The same with raw_input_contents.
void AddRawInput(InferRequest* r, const std::string& name, const std::vector<std::string>& values,
                 std::vector<int64_t> shape = {}) {
  auto* in = r->add_inputs();
  in->set_name(name);
  in->set_datatype("BYTES");
  if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
  for (int64_t d : shape) in->add_shape(d);
  r->add_raw_input_contents(RawBytes(values));
}

// One output tensor of a response, decoded from whichever form it came in.
struct Tensor {
  std::string datatype;
  std::vector<int64_t> shape;
  std::vector<float> floats;
  std::vector<std::string> strings;
  bool raw = false;
};

Tensor Output(const InferResponse& resp, const std::string& name) {
  for (int i = 0; i < resp.outputs_size(); ++i) {
    const auto& o = resp.outputs(i);
    if (o.name() != name) continue;
    Tensor t;
    t.datatype = o.datatype();
    t.shape.assign(o.shape().begin(), o.shape().end());
    t.raw = resp.raw_output_contents_size() > 0;
    if (t.raw) {
      EXPECT_EQ(resp.raw_output_contents_size(), resp.outputs_size());
      if (o.datatype() == "BYTES") {
        t.strings = ParseRawBytes(resp.raw_output_contents(i));
      } else {
        t.floats = ParseRawFloats(resp.raw_output_contents(i));
      }
    } else {
      t.floats.assign(o.contents().fp32_contents().begin(), o.contents().fp32_contents().end());
      t.strings.assign(o.contents().bytes_contents().begin(), o.contents().bytes_contents().end());
    }
    return t;
  }
  ADD_FAILURE() << "no output " << name;
  return {};
}

class KServeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MakeTinyModel(repo_.path() + "/tiny/1", 1);
    MakeTinyModel(repo_.path() + "/tiny/2", 2);
    model::MakeOptions multi;
    multi.labels = 3;
    multi.label_names = {"sports", "politics", "tech"};
    multi.problem_type = "multi_label_classification";
    multi.seed = 5;
    ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/multi/1", multi).ok());
    model::MakeOptions three;
    three.labels = 3;
    three.seed = 6;
    ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/three/1", three).ok());
  }
  void TearDown() override {
    gate_.Open();
    if (server_) server_->Shutdown();
  }

  ServerOptions Options() {
    ServerOptions o = testing::LocalServerOptions(repo_.path());
    o.metrics_host = "127.0.0.1";
    o.metrics_port = 0;
    o.versions_to_keep = 2;
    o.drain_timeout = absl::Seconds(20);
    o.servable.batching.max_queue_delay_micros = 500;
    o.servable.before_batch_hook = [this] { gate_.Pass(); };
    o.servable.batch_fault_hook = [this]() -> absl::Status {
      if (!device_fails_.load()) return absl::OkStatus();
      return model::MarkedDeviceFailure(absl::UnavailableError(
          "forward pass failed: CUDA error: uncorrectable ECC error encountered; cuda:0 can run no "
          "more work"));
    };
    o.torch_version = "test";
    o.extra_services.push_back(&kserve_);
    return o;
  }

  // StartServing only: the models are not loaded and the service not attached.
  void StartServing() {
    server_ = std::make_unique<Server>(Options());
    absl::Status s = server_->StartServing();
    ASSERT_TRUE(s.ok()) << s;
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = inference::GRPCInferenceService::NewStub(channel_);
    classify_ = v1::Inference::NewStub(channel_);
  }
  void LoadModels() {
    absl::Status s = server_->LoadModels();
    ASSERT_TRUE(s.ok()) << s;
    kserve_.Attach(&server_->inference_service(), server_->repository(), &server_->metrics());
  }
  void Start() {
    StartServing();
    LoadModels();
  }

  std::unique_ptr<grpc::ClientContext> Context() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return ctx;
  }

  grpc::Status Infer(const InferRequest& req, InferResponse* resp) {
    return stub_->ModelInfer(Context().get(), req, resp);
  }

  v1::ClassifyResponse Classify(const std::string& model, const std::vector<std::string>& texts,
                                const std::vector<std::string>& pairs = {}) {
    v1::ClassifyRequest req;
    req.set_model_name(model);
    for (size_t i = 0; i < texts.size(); ++i) {
      auto* in = req.add_inputs();
      in->set_text(texts[i]);
      if (!pairs.empty()) in->set_text_pair(pairs[i]);
    }
    v1::ClassifyResponse resp;
    grpc::Status s = classify_->Classify(Context().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // The engine's own predictions for the served version of `model`.
  std::vector<model::Prediction> EngineRun(const std::string& model,
                                           const std::vector<std::string>& texts,
                                           const std::vector<std::string>& pairs = {}) {
    auto s = server_->repository()->Get(model);
    EXPECT_TRUE(s.ok()) << s.status();
    auto servable = std::static_pointer_cast<ModelServable>(*s);
    std::vector<model::TokenizedInput> batch;
    for (size_t i = 0; i < texts.size(); ++i) {
      std::optional<std::string_view> pair;
      if (!pairs.empty()) pair = pairs[i];
      auto enc = servable->engine().tokenizer().Encode(texts[i], pair,
                                                       servable->info().max_length, true);
      EXPECT_TRUE(enc.ok()) << enc.status();
      model::TokenizedInput in;
      in.input_ids.assign(enc->input_ids.begin(), enc->input_ids.end());
      in.token_type_ids.assign(enc->token_type_ids.begin(), enc->token_type_ids.end());
      batch.push_back(std::move(in));
    }
    auto out = servable->engine().Run(batch);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<model::Prediction>{};
  }

  void ExpectMatches(const InferResponse& resp, const std::string& model,
                     const std::vector<std::string>& texts,
                     const std::vector<std::string>& pairs = {}) {
    const v1::ClassifyResponse classified = Classify(model, texts, pairs);
    const std::vector<model::Prediction> engine = EngineRun(model, texts, pairs);
    ASSERT_EQ(classified.results_size(), static_cast<int>(texts.size()));
    ASSERT_EQ(engine.size(), texts.size());
    const int64_t n = texts.size();
    const int64_t c = engine[0].logits.size();
    Tensor logits = Output(resp, "logits");
    Tensor probs = Output(resp, "probabilities");
    Tensor label = Output(resp, "label");
    EXPECT_EQ(logits.datatype, "FP32");
    EXPECT_EQ(probs.datatype, "FP32");
    EXPECT_EQ(label.datatype, "BYTES");
    EXPECT_THAT(logits.shape, ElementsAre(n, c));
    EXPECT_THAT(probs.shape, ElementsAre(n, c));
    EXPECT_THAT(label.shape, ElementsAre(n));
    ASSERT_EQ(logits.floats.size(), static_cast<size_t>(n * c));
    ASSERT_EQ(probs.floats.size(), static_cast<size_t>(n * c));
    ASSERT_EQ(label.strings.size(), static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        EXPECT_NEAR(logits.floats[i * c + j], classified.results(i).logits(j), 1e-5)
            << "input " << i << " label " << j;
        EXPECT_NEAR(logits.floats[i * c + j], engine[i].logits[j], 1e-5);
        EXPECT_NEAR(probs.floats[i * c + j], engine[i].probabilities[j], 1e-6);
      }
      EXPECT_EQ(label.strings[i], classified.results(i).label());
    }
  }

  bool Live() {
    inference::ServerLiveResponse r;
    grpc::Status s = stub_->ServerLive(Context().get(), {}, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return r.live();
  }
  bool Ready() {
    inference::ServerReadyResponse r;
    grpc::Status s = stub_->ServerReady(Context().get(), {}, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return r.ready();
  }
  bool ModelReady(const std::string& name, const std::string& version) {
    inference::ModelReadyRequest req;
    req.set_name(name);
    req.set_version(version);
    inference::ModelReadyResponse r;
    grpc::Status s = stub_->ModelReady(Context().get(), req, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return r.ready();
  }

  TempDir repo_;
  Gate gate_;
  std::atomic<bool> device_fails_{false};  // batches fail as on a GPU that failed for good
  KServeService kserve_;
  std::unique_ptr<Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  std::unique_ptr<v1::Inference::Stub> classify_;
};

const std::vector<std::string> kTexts = {"the best movie of the year", "not good at all",
                                         "an utterly forgettable afternoon"};

TEST_F(KServeTest, InferWithContentsMatchesClassifyAndTheEngine) {
  Start();
  InferRequest req;
  req.set_model_name("tiny");
  req.set_id("request-7");
  AddInput(&req, "text", kTexts);
  InferResponse resp;
  grpc::Status s = Infer(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.model_name(), "tiny");
  EXPECT_EQ(resp.model_version(), "2");  // "" = newest
  EXPECT_EQ(resp.id(), "request-7");
  EXPECT_EQ(resp.raw_output_contents_size(), 0);  // typed in, typed out
  ASSERT_EQ(resp.outputs_size(), 3);
  EXPECT_EQ(resp.outputs(0).name(), "logits");
  EXPECT_EQ(resp.outputs(1).name(), "probabilities");
  EXPECT_EQ(resp.outputs(2).name(), "label");
  ExpectMatches(resp, "tiny", kTexts);
}

TEST_F(KServeTest, InferWithRawContentsMatchesClassifyAndAnswersRaw) {
  Start();
  InferRequest req;
  req.set_model_name("tiny");
  AddRawInput(&req, "text", kTexts, {3, 1});
  InferResponse resp;
  grpc::Status s = Infer(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.raw_output_contents_size(), 3);
  for (const auto& o : resp.outputs()) EXPECT_FALSE(o.has_contents()) << o.name();
  ExpectMatches(resp, "tiny", kTexts);
}

TEST_F(KServeTest, BothShapesGiveTheSameLogits) {
  Start();
  InferRequest flat, column;
  flat.set_model_name("tiny");
  column.set_model_name("tiny");
  AddInput(&flat, "text", kTexts, {3});
  AddInput(&column, "text", kTexts, {3, 1});
  InferResponse a, b;
  ASSERT_TRUE(Infer(flat, &a).ok());
  ASSERT_TRUE(Infer(column, &b).ok());
  EXPECT_EQ(Output(a, "logits").floats, Output(b, "logits").floats);
}

TEST_F(KServeTest, TextPairMatchesClassify) {
  Start();
  const std::vector<std::string> texts = {"a man plays guitar", "the cat sleeps"};
  const std::vector<std::string> pairs = {"someone makes music", "a dog barks loudly"};
  InferRequest req;
  req.set_model_name("tiny");
  AddRawInput(&req, "text", texts);
  AddRawInput(&req, "text_pair", pairs);
  InferResponse resp;
  grpc::Status s = Infer(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectMatches(resp, "tiny", texts, pairs);
  // The pair changes the answer: it really was used.
  InferRequest alone;
  alone.set_model_name("tiny");
  AddRawInput(&alone, "text", texts);
  InferResponse single;
  ASSERT_TRUE(Infer(alone, &single).ok());
  EXPECT_NE(Output(single, "logits").floats, Output(resp, "logits").floats);
}

TEST_F(KServeTest, ProbabilitiesFollowTheProblemType) {
  Start();
  for (const std::string model : {"multi", "three"}) {
    SCOPED_TRACE(model);
    InferRequest req;
    req.set_model_name(model);
    AddInput(&req, "text", kTexts);
    InferResponse resp;
    grpc::Status s = Infer(req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ExpectMatches(resp, model, kTexts);
    Tensor p = Output(resp, "probabilities");
    ASSERT_EQ(p.floats.size(), 9u);
    const float row0 = p.floats[0] + p.floats[1] + p.floats[2];
    if (model == "three") {
      EXPECT_NEAR(row0, 1.0, 1e-5);  // softmax
    } else {
      Tensor l = Output(resp, "logits");
      EXPECT_NEAR(p.floats[0], 1 / (1 + std::exp(-l.floats[0])), 1e-6);  // sigmoid
    }
  }
}

// Triton's classification extension: "value:index:label", best first, count capped at the labels.
TEST_F(KServeTest, ClassificationParameterAnswersTheBestClassesAsTritonDoes) {
  Start();
  auto servable = server_->repository()->Get("multi");
  ASSERT_TRUE(servable.ok()) << servable.status();
  const std::vector<std::string> names =
      std::static_pointer_cast<ModelServable>(*servable)->info().labels;
  ASSERT_THAT(names, ElementsAre("sports", "politics", "tech"));
  for (bool raw : {false, true}) {
    SCOPED_TRACE(raw ? "raw" : "contents");
    // The plain tensors, to compare with.
    InferRequest plain;
    plain.set_model_name("multi");
    AddInput(&plain, "text", kTexts);
    InferResponse plain_resp;
    ASSERT_TRUE(Infer(plain, &plain_resp).ok());

    InferRequest req;
    req.set_model_name("multi");
    if (raw) {
      AddRawInput(&req, "text", kTexts);
    } else {
      AddInput(&req, "text", kTexts);
    }
    auto* logits_out = req.add_outputs();
    logits_out->set_name("logits");
    (*logits_out->mutable_parameters())["classification"].set_int64_param(2);
    auto* probs_out = req.add_outputs();
    probs_out->set_name("probabilities");
    // What a newer Triton client may send; more classes than the model has means all of them.
    (*probs_out->mutable_parameters())["classification"].set_uint64_param(10);
    req.add_outputs()->set_name("label");
    InferResponse resp;
    grpc::Status s = Infer(req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.outputs_size(), 3);
    EXPECT_EQ(resp.raw_output_contents_size(), raw ? 3 : 0);

    for (const auto& [name, k] : std::vector<std::pair<std::string, int>>{{"logits", 2},
                                                                          {"probabilities", 3}}) {
      SCOPED_TRACE(name);
      const Tensor values = Output(plain_resp, name);
      const Tensor classes = Output(resp, name);
      EXPECT_EQ(classes.datatype, "BYTES");
      EXPECT_THAT(classes.shape, ElementsAre(3, k));
      ASSERT_EQ(classes.strings.size(), static_cast<size_t>(3 * k));
      for (int i = 0; i < 3; ++i) {
        std::vector<int> order = {0, 1, 2};
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
          return values.floats[3 * i + a] > values.floats[3 * i + b];
        });
        for (int j = 0; j < k; ++j) {
          const std::string& got = classes.strings[i * k + j];
          const int idx = order[j];
          // std::to_string's "%f": six decimals, as Triton prints it.
          EXPECT_THAT(got, ::testing::MatchesRegex(
                               absl::StrCat("-?[0-9]+\\.[0-9]{6}:", idx, ":", names[idx])))
              << "input " << i << " rank " << j;
          EXPECT_NEAR(std::stof(got.substr(0, got.find(':'))), values.floats[3 * i + idx], 1e-5);
        }
      }
    }
    EXPECT_EQ(Output(resp, "label").strings, Output(plain_resp, "label").strings);
  }
  inference::ServerMetadataResponse server;
  ASSERT_TRUE(stub_->ServerMetadata(Context().get(), {}, &server).ok());
  EXPECT_THAT(server.extensions(), ::testing::Contains("classification"));
}

// Triton's `timeout` request parameter (microseconds) is a deadline of its own.
TEST_F(KServeTest, TimeoutParameterIsADeadline) {
  Start();
  InferRequest req;
  req.set_model_name("tiny");
  AddInput(&req, "text", kTexts);
  InferResponse resp;
  (*req.mutable_parameters())["timeout"].set_int64_param(0);  // none
  ASSERT_TRUE(Infer(req, &resp).ok());
  (*req.mutable_parameters())["timeout"].set_uint64_param(60'000'000);
  ASSERT_TRUE(Infer(req, &resp).ok());
  // 1 µs has passed long before the inputs reach a batch; the 30 s gRPC deadline has not.
  (*req.mutable_parameters())["timeout"].set_int64_param(1);
  grpc::Status s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  // Priority is accepted and does not change the answer (one queue per model).
  req.mutable_parameters()->erase("timeout");
  (*req.mutable_parameters())["priority"].set_uint64_param(1);
  InferResponse prioritized;
  ASSERT_TRUE(Infer(req, &prioritized).ok());
  EXPECT_EQ(Output(prioritized, "logits").floats, Output(resp, "logits").floats);
}

TEST_F(KServeTest, ConcurrentCallsBatchedTogetherEachGetTheirOwnResults) {
  Start();
  constexpr int kCalls = 8;
  struct Call {
    grpc::ClientContext ctx;
    InferRequest req;
    InferResponse resp;
    grpc::Status status;
    absl::Notification done;
    std::vector<std::string> texts;
  };
  std::vector<std::unique_ptr<Call>> calls;
  // Hold the model so that the calls queue up and share batches.
  gate_.Close();
  for (int i = 0; i < kCalls; ++i) {
    auto c = std::make_unique<Call>();
    c->texts = {absl::StrCat("call ", i, " first text"), absl::StrCat("call ", i, " and its second")};
    c->req.set_model_name("tiny");
    c->req.set_id(absl::StrCat("id-", i));
    if (i % 2 == 0) {
      AddInput(&c->req, "text", c->texts);
    } else {
      AddRawInput(&c->req, "text", c->texts, {2, 1});
    }
    c->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    Call* raw = c.get();
    stub_->async()->ModelInfer(&raw->ctx, &raw->req, &raw->resp, [raw](grpc::Status st) {
      raw->status = std::move(st);
      raw->done.Notify();
    });
    calls.push_back(std::move(c));
  }
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  gate_.Open();
  for (int i = 0; i < kCalls; ++i) {
    Call& c = *calls[i];
    c.done.WaitForNotification();
    ASSERT_TRUE(c.status.ok()) << c.status.error_message();
    EXPECT_EQ(c.resp.id(), absl::StrCat("id-", i));
    const std::vector<model::Prediction> engine = EngineRun("tiny", c.texts);
    Tensor logits = Output(c.resp, "logits");
    ASSERT_EQ(logits.floats.size(), 4u);
    for (int j = 0; j < 2; ++j) {
      EXPECT_NEAR(logits.floats[2 * j], engine[j].logits[0], 1e-5) << "call " << i;
      EXPECT_NEAR(logits.floats[2 * j + 1], engine[j].logits[1], 1e-5) << "call " << i;
    }
  }
}

TEST_F(KServeTest, RequestedOutputsOnlyInTheirOrder) {
  Start();
  for (bool raw : {false, true}) {
    SCOPED_TRACE(raw ? "raw" : "contents");
    InferRequest req;
    req.set_model_name("tiny");
    if (raw) {
      AddRawInput(&req, "text", kTexts);
    } else {
      AddInput(&req, "text", kTexts);
    }
    req.add_outputs()->set_name("label");
    req.add_outputs()->set_name("logits");
    InferResponse resp;
    grpc::Status s = Infer(req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.outputs_size(), 2);
    EXPECT_EQ(resp.outputs(0).name(), "label");
    EXPECT_EQ(resp.outputs(1).name(), "logits");
    EXPECT_EQ(resp.raw_output_contents_size(), raw ? 2 : 0);
    const v1::ClassifyResponse classified = Classify("tiny", kTexts);
    Tensor label = Output(resp, "label");
    ASSERT_EQ(label.strings.size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(label.strings[i], classified.results(i).label());
    EXPECT_EQ(Output(resp, "logits").floats.size(), 6u);
  }
}

TEST_F(KServeTest, ExplicitAndUnknownVersions) {
  Start();
  InferRequest req;
  req.set_model_name("tiny");
  req.set_model_version("1");
  AddInput(&req, "text", {"hello"});
  InferResponse v1_resp;
  ASSERT_TRUE(Infer(req, &v1_resp).ok());
  EXPECT_EQ(v1_resp.model_version(), "1");
  req.set_model_version("2");
  InferResponse v2_resp;
  ASSERT_TRUE(Infer(req, &v2_resp).ok());
  EXPECT_NE(Output(v1_resp, "logits").floats, Output(v2_resp, "logits").floats);

  InferResponse resp;
  req.set_model_version("9");
  grpc::Status s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("tiny"));
  for (const std::string bad : {"one", " 1", "+1", "1 ", "0", "99999999999999999999"}) {
    req.set_model_version(bad);
    s = Infer(req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_THAT(s.error_message(), HasSubstr("\"" + bad + "\""));
  }
  req.set_model_version("");
  req.set_model_name("nope");
  s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("nope"));
}

// A call without a version while the default version changes, the old one retired: it is answered
// by the version it was resolved to or a newer one, never NOT_FOUND (ModelInfer looked the version
// up twice, and the second lookup could miss one a swap had just retired).
TEST_F(KServeTest, VersionSwapsUnderLoadFailNoCall) {
  Start();
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0}, answered{0};
  std::string first_failure;
  absl::Mutex mu;
  std::vector<std::thread> clients;
  for (int t = 0; t < 3; ++t) {
    clients.emplace_back([&] {
      InferRequest req;
      req.set_model_name("tiny");
      AddInput(&req, "text", {"swap"});
      while (!stop.load()) {
        InferResponse resp;
        grpc::Status s = Infer(req, &resp);
        if (!s.ok()) {
          failures++;
          absl::MutexLock lock(&mu);
          if (first_failure.empty()) first_failure = s.error_message();
        } else {
          answered++;
        }
      }
    });
  }
  // Each round makes a newest version the default, then deletes it: the default goes back, and
  // the version that was answering is retired under the calls.
  for (int v = 3; v < 8; ++v) {
    const std::string staging = repo_.path() + "/.staging-v" + std::to_string(v);
    MakeTinyModel(staging, v);
    std::filesystem::rename(staging, repo_.path() + "/tiny/" + std::to_string(v));
    ASSERT_TRUE(server_->repository()->Poll().ok());
    const int before = answered.load();
    ASSERT_TRUE(Eventually([&] { return answered.load() >= before + 5; }));
    ASSERT_TRUE(server_->repository()->DeleteVersion({"tiny", v}).ok());
  }
  stop = true;
  for (auto& c : clients) c.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
}

TEST_F(KServeTest, BadInputsAreInvalidArgumentNamingTheProblem) {
  Start();
  struct Case {
    std::string what;
    std::function<void(InferRequest*)> build;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"wrong datatype",
       [](InferRequest* r) {
         auto* in = r->add_inputs();
         in->set_name("text");
         in->set_datatype("FP32");
         in->add_shape(1);
         in->mutable_contents()->add_fp32_contents(1);
       },
       "input 'text' has datatype FP32"},
      {"matrix shape", [](InferRequest* r) { AddInput(r, "text", {"a", "b", "c", "d"}, {2, 2}); },
       "input 'text' has shape [2, 2]"},
      {"zero elements", [](InferRequest* r) { AddInput(r, "text", {}, {0}); },
       "input 'text' has shape [0]"},
      {"count mismatch", [](InferRequest* r) { AddInput(r, "text", {"a", "b"}, {3}); },
       "input 'text' has shape [3] (3 elements) but 2"},
      {"missing text", [](InferRequest* r) { AddInput(r, "text_pair", {"a"}); },
       "no input 'text'"},
      {"unknown input",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         AddInput(r, "sentence", {"b"});
       },
       "input 'sentence' is not an input"},
      {"pair count",
       [](InferRequest* r) {
         AddInput(r, "text", {"a", "b"});
         AddInput(r, "text_pair", {"c"});
       },
       "input 'text_pair' has 1 elements but 'text' has 2"},
      {"empty text", [](InferRequest* r) { AddInput(r, "text", {"fine", ""}); },
       "input 'text' element 1 is empty"},
      {"unknown output",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         r->add_outputs()->set_name("embeddings");
       },
       "requested output 'embeddings'"},
      {"raw truncated",
       [](InferRequest* r) {
         AddRawInput(r, "text", {"abc"});
         r->mutable_raw_input_contents(0)->resize(5);
       },
       "input 'text': element 0 of raw_input_contents claims 3 bytes but only 1 remain"},
      {"raw leftover",
       [](InferRequest* r) {
         AddRawInput(r, "text", {"abc"});
         r->mutable_raw_input_contents(0)->append("xy");
       },
       "2 bytes left over"},
      {"raw short",
       [](InferRequest* r) { AddRawInput(r, "text", {"abc"}, {2}); },
       "raw_input_contents ends after 1 of 2"},
      {"raw count",
       [](InferRequest* r) {
         AddRawInput(r, "text", {"a"});
         AddInput(r, "text_pair", {"b"});
         r->mutable_inputs(1)->clear_contents();
       },
       "raw_input_contents has 1 entries for 2 inputs"},
      {"both forms",
       [](InferRequest* r) {
         AddRawInput(r, "text", {"a"});
         r->mutable_inputs(0)->mutable_contents()->add_bytes_contents("a");
       },
       "input 'text' has contents although the request uses raw_input_contents"},
      {"truncate type",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         (*r->mutable_parameters())["truncate"].set_string_param("yes");
       },
       "parameter 'truncate'"},
      {"not UTF-8", [](InferRequest* r) { AddInput(r, "text", {"fine", "caf\xc3"}); },
       "input 'text' element 1: invalid UTF-8"},
      {"pair not UTF-8",
       [](InferRequest* r) {
         AddInput(r, "text", {"fine", "fine"});
         AddInput(r, "text_pair", {"fine", "caf\xc3"});
       },
       "input 'text_pair' element 1: invalid UTF-8"},
      {"more elements than allowed, found before decoding",
       [](InferRequest* r) { AddRawInput(r, "text", {"a"}, {100000}); },
       "input 'text' has 100000 elements, more than the limit of 64 (--max_inputs_per_request)"},
      {"classification of label",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         auto* out = r->add_outputs();
         out->set_name("label");
         (*out->mutable_parameters())["classification"].set_int64_param(1);
       },
       "output 'label' is BYTES"},
      {"classification zero",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         auto* out = r->add_outputs();
         out->set_name("logits");
         (*out->mutable_parameters())["classification"].set_int64_param(0);
       },
       "output 'logits' parameter 'classification' is 0"},
      {"classification type",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         auto* out = r->add_outputs();
         out->set_name("probabilities");
         (*out->mutable_parameters())["classification"].set_string_param("2");
       },
       "output 'probabilities' parameter 'classification' must be an int64_param"},
      {"negative timeout",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         (*r->mutable_parameters())["timeout"].set_int64_param(-5);
       },
       "parameter 'timeout' is -5; it must not be negative"},
      {"timeout type",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         (*r->mutable_parameters())["timeout"].set_double_param(1.5);
       },
       "parameter 'timeout' must be an int64_param"},
      {"pair too long",
       [](InferRequest* r) {
         AddInput(r, "text", {"a"});
         AddInput(r, "text_pair", {std::string(70000, 'x')});
       },
       "input 'text_pair' element 0 is 70000 bytes"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    InferRequest req;
    req.set_model_name("tiny");
    c.build(&req);
    InferResponse resp;
    grpc::Status s = Infer(req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.expect));
  }
  // Bad requests are counted as Classify counts them.
  auto text = ScrapeMetrics(server_->metrics_port());
  ASSERT_TRUE(text.ok()) << text.status();
  auto m = ParseMetrics(*text);
  EXPECT_EQ(m["collabserve_requests_total{code=\"INVALID_ARGUMENT\",model=\"tiny\",version=\"2\"}"] +
                m["collabserve_requests_total{code=\"INVALID_ARGUMENT\",model=\"tiny\",version=\"\"}"] +
                m["collabserve_requests_total{code=\"INVALID_ARGUMENT\",model=\"\",version=\"\"}"],
            cases.size());
}

TEST_F(KServeTest, TruncateParameterIsClassifysOption) {
  Start();
  std::string long_text;
  for (int i = 0; i < 600; ++i) long_text += "word ";
  InferRequest req;
  req.set_model_name("tiny");
  AddInput(&req, "text", {long_text});
  InferResponse resp;
  EXPECT_TRUE(Infer(req, &resp).ok());  // truncated by default
  (*req.mutable_parameters())["truncate"].set_bool_param(false);
  grpc::Status s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("element 0 of 'text'"));
  EXPECT_THAT(s.error_message(), HasSubstr("truncation is off"));
}

TEST_F(KServeTest, SuccessfulInferIsCountedLikeClassify) {
  Start();
  InferRequest req;
  req.set_model_name("tiny");
  AddInput(&req, "text", {"one", "two"});
  InferResponse resp;
  ASSERT_TRUE(Infer(req, &resp).ok());
  auto text = ScrapeMetrics(server_->metrics_port());
  ASSERT_TRUE(text.ok()) << text.status();
  auto m = ParseMetrics(*text);
  EXPECT_EQ(m["collabserve_requests_total{code=\"OK\",model=\"tiny\",version=\"2\"}"], 1);
  EXPECT_EQ(m["collabserve_queue_duration_seconds_count{model=\"tiny\"}"], 2);
  // The in-flight gauge drops after the reactor has finished, which may be after the client has
  // its answer: wait (bounded) for it rather than race it.
  double inflight = m["collabserve_inflight_requests"];
  for (int i = 0; i < 100 && inflight != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    auto again = ScrapeMetrics(server_->metrics_port());
    ASSERT_TRUE(again.ok()) << again.status();
    inflight = ParseMetrics(*again)["collabserve_inflight_requests"];
  }
  EXPECT_EQ(inflight, 0);
}

TEST_F(KServeTest, Metadata) {
  Start();
  inference::ServerMetadataResponse server;
  ASSERT_TRUE(stub_->ServerMetadata(Context().get(), {}, &server).ok());
  EXPECT_EQ(server.name(), "collabserve");
  EXPECT_THAT(server.extensions(), ElementsAre("classification", "model_configuration", "statistics",
                                                  "model_repository"));
  EXPECT_FALSE(server.version().empty());

  inference::ModelMetadataRequest req;
  req.set_name("multi");
  inference::ModelMetadataResponse meta;
  grpc::Status s = stub_->ModelMetadata(Context().get(), req, &meta);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(meta.name(), "multi");
  EXPECT_EQ(meta.platform(), "collabserve");
  EXPECT_THAT(meta.versions(), ElementsAre("1"));
  ASSERT_EQ(meta.inputs_size(), 2);
  EXPECT_EQ(meta.inputs(0).name(), "text");
  EXPECT_EQ(meta.inputs(0).datatype(), "BYTES");
  EXPECT_THAT(meta.inputs(0).shape(), ElementsAre(-1));
  EXPECT_EQ(meta.inputs(1).name(), "text_pair");
  ASSERT_EQ(meta.outputs_size(), 3);
  EXPECT_EQ(meta.outputs(0).name(), "logits");
  EXPECT_EQ(meta.outputs(0).datatype(), "FP32");
  EXPECT_THAT(meta.outputs(0).shape(), ElementsAre(-1, 3));
  EXPECT_EQ(meta.outputs(1).name(), "probabilities");
  EXPECT_THAT(meta.outputs(1).shape(), ElementsAre(-1, 3));
  EXPECT_EQ(meta.outputs(2).name(), "label");
  EXPECT_EQ(meta.outputs(2).datatype(), "BYTES");
  EXPECT_THAT(meta.outputs(2).shape(), ElementsAre(-1));

  req.set_name("tiny");
  ASSERT_TRUE(stub_->ModelMetadata(Context().get(), req, &meta).ok());
  EXPECT_THAT(meta.versions(), ElementsAre("1", "2"));
  req.set_version("7");
  s = stub_->ModelMetadata(Context().get(), req, &meta);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  req.set_name("nope");
  req.set_version("");
  s = stub_->ModelMetadata(Context().get(), req, &meta);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("nope"));
}

// Triton's model_configuration extension, as perf_analyzer reads it: the batch dimension is the
// inputs one request may carry, every config tensor is a metadata tensor, one string per input.
TEST_F(KServeTest, ModelConfigDescribesTheServedVersionInTritonsTerms) {
  compress::CompressOptions co;
  co.spec.kind = compress::RankSpec::Kind::kPerLayer;
  co.spec.ranks = {8, 0};
  co.max_iters = 5;
  auto compressed = compress::CompressModelDirectory(repo_.path() + "/three/1", repo_.path() + "/three/2", co);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  Start();
  inference::ModelConfigRequest req;
  req.set_name("three");
  inference::ModelConfigResponse resp;
  grpc::Status s = stub_->ModelConfig(Context().get(), req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const inference::ModelConfig c = resp.config();  // a copy: `resp` is read into again below
  EXPECT_EQ(c.name(), "three");
  EXPECT_EQ(c.platform(), "collabserve");
  EXPECT_EQ(c.backend(), "collabserve");
  EXPECT_EQ(c.max_batch_size(), server_->inference_service().options().max_inputs_per_request);
  ASSERT_EQ(c.input_size(), 2);
  EXPECT_EQ(c.input(0).name(), "text");
  EXPECT_EQ(c.input(0).data_type(), inference::TYPE_STRING);
  EXPECT_THAT(c.input(0).dims(), ElementsAre(1));
  EXPECT_TRUE(c.input(0).has_reshape());
  EXPECT_EQ(c.input(0).reshape().shape_size(), 0);
  EXPECT_FALSE(c.input(0).optional());
  EXPECT_EQ(c.input(1).name(), "text_pair");
  EXPECT_TRUE(c.input(1).optional());
  ASSERT_EQ(c.output_size(), 3);
  EXPECT_EQ(c.output(0).name(), "logits");
  EXPECT_EQ(c.output(0).data_type(), inference::TYPE_FP32);
  EXPECT_THAT(c.output(0).dims(), ElementsAre(3));
  EXPECT_EQ(c.output(1).name(), "probabilities");
  EXPECT_THAT(c.output(1).dims(), ElementsAre(3));
  EXPECT_EQ(c.output(2).name(), "label");
  EXPECT_EQ(c.output(2).data_type(), inference::TYPE_STRING);
  EXPECT_THAT(c.output(2).dims(), ElementsAre(1));
  const ServerOptions o = Options();
  ASSERT_TRUE(c.has_dynamic_batching());
  EXPECT_THAT(c.dynamic_batching().preferred_batch_size(), ElementsAre(o.servable.batching.max_batch_size));
  EXPECT_EQ(c.dynamic_batching().max_queue_delay_microseconds(), 500u);
  EXPECT_EQ(c.dynamic_batching().default_queue_policy().max_queue_size(),
            static_cast<uint32_t>(o.servable.batching.max_queue_size));
  ASSERT_EQ(c.instance_group_size(), 1);
  EXPECT_EQ(c.instance_group(0).kind(), inference::ModelInstanceGroup::KIND_CPU);
  EXPECT_EQ(c.instance_group(0).count(), o.servable.batching.num_batch_threads);
  EXPECT_TRUE(c.has_model_transaction_policy());
  EXPECT_FALSE(c.model_transaction_policy().decoupled());
  // The newest version is the compressed one, and says so.
  EXPECT_EQ(c.parameters().at("problem_type").string_value(), "single_label_classification");
  EXPECT_EQ(c.parameters().at("max_length").string_value(), "512");
  EXPECT_EQ(c.parameters().at("dtype").string_value(), "float32");
  EXPECT_EQ(c.parameters().at("device").string_value(), "cpu");
  ASSERT_EQ(c.parameters().count("collaborative_ranks"), 1u);
  EXPECT_EQ(c.parameters().at("collaborative_ranks").string_value(), "8,0");
  // Version 1 is standard.
  req.set_version("1");
  ASSERT_TRUE(stub_->ModelConfig(Context().get(), req, &resp).ok());
  EXPECT_EQ(resp.config().parameters().count("collaborative_ranks"), 0u);

  // Every tensor the config names is one ModelMetadata lists (perf_analyzer refuses a config
  // tensor the metadata lacks).
  inference::ModelMetadataRequest mreq;
  mreq.set_name("three");
  inference::ModelMetadataResponse meta;
  ASSERT_TRUE(stub_->ModelMetadata(Context().get(), mreq, &meta).ok());
  for (const auto& in : c.input()) {
    EXPECT_TRUE(std::any_of(meta.inputs().begin(), meta.inputs().end(),
                            [&](const auto& t) { return t.name() == in.name(); })) << in.name();
  }
  for (const auto& out : c.output()) {
    EXPECT_TRUE(std::any_of(meta.outputs().begin(), meta.outputs().end(),
                            [&](const auto& t) { return t.name() == out.name(); })) << out.name();
  }

  // Errors as ModelMetadata's.
  req.set_version("7");
  EXPECT_EQ(stub_->ModelConfig(Context().get(), req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  req.set_version("x");
  EXPECT_EQ(stub_->ModelConfig(Context().get(), req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  req.set_name("nope");
  req.set_version("");
  s = stub_->ModelConfig(Context().get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("nope"));
}

TEST(KServeDescribeDeviceTest, GpusByIndexAndTheCpu) {
  struct Case {
    std::string device;
    inference::ModelInstanceGroup::Kind kind;
    std::vector<int> gpus;
  };
  for (const Case& c : std::vector<Case>{{"cuda:3", inference::ModelInstanceGroup::KIND_GPU, {3}},
                                         {"cuda", inference::ModelInstanceGroup::KIND_GPU, {0}},
                                         {"cuda:x", inference::ModelInstanceGroup::KIND_GPU, {0}},
                                         {"cpu", inference::ModelInstanceGroup::KIND_CPU, {}}}) {
    inference::ModelInstanceGroup g;
    DescribeDevice(c.device, &g);
    EXPECT_EQ(g.kind(), c.kind) << c.device;
    EXPECT_EQ(std::vector<int>(g.gpus().begin(), g.gpus().end()), c.gpus) << c.device;
  }
}

// Triton's statistics extension: per served version, what its calls and passes did.
TEST_F(KServeTest, ModelStatisticsCountWhatEachVersionDid) {
  Start();
  const uint64_t before_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  for (int i = 0; i < 3; ++i) {  // three calls of two inputs, and one Classify of three
    InferRequest req;
    req.set_model_name("tiny");
    AddInput(&req, "text", {absl::StrCat("call ", i), "a second input"});
    InferResponse resp;
    ASSERT_TRUE(Infer(req, &resp).ok());
  }
  Classify("tiny", {"one", "two words", "and three words"});
  // Three calls that fail after naming the version: a bad input name, an input past its deadline
  // (1 µs) before it reached a batch, and a Classify with an empty text.
  InferRequest bad;
  bad.set_model_name("tiny");
  AddInput(&bad, "txt", {"x"});
  InferResponse resp;
  ASSERT_EQ(Infer(bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  InferRequest late;
  late.set_model_name("tiny");
  AddInput(&late, "text", {"too late"});
  (*late.mutable_parameters())["timeout"].set_int64_param(1);
  ASSERT_EQ(Infer(late, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  {
    v1::ClassifyRequest empty;
    empty.set_model_name("tiny");
    empty.add_inputs()->set_text("");
    v1::ClassifyResponse cr;
    ASSERT_EQ(classify_->Classify(Context().get(), empty, &cr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  const uint64_t after_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));

  inference::ModelStatisticsRequest req;
  req.set_name("tiny");
  inference::ModelStatisticsResponse stats;
  grpc::Status s = stub_->ModelStatistics(Context().get(), req, &stats);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(stats.model_stats_size(), 2);
  const inference::ModelStatistics& old = stats.model_stats(0);
  EXPECT_EQ(old.name(), "tiny");
  EXPECT_EQ(old.version(), "1");
  EXPECT_EQ(old.inference_count(), 0u);
  EXPECT_EQ(old.execution_count(), 0u);  // warm-up passes are not calls' passes
  EXPECT_EQ(old.last_inference(), 0u);
  EXPECT_EQ(old.inference_stats().success().count(), 0u);

  const inference::ModelStatistics& st = stats.model_stats(1);
  EXPECT_EQ(st.version(), "2");
  EXPECT_EQ(st.inference_count(), 9u);
  const inference::InferStatistics& is = st.inference_stats();
  for (const auto* d : {&is.success(), &is.queue(), &is.compute_input(), &is.compute_infer(), &is.compute_output()}) {
    EXPECT_EQ(d->count(), 4u);
  }
  EXPECT_EQ(is.fail().count(), 3u);
  EXPECT_GT(is.compute_infer().ns(), 0u);
  EXPECT_GE(is.success().ns(), is.compute_infer().ns());
  EXPECT_GE(is.success().ns(), is.queue().ns());
  EXPECT_GE(st.last_inference(), before_ms);
  EXPECT_LE(st.last_inference(), after_ms);
  // Every pass is in one batch size's row, and together they answered every input.
  uint64_t passes = 0, inputs = 0, pass_ns = 0;
  for (const auto& b : st.batch_stats()) {
    passes += b.compute_infer().count();
    inputs += b.batch_size() * b.compute_infer().count();
    pass_ns += b.compute_infer().ns();
  }
  EXPECT_GE(st.execution_count(), 4u);  // one call after another
  EXPECT_EQ(passes, st.execution_count());
  EXPECT_EQ(inputs, 9u);
  EXPECT_GT(pass_ns, 0u);

  // Every served version of every model, by model and version; or one version.
  req.set_name("");
  ASSERT_TRUE(stub_->ModelStatistics(Context().get(), req, &stats).ok());
  std::vector<std::string> ids;
  for (const auto& m : stats.model_stats()) ids.push_back(m.name() + "/" + m.version());
  EXPECT_THAT(ids, ElementsAre("multi/1", "three/1", "tiny/1", "tiny/2"));
  req.set_name("tiny");
  req.set_version("2");
  ASSERT_TRUE(stub_->ModelStatistics(Context().get(), req, &stats).ok());
  ASSERT_EQ(stats.model_stats_size(), 1);
  EXPECT_EQ(stats.model_stats(0).inference_count(), 9u);

  req.set_version("7");
  EXPECT_EQ(stub_->ModelStatistics(Context().get(), req, &stats).error_code(), grpc::StatusCode::NOT_FOUND);
  req.set_version("x");
  EXPECT_EQ(stub_->ModelStatistics(Context().get(), req, &stats).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  req.set_name("");
  req.set_version("1");
  s = stub_->ModelStatistics(Context().get(), req, &stats);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("needs a model name"));
  req.set_name("nope");
  req.set_version("");
  s = stub_->ModelStatistics(Context().get(), req, &stats);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("nope"));
}

// RepositoryIndex lists every version the repository knows with Triton's state names and the reason
// it is not served; `ready` keeps the served ones. Load and unload are refused: they are the admin's.
TEST_F(KServeTest, RepositoryIndexListsEveryVersionWithWhyItIsNotServed) {
  MakeTinyModel(repo_.path() + "/tiny/3", 3);
  {
    std::ofstream broken(repo_.path() + "/tiny/3/config.json", std::ios::trunc);
    broken << "{not json";
  }
  MakeTinyModel(repo_.path() + "/multi/2", 7);
  MakeTinyModel(repo_.path() + "/multi/3", 8);
  Start();
  ASSERT_TRUE(server_->repository()->UnloadVersion({"three", 1}).ok());

  auto index = [this](bool ready) {
    inference::RepositoryIndexRequest req;
    req.set_ready(ready);
    inference::RepositoryIndexResponse resp;
    grpc::Status s = stub_->RepositoryIndex(Context().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> rows;
    for (const auto& m : resp.models()) {
      rows.push_back(absl::StrCat(m.name(), ":", m.version(), " ", m.state(), " ", m.reason()));
    }
    return rows;
  };
  const std::vector<std::string> all = index(false);
  ASSERT_EQ(all.size(), 7u) << absl::StrJoin(all, "\n");
  EXPECT_EQ(all[0], "multi:1 UNAVAILABLE unloaded: not among the newest versions the repository serves");
  EXPECT_EQ(all[1], "multi:2 READY ");
  EXPECT_EQ(all[2], "multi:3 READY ");
  EXPECT_THAT(all[3], HasSubstr("three:1 UNAVAILABLE unloaded by an admin (Admin/UnloadModel)"));
  EXPECT_EQ(all[4], "tiny:1 READY ");
  EXPECT_EQ(all[5], "tiny:2 READY ");
  EXPECT_THAT(all[6], HasSubstr("tiny:3 UNAVAILABLE the load failed: "));
  EXPECT_THAT(all[6], HasSubstr("config.json"));
  EXPECT_THAT(index(true), ElementsAre("multi:2 READY ", "multi:3 READY ", "tiny:1 READY ",
                                       "tiny:2 READY "));

  inference::RepositoryIndexRequest named;
  named.set_repository_name("models");
  inference::RepositoryIndexResponse resp;
  grpc::Status s = stub_->RepositoryIndex(Context().get(), named, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("repository_name \"models\""));

  inference::RepositoryModelLoadRequest load;
  load.set_model_name("three");
  inference::RepositoryModelLoadResponse loaded;
  s = stub_->RepositoryModelLoad(Context().get(), load, &loaded);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("explicit model load / unload is not allowed"));
  EXPECT_THAT(s.error_message(), HasSubstr("Admin/LoadModel"));
  inference::RepositoryModelUnloadRequest unload;
  unload.set_model_name("tiny");
  inference::RepositoryModelUnloadResponse unloaded;
  s = stub_->RepositoryModelUnload(Context().get(), unload, &unloaded);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("Admin/UnloadModel"));
  EXPECT_TRUE(ModelReady("tiny", "2"));  // nothing changed
  EXPECT_FALSE(ModelReady("three", "1"));
}

// The states no running server above shows for long: a version loading, one whose files are still
// being written, and a served version whose reload failed.
TEST(KServeDescribeVersionTest, LoadingSettlingAndAFailedReload) {
  using Status = repository::ModelRepository::VersionStatus;
  auto describe = [](const Status& status) {
    inference::RepositoryIndexResponse::ModelIndex index;
    DescribeVersion(status, &index);
    return absl::StrCat(index.version(), " ", index.state(), " ", index.reason());
  };
  Status loading;
  loading.version = 4;
  loading.state = Status::State::kLoading;
  EXPECT_EQ(describe(loading), "4 LOADING ");
  Status settling;
  settling.version = 5;
  settling.settling = true;
  EXPECT_EQ(describe(settling),
            "5 UNAVAILABLE its files are still changing; looked at again once they settle");
  settling.state = Status::State::kFailed;
  settling.error = absl::InvalidArgumentError("bad");
  EXPECT_THAT(describe(settling), HasSubstr("still changing"));
  Status reload;
  reload.version = 6;
  reload.state = Status::State::kAvailable;
  reload.error = absl::NotFoundError("model.safetensors is missing");
  EXPECT_EQ(describe(reload),
            "6 READY a reload failed, and the copy loaded before serves on: model.safetensors is "
            "missing");
}

TEST_F(KServeTest, ReadinessFollowsLoadingAndDraining) {
  InferRequest req;
  req.set_model_name("tiny");
  AddInput(&req, "text", {"hello"});
  InferResponse resp;

  StartServing();
  EXPECT_TRUE(Live());
  EXPECT_FALSE(Ready());
  EXPECT_FALSE(ModelReady("tiny", ""));
  grpc::Status s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("loading"));
  inference::ModelStatisticsRequest stats_req;
  stats_req.set_name("tiny");
  inference::ModelStatisticsResponse stats;
  EXPECT_EQ(stub_->ModelStatistics(Context().get(), stats_req, &stats).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  inference::RepositoryIndexResponse index;
  EXPECT_EQ(stub_->RepositoryIndex(Context().get(), {}, &index).error_code(),
            grpc::StatusCode::UNAVAILABLE);

  LoadModels();
  EXPECT_TRUE(Ready());
  EXPECT_TRUE(ModelReady("tiny", ""));
  EXPECT_TRUE(ModelReady("tiny", "1"));
  EXPECT_FALSE(ModelReady("tiny", "3"));
  EXPECT_FALSE(ModelReady("nope", ""));
  inference::ModelReadyRequest bad;
  inference::ModelReadyResponse bad_resp;
  EXPECT_EQ(stub_->ModelReady(Context().get(), bad, &bad_resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  // Hold one call in the model, start draining, and look while the drain waits for it.
  gate_.Close();
  grpc::ClientContext held_ctx;
  held_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  InferResponse held_resp;
  grpc::Status held_status;
  absl::Notification held_done;
  stub_->async()->ModelInfer(&held_ctx, &req, &held_resp, [&](grpc::Status st) {
    held_status = std::move(st);
    held_done.Notify();
  });
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  std::thread shutdown([this] { server_->Shutdown(); });
  EXPECT_TRUE(Eventually([&] { return !Ready(); }));
  EXPECT_FALSE(ModelReady("tiny", ""));
  EXPECT_TRUE(Live());
  s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("shutting down"));
  // The statistics still answer while the server drains.
  s = stub_->ModelStatistics(Context().get(), stats_req, &stats);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(stats.model_stats_size(), 2);
  s = stub_->RepositoryIndex(Context().get(), {}, &index);  // and so does the index
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(index.models_size(), 4);
  gate_.Open();
  held_done.WaitForNotification();
  EXPECT_TRUE(held_status.ok()) << held_status.error_message();  // drained, not dropped
  EXPECT_EQ(Output(held_resp, "label").strings.size(), 1u);
  shutdown.join();
}

// A GPU that fails for good (injected: server_test's ADeviceFailureStopsServingUntilARestart says
// why): the failing ModelInfer gets UNAVAILABLE; from then on the server is neither live nor ready,
// no model is ready, and ModelInfer is UNAVAILABLE naming the failure.
TEST_F(KServeTest, ADeviceFailureEndsLivenessAndReadiness) {
  Start();
  InferRequest req;
  req.set_model_name("tiny");
  AddInput(&req, "text", {"hello"});
  InferResponse resp;
  ASSERT_TRUE(Infer(req, &resp).ok());
  EXPECT_TRUE(Live());
  EXPECT_TRUE(Ready());

  device_fails_ = true;
  grpc::Status s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("uncorrectable ECC error"));
  EXPECT_FALSE(Live());
  EXPECT_FALSE(Ready());
  EXPECT_FALSE(ModelReady("tiny", ""));
  device_fails_ = false;
  s = Infer(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("GPU failed"));
}

}  // namespace
}  // namespace collabserve::service
