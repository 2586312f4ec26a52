#include "server/service/tei_http.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collabserve/v1/inference.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"
#include "server/service/kserve_http.h"

namespace collabserve::service {
namespace {

using json = nlohmann::json;

// TEI's error kinds (router/src/http/types.rs ErrorType), with the codes TEI gives them.
constexpr char kEmpty[] = "Empty";            // 400
constexpr char kValidation[] = "Validation";  // 422
constexpr char kOverloaded[] = "Overloaded";  // 429
constexpr char kUnhealthy[] = "Unhealthy";    // 503
constexpr char kBackend[] = "Backend";        // 424, or grpc-gateway's code

HttpResponse Json(int code, const json& body) {
  HttpResponse r;
  r.code = code;
  r.body = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return r;
}

HttpResponse Error(int code, const char* type, const std::string& message) {
  return Json(code, json{{"error", message}, {"error_type", type}});
}

HttpResponse FromStatus(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::FAILED_PRECONDITION:
      return Error(422, kValidation, s.error_message());
    case grpc::StatusCode::NOT_FOUND:
      return Error(404, kValidation, s.error_message());
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return Error(429, kOverloaded, s.error_message());
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:  // only the server cancels: it is shutting down
      return Error(503, kUnhealthy, s.error_message());
    default:
      return Error(HttpCodeForGrpc(s.error_code()), kBackend, s.error_message());
  }
}

// One sequence of TEI's `inputs`: a text, or a text and its pair.
struct Sequence {
  std::string text;
  std::optional<std::string> pair;
};

constexpr char kInputsForms[] =
    "expected a string, a pair of strings [string, string] or a batch of mixed strings and pairs "
    "[[string], [string, string], ...]";

// A JSON array of one or two strings: a text, or a text and its pair.
bool ParseSequence(const json& a, const std::string& where, Sequence* out, std::string* why) {
  if (!a.is_array() || a.empty() || a.size() > 2) {
    *why = absl::StrCat(where, ": not an array of 1 or 2 strings; ", kInputsForms);
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].is_string()) {
      *why = absl::StrCat(where, "[", i, "]: not a string; ", kInputsForms);
      return false;
    }
  }
  out->text = a[0].get<std::string>();
  if (a.size() == 2) out->pair = a[1].get<std::string>();
  return true;
}

// TEI's PredictInput: only the first element of an array decides between one pair and a batch.
bool ParseInputs(const json& inputs, std::vector<Sequence>* out, bool* batch, std::string* why) {
  *batch = false;
  if (inputs.is_string()) {
    out->push_back({inputs.get<std::string>(), std::nullopt});
    return true;
  }
  if (!inputs.is_array() || inputs.empty()) {
    *why =
        absl::StrCat("inputs: ", inputs.is_array() ? "an empty array" : "not a string or an array",
                     "; ", kInputsForms);
    return false;
  }
  if (!inputs[0].is_array()) {
    out->emplace_back();
    return ParseSequence(inputs, "inputs", &out->back(), why);
  }
  *batch = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    out->emplace_back();
    if (!ParseSequence(inputs[i], absl::StrCat("inputs[", i, "]"), &out->back(), why)) return false;
  }
  return true;
}

// A sequence is empty when its text is, and its pair too (TEI's check).
bool IsEmpty(const Sequence& s) { return s.text.empty() && (!s.pair || s.pair->empty()); }

// "truncate", "truncation_direction" and "raw_scores", shared by /predict and /rerank.
bool ParseOptions(const json& body, v1::ClassifyOptions* options, std::string* why) {
  if (auto it = body.find("truncate"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) {
      *why = "truncate: not a bool";
      return false;
    }
    options->set_truncate(it->get<bool>());
  }
  if (auto it = body.find("truncation_direction"); it != body.end() && !it->is_null()) {
    const std::string d = it->is_string() ? it->get<std::string>() : "";
    if (d == "left" || d == "Left") {
      *why =
          "truncation_direction: left is not supported; inputs are cut from the right, as "
          "Hugging Face's LongestFirst truncation cuts them";
      return false;
    }
    if (d != "right" && d != "Right") {
      *why = "truncation_direction: not \"right\" or \"left\"";
      return false;
    }
  }
  if (auto it = body.find("raw_scores"); it != body.end()) {
    if (!it->is_boolean()) {
      *why = "raw_scores: not a bool";
      return false;
    }
    options->set_raw_scores(it->get<bool>());
  }
  return true;
}

