#include "server/service/kserve_service.h"
#include "server/service/kserve_tensors.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/service/model_servable.h"
#include "server/service/status_mapping.h"
#include "server/util/status_macros.h"

// The raw tensor layout is little-endian; the float outputs are copied from memory as they are.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kserve_service.cc writes FP32 raw contents from host memory and needs a little-endian host"
#endif

namespace collabserve::service {
namespace {

using InferRequest = inference::ModelInferRequest;
using InferResponse = inference::ModelInferResponse;

constexpr char kText[] = "text";
constexpr char kTextPair[] = "text_pair";
constexpr char kLogits[] = "logits";
constexpr char kProbabilities[] = "probabilities";
constexpr char kLabel[] = "label";
constexpr char kPlatform[] = "collabserve";

// Every model's tensors, as ModelMetadata and ModelConfig describe them: per input, one string
// (BYTES, TYPE_STRING) or one float per label (FP32).
struct TensorSpec {
  const char* name;
  bool input;
  bool text;
  bool optional;
};
constexpr TensorSpec kTensors[] = {{kText, true, true, false},
                                   {kTextPair, true, true, true},
                                   {kLogits, false, false, false},
                                   {kProbabilities, false, false, false},
                                   {kLabel, false, true, false}};

absl::Time ToAbslTime(std::chrono::system_clock::time_point tp) {
  if (tp == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(tp);
}

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// "" = the newest version; otherwise a positive decimal integer, digits only ("1", not " 1" or
// "+1": a version is a name as much as a number, and ModelMetadata lists them that way).
absl::StatusOr<std::optional<int64_t>> ParseVersion(const std::string& version) {
  if (version.empty()) return std::optional<int64_t>();
  int64_t v = 0;
  const bool digits = std::all_of(version.begin(), version.end(),
                                  [](char ch) { return ch >= '0' && ch <= '9'; });
  if (!digits || !absl::SimpleAtoi(version, &v) || v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model version \"", version,
                     "\" is not a version; versions are positive integers (leave it empty for the "
                     "newest)"));
  }
  return std::optional<int64_t>(v);
}

absl::StatusOr<std::shared_ptr<ModelServable>> Resolve(repository::ModelRepository* repository,
                                                       const std::string& model,
                                                       const std::string& version) {
  if (model.empty()) {
    return absl::InvalidArgumentError("model name is empty; ModelMetadata or ListModels names them");
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> v, ParseVersion(version));
  ASSIGN_OR_RETURN(std::shared_ptr<repository::Servable> s, repository->Get(model, v));
  return std::static_pointer_cast<ModelServable>(std::move(s));
}


// The elements of one BYTES input tensor of shape [N] or [N, 1], 1 <= N <= max_elements (checked
// before anything is decoded).
absl::StatusOr<std::vector<std::string>> ReadTextInput(const InferRequest& request, int index,
                                                       int max_elements) {
  const InferRequest::InferInputTensor& in = request.inputs(index);
  const std::string& name = in.name();
  if (in.datatype() != "BYTES") {
    return absl::InvalidArgumentError(absl::StrCat(
        "input '", name, "' has datatype ", in.datatype().empty() ? "\"\"" : in.datatype(),
        "; it must be BYTES (UTF-8 text)"));
  }
  const auto& shape = in.shape();
  const bool shape_ok = (shape.size() == 1 || (shape.size() == 2 && shape[1] == 1)) && shape[0] >= 1;
  if (!shape_ok) {
    return absl::InvalidArgumentError(absl::StrCat("input '", name, "' has shape ",
                                                   ShapeString(shape),
                                                   "; it must be [N] or [N, 1] with N >= 1"));
  }
  const int64_t n = shape[0];
  if (n > max_elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input '", name, "' has ", n, " elements, more than the limit of ", max_elements,
        " (--max_inputs_per_request); split it into several requests"));
  }
  std::vector<std::string> texts;
  if (request.raw_input_contents_size() > 0) {
    RETURN_IF_ERROR(DecodeRawBytes(request.raw_input_contents(index), n, name, &texts));
  } else {
    const inference::InferTensorContents& c = in.contents();
    if (c.bytes_contents_size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", name, "' has shape ", ShapeString(shape), " (", n, " elements) but ",
          c.bytes_contents_size(), " elements in contents.bytes_contents"));
    }
    texts.assign(c.bytes_contents().begin(), c.bytes_contents().end());
  }
  return texts;
}

