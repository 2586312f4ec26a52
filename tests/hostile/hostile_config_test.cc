// Hostile config.json and tokenizer_config.json files: absurd sizes are refused by BertConfig::Parse
// before anything is allocated, and JSON nested a million levels deep is refused (or ignored) without
// exhausting the stack.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/config.h"
#include "server/text/bert_tokenizer.h"

namespace collabserve {
namespace {

using ::testing::HasSubstr;
using model::BertConfig;

std::string Nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

absl::Status ParseError(const std::string& json) { return BertConfig::Parse(json, "config.json").status(); }

TEST(HostileConfigTest, ATerabyteModelIsRefusedBeforeAllocating) {
  // Every field is inside its own bound; together they ask for 2^38 parameters (1 TiB as float32).
  const absl::Status s = ParseError(R"({"vocab_size": 4194304, "hidden_size": 16384,
      "num_attention_heads": 16, "intermediate_size": 65536, "num_hidden_layers": 256,
      "max_position_embeddings": 65536})");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("config.json: the model would have "));
  EXPECT_THAT(std::string(s.message()), HasSubstr("over the limit of 4294967296"));
  // The embedding alone (4M x 16384 = 2^36 parameters, 256 GiB) is refused too (261 GiB with one layer).
  EXPECT_THAT(std::string(ParseError(R"({"vocab_size": 4194304, "hidden_size": 16384,
      "num_attention_heads": 16, "num_hidden_layers": 1})").message()), HasSubstr("(261 GiB as float32)"));
  // So is a model made huge by its collaborative ranks.
  std::string ranks;
  for (int i = 0; i < 64; ++i) absl::StrAppend(&ranks, i ? "," : "", 65536);
  EXPECT_THAT(std::string(ParseError(absl::StrCat(R"({"hidden_size": 16384, "num_attention_heads": 16,
      "num_hidden_layers": 64, "intermediate_size": 16, "collaborative": {"ranks": [)", ranks, "]}}"))
                              .message()),
              HasSubstr("parameters"));
}

TEST(HostileConfigTest, RealModelSizesAreAccepted) {
  // bert-large (335M parameters) and an XLM-R-large-sized vocabulary (560M).
  EXPECT_TRUE(BertConfig::Parse(R"({"hidden_size": 1024, "num_attention_heads": 16,
      "num_hidden_layers": 24, "intermediate_size": 4096})", "large").ok());
  EXPECT_TRUE(BertConfig::Parse(R"({"vocab_size": 250002, "hidden_size": 1024,
      "num_attention_heads": 16, "num_hidden_layers": 24, "intermediate_size": 4096,
      "max_position_embeddings": 514})", "xlmr").ok());
}

TEST(HostileConfigTest, EachAbsurdFieldIsRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"vocab_size": 4194305})", "'vocab_size' = 4194305 is outside"},
      {R"({"hidden_size": 1099511627776})", "'hidden_size' = 1099511627776 is outside"},
      {R"({"hidden_size": 18446744073709551615})", "'hidden_size'"},
      {R"({"num_hidden_layers": 100000})", "'num_hidden_layers' = 100000 is outside"},
      {R"({"intermediate_size": -1})", "'intermediate_size' = -1 is outside"},
      {R"({"max_position_embeddings": 1e300})", "'max_position_embeddings' must be an integer"},
      {R"({"num_labels": 1000000000})", "'num_labels' = 1000000000 is outside"},
      {R"({"type_vocab_size": 1048576})", "'type_vocab_size' = 1048576 is outside"},
  };
  for (const auto& [json, reason] : cases) {
    const absl::Status s = ParseError(json);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_THAT(std::string(s.message()), HasSubstr(reason)) << json;
  }
  std::string labels = "{\"id2label\": {";
  for (int i = 0; i <= 65536; ++i) absl::StrAppend(&labels, i ? "," : "", "\"", i, "\":\"l\"");
  EXPECT_THAT(std::string(ParseError(labels + "}}").message()), HasSubstr("too many labels"));
}

// Error messages used to dump() the offending value, which recurses once per nesting level
// (reproducers also in tests/fuzz/regressions/).
TEST(HostileConfigTest, DeeplyNestedValuesAreRefusedWithoutOverflowingTheStack) {
  const std::string deep = Nested(1'000'000);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"hidden_act\": " + deep + "}", "hidden_act 'an array' is not supported"},
      {"{\"model_type\": " + deep + "}", "model_type an array is not supported"},
      {"{\"architectures\": [" + deep + "]}", "architecture an array is not supported"},
      {"{\"position_embedding_type\": " + deep + "}", "position_embedding_type an array"},
      {"{\"num_hidden_layers\": 1, \"collaborative\": {\"ranks\": [" + deep + "]}}",
       "'collaborative.ranks' entry an array is not a valid rank"},
  };
  for (const auto& [json, reason] : cases) {
    const absl::Status s = ParseError(json);
    EXPECT_NE(s.code(), absl::StatusCode::kOk);
    EXPECT_THAT(std::string(s.message()), HasSubstr(reason));
  }
  // Keys we do not read may hold anything.
  EXPECT_TRUE(BertConfig::Parse("{\"task_specific_params\": " + deep + "}", "c").ok());
  // A long string is cut in the message.
  const absl::Status s = ParseError("{\"model_type\": \"" + std::string(1 << 20, 'x') + "\"}");
  EXPECT_LT(s.message().size(), 300u);
}

class HostileTokenizerConfigTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& contents) {
    path_ = ::testing::TempDir() + "hostile_tokenizer_config_" + std::to_string(::getpid()) + ".json";
    std::ofstream(path_, std::ios::binary) << contents;
    return path_;
  }
  void TearDown() override { std::remove(path_.c_str()); }
  std::string Vocab() {
    const char* dir = std::getenv("COLLABSERVE_SOURCE_DIR");
    return std::string(dir ? dir : ".") + "/tests/data/bert-base-uncased-vocab.txt";
  }
  std::string path_;
};

// The same dump() recursion in the tokenizer_config.json reader.
TEST_F(HostileTokenizerConfigTest, DeeplyNestedValuesAreRefusedWithoutOverflowingTheStack) {
  const std::string deep = Nested(1'000'000);
  for (const std::string key : {"do_lower_case", "strip_accents", "model_max_length", "unk_token",
                                 "tokenizer_class", "additional_special_tokens",
                                 "added_tokens_decoder"}) {
    auto t = text::BertTokenizer::FromFiles(Vocab(), Write("{\"" + key + "\": " + deep + "}"));
    ASSERT_FALSE(t.ok()) << key;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("\"" + key + "\" must be"));
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("not array"));
  }
  // A key the reader ignores is parsed and left alone.
  auto t = text::BertTokenizer::FromFiles(Vocab(), Write("{\"chat_template\": " + deep + "}"));
  EXPECT_TRUE(t.ok()) << t.status();
}

}  // namespace
}  // namespace collabserve
