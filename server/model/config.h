// BertConfig: the subset of a Hugging Face `config.json` that BertForSequenceClassification uses,
// parsed strictly (unsupported architectures and options are errors that say so), plus the
// `collaborative` section that compressed models carry.
#ifndef COLLABSERVE_SERVER_MODEL_CONFIG_H_
#define COLLABSERVE_SERVER_MODEL_CONFIG_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace collabserve::model {

enum class Activation { kGelu, kGeluNew, kGeluPytorchTanh, kRelu };
enum class ProblemType { kSingleLabel, kMultiLabel, kRegression };
// How probabilities are derived from logits (the text-classification pipeline's rule).
enum class OutputFunction { kSoftmax, kSigmoid, kNone };

// The `collaborative` section of a compressed model's config.json.
struct CollaborativeConfig {
  std::vector<int> ranks;            // shared key/query dimension per layer (0 = layer left standard)
  std::string source;                // where the model came from (free text)
  std::string algorithm;             // "cp-als" | "exact-block"
  std::vector<double> errors;        // relative reconstruction error per layer
  // How the compressed model agreed with its original on the fidelity probes when it was made
  // (`collabserve-model compress`, an admin job); absent in files written before it was recorded.
  struct Fidelity {
    int probes = 0;
    double top1_agreement = 0;      // in [0, 1]
    double max_abs_logit_diff = 0;  // >= 0
    double mean_kl = 0;             // >= 0
  };
  std::optional<Fidelity> fidelity;
  bool present() const { return !ranks.empty(); }
};

struct BertConfig {
  int vocab_size = 30522;
  int hidden_size = 768;
  int num_hidden_layers = 12;
  int num_attention_heads = 12;
  int intermediate_size = 3072;
  Activation hidden_act = Activation::kGelu;
  double layer_norm_eps = 1e-12;
  int max_position_embeddings = 512;
  int type_vocab_size = 2;
  int pad_token_id = 0;
  std::vector<std::string> id2label;  // num_labels == id2label.size()
  std::string problem_type_name;      // as written ("" when null)
  ProblemType problem_type = ProblemType::kSingleLabel;
  CollaborativeConfig collaborative;

  int num_labels() const { return static_cast<int>(id2label.size()); }
  int head_size() const { return hidden_size / num_attention_heads; }
  // The most tokens an input is served with, given the tokenizer's model_max_length: the engine
  // refuses or cuts longer ones (ModelInfo::max_length), and the compression cuts its texts there.
  int max_input_length(int tokenizer_max_length) const {
    return max_position_embeddings < tokenizer_max_length ? max_position_embeddings : tokenizer_max_length;
  }
  OutputFunction output_function() const;

  // Parses config.json text. `name` is used in error messages (the file path). Every size is
  // bounded, and so is the whole model (2^32 parameters), so that a hostile config is refused
  // before anything is allocated.
  static absl::StatusOr<BertConfig> Parse(absl::string_view json, absl::string_view name);
  static absl::StatusOr<BertConfig> FromFile(const std::string& path);

  // Serialises to a Hugging Face compatible config.json (architectures, model_type, id2label,
  // label2id, ...), with the collaborative section when present.
  std::string ToJson() const;
};

absl::string_view ActivationName(Activation a);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_CONFIG_H_
