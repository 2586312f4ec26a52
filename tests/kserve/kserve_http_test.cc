// The Open Inference Protocol's REST form end to end: a real Server with tiny checkpoints and the
// KServe service, the HTTP server on 127.0.0.1:0 in front of its in-process channel, driven over
// raw sockets (plain and TLS) so that every byte on the wire is the test's. Infer must agree with
// the gRPC ModelInfer to the bit; errors must carry the gRPC status's message under the mapped code.
#include "server/service/kserve_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/model/checkpoint_maker.h"
#include "server/service/http_server.h"
#include "server/service/kserve_service.h"
#include "server/service/server.h"
#include "server/util/files.h"
#include "tests/kserve/raw_http_client.h"
#include "tests/kserve/rest_test_server.h"
#include "tests/service/local_server_options.h"
#include "tests/service/test_util.h"

namespace collabserve::service {
namespace {

using ::collabserve::testing::Eventually;
using ::collabserve::testing::MakeTinyModel;
using ::collabserve::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using json = nlohmann::json;

std::string RawBytes(const std::vector<std::string>& elements) {
  std::string raw;
  for (const auto& e : elements) {
    const uint32_t n = static_cast<uint32_t>(e.size());
    for (int k = 0; k < 4; ++k) raw.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
    raw += e;
  }
  return raw;
}

// One sample of the server's collectable: family `name`, with label code=`code` when given.
double Sample(const HttpServer& http, const std::string& name, const std::string& code = "") {
  for (const auto& f : http.NewCollectable()->Collect()) {
    if (f.name != name) continue;
    for (const auto& m : f.metric) {
      if (!code.empty() && (m.label.empty() || m.label[0].value != code)) continue;
      return f.type == prometheus::MetricType::Gauge ? m.gauge.value : m.counter.value;
    }
  }
  return 0;
}

class KServeHttpTest : public RestTestServer {
 protected:
  void SetUp() override {
    MakeTinyModel(repo_.path() + "/tiny/1", 1);
    model::MakeOptions three;
    three.labels = 3;
    three.label_names = {"sports", "politics", "tech"};
    three.seed = 6;
    ASSERT_TRUE(model::MakeCheckpoint(repo_.path() + "/three/1", three).ok());
  }
  void Start(HttpServerOptions http = {}, bool load = true) {
    ServerOptions o = BaseOptions();
    o.max_message_bytes = 1 << 20;
    if (http.max_body_bytes == (16 << 20)) http.max_body_bytes = o.max_message_bytes;
    ASSERT_NO_FATAL_FAILURE(StartWith(std::move(o), http, NewKServeHttpHandler, load));
    stub_ = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(GrpcAddress(), grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

const char kTwoTexts[] =
    R"({"id":"q1","inputs":[{"name":"text","shape":[2],"datatype":"BYTES",)"
    R"("data":["a fine film","not good at all"]}]})";

TEST_F(KServeHttpTest, InferAgreesWithGrpcModelInferToTheBit) {
  Start();
  inference::ModelInferRequest req;
  req.set_model_name("three");
  auto* in = req.add_inputs();
  in->set_name("text");
  in->set_datatype("BYTES");
  in->add_shape(2);
  in->mutable_contents()->add_bytes_contents("a fine film");
  in->mutable_contents()->add_bytes_contents("not good at all");
  inference::ModelInferResponse want;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->ModelInfer(&ctx, req, &want).ok());

  Reply r = Call(port_, "POST", "/v2/models/three/infer", kTwoTexts);
  ASSERT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(r.Header("content-type"), "application/json");
  json got = r.Json();
  EXPECT_EQ(got["model_name"], "three");
  EXPECT_EQ(got["model_version"], "1");
  EXPECT_EQ(got["id"], "q1");
  ASSERT_EQ(got["outputs"].size(), 3u);
  for (int i = 0; i < want.outputs_size(); ++i) {
    const auto& w = want.outputs(i);
    const json& g = got["outputs"][i];
    EXPECT_EQ(g["name"], w.name());
    EXPECT_EQ(g["datatype"], w.datatype());
    EXPECT_EQ(g["shape"], json(std::vector<int64_t>(w.shape().begin(), w.shape().end())));
    if (w.datatype() == "FP32") {
      ASSERT_EQ(g["data"].size(), static_cast<size_t>(w.contents().fp32_contents_size()));
      for (int k = 0; k < w.contents().fp32_contents_size(); ++k) {
        // The shortest decimal of the float reads back as the same float.
        EXPECT_EQ(static_cast<float>(g["data"][k].get<double>()), w.contents().fp32_contents(k))
            << w.name() << "[" << k << "]";
      }
    } else {
      EXPECT_EQ(g["data"], json(std::vector<std::string>(w.contents().bytes_contents().begin(),
                                                         w.contents().bytes_contents().end())));
    }
  }
  // Nested data as the shape [2, 1], an explicit version and a subset of outputs in their order.
  r = Call(port_, "POST", "/v2/models/three/versions/1/infer",
           R"({"inputs":[{"name":"text","shape":[2,1],"datatype":"BYTES",)"
           R"("data":[["a fine film"],["not good at all"]]}],)"
           R"("outputs":[{"name":"label"},{"name":"logits"}]})");
  ASSERT_EQ(r.code, 200) << r.body;
  got = r.Json();
  ASSERT_EQ(got["outputs"].size(), 2u);
  EXPECT_EQ(got["outputs"][0]["name"], "label");
  EXPECT_EQ(got["outputs"][1]["name"], "logits");
  EXPECT_FALSE(got.contains("id"));
}

TEST_F(KServeHttpTest, ParametersReachTheServiceAsOnGrpc) {
  Start();
  // Triton's classification extension: the two best classes, "value:index:label".
  Reply r = Call(port_, "POST", "/v2/models/three/infer",
                 R"({"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["go team"]}],)"
                 R"("outputs":[{"name":"probabilities","parameters":{"classification":2}}]})");
  ASSERT_EQ(r.code, 200) << r.body;
  json out = r.Json()["outputs"][0];
  EXPECT_EQ(out["datatype"], "BYTES");
  EXPECT_EQ(out["shape"], json({1, 2}));
  ASSERT_EQ(out["data"].size(), 2u);
  EXPECT_THAT(out["data"][0].get<std::string>(), ::testing::MatchesRegex("0\\.[0-9]+:[0-2]:(sports|politics|tech)"));
  // A parameter of the wrong type is the service's INVALID_ARGUMENT: 400, its message.
  r = Call(port_, "POST", "/v2/models/three/infer",
           R"({"parameters":{"truncate":"yes"},"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["x"]}]})");
  EXPECT_EQ(r.code, 400);
  EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr("truncate"));
}

