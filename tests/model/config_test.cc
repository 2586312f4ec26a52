#include "server/model/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace collabserve::model {
namespace {

using ::testing::HasSubstr;

TEST(BertConfigTest, ParsesHuggingFaceConfig) {
  auto c = BertConfig::Parse(R"({
    "architectures": ["BertForSequenceClassification"], "model_type": "bert",
    "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 512,
    "hidden_act": "gelu_new", "layer_norm_eps": 1e-7, "max_position_embeddings": 256,
    "type_vocab_size": 2, "vocab_size": 1000, "pad_token_id": 0,
    "id2label": {"1": "pos", "0": "neg", "2": "neutral"}, "problem_type": "multi_label_classification",
    "transformers_version": "4.40.0", "hidden_dropout_prob": 0.1})", "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 128);
  EXPECT_EQ(c->head_size(), 32);
  EXPECT_EQ(c->hidden_act, Activation::kGeluNew);
  EXPECT_DOUBLE_EQ(c->layer_norm_eps, 1e-7);
  EXPECT_EQ(c->id2label, (std::vector<std::string>{"neg", "pos", "neutral"}));
  EXPECT_EQ(c->output_function(), OutputFunction::kSigmoid);
}

TEST(BertConfigTest, DefaultsFollowTransformers) {
  auto c = BertConfig::Parse("{}", "config.json");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->num_labels(), 2);
  EXPECT_EQ(c->id2label[1], "LABEL_1");
  EXPECT_EQ(c->output_function(), OutputFunction::kSoftmax);
  auto one = BertConfig::Parse(R"({"num_labels": 1})", "config.json");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->output_function(), OutputFunction::kSigmoid);  // the pipeline's rule
  auto reg = BertConfig::Parse(R"({"num_labels": 1, "problem_type": "regression"})", "c");
  ASSERT_TRUE(reg.ok());
  EXPECT_EQ(reg->output_function(), OutputFunction::kNone);
}

TEST(BertConfigTest, RoundTripsThroughJson) {
  auto c = BertConfig::Parse(R"({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "id2label": {"0": "a", "1": "b"}, "collaborative": {"ranks": [16, 0], "algorithm": "cp-als",
      "source": "x", "errors": [0.1, 0.0]}})", "c");
  ASSERT_TRUE(c.ok()) << c.status();
  auto again = BertConfig::Parse(c->ToJson(), "again");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->collaborative.ranks, (std::vector<int>{16, 0}));
  EXPECT_EQ(again->id2label, c->id2label);
  EXPECT_EQ(again->hidden_size, 64);
  EXPECT_FALSE(again->collaborative.fidelity.has_value());  // absent stays absent
}

// The fidelity a compression measured travels in config.json, so that a restarted server still
// exports it (collabserve_model_fidelity_agreement).
TEST(BertConfigTest, FidelityRoundTrips) {
  auto c = BertConfig::Parse(R"({"num_hidden_layers": 1, "collaborative": {"ranks": [8],
      "fidelity": {"probes": 32, "top1_agreement": 0.96875, "max_abs_logit_diff": 0.25,
      "mean_kl": 0.001}}})", "c");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->collaborative.fidelity.has_value());
  auto again = BertConfig::Parse(c->ToJson(), "again");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(again->collaborative.fidelity.has_value());
  EXPECT_EQ(again->collaborative.fidelity->probes, 32);
  EXPECT_DOUBLE_EQ(again->collaborative.fidelity->top1_agreement, 0.96875);
  EXPECT_DOUBLE_EQ(again->collaborative.fidelity->max_abs_logit_diff, 0.25);
  EXPECT_DOUBLE_EQ(again->collaborative.fidelity->mean_kl, 0.001);
}

struct BadCase {
  const char* json;
  const char* message;
};

class BertConfigErrorTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BertConfigErrorTest, RejectsWithAClearMessage) {
  auto c = BertConfig::Parse(GetParam().json, "m/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("m/config.json"));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BertConfigErrorTest,
    ::testing::Values(
        BadCase{"{not json", "not valid JSON: parse error at column 3"},
        BadCase{"{\n  \"hidden_size\": 3", "not valid JSON: parse error at line 2, column 19"},
        BadCase{"[1,2]", "JSON object"},
        BadCase{R"({"model_type": "roberta"})", "model_type \"roberta\" is not supported"},
        BadCase{R"({"tokenizer_class": "BertJapaneseTokenizer"})",
                "tokenizer_class \"BertJapaneseTokenizer\" is not supported"},
        BadCase{R"({"num_hidden_layers": 1, "collaborative": {"ranks": [4], "format_version": 2}})",
                "'collaborative.format_version' is 2; this collabserve reads version 1"},
        BadCase{R"({"architectures": ["BertForMaskedLM"]})", "BertForMaskedLM\" is not supported"},
        BadCase{R"({"hidden_size": 100, "num_attention_heads": 12})", "not a multiple"},
        BadCase{R"({"hidden_act": "swish"})", "hidden_act 'swish' is not supported"},
        BadCase{R"({"position_embedding_type": "relative_key"})", "position_embedding_type"},
        BadCase{R"({"is_decoder": true})", "is_decoder"},
        BadCase{R"({"hidden_size": 1e12})", "'hidden_size' must be an integer"},
        BadCase{R"({"hidden_size": 4000000000})", "outside"},
        BadCase{R"({"vocab_size": -3})", "outside"},
        BadCase{R"({"vocab_size": 100, "pad_token_id": 100})",
                "'pad_token_id' = 100 is not a token id (vocab_size is 100)"},
        BadCase{R"({"id2label": {"0": "a", "5": "b"}})", "'id2label' key '5'"},
        BadCase{R"({"problem_type": "ranking"})", "unknown problem_type"},
        BadCase{R"({"num_hidden_layers": 2, "collaborative": {"ranks": [4]}})", "has 1 entries"},
        BadCase{R"({"num_hidden_layers": 1, "collaborative": {"ranks": [-4]}})", "not a valid rank"},
        BadCase{R"({"num_hidden_layers": 1, "collaborative": {"ranks": [4], "fidelity": 1}})",
                "'collaborative.fidelity' must be an object"},
        BadCase{R"({"num_hidden_layers": 1, "collaborative": {"ranks": [4], "fidelity":
                {"probes": 8, "top1_agreement": 1.5, "max_abs_logit_diff": 0, "mean_kl": 0}}})",
                "'collaborative.fidelity.top1_agreement' must be a number in [0, 1]"},
        BadCase{R"({"num_hidden_layers": 1, "collaborative": {"ranks": [4], "fidelity":
                {"top1_agreement": 1, "max_abs_logit_diff": 0, "mean_kl": 0}}})",
                "'collaborative.fidelity.probes' must be a non-negative integer, not nothing"}));

}  // namespace
}  // namespace collabserve::model
