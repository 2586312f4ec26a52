// text-embeddings-inference's routes end to end: a real Server with tiny checkpoints, the HTTP
// server on 127.0.0.1:0 with the handler of --http_port (NewHttpApiHandler), driven over raw
// sockets. /predict and /rerank must agree with Classify over gRPC to the bit, in TEI's shapes;
// errors must carry TEI's error_type under TEI's code.
#include "server/service/tei_http.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint_maker.h"
#include "server/service/http_server.h"
#include "server/service/kserve_http.h"
#include "server/service/kserve_service.h"
#include "server/service/model_servable.h"
#include "server/service/server.h"
#include "tests/kserve/raw_http_client.h"
#include "tests/kserve/rest_test_server.h"
#include "tests/service/local_server_options.h"
#include "tests/service/test_util.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::TempDir;
using ::testing::HasSubstr;
using json = nlohmann::json;

class TeiHttpTest : public RestTestServer {
 protected:
  // Models "three" (3 labels) and "scorer" (1 label: a re-ranker), and "tiny" (2) when `tiny`.
  void MakeModels(bool tiny) {
    model::MakeOptions three;
    three.labels = 3;
    three.label_names = {"sports", "politics", "tech"};
    three.seed = 6;
    ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/three/1", three).ok());
    if (tiny) MakeTinyModel(repo_.path() + "/tiny/1", 1);
  }
  void MakeScorer(const std::string& root) {
    model::MakeOptions scorer;
    scorer.labels = 1;
    scorer.label_names = {"relevance"};
    scorer.seed = 9;
    ASSERT_TRUE(model::MakeCheckpoint(root + "/scorer/1", scorer).ok());
  }
  static TeiHttpOptions Serving(const std::string& default_model) {
    TeiHttpOptions o;
    o.default_model = default_model;
    return o;
  }
  void Start(TeiHttpOptions tei = {}, bool load = true) {
    ServerOptions o = BaseOptions();
    o.servable.batching.max_queue_size = 4;
    ASSERT_NO_FATAL_FAILURE(StartWith(
        std::move(o), {},
        [tei](std::shared_ptr<grpc::Channel> channel) {
          return NewHttpApiHandler(std::move(channel), tei);
        },
        load));
    stub_ = v1::Inference::NewStub(
        grpc::CreateChannel(GrpcAddress(), grpc::InsecureChannelCredentials()));
  }
  // Classify over gRPC with every label's score.
  v1::ClassifyResponse Classify(const std::string& model,
                                const std::vector<std::pair<std::string, std::string>>& inputs,
                                bool raw_scores = false) {
    v1::ClassifyRequest req;
    req.set_model_name(model);
    req.mutable_options()->set_top_k(100);
    req.mutable_options()->set_raw_scores(raw_scores);
    for (const auto& [text, pair] : inputs) {
      v1::Input* in = req.add_inputs();
      in->set_text(text);
      if (!pair.empty()) in->set_text_pair(pair);
    }
    v1::ClassifyResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Classify(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }
  // TEI's predictions of one input: every label, best first, as Classify scores them.
  static json Predictions(const v1::Result& r) {
    json out = json::array();
    for (const v1::LabelScore& ls : r.top_k())
      out.push_back({{"score", ls.score()}, {"label", ls.label()}});
    return out;
  }
  // The scores and labels of TEI predictions, the scores read back as floats.
  static json Floats(json predictions) {
    for (json& p : predictions) p["score"] = static_cast<float>(p["score"].get<double>());
    return predictions;
  }

  std::unique_ptr<v1::Inference::Stub> stub_;
};

TEST_F(TeiHttpTest, PredictAgreesWithClassifyInEveryInputForm) {
  MakeModels(/*tiny=*/false);
  Start();
  // One text: a flat list of every label, best first.
  Reply r = Call(port_, "POST", "/predict", R"({"inputs":"a fine film about football"})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Header("content-type"), "application/json");
  v1::ClassifyResponse want = Classify("three", {{"a fine film about football", ""}});
  ASSERT_EQ(r.Json().size(), 3u);
  EXPECT_EQ(Floats(r.Json()), Predictions(want.results(0)));
  EXPECT_GE(r.Json()[0]["score"], r.Json()[1]["score"]);
  EXPECT_GE(r.Json()[1]["score"], r.Json()[2]["score"]);
  EXPECT_EQ(r.Header("x-compute-tokens"), std::to_string(want.num_tokens()));
  EXPECT_EQ(r.Header("x-compute-characters"), "26");
  for (const char* h :
       {"x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time"}) {
    EXPECT_FALSE(r.Header(h).empty()) << h;
  }

  // An array whose first element is a string is one pair (TEI's rule), still a flat list.
  r = Call(port_, "POST", "/predict", R"({"inputs":["the match", "ended in a draw"]})");
  ASSERT_EQ(r.code, 200) << r.body;
  want = Classify("three", {{"the match", "ended in a draw"}});
  EXPECT_EQ(Floats(r.Json()), Predictions(want.results(0)));

  // A batch of singles and pairs: one list per input, in order; raw_scores gives logits.
  r = Call(port_, "POST", "/predict",
           R"({"inputs":[["the match"],["the vote","in parliament"]],"raw_scores":true,)"
           R"("truncate":null,"truncation_direction":"Right","parameters":{"top_k":1}})");
  ASSERT_EQ(r.code, 200) << r.body;
  want = Classify("three", {{"the match", ""}, {"the vote", "in parliament"}}, /*raw_scores=*/true);
  ASSERT_EQ(r.Json().size(), 2u);
  EXPECT_EQ(Floats(r.Json()[0]), Predictions(want.results(0)));
  EXPECT_EQ(Floats(r.Json()[1]), Predictions(want.results(1)));
  // Written in the float's shortest form (0.7444537, not the double it widens to).
  EXPECT_EQ(r.Json()[0][0]["score"].get<double>(),
            ShortestDouble(want.results(0).top_k(0).score()));

  // The same routes under /models/NAME; POST / and /invocations are /predict for a classifier.
  const std::string one = R"({"inputs":"a fine film about football"})";
  want = Classify("three", {{"a fine film about football", ""}});
  for (const char* path :
       {"/models/three/predict", "/", "/invocations", "/models/three", "/models/three/"}) {
    r = Call(port_, "POST", path, one);
    ASSERT_EQ(r.code, 200) << path << ": " << r.body;
    EXPECT_EQ(Floats(r.Json()), Predictions(want.results(0))) << path;
  }
}

TEST_F(TeiHttpTest, RerankScoresQueryTextPairsBestFirst) {
  MakeModels(/*tiny=*/false);
  MakeScorer(repo_.path());
  Start(Serving("scorer"));
  const std::vector<std::string> texts = {"a goal in the last minute", "a recipe for bread",
                                          "the league table", "rain tomorrow"};
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& t : texts) pairs.emplace_back("football results", t);
  v1::ClassifyResponse want = Classify("scorer", pairs);
  std::vector<int> order = {0, 1, 2, 3};
  std::stable_sort(order.begin(), order.end(), [&want](int a, int b) {
    return want.results(a).score() > want.results(b).score();
  });
  const std::string body =
      absl::StrCat(R"({"query":"football results","texts":[")", absl::StrJoin(texts, R"(",")"),
                   R"("],"return_text":true})");
  for (const char* path : {"/rerank", "/", "/models/scorer/rerank", "/models/scorer/invocations"}) {
    Reply r = Call(port_, "POST", path, body);
    ASSERT_EQ(r.code, 200) << path << ": " << r.body;
    json got = r.Json();
    ASSERT_EQ(got.size(), 4u) << path;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(got[i]["index"], order[i]) << path;
      EXPECT_EQ(static_cast<float>(got[i]["score"].get<double>()), want.results(order[i]).score());
      EXPECT_EQ(got[i]["text"], texts[order[i]]);
    }
    // A one-label model's score is its sigmoid, as TEI's re-rankers give it.
    EXPECT_GT(got[0]["score"].get<double>(), 0.0);
    EXPECT_LT(got[0]["score"].get<double>(), 1.0);
  }
  // Without return_text, no text; /predict on a re-ranker is a one-element list.
  Reply r = Call(port_, "POST", "/rerank", R"({"query":"q","texts":["a"]})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_FALSE(r.Json()[0].contains("text"));
  r = Call(port_, "POST", "/predict", R"({"inputs":["q","a"]})");
  ASSERT_EQ(r.code, 200) << r.body;
  ASSERT_EQ(r.Json().size(), 1u);
  EXPECT_EQ(r.Json()[0]["label"], "relevance");

  // A classifier is not a re-ranker; no texts is Empty.
  r = Call(port_, "POST", "/models/three/rerank", R"({"query":"q","texts":["a"]})");
  EXPECT_EQ(r.code, 424) << r.body;
  EXPECT_EQ(r.Json()["error_type"], "Backend");
  EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr("not a re-ranker"));
  r = Call(port_, "POST", "/rerank", R"({"query":"q","texts":[]})");
  EXPECT_EQ(r.code, 400) << r.body;
  EXPECT_EQ(r.Json()["error_type"], "Empty");
  r = Call(port_, "POST", "/rerank", R"({"query":"q","texts":["a",3]})");
  EXPECT_EQ(r.code, 422) << r.body;
  EXPECT_EQ(r.Json()["error"], "texts[1]: not a string");
  r = Call(port_, "POST", "/rerank", R"({"query":"q","texts":["a"],"return_text":1})");
  EXPECT_EQ(r.code, 422) << r.body;
  EXPECT_EQ(r.Json()["error"], "return_text: not a bool");
  // raw_scores: the logit, for the same pair.
  const v1::ClassifyResponse logits = Classify("scorer", {{"q", "a"}}, /*raw_scores=*/true);
  r = Call(port_, "POST", "/rerank",
           R"({"query":"q","texts":["a"],"raw_scores":true,"truncate":true})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(static_cast<float>(r.Json()[0]["score"].get<double>()), logits.results(0).score());
  EXPECT_EQ(r.Header("x-compute-characters"), "2");
}

