#include "server/text/bert_normalizer.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/text/utf8.h"

namespace collabserve::text {
namespace {

std::string Normalize(const std::string& text, bool lowercase = true, bool strip_accents = true,
                      bool chinese = true) {
  std::vector<char32_t> in, out;
  EXPECT_TRUE(DecodeUtf8(text, &in).ok());
  BertNormalizerOptions o;
  o.lowercase = lowercase;
  o.strip_accents = strip_accents;
  o.handle_chinese_chars = chinese;
  BertNormalize(in.data(), in.data() + in.size(), o, &out);
  std::string s;
  for (char32_t c : out) AppendUtf8(c, &s);
  return s;
}

TEST(BertNormalizerTest, CleansControlCharactersAndWhitespace) {
  EXPECT_EQ(Normalize(std::string("a\0b\xEF\xBF\xBD"
                                  "c",
                                  7)),
            "abc");  // NUL and U+FFFD dropped
  EXPECT_EQ(Normalize("a\tb\nc\r\nd"), "a b c  d");
  EXPECT_EQ(Normalize("a\u00A0b\u3000c\u2029d"), "a b c d");
  EXPECT_EQ(Normalize("zero\u200Bwidth\u200Djoin\uFEFFbom\u00ADshy"), "zerowidthjoinbomshy");
  EXPECT_EQ(Normalize("vt\vff\f"), "vtff");  // Cc before whitespace: dropped, not spaces
  EXPECT_EQ(Normalize("a\u0085b"), "ab");
}

TEST(BertNormalizerTest, SurroundsCjkIdeographsWithSpaces) {
  EXPECT_EQ(Normalize("ab中文c"), "ab 中  文 c");
  EXPECT_EQ(Normalize("カタ한", true, false), "カタ한");  // kana and Hangul are not CJK ideographs
  EXPECT_EQ(Normalize("ab中c", true, true, /*chinese=*/false), "ab中c");
  // Compatibility ideographs get their spaces before NFD maps them to the unified ideograph.
  EXPECT_EQ(Normalize("x\uF900y"), "x \u8C48 y");
  EXPECT_EQ(Normalize("x\uF900y", false, false), "x \uF900 y");
}

TEST(BertNormalizerTest, StripsAccentsAfterCanonicalOrdering) {
  EXPECT_EQ(Normalize("Café Ñandú Ångström"), "cafe nandu angstrom");
  EXPECT_EQ(Normalize("Café", false, true), "Cafe");
  EXPECT_EQ(Normalize("Café", true, false), "café");
  EXPECT_EQ(Normalize("각"), "\u1100\u1161\u11A8");  // Hangul is decomposed into jamo
  EXPECT_EQ(Normalize("ǅ"), "ǆ");                    // no canonical decomposition
}

TEST(BertNormalizerTest, LowercasesCharacterByCharacter) {
  EXPECT_EQ(Normalize("ΟΔΟΣ", true, false), "οδοσ");  // no final sigma, as Hugging Face
  EXPECT_EQ(Normalize("İx", true, false), "i\u0307x");
  EXPECT_EQ(Normalize("İx"), "ix");  // NFD + strip first, then lowercase
  EXPECT_EQ(Normalize("STRAẞE"), "straße");
  EXPECT_EQ(Normalize("HeLLo", false, false), "HeLLo");
}

// The input code point each normalized one came from, with the options as Normalize's.
std::vector<uint32_t> Sources(const std::u32string& text, bool lowercase = true,
                              bool strip_accents = true) {
  std::vector<char32_t> out, plain;
  std::vector<uint32_t> sources;
  BertNormalizerOptions o;
  o.lowercase = lowercase;
  o.strip_accents = strip_accents;
  BertNormalize(text.data(), text.data() + text.size(), o, &out, &sources);
  BertNormalize(text.data(), text.data() + text.size(), o, &plain);
  EXPECT_EQ(out, plain) << "the sources change the text";
  EXPECT_EQ(sources.size(), out.size());
  return sources;
}

TEST(BertNormalizerTest, SourcesAreHuggingFacesAlignments) {
  using ::testing::ElementsAre;
  // Removed characters leave no trace; a decomposition's marks, dropped, neither.
  EXPECT_THAT(Sources(U"a\u0001b\u00E9"), ElementsAre(0, 2, 3));
  // CJK spaces and a lowercase that lengthens (İ -> i + U+0307) keep their character's source.
  EXPECT_THAT(Sources(U"x\u4E2Dy"), ElementsAre(0, 1, 1, 1, 2));
  EXPECT_THAT(Sources(U"\u0130x", true, false), ElementsAre(0, 0, 1));
  std::vector<char32_t> out;
  std::vector<uint32_t> sources;
  const std::u32string hangul = U"\uAC01";  // a syllable: three jamo, one source
  BertNormalizerOptions nfd;
  nfd.lowercase = false;
  BertNormalize(hangul.data(), hangul.data() + 1, nfd, &out, &sources);
  EXPECT_THAT(sources, ElementsAre(0, 0, 0));
  // Reordering moves each code point's role, not its source: Ä's NFD gives A and a new U+0308
  // (230), which sorts after U+1D172 (216) and U+1D16D (226); each position that "replaces" takes
  // the next character's source, so U+1D16D gets U+0308's (2), as Hugging Face aligns it. The
  // sources never decrease.
  const std::vector<uint32_t> mixed = Sources(U"\u00C4\U0001D172\u0308\U0001D16D x");
  EXPECT_TRUE(std::is_sorted(mixed.begin(), mixed.end()));
  EXPECT_THAT(mixed, ElementsAre(0, 1, 2, 4, 5));
}

}  // namespace
}  // namespace collabserve::text
