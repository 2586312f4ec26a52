// collabserve-model: the offline tool. JSON lines in, JSON lines out.
//   make      --out DIR [--preset tiny|mini|base] [--layers --hidden --heads --intermediate --labels
//             --label_names --seed --planted_rank --planted_noise --hidden_act --problem_type]
//             [--format safetensors|bin] [--dtype f32|f16|bf16] [--vocab FILE]
//   tokenize  --model DIR [--max_length N]        stdin {"text", "text_pair"} → {"input_ids", "token_type_ids"}
//   predict   --model DIR [--batch_size B] [--device D] [--dtype T]
//             stdin {"text", "text_pair"} or {"input_ids", "token_type_ids"} → {"label", "logits", "probabilities"}
//   evaluate  --model DIR --data FILE [--reference DIR] [--batch_size B] [--device D] [--dtype T]
//             FILE: {"text", "text_pair"?, "label"?} lines → accuracy; with a reference model, the
//             agreement, mean KL and max |Δ logit| against it, as the compression measures them
//             (FidelityReport: per-label decisions and Bernoulli KLs for sigmoid outputs; null for regression)
//   inspect   --model DIR                          → parameter counts, layers, heads, ranks
//   compress  --model IN --out OUT (--rank R | --ratio X | --ranks r1,... | --max_error E |
//             --target_agreement A | --max_kl K) [--calibration FILE] ...
#include <glog/logging.h>

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/compress/collaborative.h"
#include "server/model/bert.h"
#include "server/model/checkpoint_maker.h"
#include "server/model/config.h"
#include "server/model/engine.h"
#include "server/model/param_counts.h"
#include "server/text/bert_tokenizer.h"
#include "server/tools/commands.h"
#include "server/tools/flags.h"
#include "server/util/files.h"
#include "server/util/json_error.h"
#include "server/util/process_env.h"
#include "server/util/status_macros.h"

namespace collabserve::tools {
namespace {

using json = nlohmann::json;

absl::Status Make(int argc, char** argv) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(argc, argv, 2,
                                         {"out", "preset", "layers", "hidden", "heads", "intermediate",
                                          "labels", "seed", "format", "dtype", "vocab", "planted_rank",
                                          "planted_noise", "hidden_act", "problem_type", "label_names"}));
  if (!f.Has("out")) return absl::InvalidArgumentError("--out DIR is required");
  model::MakeOptions o;
  o.preset = f.Get("preset", "tiny");
  ASSIGN_OR_RETURN(o.layers, f.GetInt("layers", 0));
  ASSIGN_OR_RETURN(o.hidden, f.GetInt("hidden", 0));
  ASSIGN_OR_RETURN(o.heads, f.GetInt("heads", 0));
  ASSIGN_OR_RETURN(o.intermediate, f.GetInt("intermediate", 0));
  ASSIGN_OR_RETURN(o.labels, f.GetInt("labels", 2));
  ASSIGN_OR_RETURN(int64_t seed, f.GetInt64("seed", 0));
  ASSIGN_OR_RETURN(o.planted_rank, f.GetInt("planted_rank", 0));
  ASSIGN_OR_RETURN(o.planted_noise, f.GetDouble("planted_noise", 0.05));
  if (!(o.planted_noise >= 0) || !std::isfinite(o.planted_noise)) {
    return absl::InvalidArgumentError(absl::StrCat("--planted_noise must be a finite number >= 0, got ", f.Get("planted_noise")));
  }
  o.seed = static_cast<uint64_t>(seed);
  o.vocab_path = f.Get("vocab");
  o.hidden_act = f.Get("hidden_act", "gelu");
  o.problem_type = f.Get("problem_type");
  if (f.Has("label_names")) {
    o.label_names = absl::StrSplit(f.Get("label_names"), ',');
    std::set<std::string> seen;
    for (const std::string& name : o.label_names) {
      if (name.empty() || !seen.insert(name).second) {
        return absl::InvalidArgumentError(absl::StrCat("--label_names '", f.Get("label_names"), "': ",
                                                       name.empty() ? "a name is empty" : "'" + name + "' comes twice"));
      }
    }
    if (f.Has("labels") && o.labels != static_cast<int>(o.label_names.size())) {
      return absl::InvalidArgumentError(absl::StrCat("--labels ", o.labels, " but --label_names has ",
                                                     o.label_names.size(), " names"));
    }
  }
  std::string format = f.Get("format", "safetensors");
  if (format == "safetensors") o.format = model::WeightFormat::kSafetensors;
  else if (format == "bin") o.format = model::WeightFormat::kTorchBin;
  else return absl::InvalidArgumentError(absl::StrCat("--format '", format, "' is not safetensors or bin"));
  std::string dtype = f.Get("dtype", "f32");
  // predict's and the server's spellings too.
  if (dtype == "float32") dtype = "f32";
  if (dtype == "float16") dtype = "f16";
  if (dtype == "bfloat16") dtype = "bf16";
  if (dtype == "f32") o.dtype = model::WeightDType::kF32;
  else if (dtype == "f16") o.dtype = model::WeightDType::kF16;
  else if (dtype == "bf16") o.dtype = model::WeightDType::kBF16;
  else return absl::InvalidArgumentError(absl::StrCat("--dtype '", dtype, "' is not f32, f16 or bf16 (or float32, float16, bfloat16)"));
  if (o.dtype != model::WeightDType::kF32 && o.format != model::WeightFormat::kSafetensors) {
    return absl::InvalidArgumentError("--dtype f16/bf16 is only written as safetensors");
  }
  // Like compress: a new directory, written in a temporary sibling and renamed into place, so that a
  // failure (or an existing checkpoint) never leaves a mix of files behind.
  const std::filesystem::path out = util::DirectoryName(f.Get("out"));
  std::error_code ec;
  if (std::filesystem::exists(out, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(f.Get("out"), ": already exists; choose a new output directory"));
  }
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path(), ec);
  const std::string tmp = absl::StrCat(out.string(), ".tmp-", ::getpid());
  std::filesystem::remove_all(tmp, ec);
  absl::Status made = model::MakeCheckpoint(tmp, o);
  if (made.ok() && ::rename(tmp.c_str(), out.c_str()) != 0) {
    made = absl::FailedPreconditionError(absl::StrCat(f.Get("out"), ": cannot create: ", std::strerror(errno)));
  }
  if (!made.ok()) {
    std::filesystem::remove_all(tmp, ec);
    return made;
  }
  std::cout << json{{"out", f.Get("out")}, {"preset", o.preset}, {"format", format}, {"dtype", dtype}}.dump()
            << std::endl;
  return absl::OkStatus();
}

