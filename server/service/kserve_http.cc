#include "server/service/kserve_http.h"
#include "server/service/kserve_tensors.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "kserve/grpc_predict_v2.grpc.pb.h"

namespace collabserve::service {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using json = nlohmann::json;

constexpr char kBinaryHeader[] = "inference-header-content-length";

void Retype(json* j, const google::protobuf::Descriptor* d);

void RetypeValue(json* v, const FieldDescriptor* f) {
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
      if (int64_t n; v->is_string() && absl::SimpleAtoi(v->get<std::string>(), &n)) *v = n;
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      if (uint64_t n; v->is_string() && absl::SimpleAtoi(v->get<std::string>(), &n)) *v = n;
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      Retype(v, f->message_type());
      break;
    default:
      break;
  }
}

// protobuf's JSON of a message of type `d`, made what REST clients read: 64-bit integers as
// numbers (proto3's JSON writes them as strings), an InferParameter as its value.
void Retype(json* j, const google::protobuf::Descriptor* d) {
  if (!j->is_object()) return;
  if (d == inference::InferParameter::descriptor()) {
    if (j->size() != 1) {
      *j = nullptr;
      return;
    }
    const std::string key = j->begin().key();
    json value = j->begin().value();
    if (const FieldDescriptor* f = d->FindFieldByName(key)) RetypeValue(&value, f);
    *j = std::move(value);
    return;
  }
  for (auto& [key, value] : j->items()) {
    const FieldDescriptor* f = d->FindFieldByName(key);
    if (f == nullptr) continue;
    if (f->is_map()) {
      const FieldDescriptor* mapped = f->message_type()->map_value();
      for (auto& [k, v] : value.items()) RetypeValue(&v, mapped);
    } else if (f->is_repeated()) {
      for (json& e : value) RetypeValue(&e, f);
    } else {
      RetypeValue(&value, f);
    }
  }
}

// A message as JSON: field names as in the .proto, every scalar field (defaults too), 64-bit
// integers as numbers, enums by name, maps as objects, a oneof as its set member, an InferParameter
// as its value. Through protobuf's JSON writer, which works from the wire format: reflection over
// a map field (its lazily built repeated view) crashed under ThreadSanitizer.
json ProtoJson(const Message& m) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string text;
  if (!google::protobuf::util::MessageToJsonString(m, &text, options).ok()) {
    throw std::runtime_error(absl::StrCat("cannot write ", m.GetTypeName(), " as JSON"));
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw std::runtime_error(absl::StrCat(m.GetTypeName(), "'s JSON does not parse"));
  Retype(&j, m.GetDescriptor());
  return j;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

HttpResponse JsonResponse(int code, const json& body) {
  HttpResponse r;
  r.code = code;
  r.body = Dump(body);
  return r;
}

HttpResponse Error(int code, const std::string& message) {
  return JsonResponse(code, json{{"error", message}});
}

HttpResponse FromStatus(const grpc::Status& s) {
  return Error(HttpCodeForGrpc(s.error_code()), s.error_message());
}

// A JSON parameter as an InferParameter; false (with `why`) for another JSON type.
bool ToParameter(const json& v, inference::InferParameter* p, std::string* why) {
  if (v.is_boolean()) {
    p->set_bool_param(v.get<bool>());
  } else if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    p->set_uint64_param(v.get<uint64_t>());
  } else if (v.is_number_integer()) {
    p->set_int64_param(v.get<int64_t>());
  } else if (v.is_number_float()) {
    p->set_double_param(v.get<double>());
  } else if (v.is_string()) {
    p->set_string_param(v.get<std::string>());
  } else {
    *why = absl::StrCat("a ", v.type_name(), " (a parameter is a bool, number or string)");
    return false;
  }
  return true;
}

// Parameters of a JSON object into `map`, except the REST-only ones in `skip`.
bool ToParameters(const json& obj, const std::string& where,
                  google::protobuf::Map<std::string, inference::InferParameter>* map,
                  std::initializer_list<std::string_view> skip, std::string* why) {
  if (!obj.is_object()) {
    *why = absl::StrCat(where, ": not an object");
    return false;
  }
  for (const auto& [key, value] : obj.items()) {
    if (std::find(skip.begin(), skip.end(), key) != skip.end()) continue;
    std::string type_why;
    if (!ToParameter(value, &(*map)[key], &type_why)) {
      *why = absl::StrCat(where, ".", key, ": ", type_why);
      return false;
    }
  }
  return true;
}