bool HasTypedContents(const inference::InferTensorContents& c) {
  return c.bool_contents_size() > 0 || c.int_contents_size() > 0 || c.int64_contents_size() > 0 ||
         c.uint_contents_size() > 0 || c.uint64_contents_size() > 0 ||
         c.fp32_contents_size() > 0 || c.fp64_contents_size() > 0 || c.bytes_contents_size() > 0;
}

// One requested output.
struct RequestedOutput {
  std::string name;
  // The classification extension: > 0 answers the output as its `classes` best classes
  // ("value:index:label" strings) instead of the FP32 tensor.
  int64_t classes = 0;
};

// What a ModelInfer request asks for, checked.
struct ParsedInfer {
  std::vector<std::string> texts;
  std::optional<std::vector<std::string>> pairs;
  std::vector<RequestedOutput> outputs;  // in response order
  bool raw = false;                      // answer with raw_output_contents
  bool truncate = true;
  std::optional<absl::Duration> timeout;  // the `timeout` parameter, if > 0
};

// A count or a time in a parameter's int64_param or uint64_param (Triton's clients send either),
// >= 0.
absl::StatusOr<int64_t> NonNegativeIntParam(const inference::InferParameter& p,
                                            const std::string& what) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (p.int64_param() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, " is ", p.int64_param(), "; it must not be negative"));
      }
      return p.int64_param();
    case inference::InferParameter::kUint64Param:
      if (p.uint64_param() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(absl::StrCat(what, " is ", p.uint64_param(),
                                                       ", more than an int64 holds"));
      }
      return static_cast<int64_t>(p.uint64_param());
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " must be an int64_param (or uint64_param)"));
  }
}

absl::StatusOr<ParsedInfer> ParseInfer(const InferRequest& request, int max_inputs) {
  ParsedInfer p;
  p.raw = request.raw_input_contents_size() > 0;
  if (p.raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_input_contents has ", request.raw_input_contents_size(), " entries for ",
        request.inputs_size(), " inputs; it needs one per input, in the same order"));
  }
  bool seen_text = false;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& in = request.inputs(i);
    if (p.raw && HasTypedContents(in.contents())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", in.name(), "' has contents although the request uses raw_input_contents; "
          "use one form for all inputs"));
    }
    if (in.name() == kText) {
      if (seen_text) return absl::InvalidArgumentError("input 'text' is given twice");
      seen_text = true;
      ASSIGN_OR_RETURN(p.texts, ReadTextInput(request, i, max_inputs));
    } else if (in.name() == kTextPair) {
      if (p.pairs.has_value()) return absl::InvalidArgumentError("input 'text_pair' is given twice");
      ASSIGN_OR_RETURN(p.pairs, ReadTextInput(request, i, max_inputs));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", in.name(), "' is not an input of this model; it takes 'text' (BYTES, [N] or "
          "[N, 1]) and optionally 'text_pair' (as many elements)"));
    }
  }
  if (!seen_text) {
    return absl::InvalidArgumentError(
        "the request has no input 'text' (BYTES, shape [N] or [N, 1]); 'text_pair' is optional");
  }
  if (p.pairs.has_value() && p.pairs->size() != p.texts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("input 'text_pair' has ", p.pairs->size(),
                                                   " elements but 'text' has ", p.texts.size(),
                                                   "; they must have as many"));
  }
  for (size_t i = 0; i < p.texts.size(); ++i) {
    if (p.texts[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("input 'text' element ", i, " is empty"));
    }
  }

  for (const auto& out : request.outputs()) {
    const std::string& name = out.name();
    if (name != kLogits && name != kProbabilities && name != kLabel) {
      return absl::InvalidArgumentError(absl::StrCat(
          "requested output '", name,
          "' is not an output of this model; its outputs are 'logits', 'probabilities', 'label'"));
    }
    for (const RequestedOutput& seen : p.outputs) {
      if (seen.name == name) {
        return absl::InvalidArgumentError(absl::StrCat("output '", name, "' is requested twice"));
      }
    }
    RequestedOutput requested{name, 0};
    if (auto it = out.parameters().find("classification"); it != out.parameters().end()) {
      ASSIGN_OR_RETURN(requested.classes,
                       NonNegativeIntParam(it->second, absl::StrCat("output '", name,
                                                                      "' parameter 'classification'")));
      if (requested.classes == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "output '", name, "' parameter 'classification' is 0; ask for at least 1 class"));
      }
      if (name == kLabel) {
        return absl::InvalidArgumentError(
            "output 'label' is BYTES and cannot be answered as classes; ask 'logits' or "
            "'probabilities' for classification");
      }
    }
    p.outputs.push_back(std::move(requested));
  }
  if (p.outputs.empty()) p.outputs = {{kLogits, 0}, {kProbabilities, 0}, {kLabel, 0}};

  const auto& params = request.parameters();
  if (auto it = params.find("truncate"); it != params.end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError("parameter 'truncate' must be a bool_param");
    }
    p.truncate = it->second.bool_param();
  }
  if (auto it = params.find("timeout"); it != params.end()) {
    ASSIGN_OR_RETURN(int64_t micros, NonNegativeIntParam(it->second, "parameter 'timeout'"));
    if (micros > 0) p.timeout = absl::Microseconds(micros);
  }
  return p;
}