TEST_F(TeiHttpTest, TokenizeGivesEachTokensBytesInItsText) {
  MakeModels(/*tiny=*/false);
  Start();
  // One text: the special tokens with null spans, each other token its bytes and their text.
  Reply r = Call(port_, "POST", "/tokenize", R"({"inputs":"Éclair [SEP] x"})");
  ASSERT_EQ(r.code, 200) << r.body;
  const json want = json::parse(R"([[
      {"id":101,"text":"[CLS]","special":true,"start":null,"stop":null},
      {"id":14925,"text":"Éc","special":false,"start":0,"stop":3},
      {"id":19771,"text":"lai","special":false,"start":3,"stop":6},
      {"id":2099,"text":"r","special":false,"start":6,"stop":7},
      {"id":102,"text":"[SEP]","special":false,"start":8,"stop":13},
      {"id":1060,"text":"x","special":false,"start":14,"stop":15},
      {"id":102,"text":"[SEP]","special":true,"start":null,"stop":null}]])");
  EXPECT_EQ(r.Json(), want) << r.body;
  // The ids are Tokenize's over gRPC.
  v1::TokenizeRequest treq;
  treq.set_model_name("three");
  treq.add_inputs()->set_text("Éclair [SEP] x");
  v1::TokenizeResponse tresp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Tokenize(&ctx, treq, &tresp).ok());
  ASSERT_EQ(tresp.results(0).input_ids_size(), 7);
  for (int k = 0; k < 7; ++k) EXPECT_EQ(r.Json()[0][k]["id"], tresp.results(0).input_ids(k));

  // A batch (an array of strings: TEI takes no pairs here), without the special tokens.
  r = Call(port_, "POST", "/models/three/tokenize",
           R"({"inputs":["a b","c"],"add_special_tokens":false,"prompt_name":null})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json(), json::parse(R"([
      [{"id":1037,"text":"a","special":false,"start":0,"stop":1},
       {"id":1038,"text":"b","special":false,"start":2,"stop":3}],
      [{"id":1039,"text":"c","special":false,"start":0,"stop":1}]])"));

  // A text of no word pieces, without the special tokens: no tokens (not an error).
  r = Call(port_, "POST", "/tokenize", R"({"inputs":" \u0001 ","add_special_tokens":false})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json(), json::parse("[[]]"));

  // Errors: an empty text, no texts, a prompt, a text past the max length (nothing is cut).
  std::string long_text;
  for (int i = 0; i < 600; ++i) long_text += "word ";
  const std::vector<std::tuple<std::string, int, std::string>> cases = {
      {R"({"inputs":""})", 400, "`inputs` cannot be empty"},
      {R"({"inputs":[]})", 400, "`inputs` cannot be empty"},
      {R"({"inputs":["a",1]})", 422, "inputs[1]: not a string"},
      {R"({"inputs":"a","add_special_tokens":"no"})", 422, "add_special_tokens: not a bool"},
      {R"({"inputs":"a","prompt_name":"query"})", 422, "no sentence-transformers prompts"},
      {absl::StrCat(R"({"inputs":")", long_text, R"("})"), 422, "truncation is off"},
  };
  for (const auto& [body, code, message] : cases) {
    r = Call(port_, "POST", "/tokenize", body);
    EXPECT_EQ(r.code, code) << body.substr(0, 80) << ": " << r.body.substr(0, 200);
    EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr(message)) << body.substr(0, 80);
  }
}