// A BYTES tensor's JSON data (flat or nested arrays of strings, at most kMaxNesting deep) in the
// raw layout. Iterative: the depth of a request's arrays must not be the depth of this stack.
constexpr int kMaxNesting = 32;

bool FlattenBytes(const json& data, const std::string& where, std::string* raw, std::string* why) {
  struct Level {
    const json* array;
    size_t next;
  };
  if (!data.is_array()) {
    *why = absl::StrCat(where, ": a ", data.type_name(), ", not an array");
    return false;
  }
  std::vector<Level> stack = {{&data, 0}};
  while (!stack.empty()) {
    Level& top = stack.back();
    if (top.next == top.array->size()) {
      stack.pop_back();
      continue;
    }
    const json& e = (*top.array)[top.next++];
    if (e.is_array()) {
      if (stack.size() >= kMaxNesting) {
        *why = absl::StrCat(where, ": arrays nested more than ", kMaxNesting, " deep");
        return false;
      }
      stack.push_back({&e, 0});
      continue;
    }
    if (!e.is_string()) {
      std::string at = where;
      for (const Level& l : stack) absl::StrAppend(&at, "[", l.next - 1, "]");
      *why = absl::StrCat(at, ": a ", e.type_name(), ", not a string (BYTES data are strings)");
      return false;
    }
    AppendRawBytes(e.get_ref<const std::string&>(), raw);
  }
  return true;
}

// A raw output of `count` elements as JSON data; false for a datatype that is not written as
// JSON here, or bytes that are not `count` elements of it.
bool RawToJson(const std::string& name, const std::string& datatype, int64_t count,
               const std::string& raw, json* data) {
  *data = json::array();
  if (datatype == "FP32") {
    if (raw.size() != static_cast<size_t>(count) * 4) return false;
    for (size_t i = 0; i < raw.size(); i += 4) {
      float f;
      std::memcpy(&f, raw.data() + i, 4);  // little-endian hosts only (x86-64, aarch64)
      data->push_back(ShortestDouble(f));
    }
    return true;
  }
  if (datatype == "BYTES") {
    std::vector<std::string> elements;
    if (!DecodeRawBytes(raw, count, name, &elements).ok()) return false;
    for (std::string& e : elements) data->push_back(std::move(e));
    return true;
  }
  return false;
}