// Classify's rule (model::BertConfig::output_function).
std::vector<float> Probabilities(const std::string& problem_type,
                                 const google::protobuf::RepeatedField<float>& logits) {
  std::vector<float> p(logits.begin(), logits.end());
  if (problem_type == "regression" || p.empty()) return p;
  if (problem_type == "multi_label_classification" || p.size() == 1) {
    for (float& x : p) x = 1.0f / (1.0f + std::exp(-x));
    return p;
  }
  const float mx = *std::max_element(p.begin(), p.end());
  float sum = 0;
  for (float& x : p) {
    x = std::exp(x - mx);
    sum += x;
  }
  for (float& x : p) x /= sum;
  return p;
}

// StartClassify names the inputs of a ClassifyRequest ("inputs[3].text", "inputs[3]: text_pair:
// invalid UTF-8 ..."); say it in tensor terms. What it says of a whole input (its token count)
// concerns both tensors when the request has `text_pair`.
grpc::Status InTensorTerms(const grpc::Status& status, bool has_pairs) {
  if (status.error_code() != grpc::StatusCode::INVALID_ARGUMENT) return status;
  static const std::regex* const kField =
      new std::regex(R"(inputs\[(\d+)\](?:\.|: )(text_pair|text)\b)");
  static const std::regex* const kInput = new std::regex(R"(inputs\[(\d+)\])");
  std::string message = std::regex_replace(status.error_message(), *kField, "input '$2' element $1");
  message = std::regex_replace(
      message, *kInput, has_pairs ? "element $1 of 'text' with 'text_pair'" : "element $1 of 'text'");
  return grpc::Status(status.error_code(), message);
}

// The classification extension's strings for one row of values: the `count` highest values, best
// first (equal values in index order), each "value:index:label" with the value as Triton writes it
// (std::to_string).
void AppendClasses(const std::vector<float>& row, int64_t count,
                   const std::vector<std::string>& labels, std::vector<std::string>* out) {
  std::vector<size_t> order(row.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const size_t k = std::min<size_t>(static_cast<size_t>(count), row.size());
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&row](size_t a, size_t b) {
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  });
  for (size_t j = 0; j < k; ++j) {
    const size_t i = order[j];
    const std::string label = i < labels.size() ? labels[i] : absl::StrCat("LABEL_", i);
    out->push_back(absl::StrCat(std::to_string(row[i]), ":", i, ":", label));
  }
}

