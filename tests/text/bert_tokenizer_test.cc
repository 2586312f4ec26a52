#include "server/text/bert_tokenizer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace collabserve::text {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string SourceDir() {
  const char* dir = std::getenv("COLLABSERVE_SOURCE_DIR");
  return dir ? dir : ".";
}
std::string VocabPath() { return SourceDir() + "/tests/data/bert-base-uncased-vocab.txt"; }

// A path in this process's temporary directory (removed, with everything in it, at exit).
std::string TempPath(const std::string& name) {
  static const collabserve::testing::TempDir scratch;
  return scratch / name;
}
std::string WriteTemp(const std::string& name, const std::string& contents) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

// A checkpoint's tokenizer files in a directory of their own.
std::string TokenizerDir(const std::string& name,
                         const std::vector<std::pair<std::string, std::string>>& files) {
  const std::string dir = TempPath(name);
  ::mkdir(dir.c_str(), 0755);
  for (const auto& [file, contents] : files) {
    std::ofstream(dir + "/" + file, std::ios::binary) << contents;
  }
  return dir;
}

class BertTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = BertTokenizer::FromFiles(VocabPath(), "");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }
  static BertTokenizer* tokenizer_;
};
BertTokenizer* BertTokenizerTest::tokenizer_ = nullptr;

TEST_F(BertTokenizerTest, TokenizesTheReadmeExample) {
  auto ids = tokenizer_->TokenizeToIds("i like strawberries");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(1045, 2066, 13137, 20968));
  auto tokens = tokenizer_->Tokenize("I like strawberries!");
  ASSERT_TRUE(tokens.ok());
  EXPECT_THAT(*tokens, ElementsAre("i", "like", "straw", "##berries", "!"));
  EXPECT_EQ(tokenizer_->vocab_size(), 30522);
  EXPECT_EQ(tokenizer_->cls_id(), 101);
  EXPECT_EQ(tokenizer_->sep_id(), 102);
  EXPECT_EQ(tokenizer_->pad_id(), 0);
  EXPECT_EQ(tokenizer_->unk_id(), 100);
  EXPECT_EQ(tokenizer_->mask_id(), 103);
  EXPECT_EQ(tokenizer_->IdToToken(13137), "straw");
  EXPECT_EQ(tokenizer_->IdToToken(-1), "");
  EXPECT_EQ(tokenizer_->IdToToken(30522), "");
}

TEST_F(BertTokenizerTest, MatchesSpecialTokensWrittenInTheText) {
  auto tokens = tokenizer_->Tokenize("hello[SEP]world [MASK] [mask]");
  ASSERT_TRUE(tokens.ok());
  EXPECT_THAT(*tokens, ElementsAre("hello", "[SEP]", "world", "[MASK]", "[", "mask", "]"));
}

TEST_F(BertTokenizerTest, EncodesSinglesAndPairs) {
  auto e = tokenizer_->Encode("i like", std::nullopt);
  ASSERT_TRUE(e.ok());
  EXPECT_THAT(e->input_ids, ElementsAre(101, 1045, 2066, 102));
  EXPECT_THAT(e->token_type_ids, ElementsAre(0, 0, 0, 0));
  EXPECT_FALSE(e->truncated);
  EXPECT_EQ(e->num_tokens_before_truncation, 4);
  e = tokenizer_->Encode("i like", "strawberries");
  ASSERT_TRUE(e.ok());
  EXPECT_THAT(e->input_ids, ElementsAre(101, 1045, 2066, 102, 13137, 20968, 102));
  EXPECT_THAT(e->token_type_ids, ElementsAre(0, 0, 0, 0, 1, 1, 1));
  e = tokenizer_->Encode("", "");
  ASSERT_TRUE(e.ok());
  EXPECT_THAT(e->input_ids, ElementsAre(101, 102, 102));
}