class KServeHttp {
 public:
  explicit KServeHttp(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)), stub_(inference::GRPCInferenceService::NewStub(channel_)) {}

  HttpResponse Handle(const HttpRequest& req) {
    std::vector<std::string> seg;
    for (absl::string_view s : absl::StrSplit(req.path, '/')) {
      std::string decoded;
      if (!PercentDecodeSegment(std::string_view(s.data(), s.size()), &decoded)) {
        return Error(400, absl::StrCat("malformed escape in path ", req.path));
      }
      seg.push_back(std::move(decoded));
    }
    // seg[0] is "" (the path starts with '/'); a trailing '/' leaves an empty last segment.
    if (seg.size() > 1 && seg.back().empty()) seg.pop_back();
    if (seg.size() < 2 || !seg[0].empty() || seg[1] != "v2") return NotFound(req);
    const bool get = req.method == "GET" || req.method == "HEAD";
    const bool post = req.method == "POST";
    const size_t n = seg.size();
    if (n == 2) return get ? ServerMetadata() : NotAllowed("GET, HEAD");
    if (n == 4 && seg[2] == "health" && (seg[3] == "live" || seg[3] == "ready")) {
      if (!get) return NotAllowed("GET, HEAD");
      return seg[3] == "live" ? ServerLive() : ServerReady();
    }
    if (seg[2] == "repository") {
      if (n == 4 && seg[3] == "index") return post ? RepositoryIndex(req) : NotAllowed("POST");
      if (n == 6 && seg[3] == "models" && (seg[5] == "load" || seg[5] == "unload")) {
        if (!post) return NotAllowed("POST");
        return RepositoryLoad(seg[4], seg[5] == "load");
      }
      return NotFound(req);
    }
    if (seg[2] != "models") return NotFound(req);
    if (n == 4 && seg[3] == "stats") return get ? Stats("", "") : NotAllowed("GET, HEAD");
    if (n < 4) return NotFound(req);
    // /v2/models/M[/versions/V][/action]
    const std::string& model = seg[3];
    std::string version;
    size_t next = 4;
    if (n >= 6 && seg[4] == "versions") {
      version = seg[5];
      next = 6;
    }
    if (next == n) return get ? ModelMetadata(model, version) : NotAllowed("GET, HEAD");
    if (next + 1 != n) return NotFound(req);
    const std::string& action = seg[next];
    if (action == "infer") return post ? Infer(req, model, version) : NotAllowed("POST");
    if (action == "ready") return get ? ModelReady(model, version) : NotAllowed("GET, HEAD");
    if (action == "config") return get ? Config(model, version) : NotAllowed("GET, HEAD");
    if (action == "stats") return get ? Stats(model, version) : NotAllowed("GET, HEAD");
    return NotFound(req);
  }

 private:
  static HttpResponse NotFound(const HttpRequest& req) {
    return Error(404, absl::StrCat("no such endpoint: ", req.method, " ", req.path,
                                   " (the Open Inference Protocol's REST routes are under /v2)"));
  }
  static HttpResponse NotAllowed(const char* allow) {
    HttpResponse r = Error(405, absl::StrCat("method not allowed here; use ", allow));
    r.headers.emplace_back("Allow", allow);
    return r;
  }
  // A health answer: 200 when true, 400 when false (the protocol's "4xx is false").
  static HttpResponse Health(const char* key, bool value) {
    return JsonResponse(value ? 200 : 400, json{{key, value}});
  }

  HttpResponse ServerLive() {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse resp;
    grpc::Status s = stub_->ServerLive(&ctx, {}, &resp);
    return s.ok() ? Health("live", resp.live()) : FromStatus(s);
  }
  HttpResponse ServerReady() {
    grpc::ClientContext ctx;
    inference::ServerReadyResponse resp;
    grpc::Status s = stub_->ServerReady(&ctx, {}, &resp);
    return s.ok() ? Health("ready", resp.ready()) : FromStatus(s);
  }
  HttpResponse ServerMetadata() {
    grpc::ClientContext ctx;
    inference::ServerMetadataResponse resp;
    grpc::Status s = stub_->ServerMetadata(&ctx, {}, &resp);
    return s.ok() ? JsonResponse(200, ProtoJson(resp)) : FromStatus(s);
  }
  HttpResponse ModelReady(const std::string& model, const std::string& version) {
    grpc::ClientContext ctx;
    inference::ModelReadyRequest req;
    req.set_name(model);
    req.set_version(version);
    inference::ModelReadyResponse resp;
    grpc::Status s = stub_->ModelReady(&ctx, req, &resp);
    return s.ok() ? Health("ready", resp.ready()) : FromStatus(s);
  }
  HttpResponse ModelMetadata(const std::string& model, const std::string& version) {
    grpc::ClientContext ctx;
    inference::ModelMetadataRequest req;
    req.set_name(model);
    req.set_version(version);
    inference::ModelMetadataResponse resp;
    grpc::Status s = stub_->ModelMetadata(&ctx, req, &resp);
    return s.ok() ? JsonResponse(200, ProtoJson(resp)) : FromStatus(s);
  }
  HttpResponse Config(const std::string& model, const std::string& version) {
    grpc::ClientContext ctx;
    inference::ModelConfigRequest req;
    req.set_name(model);
    req.set_version(version);
    inference::ModelConfigResponse resp;
    grpc::Status s = stub_->ModelConfig(&ctx, req, &resp);
    return s.ok() ? JsonResponse(200, ProtoJson(resp.config())) : FromStatus(s);
  }
  HttpResponse Stats(const std::string& model, const std::string& version) {
    grpc::ClientContext ctx;
    inference::ModelStatisticsRequest req;
    req.set_name(model);
    req.set_version(version);
    inference::ModelStatisticsResponse resp;
    grpc::Status s = stub_->ModelStatistics(&ctx, req, &resp);
    return s.ok() ? JsonResponse(200, ProtoJson(resp)) : FromStatus(s);
  }
  HttpResponse RepositoryIndex(const HttpRequest& http) {
    inference::RepositoryIndexRequest req;
    if (!absl::StripAsciiWhitespace(http.body).empty()) {
      json body = json::parse(http.body, nullptr, /*allow_exceptions=*/false);
      if (!body.is_object()) return Error(400, "the request body is not a JSON object");
      if (body.contains("ready")) {
        if (!body["ready"].is_boolean()) return Error(400, "ready: not a bool");
        req.set_ready(body["ready"].get<bool>());
      }
    }
    grpc::ClientContext ctx;
    inference::RepositoryIndexResponse resp;
    grpc::Status s = stub_->RepositoryIndex(&ctx, req, &resp);
    return s.ok() ? JsonResponse(200, ProtoJson(resp)["models"]) : FromStatus(s);
  }
  HttpResponse RepositoryLoad(const std::string& model, bool load) {
    grpc::ClientContext ctx;
    grpc::Status s;
    if (load) {
      inference::RepositoryModelLoadRequest req;
      req.set_model_name(model);
      inference::RepositoryModelLoadResponse resp;
      s = stub_->RepositoryModelLoad(&ctx, req, &resp);
    } else {
      inference::RepositoryModelUnloadRequest req;
      req.set_model_name(model);
      inference::RepositoryModelUnloadResponse resp;
      s = stub_->RepositoryModelUnload(&ctx, req, &resp);
    }
    return s.ok() ? JsonResponse(200, json::object()) : FromStatus(s);
  }

  HttpResponse Infer(const HttpRequest& http, const std::string& model, const std::string& version) {
    // The JSON, and after it (binary tensor extension) the binary inputs.
    std::string_view json_text = http.body;
    std::string_view binary;
    if (const std::string* h = http.Header(kBinaryHeader)) {
      uint64_t n = 0;
      if (!absl::SimpleAtoi(*h, &n) || n > http.body.size()) {
        return Error(400, absl::StrCat("Inference-Header-Content-Length '", *h,
                                       "' is not a length within the ", http.body.size(),
                                       "-byte body"));
      }
      json_text = json_text.substr(0, n);
      binary = std::string_view(http.body).substr(n);
    }
    json body = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) return Error(400, "the request body is not JSON");
    if (!body.is_object()) return Error(400, "the request body is not a JSON object");

    inference::ModelInferRequest req;
    req.set_model_name(model);
    req.set_model_version(version);
    std::string why;
    bool all_binary_out = false;
    if (body.contains("id")) {
      if (!body["id"].is_string()) return Error(400, "id: not a string");
      req.set_id(body["id"].get<std::string>());
    }
    if (body.contains("parameters")) {
      const json& p = body["parameters"];
      if (!ToParameters(p, "parameters", req.mutable_parameters(), {"binary_data_output"}, &why)) {
        return Error(400, why);
      }
      if (p.contains("binary_data_output")) {
        if (!p["binary_data_output"].is_boolean()) {
          return Error(400, "parameters.binary_data_output: not a bool");
        }
        all_binary_out = p["binary_data_output"].get<bool>();
      }
    }
    if (!body.contains("inputs") || !body["inputs"].is_array()) {
      return Error(400, "inputs: missing, or not an array");
    }
    size_t binary_used = 0;
    const json& inputs = body["inputs"];
    for (size_t i = 0; i < inputs.size(); ++i) {
      const json& in = inputs[i];
      const std::string where = absl::StrCat("inputs[", i, "]");
      if (!in.is_object()) return Error(400, absl::StrCat(where, ": not an object"));
      auto* t = req.add_inputs();
      std::string* raw = req.add_raw_input_contents();
      if (!in.contains("name") || !in["name"].is_string()) {
        return Error(400, absl::StrCat(where, ".name: missing, or not a string"));
      }
      t->set_name(in["name"].get<std::string>());
      const std::string named = absl::StrCat(where, " (", t->name(), ")");
      if (!in.contains("datatype") || !in["datatype"].is_string()) {
        return Error(400, absl::StrCat(named, ".datatype: missing, or not a string"));
      }
      t->set_datatype(in["datatype"].get<std::string>());
      if (!in.contains("shape") || !in["shape"].is_array()) {
        return Error(400, absl::StrCat(named, ".shape: missing, or not an array"));
      }
      for (const json& d : in["shape"]) {
        if (!d.is_number_integer()) return Error(400, absl::StrCat(named, ".shape: not integers"));
        t->add_shape(d.get<int64_t>());
      }
      std::optional<uint64_t> binary_size;
      if (in.contains("parameters")) {
        const json& p = in["parameters"];
        if (!ToParameters(p, named + ".parameters", t->mutable_parameters(), {"binary_data_size"},
                          &why)) {
          return Error(400, why);
        }
        if (p.contains("binary_data_size")) {
          if (!p["binary_data_size"].is_number_unsigned()) {
            return Error(400, absl::StrCat(named, ".parameters.binary_data_size: not a length"));
          }
          binary_size = p["binary_data_size"].get<uint64_t>();
        }
      }
      if (binary_size) {
        if (in.contains("data")) {
          return Error(400, absl::StrCat(named, ": both data and binary_data_size"));
        }
        if (*binary_size > binary.size() - binary_used) {
          return Error(400, absl::StrCat(named, ".parameters.binary_data_size ", *binary_size,
                                         " is past the end of the body's ", binary.size(),
                                         " binary bytes"));
        }
        raw->assign(binary.substr(binary_used, *binary_size));
        binary_used += *binary_size;
        continue;
      }
      if (!in.contains("data")) return Error(400, absl::StrCat(named, ".data: missing"));
      if (t->datatype() != "BYTES") {
        return Error(400, absl::StrCat(named, ": datatype ", t->datatype(),
                                       "; every input of these models is BYTES (text)"));
      }
      if (!FlattenBytes(in["data"], named + ".data", raw, &why)) return Error(400, why);
    }
    if (binary_used != binary.size()) {
      return Error(400, absl::StrCat("the body has ", binary.size() - binary_used,
                                     " binary bytes after the JSON that no input's "
                                     "binary_data_size claims"));
    }
    std::map<std::string, bool> binary_by_name;  // requested output -> sent as binary
    if (body.contains("outputs")) {
      const json& outputs = body["outputs"];
      if (!outputs.is_array()) return Error(400, "outputs: not an array");
      for (size_t i = 0; i < outputs.size(); ++i) {
        const json& o = outputs[i];
        const std::string where = absl::StrCat("outputs[", i, "]");
        if (!o.is_object()) return Error(400, absl::StrCat(where, ": not an object"));
        if (!o.contains("name") || !o["name"].is_string()) {
          return Error(400, absl::StrCat(where, ".name: missing, or not a string"));
        }
        auto* out = req.add_outputs();
        out->set_name(o["name"].get<std::string>());
        bool bin = all_binary_out;
        if (o.contains("parameters")) {
          const json& p = o["parameters"];
          if (!ToParameters(p, where + ".parameters", out->mutable_parameters(), {"binary_data"},
                            &why)) {
            return Error(400, why);
          }
          if (p.contains("binary_data")) {
            if (!p["binary_data"].is_boolean()) {
              return Error(400, absl::StrCat(where, ".parameters.binary_data: not a bool"));
            }
            bin = p["binary_data"].get<bool>();
          }
        }
        binary_by_name[out->name()] = bin;
      }
    }

    // The call is cancelled when the client goes away: its input leaves the queue, and a batch
    // does not wait on an answer nobody reads.
    grpc::ClientContext ctx;
    inference::ModelInferResponse resp;
    bool cancelled = false;
    const grpc::Status s = AwaitUnlessClientGone(
        http, &ctx,
        [&](std::function<void(grpc::Status)> done) {
          stub_->async()->ModelInfer(&ctx, &req, &resp, std::move(done));
        },
        &cancelled);
    if (cancelled) return Error(499, "the client closed the connection");
    if (!s.ok()) return FromStatus(s);

    json out{{"model_name", resp.model_name()}, {"model_version", resp.model_version()}};
    if (!resp.id().empty()) out["id"] = resp.id();
    if (resp.parameters_size() > 0) {
      inference::ModelInferResponse only;  // not the outputs' bytes too
      *only.mutable_parameters() = resp.parameters();
      out["parameters"] = ProtoJson(only)["parameters"];
    }
    json tensors = json::array();
    std::string tail;
    bool any_binary = false;
    for (int i = 0; i < resp.outputs_size(); ++i) {
      const auto& o = resp.outputs(i);
      json t{{"name", o.name()}, {"datatype", o.datatype()}, {"shape", json(std::vector<int64_t>(o.shape().begin(), o.shape().end()))}};
      json params = json::object();
      if (o.parameters_size() > 0) {
        inference::ModelInferResponse::InferOutputTensor only;
        *only.mutable_parameters() = o.parameters();
        params = ProtoJson(only)["parameters"];
      }
      const std::string& raw =
          i < resp.raw_output_contents_size() ? resp.raw_output_contents(i) : std::string();
      auto it = binary_by_name.find(o.name());
      const bool bin = it != binary_by_name.end() ? it->second : all_binary_out;
      any_binary |= bin;
      if (bin) {
        params["binary_data_size"] = raw.size();
        tail += raw;
      } else {
        json data;
        int64_t count = 1;
        for (int64_t d : o.shape()) count *= d;
        if (!RawToJson(o.name(), o.datatype(), count, raw, &data)) {
          return Error(500, absl::StrCat("output ", o.name(), ": cannot write ", o.datatype(),
                                         " data as JSON (ask for it as binary_data)"));
        }
        t["data"] = std::move(data);
      }
      if (!params.empty()) t["parameters"] = std::move(params);
      tensors.push_back(std::move(t));
    }
    out["outputs"] = std::move(tensors);
    HttpResponse r = JsonResponse(200, out);
    r.compressible = true;  // what Triton compresses, and what its clients decompress
    if (any_binary) {
      r.headers.emplace_back("Inference-Header-Content-Length", std::to_string(r.body.size()));
      r.content_type = "application/octet-stream";
      r.body += tail;
    }
    return r;
  }

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

}  // namespace

