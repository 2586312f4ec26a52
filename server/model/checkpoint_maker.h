// Deterministic random-weight checkpoints in Hugging Face layout (config.json, vocab.txt,
// tokenizer_config.json, model.safetensors | pytorch_model.bin): test fixtures, benchmark models
// and the stress cases of the compression benchmarks (the demo model is trained: demo_model.h). No pretrained weights can be downloaded, so these stand in; the
// weights are scaled so that attention is peaked and the classifier's outputs differ across inputs,
// and `planted_rank` plants the shared key/query subspace that trained BERT heads show.
#ifndef COLLABSERVE_SERVER_MODEL_CHECKPOINT_MAKER_H_
#define COLLABSERVE_SERVER_MODEL_CHECKPOINT_MAKER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "server/model/config.h"
#include "server/model/state_dict.h"

namespace collabserve::model {

struct MakeOptions {
  std::string preset = "tiny";  // tiny (2×64, 4 heads), mini (4×256, 4 heads), base (12×768, 12 heads)
  // Overrides of the preset (0 = keep the preset's).
  int layers = 0, hidden = 0, heads = 0, intermediate = 0;
  int type_vocab_size = 0;  // token types (1: a model that takes no text pairs); 0 = BERT's 2
  int labels = 2;
  std::vector<std::string> label_names;  // empty: LABEL_0..
  uint64_t seed = 0;
  WeightFormat format = WeightFormat::kSafetensors;
  WeightDType dtype = WeightDType::kF32;
  std::string vocab_path;        // empty: the built-in bert-base-uncased vocabulary
  std::string hidden_act = "gelu";
  std::string problem_type;      // "" | single_label_classification | multi_label_classification | regression
  // > 0: every head's query (and key) projection is drawn from one shared subspace of this many
  // dimensions, plus `planted_noise` (relative) isotropic noise.
  int planted_rank = 0;
  double planted_noise = 0.05;
};

// Builds the config for `options` (preset + overrides), validated.
absl::StatusOr<BertConfig> MakeConfig(const MakeOptions& options);

// Writes the checkpoint directory `out_dir` (created if missing). Same options, same bytes.
absl::Status MakeCheckpoint(const std::string& out_dir, const MakeOptions& options);

// The bert-base-uncased vocabulary compiled into the binary (vocab.txt text; the demo model's).
std::string_view EmbeddedVocab();

// Deterministic normal(0, std) values (splitmix64 + Box–Muller), independent of the torch version.
void FillNormal(float* out, int64_t n, uint64_t seed, double std);
uint64_t HashSeed(uint64_t seed, std::string_view name);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_CHECKPOINT_MAKER_H_