TEST_F(BertTokenizerTest, OffsetsAreBytesOfEachTokensOwnText) {
  EncodeOptions o;
  o.offsets = true;
  // "É" is two bytes and normalizes to "e" ("ec", "##lai", "##r"); a word piece spans only its own
  // bytes; a special token written in the text has its span and is not in the mask.
  auto e = tokenizer_->Encode("Éclair unaffable [SEP]", "x", o);
  ASSERT_TRUE(e.ok()) << e.status();
  using P = std::pair<int32_t, int32_t>;
  EXPECT_THAT(e->offsets, ElementsAre(P(0, 0), P(0, 3), P(3, 6), P(6, 7), P(8, 11), P(11, 14),
                                      P(14, 17), P(18, 23), P(0, 0), P(0, 1), P(0, 0)));
  EXPECT_THAT(e->special_tokens_mask, ElementsAre(1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1));
  EXPECT_EQ(e->input_ids, tokenizer_->Encode("Éclair unaffable [SEP]", "x")->input_ids);
  // Truncation cuts the offsets with the ids; without offsets none are filled.
  o.max_length = 4;
  e = tokenizer_->Encode("Éclair unaffable", std::nullopt, o);
  ASSERT_TRUE(e.ok());
  EXPECT_THAT(e->offsets, ElementsAre(P(0, 0), P(0, 3), P(3, 6), P(0, 0)));
  EXPECT_TRUE(tokenizer_->Encode("a", std::nullopt)->offsets.empty());
}

TEST_F(BertTokenizerTest, WithoutSpecialTokensMaxLengthCountsNone) {
  EncodeOptions o;
  o.add_special_tokens = false;
  o.offsets = true;
  auto e = tokenizer_->Encode("i like", "strawberries", o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_THAT(e->input_ids, ElementsAre(1045, 2066, 13137, 20968));
  EXPECT_THAT(e->token_type_ids, ElementsAre(0, 0, 1, 1));
  EXPECT_THAT(e->special_tokens_mask, ElementsAre(0, 0, 0, 0));
  o.max_length = 2;
  e = tokenizer_->Encode("a b c", std::nullopt, o);
  ASSERT_TRUE(e.ok());
  EXPECT_THAT(e->input_ids, ElementsAre(1037, 1038));
  EXPECT_EQ(e->num_tokens_before_truncation, 3);
  o.truncate = false;
  e = tokenizer_->Encode("a b c", std::nullopt, o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("the input is 3 tokens long, over max_length 2"));
}

TEST_F(BertTokenizerTest, DecodesAsHuggingFace) {
  // Outputs of Hugging Face's tokenizer.decode (WordPiece decoder, cleanup) on the same ids.
  const std::vector<int32_t> ids = {101, 2129, 1005, 1055, 1996, 1012, 19771, 2099, 102, 100};
  EXPECT_EQ(*tokenizer_->Decode(ids), "how ' s the.lair");
  EXPECT_EQ(*tokenizer_->Decode({19771, 101, 2129, 1005, 1055, 102}, false),
            "##lai [CLS] how ' s [SEP]");
  EXPECT_EQ(*tokenizer_->Decode({}), "");
  auto bad = tokenizer_->Decode({101, 30522});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("ids[1] is 30522, not an id of this vocabulary"));
}