TEST_F(KServeHttpTest, BinaryTensorsAsTritonsClientSendsThem) {
  Start();
  const std::string header =
      R"({"inputs":[{"name":"text","shape":[2],"datatype":"BYTES","parameters":{"binary_data_size":)" +
      std::to_string(RawBytes({"a fine film", "not good at all"}).size()) +
      R"(}}],"outputs":[{"name":"logits","parameters":{"binary_data":true}},{"name":"label"}]})";
  const std::string body = header + RawBytes({"a fine film", "not good at all"});
  Reply bin = Call(port_, "POST", "/v2/models/three/infer", body,
                   absl::StrCat("Inference-Header-Content-Length: ", header.size(), "\r\n"));
  ASSERT_EQ(bin.code, 200) << bin.body;
  EXPECT_EQ(bin.Header("content-type"), "application/octet-stream");
  size_t json_size = 0;
  ASSERT_TRUE(absl::SimpleAtoi(bin.Header("inference-header-content-length"), &json_size));
  json got = json::parse(bin.body.substr(0, json_size));
  const json& logits = got["outputs"][0];
  EXPECT_FALSE(logits.contains("data"));
  ASSERT_EQ(logits["parameters"]["binary_data_size"], 2 * 3 * 4);
  ASSERT_EQ(bin.body.size(), json_size + 24);
  std::vector<float> floats(6);
  std::memcpy(floats.data(), bin.body.data() + json_size, 24);

  Reply plain = Call(port_, "POST", "/v2/models/three/infer", kTwoTexts);
  ASSERT_EQ(plain.code, 200);
  const json want = plain.Json()["outputs"][0]["data"];
  for (int k = 0; k < 6; ++k) EXPECT_EQ(floats[k], static_cast<float>(want[k].get<double>()));
  EXPECT_EQ(got["outputs"][1]["data"], plain.Json()["outputs"][2]["data"]);

  // Binary lengths that do not add up are refused, naming the problem.
  Reply bad = Call(port_, "POST", "/v2/models/three/infer", body + "xx",
                   absl::StrCat("Inference-Header-Content-Length: ", header.size(), "\r\n"));
  EXPECT_EQ(bad.code, 400);
  EXPECT_THAT(bad.Json()["error"].get<std::string>(), HasSubstr("2 binary bytes"));
  bad = Call(port_, "POST", "/v2/models/three/infer", body,
             absl::StrCat("Inference-Header-Content-Length: ", body.size() + 1, "\r\n"));
  EXPECT_EQ(bad.code, 400);
  EXPECT_THAT(bad.Json()["error"].get<std::string>(), HasSubstr("Inference-Header-Content-Length"));
}

TEST_F(KServeHttpTest, ErrorsCarryTheStatusMessageUnderTheMappedCode) {
  Start();
  struct Case {
    std::string path, body;
    int code;
    std::string says;
  };
  const std::string one = R"("shape":[1],"datatype":"BYTES")";
  const std::vector<Case> cases = {
      {"/v2/models/nope/infer", R"({"inputs":[]})", 404, "nope"},
      {"/v2/models/three/versions/7/infer", R"({"inputs":[{"name":"text",)" + one + R"(,"data":["x"]}]})", 404, "7"},
      {"/v2/models/three/infer", "{not json", 400, "not JSON"},
      {"/v2/models/three/infer", "[1,2]", 400, "not a JSON object"},
      {"/v2/models/three/infer", R"({"inputs":{}})", 400, "inputs"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"text",)" + one + R"(,"data":[1]}]})", 400,
       "inputs[0] (text).data[0]: a number, not a string"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"text","shape":[1],"data":["x"]}]})", 400,
       "datatype"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"txt",)" + one + R"(,"data":["x"]}]})", 400,
       "txt"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"text","shape":[1],"datatype":"FP32","data":[1.5]}]})",
       400, "FP32"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"text","shape":[9],"datatype":"BYTES","data":["a","b","c","d","e","f","g","h","i"]}]})",
       400, "max_inputs_per_request"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"text",)" + one + R"(,"data":["x"]}],"outputs":[{"name":"nope"}]})",
       400, "nope"},
      {"/v2/models/three/infer", R"({"inputs":[{"name":"text",)" + one + R"(,"data":["x"]}],"parameters":{"p":[1]}})",
       400, "parameters.p"},
  };
  for (const Case& c : cases) {
    Reply r = Call(port_, "POST", c.path, c.body);
    EXPECT_EQ(r.code, c.code) << c.body << " -> " << r.body;
    ASSERT_TRUE(r.Json().contains("error")) << r.body;
    EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr(c.says)) << c.body;
  }
  // Routes and methods.
  Reply r = Call(port_, "GET", "/v1/models");
  EXPECT_EQ(r.code, 404);
  EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr("/v1/models"));
  r = Call(port_, "GET", "/v2/models/three/infer");
  EXPECT_EQ(r.code, 405);
  EXPECT_EQ(r.Header("allow"), "POST");
  r = Call(port_, "DELETE", "/v2/health/live");
  EXPECT_EQ(r.code, 405);
  r = Call(port_, "GET", "/v2/models/%zz");
  EXPECT_EQ(r.code, 400);
  // Explicit loading is the admin's, as on gRPC.
  r = Call(port_, "POST", "/v2/repository/models/three/unload");
  EXPECT_EQ(r.code, 400);
  EXPECT_THAT(r.Json()["error"].get<std::string>(), HasSubstr("not allowed"));
}