TEST_F(TeiHttpTest, DecodeTurnsIdsBackIntoText) {
  MakeModels(/*tiny=*/false);
  Start();
  // One sequence: a list of one text; the special tokens left out unless asked for.
  Reply r = Call(port_, "POST", "/decode", R"({"ids":[101,14925,19771,2099,1012,102]})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json(), json::parse(R"(["eclair."])"));
  r = Call(port_, "POST", "/models/three/decode",
           R"({"ids":[[101,1037],[1038,102]],"skip_special_tokens":false})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json(), json::parse(R"(["[CLS] a","b [SEP]"])"));
  const std::vector<std::tuple<std::string, int, std::string>> cases = {
      {R"({"ids":[]})", 400, "`input_ids` cannot be empty"},
      {R"({"ids":[[101],[]]})", 400, "`input_ids` cannot be empty"},
      {R"({"ids":[1.0]})", 422, "ids[0]: not a token id"},
      {R"({"ids":[2147483648]})", 422, "ids[0]: not a token id"},
      {R"({"ids":"101"})", 422, "ids: missing, or not an array"},
      {R"({"ids":[101,-1]})", 422, "ids[1]: not a token id"},
      {R"({"ids":[[101],3]})", 422, "ids[1]: not an array"},
      {R"({"ids":[101],"skip_special_tokens":1})", 422, "skip_special_tokens: not a bool"},
      {R"({"ids":[[1],[99999]]})", 422, "sequences[1].ids[0] is 99999, not an id"},
  };
  for (const auto& [body, code, message] : cases) {
    r = Call(port_, "POST", "/decode", body);
    EXPECT_EQ(r.code, code) << body << ": " << r.body;
    EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr(message)) << body;
  }
}

TEST_F(TeiHttpTest, InfoDescribesTheModelAsTeiDoes) {
  MakeModels(/*tiny=*/false);
  MakeScorer(repo_.path());
  TeiHttpOptions tei;
  tei.default_model = "three";
  tei.version = "9.9.9";
  tei.max_concurrent_requests = 7;
  tei.max_batch_tokens = 1234;
  tei.max_batch_requests = 5;
  tei.max_client_batch_size = 8;
  tei.tokenization_workers = 3;
  Start(tei);
  Reply r = Call(port_, "GET", "/info");
  ASSERT_EQ(r.code, 200) << r.body;
  json info = r.Json();
  EXPECT_EQ(info["model_id"], "three");
  EXPECT_EQ(info["served_model_name"], "three");
  EXPECT_EQ(info["model_dtype"], "float32");
  EXPECT_TRUE(info["model_sha"].is_null());
  EXPECT_EQ(info["model_type"],
            json::parse(R"({"classifier":{"id2label":{"0":"sports","1":"politics","2":"tech"},)"
                        R"("label2id":{"sports":0,"politics":1,"tech":2}}})"));
  EXPECT_GT(info["max_input_length"].get<int>(), 2);
  EXPECT_EQ(info["max_concurrent_requests"], 7);
  EXPECT_EQ(info["max_batch_tokens"], 1234);
  EXPECT_EQ(info["max_batch_requests"], 5);
  EXPECT_EQ(info["max_client_batch_size"], 8);
  EXPECT_EQ(info["auto_truncate"], true);
  EXPECT_EQ(info["version"], "9.9.9");
  EXPECT_EQ(info["tokenization_workers"], 3);
  for (const char* key : {"sha", "docker_label"}) {
    EXPECT_TRUE(info.contains(key) && info[key].is_null()) << key;
  }
  r = Call(port_, "GET", "/models/scorer/info");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(
      r.Json()["model_type"],
      json::parse(R"({"reranker":{"id2label":{"0":"relevance"},"label2id":{"relevance":0}}})"));
  r = Call(port_, "GET", "/models/nope/info");
  EXPECT_EQ(r.code, 404) << r.body;
  EXPECT_EQ(r.Json()["error_type"], "Validation");
}

TEST_F(TeiHttpTest, HealthFollowsTheModelBeingServed) {
  MakeModels(/*tiny=*/false);
  Start({}, /*load=*/false);
  // Nothing served yet: 503 at the root (no model to choose) and for a named one.
  for (const char* path : {"/health", "/ping", "/", "/models/three/health"}) {
    Reply r = Call(port_, "GET", path);
    EXPECT_EQ(r.code, 503) << path << ": " << r.body;
    EXPECT_EQ(r.Json()["error_type"], "Unhealthy") << path;
  }
  {
    Client head(port_);
    head.HeadOnly(true);
    ASSERT_TRUE(head.Send(Request("HEAD", "/health")));
    std::optional<Reply> h = head.Read();
    ASSERT_TRUE(h);
    EXPECT_EQ(h->code, 503);
  }
  Reply r = Call(port_, "POST", "/predict", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 503) << r.body;
  LoadModels();
  for (const char* path : {"/health", "/ping", "/", "/models/three/health", "/models/three/"}) {
    r = Call(port_, "GET", path);
    EXPECT_EQ(r.code, 200) << path << ": " << r.body;
    EXPECT_EQ(r.body, "") << path;
  }
  {
    Client head(port_);
    head.HeadOnly(true);
    ASSERT_TRUE(head.Send(Request("HEAD", "/health") + Request("HEAD", "/predict")));
    std::optional<Reply> h = head.Read();
    ASSERT_TRUE(h);
    EXPECT_EQ(h->code, 200);
    h = head.Read();  // a POST route
    ASSERT_TRUE(h);
    EXPECT_EQ(h->code, 405);
    EXPECT_EQ(h->Header("allow"), "POST");
  }
  r = Call(port_, "GET", "/models/nope/health");
  EXPECT_EQ(r.code, 503) << r.body;
  // The KServe routes stay on /v2.
  r = Call(port_, "GET", "/v2/health/ready");
  EXPECT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json()["ready"], true);
}

