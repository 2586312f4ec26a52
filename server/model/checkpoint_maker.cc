#include "server/model/checkpoint_maker.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/model/bert.h"
#include "server/model/probe_sentences.h"
#include "server/text/bert_tokenizer.h"
#include <c10/core/InferenceMode.h>
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::model {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

at::Tensor Normal(std::vector<int64_t> shape, uint64_t seed, std::string_view name, double std) {
  at::Tensor t = at::empty(shape, at::kFloat);
  FillNormal(t.data_ptr<float>(), t.numel(), HashSeed(seed, name), std);
  return t;
}

// Random weights give every input nearly the same pooled vector, so raw logits barely depend on
// the text. Re-centre and re-scale the classifier on the built-in probe sentences so that each
// logit has mean 0 and standard deviation 2 across them: the outputs then differ across inputs and
// no label dominates. Deterministic, like the weights.
absl::Status CalibrateClassifier(BertClassifier& model, const std::string& vocab_path) {
  ASSIGN_OR_RETURN(auto tok, text::BertTokenizer::FromFiles(vocab_path, ""));
  const auto& probes = BuiltinProbeSentences();
  std::vector<std::vector<int32_t>> ids;
  size_t longest = 0;
  for (const auto& s : probes) {
    ASSIGN_OR_RETURN(text::Encoding e, tok->Encode(s, std::nullopt, 128, true));
    longest = std::max(longest, e.input_ids.size());
    ids.push_back(std::move(e.input_ids));
  }
  const int64_t P = static_cast<int64_t>(ids.size()), S = static_cast<int64_t>(longest);
  at::Tensor input = at::zeros({P, S}, at::kLong), mask = at::zeros({P, S}, at::kLong);
  for (int64_t i = 0; i < P; ++i) {
    for (size_t j = 0; j < ids[i].size(); ++j) input[i][j] = ids[i][j];
    mask[i].narrow(0, 0, ids[i].size()).fill_(1);
  }
  c10::InferenceMode guard;
  model.Prepare(c10::Device(c10::kCPU), c10::kFloat, /*pack_weights=*/false);  // saved next
  at::Tensor logits = model.Forward(input, at::zeros({P, S}, at::kLong), mask);  // [P, C]
  at::Tensor mean = logits.mean(0), std = logits.std(0).clamp_min(1e-6);
  at::Tensor gain = 2.0 / std;
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    if (item.key() == "classifier.weight") item.value().mul_(gain.unsqueeze(1));
    if (item.key() == "classifier.bias") item.value().sub_(mean).mul_(gain);
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t HashSeed(uint64_t seed, std::string_view name) {
  uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a over the name, mixed with the seed
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  uint64_t s = h;
  return SplitMix64(s);
}

void FillNormal(float* out, int64_t n, uint64_t seed, double std) {
  uint64_t state = seed;
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < n; i += 2) {
    double u1 = ((SplitMix64(state) >> 11) + 1) * (1.0 / 9007199254740993.0);  // (0, 1]
    double u2 = (SplitMix64(state) >> 11) * (1.0 / 9007199254740992.0);
    double r = std::sqrt(-2.0 * std::log(u1)) * std;
    out[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
  }
}

absl::StatusOr<BertConfig> MakeConfig(const MakeOptions& o) {
  BertConfig c;
  if (o.preset == "tiny") {
    c.num_hidden_layers = 2; c.hidden_size = 64; c.num_attention_heads = 4; c.intermediate_size = 256;
  } else if (o.preset == "mini") {
    c.num_hidden_layers = 4; c.hidden_size = 256; c.num_attention_heads = 4; c.intermediate_size = 1024;
  } else if (o.preset == "base") {
    c.num_hidden_layers = 12; c.hidden_size = 768; c.num_attention_heads = 12; c.intermediate_size = 3072;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown preset '", o.preset, "' (tiny, mini, base)"));
  }
  if (o.layers < 0 || o.hidden < 0 || o.heads < 0 || o.intermediate < 0 || o.type_vocab_size < 0) {
    return absl::InvalidArgumentError(
        "--layers, --hidden, --heads, --intermediate and the token types must be positive");
  }
  if (o.type_vocab_size) c.type_vocab_size = o.type_vocab_size;
  if (o.layers) c.num_hidden_layers = o.layers;
  if (o.hidden) c.hidden_size = o.hidden;
  if (o.heads) c.num_attention_heads = o.heads;
  if (o.intermediate) c.intermediate_size = o.intermediate;
  if (c.hidden_size % c.num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--hidden ", c.hidden_size,
                                                   " is not a multiple of --heads ", c.num_attention_heads));
  }
  if (!o.label_names.empty()) {
    c.id2label = o.label_names;
  } else {
    if (o.labels < 1 || o.labels > 4096) return absl::InvalidArgumentError("--labels must be in [1, 4096]");
    for (int i = 0; i < o.labels; ++i) c.id2label.push_back(absl::StrCat("LABEL_", i));
  }
  c.problem_type_name = o.problem_type;
  // The parser owns the list of supported activations and problem types.
  auto parsed = BertConfig::Parse(
      absl::StrCat("{\"hidden_act\": \"", o.hidden_act, "\"}"), "--hidden_act");
  if (!parsed.ok()) return parsed.status();
  c.hidden_act = parsed->hidden_act;
  if (!o.problem_type.empty()) {
    auto p = BertConfig::Parse(absl::StrCat("{\"problem_type\": \"", o.problem_type, "\"}"), "--problem_type");
    if (!p.ok()) return p.status();
    c.problem_type = p->problem_type;
  }
  return c;
}