TEST_F(KServeHttpTest, HealthMetadataConfigStatisticsAndIndex) {
  Start({}, /*load=*/false);
  // Before the models load: live, not ready (the protocol's 4xx for false), and inference 503.
  Reply r = Call(port_, "GET", "/v2/health/live");
  EXPECT_EQ(r.code, 200);
  EXPECT_EQ(r.Json(), json({{"live", true}}));
  r = Call(port_, "GET", "/v2/health/ready");
  EXPECT_EQ(r.code, 400);
  EXPECT_EQ(r.Json(), json({{"ready", false}}));
  r = Call(port_, "POST", "/v2/models/three/infer", kTwoTexts);
  EXPECT_EQ(r.code, 503) << r.body;
  LoadModels();
  EXPECT_EQ(Call(port_, "GET", "/v2/health/ready").code, 200);
  EXPECT_EQ(Call(port_, "GET", "/v2/models/three/ready").code, 200);
  EXPECT_EQ(Call(port_, "GET", "/v2/models/three/versions/1/ready").code, 200);
  EXPECT_EQ(Call(port_, "GET", "/v2/models/three/versions/2/ready").code, 400);
  EXPECT_EQ(Call(port_, "GET", "/v2/models/nope/ready").code, 400);

  json server = Call(port_, "GET", "/v2").Json();
  EXPECT_EQ(server["name"], "collabserve");
  EXPECT_THAT(server["extensions"].get<std::vector<std::string>>(),
              ::testing::Contains("classification"));

  r = Call(port_, "GET", "/v2/models/three");
  ASSERT_EQ(r.code, 200) << r.body;
  json meta = r.Json();
  EXPECT_EQ(meta["name"], "three");
  EXPECT_EQ(meta["versions"], json({"1"}));
  EXPECT_EQ(meta["inputs"][0], json({{"name", "text"}, {"datatype", "BYTES"}, {"shape", {-1}}}));
  EXPECT_EQ(meta["outputs"][0]["shape"], json({-1, 3}));  // 64-bit integers as numbers
  EXPECT_EQ(Call(port_, "GET", "/v2/models/three/").code, 200);  // a trailing slash

  json config = Call(port_, "GET", "/v2/models/three/config").Json();
  EXPECT_EQ(config["name"], "three");
  EXPECT_EQ(config["max_batch_size"], 8);
  EXPECT_EQ(config["instance_group"][0]["kind"], "KIND_CPU");  // enums by name
  EXPECT_EQ(config["parameters"]["problem_type"]["string_value"], "single_label_classification");

  ASSERT_EQ(Call(port_, "POST", "/v2/models/three/infer", kTwoTexts).code, 200);
  json stats = Call(port_, "GET", "/v2/models/three/stats").Json();
  ASSERT_EQ(stats["model_stats"].size(), 1u);
  EXPECT_EQ(stats["model_stats"][0]["inference_count"], 2);
  EXPECT_EQ(stats["model_stats"][0]["inference_stats"]["success"]["count"], 1);
  EXPECT_EQ(Call(port_, "GET", "/v2/models/stats").Json()["model_stats"].size(), 2u);
  EXPECT_EQ(Call(port_, "GET", "/v2/models/nope/stats").code, 404);

  json index = Call(port_, "POST", "/v2/repository/index").Json();
  ASSERT_TRUE(index.is_array()) << index;
  ASSERT_EQ(index.size(), 2u);
  EXPECT_EQ(index[0], json({{"name", "three"}, {"version", "1"}, {"state", "READY"}, {"reason", ""}}));
  EXPECT_EQ(Call(port_, "POST", "/v2/repository/index", R"({"ready":true})").Json().size(), 2u);
  EXPECT_EQ(Call(port_, "POST", "/v2/repository/index", R"({"ready":1})").code, 400);

  // HEAD: the GET's head, no body.
  Client c(port_);
  c.HeadOnly(true);
  ASSERT_TRUE(c.Send(Request("HEAD", "/v2/models/three")));
  std::optional<Reply> head = c.Read();
  ASSERT_TRUE(head);
  EXPECT_EQ(head->code, 200);
  EXPECT_EQ(head->Header("content-length"), std::to_string(meta.dump().size()));
}