TEST_F(TeiHttpTest, TheRootRoutesServeTheOnlyModelOrTheDefault) {
  MakeModels(/*tiny=*/true);
  Start();
  // Two models and no default: the root cannot choose, and says how to.
  Reply r = Call(port_, "POST", "/predict", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 400) << r.body;
  EXPECT_THAT(
      r.Json()["error"].get<std::string>(),
      ::testing::AllOf(HasSubstr("2 models are known (three, tiny)"),
                       HasSubstr("/models/NAME/predict"), HasSubstr("--http_default_model")));
  r = Call(port_, "GET", "/health");
  EXPECT_EQ(r.code, 400) << r.body;
  r = Call(port_, "POST", "/models/tiny/predict", R"({"inputs":"a"})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json().size(), 2u);
  r = Call(port_, "POST", "/models/t%69ny/predict", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 200) << r.body;
  r = Call(port_, "POST", "/models/nope/predict", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 404) << r.body;
  EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr("nope"));
  r = Call(port_, "POST", "/models/tiny/predict/extra", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 404) << r.body;
  r = Call(port_, "POST", "/models//predict", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 404) << r.body;
  r = Call(port_, "POST", "/models/tiny/predict?verbose=1", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 200) << r.body;

  // With the default named, the root serves it.
  http_.reset();
  server_->Shutdown();
  server_.reset();
  Start(Serving("tiny"));
  r = Call(port_, "POST", "/predict", R"({"inputs":"a"})");
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Json().size(), 2u);
  EXPECT_EQ(Call(port_, "GET", "/info").Json()["model_id"], "tiny");
}