// Reads JSON lines from stdin and calls `fn` on each object; errors are printed as
// {"error": "..."} lines in place of the result, and make the command's status an error.
// `before_error` runs before an error line is printed, so that results buffered for earlier lines
// come out first.
template <typename Fn>
absl::Status ForEachLine(Fn fn, const std::function<absl::Status()>& before_error = nullptr) {
  std::string line;
  int64_t n = 0, failed = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    absl::Status s;
    if (j.is_discarded()) {
      s = util::JsonSyntaxError(line, "");
    } else if (!j.is_object()) {
      s = absl::InvalidArgumentError("not a JSON object");
    } else {
      s = fn(j);
    }
    if (!s.ok()) {
      ++failed;
      if (before_error) {
        absl::Status f = before_error();
        if (!f.ok()) return f;
      }
      std::cout << json{{"error", absl::StrCat("line ", n, ": ", s.message())}}.dump() << "\n";
    }
  }
  std::cout.flush();
  if (failed) return absl::InvalidArgumentError(absl::StrCat(failed, " of ", n, " input lines failed"));
  return absl::OkStatus();
}

absl::StatusOr<std::string> GetString(const json& j, const char* key, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("missing \"", key, "\""));
    return std::string();
  }
  if (!it->is_string()) return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be a string"));
  return it->get<std::string>();
}