TEST(BertTokenizerDecodeTest, RefusesShadowedIdsAndLongTextsAndSkipsAdditionalSpecialTokens) {
  // "dup" twice: Hugging Face maps it to its last id and never gives (nor decodes) the first.
  TokenizerOptions o;
  o.additional_special_tokens = {"[E1]"};
  auto t = BertTokenizer::Create(
      {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "dup", "x", "dup", "[E1]", "##y"}, o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*(*t)->Decode({2, 7, 6, 9, 8, 3}), "dup xy");
  EXPECT_EQ(*(*t)->Decode({2, 7, 8, 3}, false), "[CLS] dup [E1] [SEP]");
  auto shadowed = (*t)->Decode({6, 5});
  EXPECT_EQ(shadowed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shadowed.status().message(),
              HasSubstr("ids[1] is 5, whose token \"dup\" has the later id 7"));
  auto longer = (*t)->Decode({6, 6, 6, 6}, true, /*max_bytes=*/6);
  EXPECT_EQ(longer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(longer.status().message(), HasSubstr("7 bytes, over the limit of 6"));
  EXPECT_EQ(*(*t)->Decode({6, 6, 6}, true, 5), "x x x");
}

// Lengths of the two sides after Encode(a words, b words, max_length) with single-piece words.
std::pair<size_t, size_t> PairLengths(const BertTokenizer& t, int a, int b, int max_length) {
  std::string x, y;
  for (int i = 0; i < a; ++i) x += "a ";
  for (int i = 0; i < b; ++i) y += "b ";
  auto e = t.Encode(x, y, max_length);
  EXPECT_TRUE(e.ok()) << e.status();
  size_t first = 0;
  while (e->input_ids[first + 1] != 102) ++first;
  return {first, e->input_ids.size() - first - 3};
}

TEST_F(BertTokenizerTest, TruncatesLongestFirstAsHuggingFace) {
  // The cases of tokenizers' truncation.rs test with max_length 7 (+3 special tokens).
  EXPECT_EQ(PairLengths(*tokenizer_, 2, 8, 10), std::make_pair(size_t{2}, size_t{5}));
  EXPECT_EQ(PairLengths(*tokenizer_, 4, 4, 10), std::make_pair(size_t{3}, size_t{4}));
  EXPECT_EQ(PairLengths(*tokenizer_, 4, 8, 10), std::make_pair(size_t{3}, size_t{4}));
  EXPECT_EQ(PairLengths(*tokenizer_, 8, 2, 10), std::make_pair(size_t{5}, size_t{2}));
  EXPECT_EQ(PairLengths(*tokenizer_, 8, 4, 10), std::make_pair(size_t{4}, size_t{3}));
  EXPECT_EQ(PairLengths(*tokenizer_, 8, 8, 10), std::make_pair(size_t{3}, size_t{4}));
  EXPECT_EQ(PairLengths(*tokenizer_, 0, 8, 10), std::make_pair(size_t{0}, size_t{7}));
  EXPECT_EQ(PairLengths(*tokenizer_, 2, 2, 10), std::make_pair(size_t{2}, size_t{2}));
  EXPECT_EQ(PairLengths(*tokenizer_, 5, 5, 3), std::make_pair(size_t{0}, size_t{0}));

  auto e = tokenizer_->Encode("a b c d e f", std::nullopt, 5);
  ASSERT_TRUE(e.ok());
  EXPECT_THAT(e->input_ids, ElementsAre(101, 1037, 1038, 1039, 102));
  EXPECT_TRUE(e->truncated);
  EXPECT_EQ(e->num_tokens_before_truncation, 8);
}

TEST_F(BertTokenizerTest, RefusesTooLongInputWithoutTruncation) {
  auto e = tokenizer_->Encode("a b c d e f", std::nullopt, 5, /*truncate=*/false);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("8 tokens"));
  EXPECT_THAT(e.status().message(), HasSubstr("max_length 5"));
  EXPECT_TRUE(tokenizer_->Encode("a b c", std::nullopt, 5, false).ok());
  e = tokenizer_->Encode("a", "b", 2);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("3 special tokens"));
}

TEST_F(BertTokenizerTest, DefaultLimitIsModelMaxLength) {
  std::string text;
  for (int i = 0; i < 600; ++i) text += "a ";
  auto e = tokenizer_->Encode(text, std::nullopt);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->input_ids.size(), 512u);
  EXPECT_EQ(e->num_tokens_before_truncation, 602);
  EXPECT_THAT(tokenizer_->Encode(text, std::nullopt, 0, false).status().message(),
              HasSubstr("model_max_length"));
}