TEST_F(TeiHttpTest, AModelOnDiskThatIsNotServedIsUnhealthyAndStillCountsAtTheRoot) {
  MakeModels(/*tiny=*/false);
  ASSERT_TRUE(std::filesystem::create_directories(repo_.path() + "/broken/1"));
  { std::ofstream(repo_.path() + "/broken/1/config.json") << "{not json"; }
  Start();
  // The root does not quietly pick the one model served while another is known.
  Reply r = Call(port_, "POST", "/predict", R"({"inputs":"a"})");
  EXPECT_EQ(r.code, 400) << r.body;
  EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr("(broken, three)"));
  // The broken one: 503 (TEI's clients retry it), not an unknown model's 404.
  for (const char* path : {"/models/broken/predict", "/models/broken/info"}) {
    const bool post = absl::EndsWith(path, "predict");
    r = Call(port_, post ? "POST" : "GET", path, post ? R"({"inputs":"a"})" : "");
    EXPECT_EQ(r.code, 503) << path << ": " << r.body;
    EXPECT_EQ(r.Json()["error_type"], "Unhealthy") << path;
  }
  EXPECT_EQ(Call(port_, "GET", "/models/broken/health").code, 503);
  EXPECT_EQ(Call(port_, "POST", "/models/three/predict", R"({"inputs":"a"})").code, 200);
}