// j[key] as a list of 32-bit integers (a value that does not fit is refused, not wrapped).
absl::StatusOr<std::vector<int32_t>> Int32List(const json& j, const char* key) {
  const json& list = j[key];
  const auto error = [&] { return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be a list of integers")); };
  if (!list.is_array()) return error();
  std::vector<int32_t> out;
  for (const auto& x : list) {
    if (!x.is_number_integer()) return error();
    const bool fits = x.is_number_unsigned()
                          ? x.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
                          : x.get<int64_t>() >= std::numeric_limits<int32_t>::min() &&
                                x.get<int64_t>() <= std::numeric_limits<int32_t>::max();
    if (!fits) return absl::InvalidArgumentError(absl::StrCat("\"", key, "\": ", x.dump(), " is out of range"));
    out.push_back(x.get<int32_t>());
  }
  return out;
}

absl::StatusOr<model::TokenizedInput> ToInput(const json& j, const text::BertTokenizer& tok, int max_length) {
  model::TokenizedInput in;
  if (j.contains("input_ids")) {
    ASSIGN_OR_RETURN(in.input_ids, Int32List(j, "input_ids"));
    if (j.contains("token_type_ids")) {
      ASSIGN_OR_RETURN(in.token_type_ids, Int32List(j, "token_type_ids"));
    }
    return in;
  }
  ASSIGN_OR_RETURN(std::string text, GetString(j, "text", true));
  ASSIGN_OR_RETURN(std::string pair, GetString(j, "text_pair", false));
  std::optional<std::string_view> p;
  if (j.contains("text_pair") && !j["text_pair"].is_null()) p = pair;
  ASSIGN_OR_RETURN(text::Encoding e, tok.Encode(text, p, max_length, /*truncate=*/true));
  in.input_ids = std::move(e.input_ids);
  in.token_type_ids = std::move(e.token_type_ids);
  return in;
}

absl::Status Tokenize(int argc, char** argv) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(argc, argv, 2, {"model", "max_length"}));
  if (!f.Has("model")) return absl::InvalidArgumentError("--model DIR is required");
  ASSIGN_OR_RETURN(const int max_length, f.GetInt("max_length", 0));
  ASSIGN_OR_RETURN(auto tok, text::BertTokenizer::FromDirectory(f.Get("model")));
  return ForEachLine([&](const json& j) -> absl::Status {
    ASSIGN_OR_RETURN(model::TokenizedInput in, ToInput(j, *tok, max_length));
    std::cout << json{{"input_ids", in.input_ids}, {"token_type_ids", in.token_type_ids}}.dump() << "\n";
    return absl::OkStatus();
  });
}

json PredictionJson(const model::Prediction& p, const model::ModelInfo& info) {
  return json{{"label", info.labels[p.label]}, {"logits", p.logits}, {"probabilities", p.probabilities}};
}

// --device / --dtype of predict and evaluate. Also gives ATen every CPU: one pass at a time over
// all of them, as a server batch thread with the whole machine runs it (LibTorch's own default
// here is one thread).
model::EngineOptions InferenceOptions(const Flags& f) {
  at::set_num_threads(util::UsableCpus());
  model::EngineOptions eo;
  eo.device = f.Get("device", "cpu");
  eo.dtype = f.Get("dtype", "float32");
  return eo;
}

absl::Status Predict(int argc, char** argv) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(argc, argv, 2, {"model", "batch_size", "device", "dtype"}));
  if (!f.Has("model")) return absl::InvalidArgumentError("--model DIR is required");
  ASSIGN_OR_RETURN(int64_t batch_size, f.GetInt("batch_size", 8));
  if (batch_size < 1) return absl::InvalidArgumentError("--batch_size must be at least 1");
  const model::EngineOptions eo = InferenceOptions(f);
  ASSIGN_OR_RETURN(auto engine, model::Engine::Load(f.Get("model"), eo));
  std::vector<model::TokenizedInput> pending;
  auto flush = [&]() -> absl::Status {
    if (pending.empty()) return absl::OkStatus();
    auto preds = engine->Run(pending);
    pending.clear();
    if (!preds.ok()) return preds.status();
    for (const auto& p : *preds) std::cout << PredictionJson(p, engine->info()).dump() << "\n";
    return absl::OkStatus();
  };
  absl::Status st = ForEachLine([&](const json& j) -> absl::Status {
    // A bad line must be reported in its place: flush what came before it first. The engine's own
    // checks run here, line by line, so that a bad input never fails the batch of good ones.
    ASSIGN_OR_RETURN(model::TokenizedInput in, ToInput(j, engine->tokenizer(), 0));
    RETURN_IF_ERROR(engine->CheckInput(in));
    pending.push_back(std::move(in));
    if (static_cast<int64_t>(pending.size()) >= batch_size) return flush();
    return absl::OkStatus();
  }, flush);
  RETURN_IF_ERROR(flush());
  std::cout.flush();
  return st;
}

// A labelled data set in JSON lines: {"text", "text_pair"?, "label"?}; each input checked by the
// engine and each label one of its labels. Errors name FILE:LINE.
struct Example {
  model::TokenizedInput input;
  std::string label;  // empty: unlabelled
};

absl::StatusOr<std::vector<Example>> ReadExamples(const std::string& path, const model::Engine& engine) {
  const std::vector<std::string>& labels = engine.info().labels;
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::vector<Example> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return util::JsonSyntaxError(line, absl::StrCat(path, ":", n));
    if (!j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": not a JSON object"));
    }
    Example e;
    auto input = ToInput(j, engine.tokenizer(), 0);
    absl::Status checked = input.ok() ? engine.CheckInput(*input) : input.status();
    if (!checked.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", checked.message()));
    e.input = *std::move(input);
    auto label = GetString(j, "label", false);
    if (!label.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", label.status().message()));
    e.label = *std::move(label);
    if (!e.label.empty() && std::find(labels.begin(), labels.end(), e.label) == labels.end()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": label '", e.label,
                                                     "' is not one of the model's (", absl::StrJoin(labels, ", "), ")"));
    }
    out.push_back(std::move(e));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  return out;
}