TEST_F(KServeHttpTest, PersistentPipelinedChunkedAndContinuedRequests) {
  Start();
  Client c(port_);
  ASSERT_TRUE(c.ok());
  // Three requests in one write, answered in order on the one connection.
  ASSERT_TRUE(c.Send(Request("GET", "/v2/health/live") + Request("POST", "/v2/models/three/infer", kTwoTexts) +
                     Request("GET", "/v2/models/three/ready")));
  std::optional<Reply> a = c.Read(), b = c.Read(), d = c.Read();
  ASSERT_TRUE(a && b && d);
  EXPECT_EQ(a->code, 200);
  EXPECT_EQ(b->code, 200);
  EXPECT_EQ(b->Json()["id"], "q1");
  EXPECT_EQ(d->code, 200);
  // A chunked body, with a chunk extension and a trailer.
  const std::string body = kTwoTexts;
  std::string chunked = absl::StrCat(absl::Hex(10), ";ext=1\r\n", body.substr(0, 10), "\r\n",
                                     absl::Hex(body.size() - 10), "\r\n", body.substr(10),
                                     "\r\n0\r\nX-Trailer: 1\r\n\r\n");
  ASSERT_TRUE(c.Send("POST /v2/models/three/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
                     chunked));
  std::optional<Reply> e = c.Read();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, 200) << e->body;
  EXPECT_EQ(e->Json()["outputs"], b->Json()["outputs"]);
  // Expect: 100-continue gets its interim answer before the body is sent.
  ASSERT_TRUE(c.Send(absl::StrCat("POST /v2/models/three/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                  "Content-Length: ", body.size(), "\r\n\r\n")));
  std::optional<Reply> cont = c.Read();
  ASSERT_TRUE(cont);
  EXPECT_EQ(cont->code, 100);
  ASSERT_TRUE(c.Send(body));
  std::optional<Reply> f = c.Read();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->code, 200);
  // Connection: close is honoured.
  ASSERT_TRUE(c.Send(Request("GET", "/v2/health/live", "", "Connection: close\r\n")));
  std::optional<Reply> g = c.Read();
  ASSERT_TRUE(g);
  EXPECT_EQ(g->Header("connection"), "close");
  EXPECT_TRUE(c.Closed());

  // HTTP/1.0 closes unless asked to keep the connection.
  Client old(port_);
  ASSERT_TRUE(old.Send("GET /v2/health/live HTTP/1.0\r\n\r\n"));
  ASSERT_TRUE(old.Read());
  EXPECT_TRUE(old.Closed());
}

TEST_F(KServeHttpTest, MalformedAndOversizedRequestsAreRefusedAndTheConnectionClosed) {
  Start();
  struct Case {
    std::string bytes;
    int code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"GARBAGE\r\n\r\n", 400, "request line"},
      {"GET /v2 HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"},
      {"GET /v2 HTTP/1.1\r\nno colon\r\n\r\n", 400, "header line 1"},
      {"POST /v2/models/three/infer HTTP/1.1\r\nContent-Length: 12x\r\n\r\n", 400, "Content-Length"},
      {"POST /v2/models/three/infer HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400,
       "conflicting"},
      {"POST /v2/models/three/infer HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "gzip"},
      {"POST /v2/models/three/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
       400, "both"},
      {"POST /v2/models/three/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "chunk size"},
      // Over the body limit (the server's --max_message_bytes, 1 MiB here): refused before it is read.
      {"POST /v2/models/three/infer HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n", 413, "1048576-byte limit"},
      {"POST /v2/models/three/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n100001\r\n", 413, "limit"},
      {absl::StrCat("GET /v2 HTTP/1.1\r\nX-Big: ", std::string(20000, 'a'), "\r\n\r\n"), 431, "head"},
      // What request smuggling and header injection rely on.
      {"GET /v2 HTTP/1.1\r\nX-A: b\nX-B: c\r\n\r\n", 400, "bare CR, LF or NUL in header line 1"},
      {"GET /v2 HTTP/1.1\r\nBad Name: x\r\n\r\n", 400, "header line 1"},
      {"GET /v2 HTTP/1.1\r\nName\t: x\r\n\r\n", 400, "header line 1"},
      {"POST /v2 HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
       "more than one Transfer-Encoding"},
      {"POST /v2 HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "HTTP/1.0"},
      {"GET /v2 HTTP/1.1\r\nX: y\r\n\r\nGET example/v2 HTTP/1.1\r\n\r\n", 0, ""},
      {"GET /v2 HTTP/1.1\r\nX: \x80\x01\r\n\r\nBAD \xff HTTP/9\r\n\r\n", 0, ""},
  };
  for (const Case& c : cases) {
    Client client(port_);
    ASSERT_TRUE(client.Send(c.bytes));
    std::optional<Reply> r = client.Read();
    if (c.code == 0) {
      // Bytes past ASCII in a header value pass; the next request's are echoed as JSON escapes.
      ASSERT_TRUE(r);
      EXPECT_EQ(r->code, 200);
      r = client.Read();
      ASSERT_TRUE(r);
      EXPECT_EQ(r->code, 400);
      EXPECT_TRUE(r->Json().contains("error")) << r->body;
      continue;
    }
    ASSERT_TRUE(r) << c.bytes.substr(0, 80);
    EXPECT_EQ(r->code, c.code) << c.bytes.substr(0, 80) << " -> " << r->body;
    EXPECT_THAT(r->body, HasSubstr(c.says)) << c.bytes.substr(0, 80);
    EXPECT_TRUE(client.Closed()) << c.bytes.substr(0, 80);
  }
  // Answered before a request was read whole, and counted all the same.
  EXPECT_GE(Sample(*http_, "collabserve_http_responses_total", "400"), 10);
  EXPECT_EQ(Sample(*http_, "collabserve_http_responses_total", "413"), 2);
  EXPECT_EQ(Sample(*http_, "collabserve_http_responses_total", "431"), 1);
}

// `in` compressed by zlib: gzip, or the zlib format ("deflate" in HTTP).
std::string Compress(const std::string& in, bool gzip) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, gzip ? 16 + MAX_WBITS : MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, in.size()), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

std::string Gunzip(const std::string& in) {
  z_stream zs{};
  EXPECT_EQ(inflateInit2(&zs, 16 + MAX_WBITS), Z_OK);
  std::string out(4 << 20, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(inflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  inflateEnd(&zs);
  return out;
}

TEST_F(KServeHttpTest, CompressedBodiesAsTritonsClientSendsAndAsksForThem) {
  Start();
  const json want = Call(port_, "POST", "/v2/models/three/infer", kTwoTexts).Json();
  // gzip and deflate request bodies (tritonclient's request_compression_algorithm).
  for (const auto& [coding, gzip] : {std::pair<std::string, bool>{"gzip", true}, {"deflate", false}}) {
    Reply r = Call(port_, "POST", "/v2/models/three/infer", Compress(kTwoTexts, gzip),
                   "Content-Encoding: " + coding + "\r\n");
    ASSERT_EQ(r.code, 200) << coding << ": " << r.body;
    EXPECT_EQ(r.Json(), want) << coding;
  }
  // A gzipped inference answer of 1 KiB or more for a client that asks
  // (response_compression_algorithm); none for q=0, where gzip is named with q=0 beside "*", for
  // a small answer, nor for the other routes, whose raw body tritonclient.http.aio parses as it is.
  // Eight inputs and a long id (echoed): over 1 KiB of answer.
  std::string eight = absl::StrCat(R"({"id":")", std::string(400, 'q'),
                                   R"(","inputs":[{"name":"text","shape":[8],"datatype":"BYTES","data":[)");
  for (int i = 0; i < 8; ++i) absl::StrAppend(&eight, i ? "," : "", "\"text number ", i, "\"");
  eight += "]}]}";
  const Reply big = Call(port_, "POST", "/v2/models/three/infer", eight);
  ASSERT_EQ(big.code, 200) << big.body;
  ASSERT_GE(big.body.size(), 1024u);
  Reply zipped = Call(port_, "POST", "/v2/models/three/infer", eight, "Accept-Encoding: deflate, gzip\r\n");
  ASSERT_EQ(zipped.code, 200);
  EXPECT_EQ(zipped.Header("content-encoding"), "gzip");
  EXPECT_EQ(zipped.Header("vary"), "Accept-Encoding");
  EXPECT_LT(zipped.body.size(), big.body.size());
  EXPECT_EQ(Gunzip(zipped.body), big.body);
  for (const char* refused : {"gzip;q=0", "gzip;q=0, *", "identity"}) {
    Reply plain = Call(port_, "POST", "/v2/models/three/infer", eight,
                       absl::StrCat("Accept-Encoding: ", refused, "\r\n"));
    EXPECT_EQ(plain.Header("content-encoding"), "") << refused;
    EXPECT_EQ(plain.body, big.body) << refused;
  }
  EXPECT_EQ(Call(port_, "POST", "/v2/models/three/infer", eight, "Accept-Encoding: *\r\n").Header("content-encoding"),
            "gzip");
  const Reply config = Call(port_, "GET", "/v2/models/three/config", "", "Accept-Encoding: gzip\r\n");
  ASSERT_GE(config.body.size(), 1024u);
  EXPECT_EQ(config.Header("content-encoding"), "");
  EXPECT_EQ(config.Json()["name"], "three");
  EXPECT_EQ(Call(port_, "POST", "/v2/models/three/infer", kTwoTexts, "Accept-Encoding: gzip\r\n")
                .Header("content-encoding"), "");
  // Several gzip members in one body (RFC 1952), and an empty body that names a coding.
  const std::string body = kTwoTexts;
  Reply members = Call(port_, "POST", "/v2/models/three/infer",
                       Compress(body.substr(0, 30), true) + Compress(body.substr(30), true),
                       "Content-Encoding: gzip\r\n");
  EXPECT_EQ(members.code, 200) << members.body;
  EXPECT_EQ(Call(port_, "POST", "/v2/repository/index", "", "Content-Encoding: gzip\r\n").code, 200);
  // A small body that inflates past the limit (1 MiB here) is refused; so is one that is not
  // what it says, and a coding not served.
  Reply bomb = Call(port_, "POST", "/v2/models/three/infer", Compress(std::string(4 << 20, ' '), true),
                    "Content-Encoding: gzip\r\n");
  EXPECT_EQ(bomb.code, 413);
  EXPECT_THAT(bomb.body, HasSubstr("inflates past the 1048576-byte limit"));
  Reply bad = Call(port_, "POST", "/v2/models/three/infer", kTwoTexts, "Content-Encoding: gzip\r\n");
  EXPECT_EQ(bad.code, 400);
  EXPECT_THAT(bad.body, HasSubstr("not valid gzip"));
  Reply cut = Call(port_, "POST", "/v2/models/three/infer",
                   Compress(kTwoTexts, true).substr(0, 20), "Content-Encoding: gzip\r\n");
  EXPECT_EQ(cut.code, 400);
  Reply br = Call(port_, "POST", "/v2/models/three/infer", kTwoTexts, "Content-Encoding: br\r\n");
  EXPECT_EQ(br.code, 415);
  EXPECT_THAT(br.body, HasSubstr("'br'"));
}

TEST_F(KServeHttpTest, DeeplyNestedDataIsRefusedWithoutRecursion) {
  Start();
  auto nested = [](int depth) {
    return absl::StrCat(R"({"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":)",
                        std::string(depth, '['), "\"x\"", std::string(depth, ']'), "}]}");
  };
  // Fifty thousand levels in 100 KB: a recursive walk would overflow the connection's stack.
  for (int depth : {50000, 33}) {
    Reply r = Call(port_, "POST", "/v2/models/three/infer", nested(depth));
    EXPECT_EQ(r.code, 400) << depth;
    EXPECT_THAT(r.body, HasSubstr("nested more than 32 deep")) << depth;
  }
  // Nesting is layout only: one element three deep is shape [1]'s one element.
  Reply r = Call(port_, "POST", "/v2/models/three/infer", nested(3));
  EXPECT_EQ(r.code, 200) << r.body;
  r = Call(port_, "POST", "/v2/models/three/infer",
           R"({"inputs":[{"name":"text","shape":[1,1,1],"datatype":"BYTES","data":[[["x"]]]}]})");
  EXPECT_EQ(r.code, 400) << r.body;  // rank 3 is not a text tensor's shape: named by the service
  EXPECT_THAT(r.body, HasSubstr("shape"));
}

TEST_F(KServeHttpTest, SlowClientsAreCutByTheWatchdog) {
  HttpServerOptions o;
  o.idle_timeout = absl::Milliseconds(300);
  Start(o);
  // Each byte comes well within the idle timeout; the head never completes. Without a deadline
  // on the whole head the connection (and its thread) would be held for as long as it drips.
  Client c(port_);
  const std::string head = "GET /v2/health/live HTTP/1.1\r\nX-Slow: " + std::string(1000, 'a');
  bool cut = false;
  for (size_t i = 0; i < head.size() && !cut; ++i) {
    cut = !c.Send(head.substr(i, 1));
    absl::SleepFor(absl::Milliseconds(50));
    cut = cut || http_->connections() == 0;
  }
  EXPECT_TRUE(cut) << "a client dripping its head was never cut";
  EXPECT_TRUE(Eventually([&] { return Sample(*http_, "collabserve_http_connections_cut_total") == 1; }));
}

TEST_F(KServeHttpTest, AnEarlyErrorIsReadByTheClientNotReset) {
  Start();
  // A body over the limit, sent whole while the server has already answered 413: the lingering
  // close lets the client read the answer instead of a connection reset.
  Client c(port_);
  const std::string body(4 << 20, 'x');
  std::thread sender([&] {
    c.Send(absl::StrCat("POST /v2/models/three/infer HTTP/1.1\r\nContent-Length: ", body.size(),
                        "\r\n\r\n", body));
  });
  std::optional<Reply> r = c.Read();
  sender.join();
  ASSERT_TRUE(r) << "the connection was reset before the 413 was read";
  EXPECT_EQ(r->code, 413);
  // The server goes on reading (and dropping) for a while: a client still sending gets no reset,
  // which (on a loaded network, with the answer not yet read) would have destroyed the 413.
  const std::string more(64 << 10, 'y');
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(c.Send(more)) << "reset after " << i << " more chunks: no lingering close";
    absl::SleepFor(absl::Milliseconds(20));
  }
}

TEST_F(KServeHttpTest, KeepAliveHeadersAsEachVersionWantsThem) {
  Start();
  Client old(port_);
  ASSERT_TRUE(old.Send("GET /v2/health/live HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"));
  std::optional<Reply> r = old.Read();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->Header("connection"), "keep-alive");
  ASSERT_TRUE(old.Send("GET /v2/health/live HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  EXPECT_TRUE(old.Read());
  // The absolute form (as sent to a proxy) is served by its path (RFC 9112 3.2.2).
  Client proxy_style(port_);
  ASSERT_TRUE(proxy_style.Send("GET http://collabserve.example:8000/v2/health/live HTTP/1.1\r\n\r\n"));
  r = proxy_style.Read();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 200);
  // A list naming close closes; leading empty lines before a request are skipped.
  Client c(port_);
  ASSERT_TRUE(c.Send("\r\n\r\nGET /v2/health/live HTTP/1.1\r\nConnection: keep-alive, close\r\n\r\n"));
  r = c.Read();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 200);
  EXPECT_EQ(r->Header("connection"), "close");
  EXPECT_TRUE(c.Closed());
}

TEST_F(KServeHttpTest, DrainClosesWaitingConnectionsAndEveryLaterResponseCloses) {
  Start();
  Client waiting(port_);
  ASSERT_TRUE(waiting.Send(Request("GET", "/v2/health/live")));
  ASSERT_TRUE(waiting.Read());
  http_->BeginDrain();
  EXPECT_TRUE(waiting.Closed());
  // A client that connects meanwhile is answered, and told to go.
  Client late(port_);
  ASSERT_TRUE(late.Send(Request("GET", "/v2/health/live")));
  std::optional<Reply> r = late.Read();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 200);
  EXPECT_EQ(r->Header("connection"), "close");
  EXPECT_TRUE(late.Closed());
}

TEST_F(KServeHttpTest, AClientThatLeavesCancelsItsInference) {
  Start();
  gate_.Close();
  {
    Client c(port_);
    ASSERT_TRUE(c.Send(Request("POST", "/v2/models/three/infer", kTwoTexts)));
    ASSERT_TRUE(gate_.WaitForArrivals(1));
  }  // closed while its forward pass is held
  // The handler does not wait for the pass: the call is cancelled and the connection ends.
  EXPECT_TRUE(Eventually([&] { return http_->connections() == 0; }));
  gate_.Open();
  EXPECT_EQ(Call(port_, "POST", "/v2/models/three/infer", kTwoTexts).code, 200);
}

TEST_F(KServeHttpTest, ConnectionsAreBoundedAndIdleOnesClosed) {
  HttpServerOptions o;
  o.max_connections = 2;
  o.idle_timeout = absl::Seconds(2);  // room for the steps below on a loaded machine
  Start(o);
  {
    Client a(port_), b(port_);
    ASSERT_TRUE(a.Send(Request("GET", "/v2/health/live")));
    ASSERT_TRUE(b.Send(Request("GET", "/v2/health/live")));
    ASSERT_TRUE(a.Read() && b.Read());
    // A third while two are open: 503 naming the flag, then closed.
    Client c(port_);
    std::optional<Reply> r = c.Read();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->code, 503);
    EXPECT_THAT(r->body, HasSubstr("--http_max_connections=2"));
    EXPECT_TRUE(c.Closed());
    EXPECT_EQ(Sample(*http_, "collabserve_http_connections"), 2);
    EXPECT_EQ(Sample(*http_, "collabserve_http_connections_refused_total"), 1);
    EXPECT_EQ(Sample(*http_, "collabserve_http_responses_total", "503"), 1);
    EXPECT_EQ(Sample(*http_, "collabserve_http_responses_total", "200"), 2);
    // A request cut off mid-head is answered 408 once the connection idles; a quiet one is closed.
    ASSERT_TRUE(a.Send("GET /v2/health/li"));
    std::optional<Reply> cut = a.Read();
    ASSERT_TRUE(cut);
    EXPECT_EQ(cut->code, 408);
    EXPECT_TRUE(a.Closed());
    EXPECT_TRUE(b.Closed());
  }
  // Both slots free again once the server has reaped the closed connections. Quiet keep-alive
  // connections closed are not counted as cut.
  ASSERT_TRUE(Eventually([&] { return http_->connections() == 0; }));
  EXPECT_EQ(Sample(*http_, "collabserve_http_connections"), 0);
  EXPECT_EQ(Call(port_, "GET", "/v2/health/live").code, 200);
}

TEST_F(KServeHttpTest, StoppingClosesWaitingConnectionsAndFinishesTheOnesInFlight) {
  Start();
  Client idle(port_);
  ASSERT_TRUE(idle.Send(Request("GET", "/v2/health/live")));
  ASSERT_TRUE(idle.Read());
  // A call held in its forward pass while the HTTP server stops.
  gate_.Close();
  Client busy(port_);
  ASSERT_TRUE(busy.Send(Request("POST", "/v2/models/three/infer", kTwoTexts)));
  ASSERT_TRUE(gate_.WaitForArrivals(1));
  std::atomic<bool> stopped{false};
  std::thread stop([&] {
    http_.reset();
    stopped = true;
  });
  // The waiting connection is closed at once; the busy one is not, and the stop waits for it.
  EXPECT_TRUE(idle.Closed());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(stopped.load());
  gate_.Open();
  std::optional<Reply> r = busy.Read();
  stop.join();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 200) << r->body;
  EXPECT_EQ(r->Header("connection"), "close");
  EXPECT_TRUE(busy.Closed());
}

TEST_F(KServeHttpTest, StoppingDoesNotWaitForSlowClients) {
  Start();  // the default 60 s idle timeout
  Client reading(port_), waiting(port_);
  ASSERT_TRUE(reading.Send("POST /v2/models/three/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"));
  ASSERT_TRUE(Eventually([&] { return http_->connections() == 2; }));
  const absl::Time began = absl::Now();
  http_.reset();
  // Well under the 60 s the two connections' deadlines would allow.
  EXPECT_LT(absl::Now() - began, absl::Seconds(30));
  EXPECT_TRUE(reading.Closed());
  EXPECT_TRUE(waiting.Closed());
}

TEST_F(KServeHttpTest, BadOptionsAreRefusedNamingTheFlag) {
  Start();
  auto refuse = [&](HttpServerOptions o, const std::string& says) {
    o.host = "127.0.0.1";
    auto s = HttpServer::Start(o, NewKServeHttpHandler(server_->InProcessChannel()));
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(says));
  };
  HttpServerOptions o;
  o.port = 70000;
  refuse(o, "--http_port=70000");
  o = {};
  o.port = port_;  // taken
  refuse(o, "cannot serve HTTP");
  o = {};
  o.port = 0;
  o.max_connections = 0;
  refuse(o, "--http_max_connections");
  o = {};
  o.port = 0;
  o.idle_timeout = absl::ZeroDuration();
  refuse(o, "--http_idle_timeout_s");
  o = {};
  o.port = 0;
  o.tls.cert_file = "/nonexistent/tls.crt";
  o.tls.key_file = "/nonexistent/tls.key";
  refuse(o, "/nonexistent/tls.crt");
}