absl::Status MakeCheckpoint(const std::string& out_dir, const MakeOptions& o) {
  ASSIGN_OR_RETURN(BertConfig c, MakeConfig(o));
  std::string vocab;
  if (o.vocab_path.empty()) {
    vocab = std::string(EmbeddedVocab());
  } else {
    ASSIGN_OR_RETURN(vocab, util::ReadFile(o.vocab_path, 64 << 20));
  }
  int64_t vocab_lines = 0;
  for (char ch : vocab) vocab_lines += ch == '\n';
  if (!vocab.empty() && vocab.back() != '\n') ++vocab_lines;
  if (vocab_lines == 0) return absl::InvalidArgumentError(absl::StrCat(o.vocab_path, ": empty vocabulary"));
  c.vocab_size = static_cast<int>(vocab_lines);
  if (o.planted_rank < 0 || o.planted_rank > c.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("--planted_rank must be in [0, ", c.hidden_size, "]"));
  }

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));

  BertClassifier model(c);
  const double D = c.hidden_size, F = c.intermediate_size;
  // Scores q·k/sqrt(dk) for LayerNorm'd inputs have std ≈ sigma_qk^2 · D: about 2.5 → peaked.
  const double sigma_qk = std::sqrt(2.5 / D);
  at::Tensor shared_q, shared_k;
  if (o.planted_rank > 0) {
    shared_q = Normal({o.planted_rank, c.hidden_size}, o.seed, "planted.shared_query", 1.0);
    shared_k = Normal({o.planted_rank, c.hidden_size}, o.seed, "planted.shared_key", 1.0);
  }
  at::NoGradGuard no_grad;
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& k = item.key();
    at::Tensor& p = item.value();
    std::vector<int64_t> shape = p.sizes().vec();
    at::Tensor v;
    const bool is_bias = absl::EndsWith(k, ".bias");
    if (absl::StrContains(k, "LayerNorm")) {
      v = Normal(shape, o.seed, k, 0.05);
      if (absl::EndsWith(k, ".weight")) v.add_(1.0);
    } else if (k == "bert.embeddings.word_embeddings.weight") {
      v = Normal(shape, o.seed, k, 1.0);
    } else if (absl::StartsWith(k, "bert.embeddings.")) {
      v = Normal(shape, o.seed, k, 0.3);
    } else if (is_bias) {
      v = Normal(shape, o.seed, k, 0.1);
    } else if (absl::EndsWith(k, ".attention.self.query.weight") ||
               absl::EndsWith(k, ".attention.self.key.weight")) {
      if (o.planted_rank > 0) {
        // Rows of head i = G_i^T S^T: every head's projection lives in the shared subspace S.
        const bool q = absl::EndsWith(k, "query.weight");
        at::Tensor g = Normal({c.hidden_size, o.planted_rank}, o.seed, k, sigma_qk / std::sqrt(double(o.planted_rank)));
        v = at::matmul(g, q ? shared_q : shared_k);
        v.add_(Normal(shape, o.seed, k + ".noise", sigma_qk * o.planted_noise));
      } else {
        v = Normal(shape, o.seed, k, sigma_qk);
      }
    } else if (absl::StartsWith(k, "classifier.")) {
      v = Normal(shape, o.seed, k, 4.0 / std::sqrt(D));
    } else if (absl::EndsWith(k, ".output.dense.weight") && !absl::StrContains(k, "attention")) {
      v = Normal(shape, o.seed, k, 1.0 / std::sqrt(F));
    } else {
      v = Normal(shape, o.seed, k, (absl::StartsWith(k, "bert.pooler.") ? 1.5 : 1.0) / std::sqrt(D));
    }
    p.copy_(v);
  }
  RETURN_IF_ERROR(util::WriteFileAtomic(util::JoinPath(out_dir, "vocab.txt"), vocab));
  RETURN_IF_ERROR(CalibrateClassifier(model, util::JoinPath(out_dir, "vocab.txt")));
  RETURN_IF_ERROR(util::WriteFileAtomic(
      util::JoinPath(out_dir, "tokenizer_config.json"),
      "{\n  \"tokenizer_class\": \"BertTokenizer\",\n  \"do_lower_case\": true,\n"
      "  \"model_max_length\": 512\n}\n"));
  // Weights before config: a directory with a config.json is complete.
  RETURN_IF_ERROR(SaveWeights(model, out_dir, o.format, o.dtype,
                              {{"format", "pt"}, {"generator", "collabserve-model make"}}));
  return util::WriteFileAtomic(util::JoinPath(out_dir, "config.json"), c.ToJson());
}

}  // namespace collabserve::model