// Every example's prediction, `batch_size` at a time in order of length (little padding).
absl::StatusOr<std::vector<model::Prediction>> PredictAll(const model::Engine& engine,
                                                          const std::vector<Example>& examples,
                                                          int64_t batch_size) {
  std::vector<size_t> order(examples.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return examples[a].input.input_ids.size() < examples[b].input.input_ids.size();
  });
  std::vector<model::Prediction> out(examples.size());
  std::vector<const model::TokenizedInput*> batch;
  for (size_t start = 0; start < order.size(); start += static_cast<size_t>(batch_size)) {
    batch.clear();
    const size_t end = std::min(order.size(), start + static_cast<size_t>(batch_size));
    for (size_t k = start; k < end; ++k) batch.push_back(&examples[order[k]].input);
    ASSIGN_OR_RETURN(std::vector<model::Prediction> preds, engine.Run(batch));
    for (size_t k = start; k < end; ++k) out[order[k]] = std::move(preds[k - start]);
  }
  return out;
}

absl::Status Evaluate(int argc, char** argv) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(argc, argv, 2,
                                         {"model", "data", "reference", "batch_size", "device", "dtype"}));
  if (!f.Has("model")) return absl::InvalidArgumentError("--model DIR is required");
  if (!f.Has("data")) return absl::InvalidArgumentError("--data FILE (JSON lines) is required");
  ASSIGN_OR_RETURN(int64_t batch_size, f.GetInt("batch_size", 32));
  if (batch_size < 1) return absl::InvalidArgumentError("--batch_size must be at least 1");
  const model::EngineOptions eo = InferenceOptions(f);
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(auto engine, model::Engine::Load(f.Get("model"), eo));
  ASSIGN_OR_RETURN(std::vector<Example> examples, ReadExamples(f.Get("data"), *engine));
  ASSIGN_OR_RETURN(std::vector<model::Prediction> preds, PredictAll(*engine, examples, batch_size));
  const std::vector<std::string>& labels = engine->info().labels;
  int64_t labelled = 0, correct = 0;
  for (size_t i = 0; i < examples.size(); ++i) {
    if (examples[i].label.empty()) continue;  // ReadExamples checked the others
    ++labelled;
    correct += labels[preds[i].label] == examples[i].label;
  }
  json out{{"model", f.Get("model")}, {"data", f.Get("data")}, {"examples", examples.size()},
           {"labelled", labelled}};
  if (labelled > 0) out["accuracy"] = static_cast<double>(correct) / labelled;
  if (f.Has("reference")) {
    ASSIGN_OR_RETURN(auto ref, model::Engine::Load(f.Get("reference"), eo));
    if (ref->info().labels != labels) {
      return absl::InvalidArgumentError("--reference has other labels than --model");
    }
    ASSIGN_OR_RETURN(std::vector<model::Prediction> rp, PredictAll(*ref, examples, batch_size));
    // Compared as the reference serves its outputs (softmax, sigmoid per label, or regression), as
    // the compression measures it.
    const model::OutputFunction fn = ref->classifier().config().output_function();
    std::vector<std::vector<float>> a(examples.size()), b(examples.size());
    for (size_t i = 0; i < examples.size(); ++i) {
      a[i] = std::move(rp[i].logits);
      b[i] = std::move(preds[i].logits);
    }
    ASSIGN_OR_RETURN(compress::FidelityReport fid, compress::CompareLogitRows(a, b, fn));
    out["reference"] = f.Get("reference");
    out["top1_agreement"] = fid.top1_agreement;  // NaN (null) for a regression model
    out["top1_agreement_lower95"] = fid.agreement_lower95;
    out["mean_kl"] = fid.mean_kl;
    out["max_abs_logit_diff"] = fid.max_abs_logit_diff;
  }
  out["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << out.dump() << std::endl;
  return absl::OkStatus();
}

