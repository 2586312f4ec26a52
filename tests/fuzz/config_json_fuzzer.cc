// Fuzzes BertConfig::Parse (config.json) with arbitrary text: an error with a message, or a config
// inside the documented bounds that serialises and parses back to the same config.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "server/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using collabserve::model::BertConfig;
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = BertConfig::Parse(text, "config.json");
  if (!config.ok()) {
    if (config.status().message().empty()) std::abort();
    return 0;
  }
  const BertConfig& c = *config;
  if (c.vocab_size < 1 || c.hidden_size < 1 || c.num_hidden_layers < 1 ||
      c.num_attention_heads < 1 || c.hidden_size % c.num_attention_heads != 0 ||
      c.intermediate_size < 1 || c.max_position_embeddings < 1 || c.type_vocab_size < 1 ||
      c.num_labels() < 1 || !(c.layer_norm_eps > 0) || c.pad_token_id < 0 ||
      (c.collaborative.present() &&
       static_cast<int>(c.collaborative.ranks.size()) != c.num_hidden_layers)) {
    std::fprintf(stderr, "accepted a config outside the documented bounds\n");
    std::abort();
  }
  // What we accept we can write, and what we write we read back identically.
  auto again = BertConfig::Parse(c.ToJson(), "round trip");
  if (!again.ok()) {
    std::fprintf(stderr, "ToJson output does not parse: %s\n", std::string(again.status().message()).c_str());
    std::abort();
  }
  if (again->ToJson() != c.ToJson()) {
    std::fprintf(stderr, "round trip changed the config\n");
    std::abort();
  }
  return 0;
}
