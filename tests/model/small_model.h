// A small random-weight BertClassifier (2 layers of 64, 2 heads, 64 positions, vocabulary 3000) for
// tests that need a model's passes, not a checkpoint: standard, or collaborative where `ranks`
// has non-zero entries (one per layer).
#ifndef COLLABSERVE_TESTS_MODEL_SMALL_MODEL_H_
#define COLLABSERVE_TESTS_MODEL_SMALL_MODEL_H_

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/model/bert.h"
#include "server/model/config.h"

namespace collabserve::model {

inline BertConfig SmallBertConfig(std::vector<int> ranks, int labels) {
  BertConfig c;
  c.vocab_size = 3000;
  c.hidden_size = 64;
  c.num_attention_heads = 2;
  c.num_hidden_layers = 2;
  c.intermediate_size = 128;
  c.max_position_embeddings = 64;
  for (int i = 0; i < labels; ++i) c.id2label.push_back(std::string(1, static_cast<char>('a' + i)));
  c.collaborative.ranks = std::move(ranks);
  return c;
}

// Parameters drawn from normal(0, 0.3) after at::manual_seed(seed), then Prepare(device, dtype).
inline std::unique_ptr<BertClassifier> SmallBertModel(std::vector<int> ranks, int labels, uint64_t seed,
                                                      const c10::Device& device, at::ScalarType dtype) {
  auto m = std::make_unique<BertClassifier>(SmallBertConfig(std::move(ranks), labels));
  c10::InferenceMode guard;
  at::manual_seed(seed);
  for (auto& p : m->named_parameters()) p.value().normal_(0.0, 0.3);
  m->Prepare(device, dtype);
  return m;
}

}  // namespace collabserve::model

#endif  // COLLABSERVE_TESTS_MODEL_SMALL_MODEL_H_