TEST_F(BertTokenizerTest, RejectsInvalidUtf8NamingTheOffset) {
  auto ids = tokenizer_->TokenizeToIds("ok \xC0\xAF");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), HasSubstr("byte offset 3"));
  auto e = tokenizer_->Encode("fine", "bad \xED\xA0\x80 surrogate");
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("text_pair"));
  EXPECT_THAT(e.status().message(), HasSubstr("byte offset 4"));
  EXPECT_EQ(tokenizer_->Encode("trunc \xE2\x82", std::nullopt).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(BertTokenizerTest, IsSafeToShareAcrossThreads) {
  const std::string text = "Concurrent café tokenization, 中文 and emoji 😀 [SEP] repeated.";
  auto expected = tokenizer_->Encode(text, "second part", 16);
  ASSERT_TRUE(expected.ok());
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto e = tokenizer_->Encode(text, "second part", 16);
        if (!e.ok() || e->input_ids != expected->input_ids) ++mismatches[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_THAT(mismatches, ElementsAre(0, 0, 0, 0));
}

TEST(BertTokenizerOptionsTest, CasedAndAccentOptionsFollowHuggingFace) {
  std::vector<std::string> vocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                    "Café",  "cafe",  "café",  "Cafe"};
  TokenizerOptions o;
  o.do_lower_case = false;
  auto cased = BertTokenizer::Create(vocab, o);
  ASSERT_TRUE(cased.ok()) << cased.status();
  EXPECT_THAT(*(*cased)->Tokenize("Café"),
              ElementsAre("Café"));  // strip_accents follows lowercasing
  o.strip_accents = true;
  EXPECT_THAT(*(*BertTokenizer::Create(vocab, o))->Tokenize("Café"), ElementsAre("Cafe"));
  o.do_lower_case = true;
  o.strip_accents = false;
  EXPECT_THAT(*(*BertTokenizer::Create(vocab, o))->Tokenize("Café"), ElementsAre("café"));
  o.strip_accents.reset();
  EXPECT_THAT(*(*BertTokenizer::Create(vocab, o))->Tokenize("Café"), ElementsAre("cafe"));
  o.split_special_tokens = true;
  EXPECT_THAT(*(*BertTokenizer::Create(vocab, o))->TokenizeToIds("[SEP]"), ElementsAre(1, 1, 1));
}

TEST(BertTokenizerCreateTest, RejectsMissingSpecialTokens) {
  auto t = BertTokenizer::Create({"[PAD]", "[UNK]", "[CLS]", "[MASK]"}, TokenizerOptions{});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("sep_token \"[SEP]\" is not in the vocabulary"));
  TokenizerOptions o;
  o.mask_token = "";
  EXPECT_TRUE(BertTokenizer::Create({"[PAD]", "[UNK]", "[CLS]", "[SEP]"}, o).ok());
  o.model_max_length = 1;
  EXPECT_THAT(BertTokenizer::Create({"[PAD]", "[UNK]", "[CLS]", "[SEP]"}, o).status().message(),
              HasSubstr("model_max_length"));
  EXPECT_EQ(BertTokenizer::Create({}, TokenizerOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BertTokenizerFilesTest, ReadsVocabLinesAsHuggingFace) {
  // CRLF endings and trailing whitespace are trimmed; a repeated token maps to its later line.
  const std::string vocab =
      WriteTemp("v1.txt", "[PAD]\r\n[UNK]\n[CLS] \n[SEP]\t\n[MASK]\nhello\nworld\nhello\n");
  auto t = BertTokenizer::FromFiles(vocab, "");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 8);
  EXPECT_EQ((*t)->cls_id(), 2);
  EXPECT_EQ((*t)->sep_id(), 3);
  EXPECT_THAT(*(*t)->TokenizeToIds("hello world"), ElementsAre(7, 6));
  EXPECT_EQ((*t)->IdToToken(5), "hello");
}

TEST(BertTokenizerFilesTest, AppliesTokenizerConfig) {
  const std::string vocab = WriteTemp("v2.txt", "<pad>\n<unk>\n<s>\n</s>\nHello\nhello\n");
  const std::string config = WriteTemp("c2.json", R"({
    "do_lower_case": false, "strip_accents": null, "tokenize_chinese_chars": false,
    "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "BertTokenizer",
    "unk_token": "<unk>", "sep_token": {"content": "</s>", "lstrip": false, "__type": "AddedToken"},
    "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "", "unknown_key": [1, 2]})");
  auto t = BertTokenizer::FromFiles(vocab, config);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE((*t)->options().do_lower_case);
  EXPECT_FALSE((*t)->options().strip_accents.has_value());
  EXPECT_FALSE((*t)->options().tokenize_chinese_chars);
  EXPECT_EQ((*t)->options().model_max_length, std::numeric_limits<int>::max());
  EXPECT_EQ((*t)->sep_id(), 3);
  EXPECT_THAT(*(*t)->TokenizeToIds("Hello hello"), ElementsAre(4, 5));
}

TEST(BertTokenizerFilesTest, ErrorsNameTheFileAndTheProblem) {
  auto t = BertTokenizer::FromFiles(TempPath("absent.txt"), "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("absent.txt"));

  const std::string empty = WriteTemp("empty.txt", "");
  t = BertTokenizer::FromFiles(empty, "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("empty.txt: the vocabulary is empty"));

  const std::string no_unk = WriteTemp("nounk.txt", "[PAD]\n[CLS]\n[SEP]\n[MASK]\n");
  t = BertTokenizer::FromFiles(no_unk, "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("nounk.txt"));
  EXPECT_THAT(t.status().message(), HasSubstr("unk_token \"[UNK]\" is not in the vocabulary"));

  const std::string bad_utf8 = WriteTemp("bad.txt", "[PAD]\n[UNK]\nab\xFF\n");
  t = BertTokenizer::FromFiles(bad_utf8, "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("bad.txt: line 3"));

  const std::string malformed = WriteTemp("bad.json", "{\"do_lower_case\": tru}");
  t = BertTokenizer::FromFiles(VocabPath(), malformed);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("bad.json: not valid JSON: parse error at column 22"));

  const std::string wrong_type = WriteTemp("type.json", "{\"do_lower_case\": \"yes\"}");
  t = BertTokenizer::FromFiles(VocabPath(), wrong_type);
  EXPECT_THAT(t.status().message(),
              HasSubstr("type.json: \"do_lower_case\" must be true or false"));

  const std::string bad_len = WriteTemp("len.json", "{\"model_max_length\": -5}");
  t = BertTokenizer::FromFiles(VocabPath(), bad_len);
  EXPECT_THAT(t.status().message(), HasSubstr("\"model_max_length\" must be an integer >= 2"));

  const std::string not_object = WriteTemp("arr.json", "[1]");
  EXPECT_THAT(BertTokenizer::FromFiles(VocabPath(), not_object).status().message(),
              HasSubstr("not a JSON object"));

  EXPECT_EQ(BertTokenizer::FromFiles(VocabPath(), TempPath("nope.json")).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(BertTokenizerFilesTest, FromDirectoryReadsConfigAndSpecialTokensMap) {
  const std::string dir = TempPath("dir");
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  std::ofstream(dir + "/vocab.txt") << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n<m>\nA\na\n";
  auto t = BertTokenizer::FromDirectory(dir);  // no config files: defaults
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*(*t)->TokenizeToIds("A"), ElementsAre(7));
  std::ofstream(dir + "/tokenizer_config.json")
      << R"({"do_lower_case": false, "mask_token": "[MASK]"})";
  std::ofstream(dir + "/special_tokens_map.json") << R"({"mask_token": "<m>"})";
  t = BertTokenizer::FromDirectory(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*(*t)->TokenizeToIds("A"), ElementsAre(6));
  EXPECT_EQ((*t)->mask_id(), 5);
  EXPECT_EQ(BertTokenizer::FromDirectory(dir + "/missing").status().code(),
            absl::StatusCode::kNotFound);
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace collabserve::text

namespace collabserve::text {
namespace {

// Added tokens: special ones in vocab.txt are matched in the text as Hugging Face matches them;
// anything this tokenizer would split differently is refused by name, never served.
TEST(BertTokenizerFilesTest, AddedTokensAreMatchedOrRefused) {
  // ids:            0       1       2       3       4         5         6       7
  const std::string vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n[unused1]\nhello\nworld\n";
  auto plain = BertTokenizer::FromDirectory(TokenizerDir("plain", {{"vocab.txt", vocab}}));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_THAT(*(*plain)->TokenizeToIds("hello[unused1]world"), ::testing::Not(::testing::Contains(5)));

  auto additional = BertTokenizer::FromDirectory(TokenizerDir(
      "additional", {{"vocab.txt", vocab},
                     {"special_tokens_map.json", R"({"additional_special_tokens": ["[unused1]"]})"}}));
  ASSERT_TRUE(additional.ok()) << additional.status();
  EXPECT_THAT(*(*additional)->TokenizeToIds("hello[unused1]world"), ElementsAre(6, 5, 7));

  // The form transformers 4.34+ writes: the special tokens, and one more, in added_tokens_decoder.
  auto decoder = BertTokenizer::FromDirectory(TokenizerDir(
      "decoder", {{"vocab.txt", vocab},
                  {"tokenizer_config.json", R"({"added_tokens_decoder": {
                     "0": {"content": "[PAD]", "special": true},
                     "4": {"content": "[MASK]", "special": true},
                     "5": {"content": "[unused1]", "lstrip": false, "special": true}},
                     "tokenizer_class": "BertTokenizerFast"})"},
                  {"added_tokens.json", R"({"[unused1]": 5})"}}));
  ASSERT_TRUE(decoder.ok()) << decoder.status();
  EXPECT_THAT(*(*decoder)->TokenizeToIds("hello [unused1] world"), ElementsAre(6, 5, 7));

  struct Case {
    std::string what;
    std::vector<std::pair<std::string, std::string>> files;
    absl::StatusCode code;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"a special token beyond vocab.txt",
       {{"tokenizer_config.json", R"({"added_tokens_decoder": {"8": {"content": "[E1]", "special": true}}})"}},
       absl::StatusCode::kUnimplemented,
       {"additional special token \"[E1]\" is not in the vocabulary (8 tokens)"}},
      {"a non-special added token",
       {{"tokenizer_config.json", R"({"added_tokens_decoder": {"6": {"content": "hello", "special": false}}})"}},
       absl::StatusCode::kUnimplemented,
       {"tokenizer_config.json: added token \"hello\" is not a special token"}},
      {"added_tokens.json beyond vocab.txt",
       {{"added_tokens.json", R"({"[E1]": 8})"}},
       absl::StatusCode::kUnimplemented,
       {"added_tokens.json: added token \"[E1]\" has id 8, beyond the 8 tokens of vocab.txt"}},
      {"added_tokens.json at another token's id",
       {{"added_tokens.json", R"({"[unused1]": 4})"}},
       absl::StatusCode::kUnimplemented,
       {"added_tokens.json: added token \"[unused1]\" has id 4, where vocab.txt has \"[MASK]\""}},
      {"added_tokens.json malformed",
       {{"added_tokens.json", R"({"[unused1]": "five"})"}},
       absl::StatusCode::kInvalidArgument,
       {"added_tokens.json: \"[unused1]\" must be an id"}},
      {"another tokenizer",
       {{"tokenizer_config.json", R"({"tokenizer_class": "BertJapaneseTokenizer"})"}},
       absl::StatusCode::kUnimplemented,
       {"tokenizer_config.json: tokenizer_class \"BertJapaneseTokenizer\" is not supported"}},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<std::pair<std::string, std::string>> files = c.files;
    files.emplace_back("vocab.txt", vocab);
    auto t = BertTokenizer::FromDirectory(TokenizerDir("case" + std::to_string(n++), files));
    EXPECT_EQ(t.status().code(), c.code) << t.status();
    for (const std::string& e : c.expect) EXPECT_THAT(t.status().message(), HasSubstr(e));
  }
}

TEST(BertTokenizerFilesTest, ANullMaskTokenIsNoneAndADanglingConfigIsAnError) {
  const std::string vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n";
  auto t = BertTokenizer::FromDirectory(TokenizerDir(
      "nomask", {{"vocab.txt", vocab}, {"tokenizer_config.json", R"({"mask_token": null})"}}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->mask_id(), -1);

  // A cased model whose config is a dangling link must not be served lowercased.
  const std::string dir = TokenizerDir("dangling", {{"vocab.txt", vocab}});
  ASSERT_EQ(::symlink("missing.json", (dir + "/tokenizer_config.json").c_str()), 0);
  t = BertTokenizer::FromDirectory(dir);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer_config.json: exists but is not a readable file"));
}

}  // namespace
}  // namespace collabserve::text