TEST_F(TeiHttpTest, ALeavingClientCancelsAndAFullQueueIsOverloaded) {
  MakeModels(/*tiny=*/false);
  Start();
  gate_.Close();
  {
    Client leaving(port_);
    ASSERT_TRUE(leaving.Send(Request("POST", "/predict", R"({"inputs":"a"})")));
    ASSERT_TRUE(gate_.WaitForArrivals(1));
  }  // closed while its forward pass is held
  // The handler does not wait for the pass: the call is cancelled and the connection ends.
  EXPECT_TRUE(testing::Eventually([&] { return http_->connections() == 0; }));
  // The pass still held, the queue (4 inputs) fills, and one more input is refused.
  Client queued(port_);
  ASSERT_TRUE(queued.Send(Request("POST", "/predict", R"({"inputs":[["b"],["c"],["d"],["e"]]})")));
  auto servable = server_->repository()->Get("three");
  ASSERT_TRUE(servable.ok()) << servable.status();
  ASSERT_TRUE(testing::Eventually([&] {
    return std::static_pointer_cast<ModelServable>(*servable)->scheduler_stats().tasks_scheduled ==
           5;
  }));
  Reply r;
  ASSERT_TRUE(testing::Eventually([&] {
    r = Call(port_, "POST", "/predict", R"({"inputs":"f"})");
    return r.code == 429;
  })) << r.code
      << " " << r.body;
  EXPECT_EQ(r.Json()["error_type"], "Overloaded");
  gate_.Open();
  std::optional<Reply> b = queued.Read();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->code, 200) << b->body;
  EXPECT_EQ(b->Json().size(), 4u);
}