absl::Status Inspect(int argc, char** argv) {
  ASSIGN_OR_RETURN(Flags f, Flags::Parse(argc, argv, 2, {"model"}));
  if (!f.Has("model")) return absl::InvalidArgumentError("--model DIR is required");
  std::string dir = f.Get("model");
  ASSIGN_OR_RETURN(model::BertConfig config, model::BertConfig::FromFile(util::JoinPath(dir, "config.json")));
  ASSIGN_OR_RETURN(auto classifier, model::LoadClassifier(dir, config));
  model::ParamCounts p = model::CountParams(*classifier);
  ASSIGN_OR_RETURN(std::string weights, model::FindWeightsFile(dir));
  json layers = json::array();
  const int64_t std_qk = model::StandardQkParamsPerLayer(config);
  for (int i = 0; i < config.num_hidden_layers; ++i) {
    const auto& l = classifier->layers()[i];
    int64_t qk = l.collaborative
                     ? l.collab_query_w.numel() + l.collab_key_w.numel() + l.mixing.numel() + l.content_bias.numel()
                     : l.query_w.numel() + l.query_b.numel() + l.key_w.numel() + l.key_b.numel();
    json lj{{"layer", i}, {"attention", l.collaborative ? "collaborative" : "standard"}, {"qk_params", qk}};
    if (l.collaborative) {
      lj["rank"] = l.rank;
      if (i < static_cast<int>(config.collaborative.errors.size())) lj["relative_error"] = config.collaborative.errors[i];
    }
    layers.push_back(lj);
  }
  json out{{"model", dir},
           {"weights", weights},
           {"layers", config.num_hidden_layers},
           {"hidden_size", config.hidden_size},
           {"heads", config.num_attention_heads},
           {"head_size", config.head_size()},
           {"intermediate_size", config.intermediate_size},
           {"vocab_size", config.vocab_size},
           {"labels", config.id2label},
           {"collaborative", config.collaborative.present()},
           {"parameters",
            {{"total", p.total},
             {"embeddings", p.embeddings},
             {"attention_qk", p.attention_qk},
             {"attention_vo", p.attention_vo},
             {"ffn", p.ffn},
             {"layer_norm", p.layer_norm},
             {"pooler_classifier", p.head}}},
           {"qk_compression_ratio",
            p.attention_qk ? static_cast<double>(std_qk * config.num_hidden_layers) / p.attention_qk : 1.0},
           {"per_layer", layers}};
  std::cout << out.dump() << std::endl;
  return absl::OkStatus();
}

int Usage() {
  std::cerr << "usage: collabserve-model COMMAND --flag value ...   (JSON lines on stdin for tokenize and predict)\n"
               "  make     --out DIR [--preset tiny|mini|base] [--labels 2 | --label_names a,b,...] [--seed 0]\n"
               "           [--format safetensors|bin] [--dtype f32|f16|bf16] [--layers L] [--hidden H] [--heads A]\n"
               "           [--intermediate F] [--vocab FILE] [--hidden_act gelu] [--problem_type T]\n"
               "           [--planted_rank 0] [--planted_noise 0.05]\n"
               "  tokenize --model DIR [--max_length N]\n"
               "  predict  --model DIR [--batch_size 8] [--device cpu|cuda[:N]] [--dtype float32|float16|bfloat16]\n"
               "  evaluate --model DIR --data FILE.jsonl [--reference DIR] [--batch_size 32] [--device D] [--dtype T]\n"
               "  inspect  --model DIR\n"
               "  compress --model IN --out OUT (--rank R | --ratio X | --ranks r1,... | --max_error E |\n"
               "           --target_agreement A | --max_kl K) [--calibration FILE] [--search_seconds 600] ...\n"
               "           (every compress flag: README.md, \"The offline tool\")\n";
  return 2;
}

}  // namespace
}  // namespace collabserve::tools

int main(int argc, char** argv) {
  collabserve::util::EnsurePassiveOpenMpWaiting(argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  using namespace collabserve::tools;
  if (argc < 2) return Usage();
  std::string cmd = argv[1];
  absl::Status st;
  if (cmd == "make") st = Make(argc, argv);
  else if (cmd == "tokenize") st = Tokenize(argc, argv);
  else if (cmd == "predict") st = Predict(argc, argv);
  else if (cmd == "evaluate") st = Evaluate(argc, argv);
  else if (cmd == "inspect") st = Inspect(argc, argv);
  else if (cmd == "compress") st = Compress(argc, argv);
  else if (cmd == "--help" || cmd == "-h" || cmd == "help") { Usage(); return 0; }
  else {
    std::cerr << "collabserve-model: unknown command '" << cmd << "'\n";
    return Usage();
  }
  if (!st.ok()) {
    std::cerr << "collabserve-model " << cmd << ": " << st.message() << std::endl;
    return 1;
  }
  return 0;
}
