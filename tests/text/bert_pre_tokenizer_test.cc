#include "server/text/bert_pre_tokenizer.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/text/utf8.h"

namespace collabserve::text {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> Words(const std::string& text) {
  std::vector<char32_t> cps;
  EXPECT_TRUE(DecodeUtf8(text, &cps).ok());
  std::vector<WordSpan> spans;
  BertPreTokenize(cps.data(), cps.size(), &spans);
  std::vector<std::string> words;
  for (auto [b, e] : spans) {
    std::string w;
    for (size_t i = b; i < e; ++i) AppendUtf8(cps[i], &w);
    words.push_back(w);
  }
  return words;
}

TEST(BertPreTokenizerTest, SplitsOnWhitespaceAndIsolatesPunctuation) {
  EXPECT_THAT(Words("Hey friend!     How are you?!?"),
              ElementsAre("Hey", "friend", "!", "How", "are", "you", "?", "!", "?"));
  EXPECT_THAT(Words("don't"), ElementsAre("don", "'", "t"));
  EXPECT_THAT(Words("¿Qué?«hola»"), ElementsAre("¿", "Qué", "?", "«", "hola", "»"));
  EXPECT_THAT(Words("नमस्ते।"), ElementsAre("नमस्ते", "।"));
  EXPECT_THAT(Words("a\u00A0b\u2003c\u3000d"), ElementsAre("a", "b", "c", "d"));
  EXPECT_THAT(Words("$5+3=8"), ElementsAre("$", "5", "+", "3", "=", "8"));  // ASCII symbols too
  EXPECT_THAT(Words("€5"), ElementsAre("€5"));                              // not punctuation
  EXPECT_THAT(Words("zero\u200Bwidth"), ElementsAre("zero\u200Bwidth"));    // not whitespace
  EXPECT_TRUE(Words("   \t\n").empty());
  EXPECT_TRUE(Words("").empty());
}

}  // namespace
}  // namespace collabserve::text