// Fills `response` from Classify's results for the requested outputs.
absl::Status BuildResponse(const ParsedInfer& parsed, const model::ModelInfo& info,
                           const v1::ClassifyResponse& result, InferResponse* response) {
  const int64_t n = result.results_size();
  const int64_t c = n > 0 ? result.results(0).logits_size() : 0;
  for (const auto& r : result.results()) {
    if (r.logits_size() != c) {
      return absl::InternalError("results with different numbers of logits in one response");
    }
  }
  response->set_model_name(result.model_name());
  response->set_model_version(std::to_string(result.model_version()));
  // A BYTES output, in the form the request used.
  auto add_bytes = [&](InferResponse::InferOutputTensor* t, const std::vector<std::string>& v) {
    t->set_datatype("BYTES");
    std::string* raw = parsed.raw ? response->add_raw_output_contents() : nullptr;
    for (const std::string& e : v) {
      if (raw != nullptr) {
        AppendRawBytes(e, raw);
      } else {
        t->mutable_contents()->add_bytes_contents(e);
      }
    }
  };
  for (const RequestedOutput& out : parsed.outputs) {
    InferResponse::InferOutputTensor* t = response->add_outputs();
    t->set_name(out.name);
    if (out.name == kLabel) {
      t->add_shape(n);
      std::vector<std::string> labels;
      labels.reserve(n);
      for (const auto& r : result.results()) labels.push_back(r.label());
      add_bytes(t, labels);
      continue;
    }
    std::vector<float> values;
    values.reserve(n * c);
    for (const auto& r : result.results()) {
      if (out.name == kLogits) {
        values.insert(values.end(), r.logits().begin(), r.logits().end());
      } else {
        std::vector<float> p = Probabilities(info.problem_type, r.logits());
        values.insert(values.end(), p.begin(), p.end());
      }
    }
    if (out.classes > 0) {
      const int64_t k = std::min<int64_t>(out.classes, c);
      t->add_shape(n);
      t->add_shape(k);
      std::vector<std::string> classes;
      classes.reserve(n * k);
      for (int64_t i = 0; i < n; ++i) {
        const std::vector<float> row(values.begin() + i * c, values.begin() + (i + 1) * c);
        AppendClasses(row, k, info.labels, &classes);
      }
      add_bytes(t, classes);
      continue;
    }
    t->set_datatype("FP32");
    t->add_shape(n);
    t->add_shape(c);
    if (parsed.raw) {
      response->add_raw_output_contents()->assign(reinterpret_cast<const char*>(values.data()),
                                                  values.size() * sizeof(float));
    } else {
      t->mutable_contents()->mutable_fp32_contents()->Add(values.begin(), values.end());
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Like InferenceService's unary reactor: remembers that the client gave up, so that queued inputs
// are dropped before they reach the model.
class KServeService::InferReactor final : public grpc::ServerUnaryReactor {
 public:
  InferReactor() : cancelled_(std::make_shared<std::atomic<bool>>(false)) {}
  void OnCancel() override { cancelled_->store(true, std::memory_order_relaxed); }
  void OnDone() override { delete this; }
  const std::shared_ptr<std::atomic<bool>>& cancelled() const { return cancelled_; }

 private:
  const std::shared_ptr<std::atomic<bool>> cancelled_;
};

KServeService::KServeService(KServeServiceOptions options) : options_(std::move(options)) {}

void KServeService::Attach(InferenceService* inference, repository::ModelRepository* repository,
                           metrics::Metrics* metrics) {
  absl::MutexLock lock(&mu_);
  attached_.inference = inference;
  attached_.repository = repository;
  attached_.metrics = metrics;
}

KServeService::Attached KServeService::attached() const {
  absl::MutexLock lock(&mu_);
  return attached_;
}

grpc::Status KServeService::CheckServing(const Attached& a) {
  if (a.inference != nullptr) {
    if (grpc::Status refusal = a.inference->Refusal(); !refusal.ok()) return refusal;
  }
  if (a.inference == nullptr || a.repository == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "collabserve is still loading its models; retry once ServerReady is true");
  }
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* KServeService::ServerLive(grpc::CallbackServerContext* context,
                                                    const inference::ServerLiveRequest* request,
                                                    inference::ServerLiveResponse* response) {
  return FinishUnary(context, [&] {
    // Not live once the GPU failed for good: only a restart brings it back.
    const Attached a = attached();
    response->set_live(a.inference == nullptr || !a.inference->device_failed());
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* KServeService::ServerReady(grpc::CallbackServerContext* context,
                                                     const inference::ServerReadyRequest* request,
                                                     inference::ServerReadyResponse* response) {
  return FinishUnary(context, [&] {
    response->set_ready(CheckServing(attached()).ok());
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* KServeService::ModelReady(grpc::CallbackServerContext* context,
                                                    const inference::ModelReadyRequest* request,
                                                    inference::ModelReadyResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (request->name().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "model name is empty");
    }
    auto version = ParseVersion(request->version());
    if (!version.ok()) return ToGrpcStatus(version.status());
    const Attached a = attached();
    response->set_ready(CheckServing(a).ok() && a.repository->Get(request->name(), *version).ok());
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* KServeService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest* request,
    inference::ServerMetadataResponse* response) {
  return FinishUnary(context, [&] {
    response->set_name(options_.server_name);
    response->set_version(options_.server_version);
    response->add_extensions("classification");
    response->add_extensions("model_configuration");
    response->add_extensions("statistics");
    response->add_extensions("model_repository");
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* KServeService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    const Attached a = attached();
    if (grpc::Status serving = CheckServing(a); !serving.ok()) return serving;
    auto servable = Resolve(a.repository, request->name(), request->version());
    if (!servable.ok()) return ToGrpcStatus(servable.status());
    const model::ModelInfo& info = (*servable)->info();
    const int64_t c = static_cast<int64_t>(info.labels.size());
    response->set_name((*servable)->id().model);
    response->set_platform(kPlatform);
    const auto all = a.repository->List();
    if (auto it = all.find((*servable)->id().model); it != all.end()) {
      for (const auto& v : it->second) {
        if (v.state == repository::ModelRepository::VersionStatus::State::kAvailable) {
          response->add_versions(std::to_string(v.version));
        }
      }
    }
    for (const TensorSpec& spec : kTensors) {
      auto* t = spec.input ? response->add_inputs() : response->add_outputs();
      t->set_name(spec.name);
      t->set_datatype(spec.text ? "BYTES" : "FP32");
      t->add_shape(-1);
      if (!spec.text) t->add_shape(c);
    }
    return grpc::Status::OK;
  });
}

void DescribeDevice(const std::string& device, inference::ModelInstanceGroup* group) {
  if (!absl::StartsWith(device, "cuda")) {
    group->set_kind(inference::ModelInstanceGroup::KIND_CPU);
    return;
  }
  group->set_kind(inference::ModelInstanceGroup::KIND_GPU);
  int index = 0;
  const size_t colon = device.find(':');
  if (colon != std::string::npos && !absl::SimpleAtoi(device.substr(colon + 1), &index)) index = 0;
  group->add_gpus(index);
}

grpc::ServerUnaryReactor* KServeService::ModelConfig(grpc::CallbackServerContext* context,
                                                     const inference::ModelConfigRequest* request,
                                                     inference::ModelConfigResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    const Attached a = attached();
    if (grpc::Status serving = CheckServing(a); !serving.ok()) return serving;
    auto servable = Resolve(a.repository, request->name(), request->version());
    if (!servable.ok()) return ToGrpcStatus(servable.status());
    const model::ModelInfo& info = (*servable)->info();
    const batching::SchedulerOptions& batching = (*servable)->batching_options();
    const int64_t c = static_cast<int64_t>(info.labels.size());
    inference::ModelConfig* config = response->mutable_config();
    config->set_name((*servable)->id().model);
    config->set_platform(kPlatform);
    config->set_backend(kPlatform);
    config->set_max_batch_size(a.inference->options().max_inputs_per_request);
    // Without the batch dimension; one string per input is, as Triton writes a scalar per batch
    // element, dims [1] reshaped to [].
    auto describe = [c](const TensorSpec& spec, auto* t) {
      t->set_name(spec.name);
      t->set_data_type(spec.text ? inference::TYPE_STRING : inference::TYPE_FP32);
      t->add_dims(spec.text ? 1 : c);
      if (spec.text) t->mutable_reshape();
    };
    for (const TensorSpec& spec : kTensors) {
      if (spec.input) {
        inference::ModelInput* in = config->add_input();
        describe(spec, in);
        in->set_optional(spec.optional);
      } else {
        describe(spec, config->add_output());
      }
    }
    inference::ModelDynamicBatching* dynamic = config->mutable_dynamic_batching();
    // (Triton refuses a preferred size above max_batch_size.)
    dynamic->add_preferred_batch_size(static_cast<int32_t>(
        std::min<int64_t>(batching.max_batch_size, config->max_batch_size())));
    dynamic->set_max_queue_delay_microseconds(static_cast<uint64_t>(batching.max_queue_delay_micros));
    dynamic->set_preserve_ordering(false);
    dynamic->mutable_default_queue_policy()->set_max_queue_size(
        static_cast<uint32_t>(std::min<int64_t>(batching.max_queue_size, std::numeric_limits<uint32_t>::max())));
    inference::ModelInstanceGroup* group = config->add_instance_group();
    group->set_name((*servable)->id().model);
    group->set_count(batching.num_batch_threads);
    DescribeDevice(info.device, group);
    auto& parameters = *config->mutable_parameters();
    parameters["problem_type"].set_string_value(info.problem_type);
    parameters["max_length"].set_string_value(std::to_string(info.max_length));
    parameters["dtype"].set_string_value(info.dtype);
    parameters["device"].set_string_value(info.device);
    if (!info.collaborative_ranks.empty()) {
      parameters["collaborative_ranks"].set_string_value(absl::StrJoin(info.collaborative_ranks, ","));
    }
    config->mutable_model_transaction_policy()->set_decoupled(false);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* KServeService::ModelStatistics(grpc::CallbackServerContext* context,
                                                         const inference::ModelStatisticsRequest* request,
                                                         inference::ModelStatisticsResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    // Answered while the server drains or after its GPU failed too, when an operator wants them.
    const Attached a = attached();
    if (a.repository == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "collabserve is still loading its models");
    }
    std::vector<std::shared_ptr<ModelServable>> servables;
    if (!request->version().empty()) {
      if (request->name().empty()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a version needs a model name");
      }
      auto servable = Resolve(a.repository, request->name(), request->version());
      if (!servable.ok()) return ToGrpcStatus(servable.status());
      servables.push_back(std::move(servable).value());
    } else {
      if (!request->name().empty()) {
        // NOT_FOUND (naming the model and what is served) when it serves no version.
        auto newest = Resolve(a.repository, request->name(), "");
        if (!newest.ok()) return ToGrpcStatus(newest.status());
      }
      for (const auto& [model, versions] : a.repository->List()) {
        if (!request->name().empty() && model != request->name()) continue;
        for (const auto& v : versions) {
          if (v.state != repository::ModelRepository::VersionStatus::State::kAvailable) continue;
          // A version unloaded since List() is left out.
          if (auto s = a.repository->Get(model, v.version); s.ok()) {
            servables.push_back(std::static_pointer_cast<ModelServable>(std::move(s).value()));
          }
        }
      }
    }
    auto fill = [](const ServableStatistics::Duration& d, inference::StatisticDuration* out) {
      out->set_count(d.count);
      out->set_ns(d.ns);
    };
    for (const auto& servable : servables) {
      const ServableStatistics::Snapshot s = servable->statistics().Get();
      inference::ModelStatistics* out = response->add_model_stats();
      out->set_name(servable->id().model);
      out->set_version(std::to_string(servable->id().version));
      out->set_last_inference(static_cast<uint64_t>(s.last_inference_ms));
      out->set_inference_count(s.inference_count);
      out->set_execution_count(s.execution_count);
      inference::InferStatistics* is = out->mutable_inference_stats();
      fill(s.success, is->mutable_success());
      fill(s.fail, is->mutable_fail());
      fill(s.queue, is->mutable_queue());
      fill(s.compute_input, is->mutable_compute_input());
      fill(s.compute_infer, is->mutable_compute_infer());
      fill(s.compute_output, is->mutable_compute_output());
      for (const auto& [size, d] : s.batches) {
        inference::InferBatchStatistics* b = out->add_batch_stats();
        b->set_batch_size(static_cast<uint64_t>(size));
        fill(d, b->mutable_compute_infer());
      }
    }
    return grpc::Status::OK;
  });
}

void DescribeVersion(const repository::ModelRepository::VersionStatus& status,
                     inference::RepositoryIndexResponse::ModelIndex* index) {
  using State = repository::ModelRepository::VersionStatus::State;
  index->set_version(std::to_string(status.version));
  if (status.state == State::kAvailable) {
    index->set_state("READY");
    if (!status.error.ok()) {
      index->set_reason(absl::StrCat("a reload failed, and the copy loaded before serves on: ",
                                     status.error.message()));
    }
    return;
  }
  if (status.state == State::kLoading) {
    index->set_state("LOADING");
    return;
  }
  index->set_state("UNAVAILABLE");
  if (status.settling) {
    index->set_reason("its files are still changing; looked at again once they settle");
  } else if (status.state == State::kFailed) {
    index->set_reason(absl::StrCat("the load failed: ", status.error.message(),
                                   " (tried again once its files change)"));
  } else if (status.disabled) {
    index->set_reason("unloaded by an admin (Admin/UnloadModel); Admin/LoadModel serves it again");
  } else {
    index->set_reason("unloaded: not among the newest versions the repository serves");
  }
}

grpc::ServerUnaryReactor* KServeService::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  return FinishUnary(context, [&]() -> grpc::Status {
    if (!request->repository_name().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("repository_name \"", absl::CHexEscape(request->repository_name()),
                                       "\": collabserve serves one model repository; leave it empty"));
    }
    // Answered while the server drains or after its GPU failed too, as ModelStatistics.
    const Attached a = attached();
    if (a.repository == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "collabserve is still loading its models");
    }
    for (const auto& [model, versions] : a.repository->List()) {
      for (const auto& v : versions) {
        if (request->ready() &&
            v.state != repository::ModelRepository::VersionStatus::State::kAvailable) {
          continue;
        }
        inference::RepositoryIndexResponse::ModelIndex* index = response->add_models();
        index->set_name(model);
        DescribeVersion(v, index);
      }
    }
    return grpc::Status::OK;
  });
}

namespace {

// `verb` "load" or "unload"; `rpc` the Admin RPC that does it.
grpc::Status RefuseModelControl(const char* verb, const char* rpc, const std::string& model) {
  return grpc::Status(
      grpc::StatusCode::FAILED_PRECONDITION,
      absl::StrCat("explicit model load / unload is not allowed: collabserve polls its model "
                   "repository, and an admin ", verb, "s a version of \"", absl::CHexEscape(model),
                   "\" with collabserve.v1.Admin/", rpc, " (admin token)"));
}

}  // namespace

grpc::ServerUnaryReactor* KServeService::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
    inference::RepositoryModelLoadResponse* response) {
  return FinishUnary(context,
                     [&] { return RefuseModelControl("load", "LoadModel", request->model_name()); });
}

grpc::ServerUnaryReactor* KServeService::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
    inference::RepositoryModelUnloadResponse* response) {
  return FinishUnary(
      context, [&] { return RefuseModelControl("unload", "UnloadModel", request->model_name()); });
}

grpc::ServerUnaryReactor* KServeService::ModelInfer(grpc::CallbackServerContext* context,
                                                    const inference::ModelInferRequest* request,
                                                    inference::ModelInferResponse* response) {
  const absl::Time arrival = absl::Now();
  auto* reactor = new InferReactor();
  const Attached a = attached();
  // Failures found here never reach StartClassify; count them as it counts its own.
  auto reject = [&](const grpc::Status& status, const std::string& model,
                    const std::string& version) {
    VLOG(1) << "ModelInfer(" << request->model_name() << ") rejected: " << status.error_message();
    if (a.metrics != nullptr) a.metrics->CountRequest(model, version, CodeName(status.error_code()));
    reactor->Finish(status);
    return reactor;
  };
  // Only refusals need it (a repository lookup).
  auto label = [&] {
    return a.inference != nullptr ? a.inference->ModelLabel(request->model_name()) : std::string();
  };
  grpc::Status serving = CheckServing(a);
  if (!serving.ok()) return reject(serving, label(), "");
  auto resolved = Resolve(a.repository, request->model_name(), request->model_version());
  if (!resolved.ok()) return reject(ToGrpcStatus(resolved.status()), label(), "");
  std::shared_ptr<ModelServable> servable = std::move(resolved).value();
  const std::string& model = servable->id().model;
  const std::string version = std::to_string(servable->id().version);
  auto parsed = ParseInfer(*request, a.inference->options().max_inputs_per_request);
  if (!parsed.ok()) {
    servable->statistics().RecordFailure(absl::Now() - arrival);
    return reject(ToGrpcStatus(parsed.status()), model, version);
  }

  // The resolved version answers (StartClassify takes it as it is, so that a swap between two
  // lookups cannot fail the call), and the labels below describe it.
  v1::ClassifyRequest classify;
  classify.set_model_name(model);
  classify.set_model_version(servable->id().version);
  classify.mutable_options()->set_truncate(parsed->truncate);
  for (size_t i = 0; i < parsed->texts.size(); ++i) {
    v1::Input* in = classify.add_inputs();
    in->set_text(std::move(parsed->texts[i]));
    if (parsed->pairs.has_value()) in->set_text_pair(std::move((*parsed->pairs)[i]));
  }
  response->set_id(request->id());
  // The `timeout` parameter works as a deadline of its own; the earlier one applies.
  absl::Time deadline = ToAbslTime(context->deadline());
  if (parsed->timeout.has_value()) deadline = std::min(deadline, absl::Now() + *parsed->timeout);
  auto shared = std::make_shared<ParsedInfer>(std::move(parsed).value());
  a.inference->StartClassify(
      classify, deadline, reactor->cancelled(),
      [reactor, response, servable, shared](const grpc::Status& status,
                                            v1::ClassifyResponse* result) {
        if (!status.ok() || result == nullptr) {
          reactor->Finish(status.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "no result")
                                      : InTensorTerms(status, shared->pairs.has_value()));
          return;
        }
        absl::Status built = BuildResponse(*shared, servable->info(), *result, response);
        reactor->Finish(ToGrpcStatus(built));
      },
      servable);
  return reactor;
}

