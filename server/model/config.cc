#include "server/model/config.h"

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/text/bert_tokenizer.h"
#include "server/util/files.h"
#include "server/util/json_error.h"
#include "server/util/status_macros.h"

namespace collabserve::model {
namespace {

using json = nlohmann::json;

// Limits that keep a hostile config from asking for absurd allocations before any weight is read.
constexpr int64_t kMaxVocab = 1 << 22;
constexpr int64_t kMaxHidden = 1 << 14;
constexpr int64_t kMaxLayers = 256;
constexpr int64_t kMaxPositions = 1 << 16;
constexpr int64_t kMaxLabels = 1 << 16;
// Each field bound above still allows combinations of hundreds of GB (vocab 4M x hidden 16384 alone
// is 2^36 parameters), so the whole model is bounded too: 2^32 parameters, 16 GiB as float32.
constexpr int64_t kMaxParameters = int64_t{1} << 32;

// Parameters of BertForSequenceClassification with this config (standard attention), plus what the
// collaborative layers add (shared W_Q/W_K of hidden x rank and a head-mixing matrix). Every factor
// is bounded by the field limits, so this cannot overflow int64.
int64_t ParameterCount(const BertConfig& c) {
  const int64_t h = c.hidden_size, i = c.intermediate_size;
  int64_t n = (int64_t{c.vocab_size} + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h;
  const int64_t layer = 4 * (h * h + h) + 2 * h + h * i + i + i * h + h + 2 * h;
  n += c.num_hidden_layers * layer;
  for (int rank : c.collaborative.ranks) n += 2 * h * rank + int64_t{c.num_attention_heads} * rank;
  n += h * h + h;                                      // pooler
  n += h * c.num_labels() + c.num_labels();            // classifier
  return n;
}

absl::Status Invalid(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
}

// A JSON value for an error message. Containers are named, not dumped: dump() recurses once per
// nesting level, so a config nested 30000 deep overflowed the stack (reproducers in
// tests/fuzz/regressions/config_json); long strings are cut so a message stays readable.
std::string Describe(const json& v) {
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  std::string s = v.dump();
  if (s.size() > 80) {
    size_t cut = 80;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // UTF-8 boundary
    s = s.substr(0, cut) + "...";
  }
  return s;
}

absl::StatusOr<int> GetInt(const json& j, const char* key, int def, int64_t lo, int64_t hi,
                           absl::string_view name) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number_integer()) return Invalid(name, absl::StrCat("'", key, "' must be an integer"));
  int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return Invalid(name, absl::StrCat("'", key, "' = ", v, " is outside [", lo, ", ", hi, "]"));
  }
  return static_cast<int>(v);
}

}  // namespace

absl::string_view ActivationName(Activation a) {
  switch (a) {
    case Activation::kGelu: return "gelu";
    case Activation::kGeluNew: return "gelu_new";
    case Activation::kGeluPytorchTanh: return "gelu_pytorch_tanh";
    case Activation::kRelu: return "relu";
  }
  return "gelu";
}

OutputFunction BertConfig::output_function() const {
  if (problem_type == ProblemType::kRegression) return OutputFunction::kNone;
  if (problem_type == ProblemType::kMultiLabel || num_labels() == 1) return OutputFunction::kSigmoid;
  return OutputFunction::kSoftmax;
}

