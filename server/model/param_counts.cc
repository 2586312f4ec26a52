#include "server/model/param_counts.h"

#include "absl/strings/match.h"

namespace collabserve::model {

ParamCounts CountParams(const BertClassifier& model) {
  ParamCounts p;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& k = item.key();
    const int64_t n = item.value().numel();
    p.total += n;
    if (absl::StartsWith(k, "bert.embeddings.")) {
      p.embeddings += n;
    } else if (absl::StartsWith(k, "bert.pooler.") || absl::StartsWith(k, "classifier.")) {
      p.head += n;
    } else if (absl::StrContains(k, ".attention.self.value.") ||
               absl::StrContains(k, ".attention.output.dense.")) {
      p.attention_vo += n;
    } else if (absl::StrContains(k, ".attention.self.")) {
      p.attention_qk += n;
    } else if (absl::StrContains(k, "LayerNorm")) {
      p.layer_norm += n;
    } else {
      p.ffn += n;  // intermediate.dense, output.dense
    }
  }
  return p;
}

int64_t StandardQkParamsPerLayer(const BertConfig& c) {
  const int64_t D = c.hidden_size;
  return 2 * (D * D + D);
}

int64_t CollaborativeQkParamsPerLayer(const BertConfig& c, int rank) {
  if (rank == 0) return StandardQkParamsPerLayer(c);
  const int64_t D = c.hidden_size, H = c.num_attention_heads, R = rank;
  return 2 * D * R + H * R + H * D;
}

}  // namespace collabserve::model