absl::Status DecodeRawBytes(const std::string& raw, int64_t count, const std::string& name,
                            std::vector<std::string>* out) {
  out->clear();
  size_t pos = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (raw.size() - pos < 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", name, "': raw_input_contents ends after ", i, " of ", count,
          " BYTES elements (each element is a 4-byte little-endian length, then its bytes)"));
    }
    const auto* p = reinterpret_cast<const unsigned char*>(raw.data() + pos);
    const uint32_t len = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
    pos += 4;
    if (len > raw.size() - pos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input '", name, "': element ", i, " of raw_input_contents claims ", len,
          " bytes but only ", raw.size() - pos, " remain"));
    }
    out->emplace_back(raw, pos, len);
    pos += len;
  }
  if (pos != raw.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input '", name, "': raw_input_contents has ", raw.size() - pos,
        " bytes left over after the ", count, " BYTES elements its shape ",
        "calls for (each element is a 4-byte little-endian length, then its bytes)"));
  }
  return absl::OkStatus();
}

void AppendRawBytes(const std::string& element, std::string* raw) {
  const uint32_t len = static_cast<uint32_t>(element.size());
  const char prefix[4] = {static_cast<char>(len & 0xff), static_cast<char>((len >> 8) & 0xff),
                          static_cast<char>((len >> 16) & 0xff),
                          static_cast<char>((len >> 24) & 0xff)};
  raw->append(prefix, 4);
  raw->append(element);
}

}  // namespace collabserve::service