absl::StatusOr<BertConfig> BertConfig::Parse(absl::string_view text, absl::string_view name) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return util::JsonSyntaxError(text, name);
  if (!j.is_object()) return Invalid(name, "must be a JSON object");
  BertConfig c;

  if (auto it = j.find("model_type"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "bert") {
      return absl::UnimplementedError(absl::StrCat(name, ": model_type ", Describe(*it),
                                                   " is not supported (only \"bert\")"));
    }
  }
  // Hugging Face's AutoTokenizer falls back on this one when tokenizer_config.json names none.
  if (auto it = j.find("tokenizer_class"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || !text::BertTokenizer::IsSupportedClass(it->get<std::string>())) {
      return absl::UnimplementedError(absl::StrCat(
          name, ": tokenizer_class ", Describe(*it),
          " is not supported; collabserve tokenizes as BertTokenizer / BertTokenizerFast do"));
    }
  }
  if (auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return Invalid(name, "'architectures' must be a list");
    for (const auto& a : *it) {
      if (!a.is_string() || (a != "BertForSequenceClassification")) {
        return absl::UnimplementedError(
            absl::StrCat(name, ": architecture ", Describe(a),
                         " is not supported (only BertForSequenceClassification)"));
      }
    }
  }
  if (auto it = j.find("position_embedding_type"); it != j.end() && !it->is_null()) {
    if (*it != "absolute") {
      return absl::UnimplementedError(absl::StrCat(
          name, ": position_embedding_type ", Describe(*it), " is not supported (only \"absolute\")"));
    }
  }
  for (const char* flag : {"is_decoder", "add_cross_attention"}) {
    if (auto it = j.find(flag); it != j.end() && it->is_boolean() && it->get<bool>()) {
      return absl::UnimplementedError(absl::StrCat(name, ": '", flag, "' = true is not supported"));
    }
  }

  ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size", 30522, 1, kMaxVocab, name));
  ASSIGN_OR_RETURN(c.hidden_size, GetInt(j, "hidden_size", 768, 1, kMaxHidden, name));
  ASSIGN_OR_RETURN(c.num_hidden_layers, GetInt(j, "num_hidden_layers", 12, 1, kMaxLayers, name));
  ASSIGN_OR_RETURN(c.num_attention_heads, GetInt(j, "num_attention_heads", 12, 1, kMaxHidden, name));
  ASSIGN_OR_RETURN(c.intermediate_size, GetInt(j, "intermediate_size", 3072, 1, 4 * kMaxHidden, name));
  ASSIGN_OR_RETURN(c.max_position_embeddings,
                   GetInt(j, "max_position_embeddings", 512, 1, kMaxPositions, name));
  ASSIGN_OR_RETURN(c.type_vocab_size, GetInt(j, "type_vocab_size", 2, 1, 1 << 10, name));
  ASSIGN_OR_RETURN(c.pad_token_id, GetInt(j, "pad_token_id", 0, 0, kMaxVocab, name));
  // Padded rows and positions hold this id, so a batch of several lengths looks it up (nn.Embedding
  // refuses such a padding_idx too).
  if (c.pad_token_id >= c.vocab_size) {
    return Invalid(name, absl::StrCat("'pad_token_id' = ", c.pad_token_id,
                                      " is not a token id (vocab_size is ", c.vocab_size, ")"));
  }
  if (c.hidden_size % c.num_attention_heads != 0) {
    return Invalid(name, absl::StrCat("hidden_size ", c.hidden_size,
                                      " is not a multiple of num_attention_heads ",
                                      c.num_attention_heads));
  }
  if (auto it = j.find("layer_norm_eps"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() <= 0) return Invalid(name, "'layer_norm_eps' must be > 0");
    c.layer_norm_eps = it->get<double>();
  }
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    std::string act = it->is_string() ? it->get<std::string>() : Describe(*it);
    if (act == "gelu") c.hidden_act = Activation::kGelu;
    else if (act == "gelu_new" || act == "gelu_fast") c.hidden_act = Activation::kGeluNew;
    else if (act == "gelu_pytorch_tanh") c.hidden_act = Activation::kGeluPytorchTanh;
    else if (act == "relu") c.hidden_act = Activation::kRelu;
    else {
      return absl::UnimplementedError(absl::StrCat(
          name, ": hidden_act '", act, "' is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)"));
    }
  }

  // Labels: id2label (keys are decimal strings), else num_labels, else HF's default of 2.
  if (auto it = j.find("id2label"); it != j.end() && !it->is_null()) {
    if (!it->is_object() || it->empty()) return Invalid(name, "'id2label' must be a non-empty object");
    if (it->size() > kMaxLabels) return Invalid(name, "'id2label' has too many labels");
    c.id2label.assign(it->size(), "");
    std::vector<bool> seen(it->size(), false);
    for (const auto& [k, v] : it->items()) {
      size_t pos = 0;
      long id = -1;
      try { id = std::stol(k, &pos); } catch (...) { pos = 0; }
      if (pos != k.size() || id < 0 || id >= static_cast<long>(c.id2label.size()) || seen[id]) {
        return Invalid(name, absl::StrCat("'id2label' key '", k, "' is not an id in [0, ",
                                          c.id2label.size(), ") or is repeated"));
      }
      if (!v.is_string()) return Invalid(name, absl::StrCat("'id2label'[", k, "] must be a string"));
      seen[id] = true;
      c.id2label[id] = v.get<std::string>();
    }
  } else {
    ASSIGN_OR_RETURN(int n, GetInt(j, "num_labels", 2, 1, kMaxLabels, name));
    for (int i = 0; i < n; ++i) c.id2label.push_back(absl::StrCat("LABEL_", i));
  }

  if (auto it = j.find("problem_type"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return Invalid(name, "'problem_type' must be a string");
    c.problem_type_name = it->get<std::string>();
    if (c.problem_type_name == "single_label_classification") c.problem_type = ProblemType::kSingleLabel;
    else if (c.problem_type_name == "multi_label_classification") c.problem_type = ProblemType::kMultiLabel;
    else if (c.problem_type_name == "regression") c.problem_type = ProblemType::kRegression;
    else return Invalid(name, absl::StrCat("unknown problem_type '", c.problem_type_name, "'"));
  }

  if (auto it = j.find("collaborative"); it != j.end() && !it->is_null()) {
    const json& cj = *it;
    if (!cj.is_object()) return Invalid(name, "'collaborative' must be an object");
    // Version 1 is the form this code writes and runs; a later one may compute something else.
    if (auto v = cj.find("format_version"); v != cj.end() && !(v->is_number_integer() && v->get<int64_t>() == 1)) {
      return absl::UnimplementedError(absl::StrCat(
          name, ": 'collaborative.format_version' is ", Describe(*v),
          "; this collabserve reads version 1 (a newer collabserve wrote this checkpoint?)"));
    }
    auto ranks = cj.find("ranks");
    if (ranks == cj.end() || !ranks->is_array()) return Invalid(name, "'collaborative.ranks' must be a list");
    if (static_cast<int>(ranks->size()) != c.num_hidden_layers) {
      return Invalid(name, absl::StrCat("'collaborative.ranks' has ", ranks->size(),
                                        " entries but the model has ", c.num_hidden_layers, " layers"));
    }
    for (const auto& r : *ranks) {
      if (!r.is_number_integer() || r.get<int64_t>() < 0 || r.get<int64_t>() > kMaxHidden * 4) {
        return Invalid(name, absl::StrCat("'collaborative.ranks' entry ", Describe(r), " is not a valid rank"));
      }
      c.collaborative.ranks.push_back(r.get<int>());
    }
    if (auto s = cj.find("source"); s != cj.end() && s->is_string()) c.collaborative.source = *s;
    if (auto s = cj.find("algorithm"); s != cj.end() && s->is_string()) c.collaborative.algorithm = *s;
    if (auto e = cj.find("errors"); e != cj.end() && e->is_array()) {
      for (const auto& x : *e) c.collaborative.errors.push_back(x.is_number() ? x.get<double>() : -1.0);
    }
    if (auto f = cj.find("fidelity"); f != cj.end() && !f->is_null()) {
      if (!f->is_object()) return Invalid(name, "'collaborative.fidelity' must be an object");
      CollaborativeConfig::Fidelity fid;
      // Each figure: a finite number in [lo, hi] (`range` says so in the error).
      auto number = [&](const char* key, double lo, double hi, const char* range,
                        double* out) -> absl::Status {
        auto it = f->find(key);
        if (it == f->end() || !it->is_number() || !std::isfinite(it->get<double>()) ||
            it->get<double>() < lo || it->get<double>() > hi) {
          return Invalid(name, absl::StrCat("'collaborative.fidelity.", key, "' must be ", range, ", not ",
                                            it == f->end() ? std::string("nothing") : Describe(*it)));
        }
        *out = it->get<double>();
        return absl::OkStatus();
      };
      auto probes = f->find("probes");
      if (probes == f->end() || !probes->is_number_integer() || probes->get<int64_t>() < 0 ||
          probes->get<int64_t>() > std::numeric_limits<int>::max()) {
        return Invalid(name, absl::StrCat("'collaborative.fidelity.probes' must be a non-negative integer, not ",
                                          probes == f->end() ? std::string("nothing") : Describe(*probes)));
      }
      fid.probes = probes->get<int>();
      const double inf = std::numeric_limits<double>::infinity();
      RETURN_IF_ERROR(number("top1_agreement", 0, 1, "a number in [0, 1]", &fid.top1_agreement));
      RETURN_IF_ERROR(number("max_abs_logit_diff", 0, inf, "a finite number >= 0", &fid.max_abs_logit_diff));
      RETURN_IF_ERROR(number("mean_kl", 0, inf, "a finite number >= 0", &fid.mean_kl));
      c.collaborative.fidelity = fid;
    }
  }
  if (const int64_t n = ParameterCount(c); n > kMaxParameters) {
    return Invalid(name, absl::StrCat("the model would have ", n, " parameters (",
                                      n * 4 / (int64_t{1} << 30), " GiB as float32), over the limit of ",
                                      kMaxParameters, "; vocab_size ", c.vocab_size, ", hidden_size ",
                                      c.hidden_size, ", num_hidden_layers ", c.num_hidden_layers,
                                      ", intermediate_size ", c.intermediate_size));
  }
  return c;
}