TEST_F(TeiHttpTest, BadRequestsGetTeisErrorTypesAndCodes) {
  MakeModels(/*tiny=*/false);
  Start();
  struct Case {
    const char* method;
    const char* path;
    std::string body;
    int code;
    const char* type;
    const char* message;  // a part of the error
  };
  const std::string nine = absl::StrCat(
      R"({"inputs":[)", absl::StrJoin(std::vector<std::string>(9, R"(["a"])"), ","), "]}");
  std::string long_text;
  for (int i = 0; i < 600; ++i) long_text += "word ";
  const std::vector<Case> cases = {
      {"POST", "/predict", R"({"inputs":""})", 400, "Empty", "`inputs` cannot be empty"},
      {"POST", "/predict", R"({"inputs":[["a"],[""]]})", 400, "Empty", "`inputs` cannot be empty"},
      {"POST", "/predict", R"({"inputs":["",""]})", 400, "Empty", "`inputs` cannot be empty"},
      {"POST", "/predict", R"({"inputs":[]})", 422, "Validation", "inputs: an empty array"},
      {"POST", "/predict", R"({"inputs":["a","b","c"]})", 422, "Validation",
       "inputs: not an array of 1 or 2"},
      {"POST", "/predict", R"({"inputs":[["a"],"b"]})", 422, "Validation",
       "inputs[1]: not an array"},
      {"POST", "/predict", R"({"inputs":[["a",1]]})", 422, "Validation",
       "inputs[0][1]: not a string"},
      {"POST", "/predict", R"({"inputs":7})", 422, "Validation",
       "inputs: not a string or an array"},
      {"POST", "/predict", R"({"text":"a"})", 422, "Validation", "inputs: missing"},
      {"POST", "/predict", R"(["a"])", 422, "Validation", "not a JSON object"},
      {"POST", "/predict", "{inputs", 400, "Validation", "not JSON"},
      {"POST", "/predict", R"({"inputs":"a","truncate":"yes"})", 422, "Validation",
       "truncate: not a bool"},
      {"POST", "/predict", R"({"inputs":"a","raw_scores":1})", 422, "Validation",
       "raw_scores: not a bool"},
      {"POST", "/predict", R"({"inputs":"a","truncation_direction":"left"})", 422, "Validation",
       "left is not supported"},
      {"POST", "/predict", R"({"inputs":"a","truncation_direction":"Left"})", 422, "Validation",
       "left is not supported"},
      {"POST", "/predict", R"({"inputs":"a","truncation_direction":"middle"})", 422, "Validation",
       "truncation_direction: not"},
      {"POST", "/predict", nine, 422, "Validation", "more than the limit of 8"},
      {"POST", "/predict", absl::StrCat(R"({"inputs":")", long_text, R"(","truncate":false})"), 422,
       "Validation", "over max_length 512"},
      {"GET", "/predict", "", 405, "Validation", "use POST"},
      {"POST", "/info", "{}", 405, "Validation", "use GET"},
      {"GET", "/embed", "", 404, "Validation", "no such endpoint: GET /embed"},
      {"GET", "/models/", "", 404, "Validation", "no such endpoint"},
      {"GET", "/models/a%zz/info", "", 400, "Validation", "malformed escape"},
  };
  for (const Case& c : cases) {
    Reply r = Call(port_, c.method, c.path, c.body);
    EXPECT_EQ(r.code, c.code) << c.method << " " << c.path << " " << c.body.substr(0, 80) << ": "
                              << r.body;
    json j = r.Json();
    EXPECT_EQ(j["error_type"], c.type) << c.path << " " << c.body.substr(0, 80);
    EXPECT_THAT(j["error"].get<std::string>(), HasSubstr(c.message)) << c.body.substr(0, 80);
  }
  // Truncation is on unless refused, as TEI's --auto-truncate.
  Reply r = Call(port_, "POST", "/predict", absl::StrCat(R"({"inputs":")", long_text, R"("})"));
  EXPECT_EQ(r.code, 200) << r.body.substr(0, 200);
  EXPECT_EQ(Call(port_, "GET", "/predict").Header("allow"), "POST");
}

}  // namespace
}  // namespace collabserve::service