// Code points of UTF-8 text (TEI's x-compute-characters).
int64_t CountChars(const std::string& s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; });
}

// TEI's timing and size headers of an answer.
void AddComputeHeaders(const v1::ClassifyResponse& resp, int64_t chars, HttpResponse* r) {
  auto ms = [](int64_t us) { return std::to_string(us / 1000); };
  r->headers.emplace_back("x-compute-characters", std::to_string(chars));
  r->headers.emplace_back("x-compute-tokens", std::to_string(resp.num_tokens()));
  r->headers.emplace_back("x-total-time", ms(resp.timings().total_us()));
  r->headers.emplace_back("x-tokenization-time", ms(resp.timings().tokenization_us()));
  r->headers.emplace_back("x-queue-time", ms(resp.timings().queue_us()));
  r->headers.emplace_back("x-inference-time", ms(resp.timings().inference_us()));
}

class TeiHttp {
 public:
  TeiHttp(std::shared_ptr<grpc::Channel> channel, TeiHttpOptions options)
      : inference_(v1::Inference::NewStub(channel)),
        kserve_(inference::GRPCInferenceService::NewStub(channel)),
        options_(std::move(options)) {}

  HttpResponse Handle(const HttpRequest& req) {
    std::string_view rest = req.path;
    std::string model;
    if (rest.substr(0, 8) == "/models/") {
      rest.remove_prefix(8);
      const size_t slash = rest.find('/');
      if (!PercentDecodeSegment(rest.substr(0, slash), &model)) {
        return Error(400, kValidation, absl::StrCat("malformed escape in path ", req.path));
      }
      if (model.empty()) return NotFound(req);
      rest = slash == std::string_view::npos ? "/" : rest.substr(slash);
    }
    const bool get = req.method == "GET" || req.method == "HEAD";
    const bool post = req.method == "POST";
    enum { kHealth, kInfo, kPredict, kRerank, kEither, kTokenize, kDecode } route;
    if (rest == "/health" || rest == "/ping") {
      if (!get) return NotAllowed("GET, HEAD");
      route = kHealth;
    } else if (rest == "/") {
      if (!get && !post) return NotAllowed("GET, HEAD, POST");
      route = get ? kHealth : kEither;
    } else if (rest == "/info") {
      if (!get) return NotAllowed("GET, HEAD");
      route = kInfo;
    } else if (rest == "/predict" || rest == "/rerank" || rest == "/invocations" ||
               rest == "/tokenize" || rest == "/decode") {
      if (!post) return NotAllowed("POST");
      route = rest == "/predict"    ? kPredict
              : rest == "/rerank"   ? kRerank
              : rest == "/tokenize" ? kTokenize
              : rest == "/decode"   ? kDecode
                                    : kEither;
    } else {
      return NotFound(req);
    }
    if (model.empty()) {
      if (std::optional<HttpResponse> refused = DefaultModel(&model)) return *std::move(refused);
    }
    if (route == kHealth) return Health(model);
    if (route == kInfo) return Info(model);

    json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) return Error(400, kValidation, "the request body is not JSON");
    if (!body.is_object()) return Error(422, kValidation, "the request body is not a JSON object");
    if (route == kPredict) return Predict(req, model, body);
    if (route == kTokenize) return Tokenize(model, body);
    if (route == kDecode) return Decode(model, body);
    v1::ModelMetadata metadata;
    if (auto refused = Metadata(model, &metadata)) return *std::move(refused);
    const bool reranker = metadata.labels_size() == 1;
    if (route == kEither) return reranker ? Rerank(req, model, body) : Predict(req, model, body);
    if (!reranker) {
      return Error(424, kBackend,
                   absl::StrCat("model ", model, " is not a re-ranker model: it has ",
                                metadata.labels_size(), " labels, and /rerank needs one"));
    }
    return Rerank(req, model, body);
  }

 private:
  static HttpResponse NotFound(const HttpRequest& req) {
    return Error(404, kValidation,
                 absl::StrCat("no such endpoint: ", req.method, " ", req.path,
                              " (text-embeddings-inference's routes: /health, /info, /predict, "
                              "/rerank, /tokenize, /decode, and the same under /models/NAME; "
                              "the Open Inference Protocol's under /v2)"));
  }
  static HttpResponse NotAllowed(const char* allow) {
    HttpResponse r = Error(405, kValidation, absl::StrCat("method not allowed here; use ", allow));
    r.headers.emplace_back("Allow", allow);
    return r;
  }

  // The model the root routes serve: --http_default_model, or the only one the server knows (on
  // disk or served: a second model loading does not change what the root means). Sets `model`, or
  // returns the refusal.
  std::optional<HttpResponse> DefaultModel(std::string* model) {
    if (!options_.default_model.empty()) {
      *model = options_.default_model;
      return std::nullopt;
    }
    std::vector<std::string> known;
    if (grpc::Status s = KnownModels(&known); !s.ok()) return FromStatus(s);
    if (known.size() == 1) {
      *model = known[0];
      return std::nullopt;
    }
    if (known.empty()) return Error(503, kUnhealthy, "no model is served yet");
    return Error(400, kValidation,
                 absl::StrCat(known.size(), " models are known (", absl::StrJoin(known, ", "),
                              "): name one in the path, /models/NAME/predict, or start the "
                              "server with --http_default_model"));
  }

  // A call's refusal; NOT_FOUND for a model the server knows (loading, or no version served
  // now) is 503 Unhealthy, which TEI's clients retry, rather than 404.
  HttpResponse Refusal(const std::string& model, const grpc::Status& s) {
    std::vector<std::string> known;
    if (s.error_code() == grpc::StatusCode::NOT_FOUND && KnownModels(&known).ok() &&
        std::find(known.begin(), known.end(), model) != known.end()) {
      return Error(503, kUnhealthy, s.error_message());
    }
    return FromStatus(s);
  }

  // A call's outcome: its refusal, or 424 when it answered `got` items for `want` asked (a
  // broken contract, never a client's fault); nullopt when it answered as asked.
  std::optional<HttpResponse> Answered(const char* call, const std::string& model,
                                       const grpc::Status& s, int got, int want) {
    if (!s.ok()) return Refusal(model, s);
    if (got != want) {
      return Error(424, kBackend, absl::StrCat(call, " answered ", got, " items for ", want));
    }
    return std::nullopt;
  }

  // The models the server knows, served or not (ListModels).
  grpc::Status KnownModels(std::vector<std::string>* names) {
    grpc::ClientContext ctx;
    v1::ListModelsResponse resp;
    grpc::Status s = inference_->ListModels(&ctx, {}, &resp);
    for (const v1::ModelSummary& m : resp.models()) names->push_back(m.name());
    return s;
  }

  HttpResponse Health(const std::string& model) {
    grpc::ClientContext ctx;
    inference::ModelReadyRequest req;
    req.set_name(model);
    inference::ModelReadyResponse resp;
    grpc::Status s = kserve_->ModelReady(&ctx, req, &resp);
    if (s.ok() && resp.ready()) {
      HttpResponse r;
      r.content_type = "text/plain";
      return r;
    }
    return Error(503, kUnhealthy, "unhealthy");
  }

  // Sets `out` to the newest served version's metadata, or returns the refusal.
  std::optional<HttpResponse> Metadata(const std::string& model, v1::ModelMetadata* out) {
    grpc::ClientContext ctx;
    v1::GetModelRequest req;
    req.set_model_name(model);
    grpc::Status s = inference_->GetModel(&ctx, req, out);
    if (!s.ok()) return Refusal(model, s);
    return std::nullopt;
  }

  HttpResponse Info(const std::string& model) {
    v1::ModelMetadata metadata;
    if (auto refused = Metadata(model, &metadata)) return *std::move(refused);
    json id2label = json::object(), label2id = json::object();
    for (int i = 0; i < metadata.labels_size(); ++i) {
      id2label[std::to_string(i)] = metadata.labels(i);
      label2id[metadata.labels(i)] = i;
    }
    json labels{{"id2label", std::move(id2label)}, {"label2id", std::move(label2id)}};
    return Json(
        200, json{{"model_id", metadata.name()},
                  {"model_sha", nullptr},
                  {"model_dtype", metadata.dtype()},
                  {"served_model_name", metadata.name()},
                  {"model_type",
                   {{metadata.labels_size() == 1 ? "reranker" : "classifier", std::move(labels)}}},
                  {"max_concurrent_requests", options_.max_concurrent_requests},
                  {"max_input_length", metadata.max_length()},
                  {"max_batch_tokens", options_.max_batch_tokens},
                  {"max_batch_requests", options_.max_batch_requests},
                  {"max_client_batch_size", options_.max_client_batch_size},
                  {"auto_truncate", true},
                  {"tokenization_workers", options_.tokenization_workers},
                  {"version", options_.version},
                  {"sha", nullptr},
                  {"docker_label", nullptr}});
  }

  // Classify over the in-process channel, cancelled if the client goes away. Sets `resp`, or
  // returns the refusal.
  std::optional<HttpResponse> Classify(const HttpRequest& http, const v1::ClassifyRequest& req,
                                       v1::ClassifyResponse* resp) {
    grpc::ClientContext ctx;
    bool client_gone = false;
    const grpc::Status s = AwaitUnlessClientGone(
        http, &ctx,
        [&](std::function<void(grpc::Status)> done) {
          inference_->async()->Classify(&ctx, &req, resp, std::move(done));
        },
        &client_gone);
    if (client_gone) return Error(499, kBackend, "the client closed the connection");
    return Answered("Classify", req.model_name(), s, resp->results_size(), req.inputs_size());
  }

  HttpResponse Predict(const HttpRequest& http, const std::string& model, const json& body) {
    if (!body.contains("inputs")) return Error(422, kValidation, "inputs: missing");
    std::vector<Sequence> sequences;
    bool batch = false;
    std::string why;
    if (!ParseInputs(body["inputs"], &sequences, &batch, &why)) return Error(422, kValidation, why);
    v1::ClassifyRequest req;
    req.set_model_name(model);
    if (!ParseOptions(body, req.mutable_options(), &why)) return Error(422, kValidation, why);
    req.mutable_options()->set_top_k(std::numeric_limits<int32_t>::max());  // every label
    int64_t chars = 0;
    for (const Sequence& s : sequences) {
      if (IsEmpty(s)) return Error(400, kEmpty, "`inputs` cannot be empty");
      v1::Input* in = req.add_inputs();
      in->set_text(s.text);
      if (s.pair) in->set_text_pair(*s.pair);
      chars += CountChars(s.text) + (s.pair ? CountChars(*s.pair) : 0);
    }
    v1::ClassifyResponse resp;
    if (std::optional<HttpResponse> refused = Classify(http, req, &resp))
      return *std::move(refused);
    json out = json::array();
    for (const v1::Result& r : resp.results()) {
      json predictions = json::array();
      for (const v1::LabelScore& ls : r.top_k()) {
        predictions.push_back({{"score", ShortestDouble(ls.score())}, {"label", ls.label()}});
      }
      out.push_back(std::move(predictions));
    }
    HttpResponse r = Json(200, batch ? out : out.at(0));
    AddComputeHeaders(resp, chars, &r);
    return r;
  }

  HttpResponse Tokenize(const std::string& model, const json& body) {
    if (!body.contains("inputs")) return Error(422, kValidation, "inputs: missing");
    const json& inputs = body["inputs"];
    std::vector<std::string> texts;
    if (inputs.is_string()) {
      texts.push_back(inputs.get<std::string>());
    } else if (inputs.is_array()) {
      if (inputs.empty()) return Error(400, kEmpty, "`inputs` cannot be empty");
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (!inputs[i].is_string()) {
          return Error(422, kValidation, absl::StrCat("inputs[", i, "]: not a string"));
        }
        texts.push_back(inputs[i].get<std::string>());
      }
    } else {
      return Error(422, kValidation, "inputs: not a string or an array of strings");
    }
    v1::TokenizeRequest req;
    req.set_model_name(model);
    req.set_truncate(false);  // TEI's /tokenize cuts nothing
    if (auto it = body.find("add_special_tokens"); it != body.end()) {
      if (!it->is_boolean()) return Error(422, kValidation, "add_special_tokens: not a bool");
      req.set_add_special_tokens(it->get<bool>());
    }
    if (auto it = body.find("prompt_name"); it != body.end() && !it->is_null()) {
      return Error(422, kValidation,
                   "prompt_name: this model has no sentence-transformers prompts");
    }
    for (const std::string& t : texts) {
      if (t.empty()) return Error(400, kEmpty, "`inputs` cannot be empty");
      req.add_inputs()->set_text(t);
    }
    grpc::ClientContext ctx;
    v1::TokenizeResponse resp;
    grpc::Status s = inference_->Tokenize(&ctx, req, &resp);
    if (auto refused = Answered("Tokenize", model, s, resp.results_size(), req.inputs_size())) {
      return *std::move(refused);
    }
    json out = json::array();
    for (int i = 0; i < resp.results_size(); ++i) {
      const v1::Tokens& t = resp.results(i);
      const std::string& text = texts[i];
      json tokens = json::array();
      for (int k = 0; k < t.input_ids_size(); ++k) {
        const bool special = k < t.special_tokens_mask_size() && t.special_tokens_mask(k);
        json token{{"id", t.input_ids(k)}, {"special", special}};
        if (special || k >= t.offsets_size()) {
          token["text"] = k < t.tokens_size() ? t.tokens(k) : "";
          token["start"] = nullptr;
          token["stop"] = nullptr;
        } else {
          const auto start = static_cast<size_t>(std::max(0, t.offsets(k).start()));
          const auto stop = static_cast<size_t>(std::max(t.offsets(k).start(), t.offsets(k).end()));
          token["text"] = text.substr(std::min(start, text.size()), stop - start);
          token["start"] = start;
          token["stop"] = stop;
        }
        tokens.push_back(std::move(token));
      }
      out.push_back(std::move(tokens));
    }
    return Json(200, out);
  }

  HttpResponse Decode(const std::string& model, const json& body) {
    if (!body.contains("ids") || !body["ids"].is_array()) {
      return Error(422, kValidation, "ids: missing, or not an array of ids or of arrays of ids");
    }
    const json& ids = body["ids"];
    if (ids.empty()) return Error(400, kEmpty, "`input_ids` cannot be empty");
    v1::DecodeRequest req;
    req.set_model_name(model);
    if (auto it = body.find("skip_special_tokens"); it != body.end()) {
      if (!it->is_boolean()) return Error(422, kValidation, "skip_special_tokens: not a bool");
      req.set_skip_special_tokens(it->get<bool>());
    }
    // One sequence of ids, or (its first element an array) a batch of them.
    const bool batch = ids[0].is_array();
    for (size_t i = 0; i < (batch ? ids.size() : 1); ++i) {
      const json& seq = batch ? ids[i] : ids;
      const std::string where = batch ? absl::StrCat("ids[", i, "]") : "ids";
      if (!seq.is_array()) return Error(422, kValidation, absl::StrCat(where, ": not an array"));
      if (seq.empty()) return Error(400, kEmpty, "`input_ids` cannot be empty");
      v1::TokenIds* out = req.add_sequences();
      for (size_t k = 0; k < seq.size(); ++k) {
        if (!seq[k].is_number_unsigned() ||
            seq[k].get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
          return Error(422, kValidation, absl::StrCat(where, "[", k, "]: not a token id"));
        }
        out->add_ids(seq[k].get<int32_t>());
      }
    }
    grpc::ClientContext ctx;
    v1::DecodeResponse resp;
    grpc::Status s = inference_->Decode(&ctx, req, &resp);
    if (auto refused = Answered("Decode", model, s, resp.texts_size(), req.sequences_size())) {
      return *std::move(refused);
    }
    return Json(200, json(std::vector<std::string>(resp.texts().begin(), resp.texts().end())));
  }

  HttpResponse Rerank(const HttpRequest& http, const std::string& model, const json& body) {
    if (!body.contains("query") || !body["query"].is_string()) {
      return Error(422, kValidation, "query: missing, or not a string");
    }
    if (!body.contains("texts") || !body["texts"].is_array()) {
      return Error(422, kValidation, "texts: missing, or not an array of strings");
    }
    const json& texts = body["texts"];
    if (texts.empty()) return Error(400, kEmpty, "`texts` cannot be empty");
    bool return_text = false;
    if (auto it = body.find("return_text"); it != body.end()) {
      if (!it->is_boolean()) return Error(422, kValidation, "return_text: not a bool");
      return_text = it->get<bool>();
    }
    v1::ClassifyRequest req;
    req.set_model_name(model);
    std::string why;
    if (!ParseOptions(body, req.mutable_options(), &why)) return Error(422, kValidation, why);
    const std::string query = body["query"].get<std::string>();
    int64_t chars = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      if (!texts[i].is_string()) {
        return Error(422, kValidation, absl::StrCat("texts[", i, "]: not a string"));
      }
      Sequence s{query, texts[i].get<std::string>()};
      if (IsEmpty(s)) return Error(400, kEmpty, "`inputs` cannot be empty");
      v1::Input* in = req.add_inputs();
      in->set_text(s.text);
      in->set_text_pair(*s.pair);
      chars += CountChars(s.text) + CountChars(*s.pair);
    }
    v1::ClassifyResponse resp;
    if (std::optional<HttpResponse> refused = Classify(http, req, &resp))
      return *std::move(refused);
    std::vector<int> order(resp.results_size());
    for (int i = 0; i < resp.results_size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&resp](int a, int b) {
      return resp.results(a).score() > resp.results(b).score();
    });
    json out = json::array();
    for (int i : order) {
      json item{{"index", i}, {"score", ShortestDouble(resp.results(i).score())}};
      if (return_text) item["text"] = texts[i];
      out.push_back(std::move(item));
    }
    HttpResponse r = Json(200, out);
    AddComputeHeaders(resp, chars, &r);
    return r;
  }

  const std::unique_ptr<v1::Inference::Stub> inference_;
  const std::unique_ptr<inference::GRPCInferenceService::Stub> kserve_;
  const TeiHttpOptions options_;
};

}  // namespace

HttpHandler NewTeiHttpHandler(std::shared_ptr<grpc::Channel> channel, TeiHttpOptions options) {
  auto tei = std::make_shared<TeiHttp>(std::move(channel), std::move(options));
  return [tei](const HttpRequest& req) { return tei->Handle(req); };
}

HttpHandler NewHttpApiHandler(std::shared_ptr<grpc::Channel> channel, TeiHttpOptions options) {
  HttpHandler kserve = NewKServeHttpHandler(channel);
  HttpHandler tei = NewTeiHttpHandler(std::move(channel), std::move(options));
  return [kserve = std::move(kserve), tei = std::move(tei)](const HttpRequest& req) {
    const bool v2 = req.path == "/v2" || absl::StartsWith(req.path, "/v2/");
    return v2 ? kserve(req) : tei(req);
  };
}

}  // namespace collabserve::service