absl::StatusOr<BertConfig> BertConfig::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, util::ReadFile(path, 16 << 20));
  return Parse(text, path);
}

std::string BertConfig::ToJson() const {
  json j;
  j["architectures"] = {"BertForSequenceClassification"};
  j["model_type"] = "bert";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["intermediate_size"] = intermediate_size;
  j["hidden_act"] = std::string(ActivationName(hidden_act));
  j["hidden_dropout_prob"] = 0.1;
  j["attention_probs_dropout_prob"] = 0.1;
  j["layer_norm_eps"] = layer_norm_eps;
  j["max_position_embeddings"] = max_position_embeddings;
  j["type_vocab_size"] = type_vocab_size;
  j["pad_token_id"] = pad_token_id;
  j["position_embedding_type"] = "absolute";
  j["initializer_range"] = 0.02;
  json id2l = json::object(), l2id = json::object();
  for (size_t i = 0; i < id2label.size(); ++i) {
    id2l[std::to_string(i)] = id2label[i];
    l2id[id2label[i]] = i;
  }
  j["id2label"] = id2l;
  j["label2id"] = l2id;
  if (!problem_type_name.empty()) j["problem_type"] = problem_type_name;
  if (collaborative.present()) {
    json cj;
    cj["format_version"] = 1;
    cj["ranks"] = collaborative.ranks;
    cj["source"] = collaborative.source;
    cj["algorithm"] = collaborative.algorithm;
    cj["errors"] = collaborative.errors;
    if (const auto& f = collaborative.fidelity) {
      cj["fidelity"] = {{"probes", f->probes},
                        {"top1_agreement", f->top1_agreement},
                        {"max_abs_logit_diff", f->max_abs_logit_diff},
                        {"mean_kl", f->mean_kl}};
    }
    j["collaborative"] = cj;
  }
  return j.dump(2) + "\n";
}

}  // namespace collabserve::model