TEST(KServeHttpCodesTest, GrpcGatewaysTable) {
  EXPECT_EQ(HttpCodeForGrpc(0), 200);
  EXPECT_EQ(HttpCodeForGrpc(1), 503);   // CANCELLED: by the server, shutting down
  EXPECT_EQ(HttpCodeForGrpc(3), 400);   // INVALID_ARGUMENT
  EXPECT_EQ(HttpCodeForGrpc(4), 504);   // DEADLINE_EXCEEDED
  EXPECT_EQ(HttpCodeForGrpc(5), 404);   // NOT_FOUND
  EXPECT_EQ(HttpCodeForGrpc(8), 429);   // RESOURCE_EXHAUSTED
  EXPECT_EQ(HttpCodeForGrpc(9), 400);   // FAILED_PRECONDITION
  EXPECT_EQ(HttpCodeForGrpc(12), 501);  // UNIMPLEMENTED
  EXPECT_EQ(HttpCodeForGrpc(13), 500);  // INTERNAL
  EXPECT_EQ(HttpCodeForGrpc(14), 503);  // UNAVAILABLE
  EXPECT_EQ(HttpCodeForGrpc(16), 401);  // UNAUTHENTICATED
}

// TLS: a self-signed certificate for localhost whose subject carries `org`.
void MakeCertificate(const std::string& dir, const std::string& name, const std::string& org) {
  const std::string cmd = absl::StrCat(
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost/O=", org,
      " -addext subjectAltName=DNS:localhost -keyout ", dir, "/", name, ".key -out ", dir, "/",
      name, ".crt >/dev/null 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "openssl could not make a test certificate";
}

// A client context that trusts `ca` and, when given, presents `cert`/`key`.
std::shared_ptr<SSL_CTX> ClientContext(const std::string& ca, const std::string& cert = "",
                                       const std::string& key = "") {
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  EXPECT_EQ(SSL_CTX_load_verify_locations(ctx.get(), ca.c_str(), nullptr), 1);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  if (!cert.empty()) {
    EXPECT_EQ(SSL_CTX_use_certificate_file(ctx.get(), cert.c_str(), SSL_FILETYPE_PEM), 1);
    EXPECT_EQ(SSL_CTX_use_PrivateKey_file(ctx.get(), key.c_str(), SSL_FILETYPE_PEM), 1);
  }
  return ctx;
}

std::string PeerOrganization(SSL* ssl) {
  X509* peer = SSL_get1_peer_certificate(ssl);
  if (peer == nullptr) return "";
  char buf[256] = {};
  X509_NAME_get_text_by_NID(X509_get_subject_name(peer), NID_organizationName, buf, sizeof(buf));
  X509_free(peer);
  return buf;
}

TEST_F(KServeHttpTest, TlsServesTheFollowedCertificateAndMutualTlsRefusesStrangers) {
  TempDir certs;
  const std::string d = certs.path();
  MakeCertificate(d, "first", "first");
  MakeCertificate(d, "second", "second");
  MakeCertificate(d, "client", "client");
  std::filesystem::copy_file(d + "/first.crt", d + "/tls.crt");
  std::filesystem::copy_file(d + "/first.key", d + "/tls.key");
  HttpServerOptions o;
  o.tls.cert_file = d + "/tls.crt";
  o.tls.key_file = d + "/tls.key";
  o.tls.client_ca_file = d + "/client.crt";  // the self-signed client certificate is its own CA
  o.tls.reload_interval = absl::Seconds(1);
  Start(o);
  EXPECT_TRUE(http_->tls());

  auto first = ClientContext(d + "/first.crt", d + "/client.crt", d + "/client.key");
  {
    Client c(port_, first.get());
    ASSERT_TRUE(c.ok()) << "handshake refused";
    EXPECT_EQ(PeerOrganization(c.ssl()), "first");
    ASSERT_TRUE(c.Send(Request("POST", "/v2/models/three/infer", kTwoTexts)));
    std::optional<Reply> r = c.Read();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->code, 200);
  }
  {
    // A client resuming its session (as Go, Java and Python clients do) is let in again.
    SSL_SESSION* session = nullptr;
    {
      Client c(port_, first.get());
      ASSERT_TRUE(c.ok());
      ASSERT_TRUE(c.Send(Request("GET", "/v2/health/live")));
      ASSERT_TRUE(c.Read());  // the TLS 1.3 ticket comes after the handshake
      session = SSL_get1_session(c.ssl());
    }
    ASSERT_NE(session, nullptr);
    Client again(port_, first.get(), session);
    SSL_SESSION_free(session);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(SSL_session_reused(again.ssl()));
    ASSERT_TRUE(again.Send(Request("GET", "/v2/health/live")));
    std::optional<Reply> r = again.Read();
    ASSERT_TRUE(r) << "the resumed session was refused";
    EXPECT_EQ(r->code, 200);
  }
  {
    // No client certificate: refused at the handshake (TLS 1.3 shows it at the first read).
    auto stranger = ClientContext(d + "/first.crt");
    Client c(port_, stranger.get());
    const bool refused = !c.ok() || !c.Send(Request("GET", "/v2/health/live")) || !c.Read().has_value();
    EXPECT_TRUE(refused);
  }
  EXPECT_TRUE(Eventually([&] { return Sample(*http_, "collabserve_http_tls_handshake_failures_total") >= 1; }));
  {
    // Plain HTTP on the TLS port gets no answer.
    Client c(port_);
    ASSERT_TRUE(c.Send(Request("GET", "/v2/health/live")));
    EXPECT_FALSE(c.Read().has_value());
  }
  // A renewed pair serves the connections made after the next reload.
  std::filesystem::copy_file(d + "/second.crt", d + "/tls.crt",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(d + "/second.key", d + "/tls.key",
                             std::filesystem::copy_options::overwrite_existing);
  auto second = ClientContext(d + "/second.crt", d + "/client.crt", d + "/client.key");
  ASSERT_TRUE(Eventually([&] {
    Client c(port_, second.get());
    return c.ok() && PeerOrganization(c.ssl()) == "second";
  }));
  // A pair that no longer loads leaves the last good one serving.
  ASSERT_TRUE(util::WriteFileAtomic(d + "/tls.key", "not a key").ok());
  absl::SleepFor(absl::Milliseconds(1200));
  Client c(port_, second.get());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(PeerOrganization(c.ssl()), "second");
  ASSERT_TRUE(c.Send(Request("GET", "/v2/health/ready")));
  std::optional<Reply> r = c.Read();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->code, 200);
}

}  // namespace
}  // namespace collabserve::service