double ShortestDouble(float f) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), f);
  if (ec != std::errc() || !std::isfinite(f)) return static_cast<double>(f);
  *end = '\0';
  return std::strtod(buf, nullptr);
}

grpc::Status AwaitUnlessClientGone(const HttpRequest& http, grpc::ClientContext* ctx,
                                   const std::function<void(std::function<void(grpc::Status)>)>& start,
                                   bool* client_gone) {
  absl::Mutex mu;
  std::optional<grpc::Status> done;
  start([&mu, &done](grpc::Status s) {
    absl::MutexLock lock(&mu);
    done = std::move(s);
  });
  *client_gone = false;
  absl::MutexLock lock(&mu);
  auto finished = [&done]() { return done.has_value(); };
  while (!mu.AwaitWithTimeout(absl::Condition(&finished), absl::Milliseconds(50))) {
    if (!*client_gone && http.client_gone()) {
      ctx->TryCancel();
      *client_gone = true;
    }
  }
  return *std::move(done);
}

int HttpCodeForGrpc(int grpc_code) {
  switch (static_cast<grpc::StatusCode>(grpc_code)) {
    case grpc::StatusCode::OK: return 200;
    // The HTTP client cannot cancel a call (its leaving is answered 499 before this): a call
    // cancelled is the server's doing, shutting down.
    case grpc::StatusCode::CANCELLED: return 503;
    case grpc::StatusCode::INVALID_ARGUMENT: return 400;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return 504;
    case grpc::StatusCode::NOT_FOUND: return 404;
    case grpc::StatusCode::ALREADY_EXISTS: return 409;
    case grpc::StatusCode::PERMISSION_DENIED: return 403;
    case grpc::StatusCode::UNAUTHENTICATED: return 401;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return 429;
    case grpc::StatusCode::FAILED_PRECONDITION: return 400;
    case grpc::StatusCode::ABORTED: return 409;
    case grpc::StatusCode::OUT_OF_RANGE: return 400;
    case grpc::StatusCode::UNIMPLEMENTED: return 501;
    case grpc::StatusCode::UNAVAILABLE: return 503;
    default: return 500;  // UNKNOWN, INTERNAL, DATA_LOSS
  }
}

HttpHandler NewKServeHttpHandler(std::shared_ptr<grpc::Channel> channel) {
  auto http = std::make_shared<KServeHttp>(std::move(channel));
  return [http](const HttpRequest& req) { return http->Handle(req); };
}

}  // namespace collabserve::service
