#include "server/text/unicode.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace collabserve::text::unicode {
namespace {

using ::testing::ElementsAre;

std::vector<char32_t> Decompose(char32_t c) {
  std::vector<char32_t> out;
  AppendDecomposition(c, &out);
  return out;
}

std::vector<char32_t> Lower(char32_t c) {
  std::vector<char32_t> out;
  AppendLowercase(c, &out);
  return out;
}

TEST(UnicodeTest, ClassifiesAsTokenizersDoes) {
  for (char32_t c :
       {U' ', U'\t', U'\n', U'\r', U'\u00A0', U'\u3000', U'\u2028', U'\u1680', U'\u000B'}) {
    EXPECT_TRUE(Properties(c) & kWhitespace) << std::hex << static_cast<uint32_t>(c);
  }
  // Zero-width characters are format controls, not whitespace.
  for (char32_t c : {U'\u200B', U'\u200D', U'\uFEFF', U'\u00AD', U'\u0007', U'\u007F', U'\uE000'}) {
    EXPECT_TRUE(Properties(c) & kControl) << std::hex << static_cast<uint32_t>(c);
    EXPECT_FALSE(Properties(c) & kWhitespace) << std::hex << static_cast<uint32_t>(c);
  }
  EXPECT_FALSE(Properties(U'\t') & kControl);
  for (char32_t c :
       {U'!', U'$', U'+', U'^', U'`', U'~', U'¿', U'«', U'。', U'।', U'،', U'\u2014'}) {
    EXPECT_TRUE(Properties(c) & kPunctuation) << std::hex << static_cast<uint32_t>(c);
  }
  EXPECT_FALSE(Properties(U'€') & kPunctuation);  // Sc, and not ASCII
  EXPECT_TRUE(Properties(U'\u0301') & kNonspacingMark);
  EXPECT_TRUE(Properties(U'中') & kCjkIdeograph);
  EXPECT_TRUE(Properties(U'\U0002B820' - 1) & kCjkIdeograph);
  EXPECT_FALSE(Properties(U'\U0002B820') & kCjkIdeograph);  // tokenizers' range has a gap here
  EXPECT_FALSE(Properties(U'カ') & kCjkIdeograph);
  EXPECT_FALSE(Properties(U'한') & kCjkIdeograph);
}

TEST(UnicodeTest, LookupTableAgreesWithTheGeneratedRangesEverywhere) {
  size_t range = 0;
  for (char32_t c = 0; c <= 0x10FFFF; ++c) {
    while (range + 1 < kNumPropertyRanges && kPropertyRanges[range + 1].start <= c) ++range;
    ASSERT_EQ(Properties(c), kPropertyRanges[range].bits) << std::hex << static_cast<uint32_t>(c);
  }
  EXPECT_EQ(Properties(0x110000), 0);
  EXPECT_EQ(Properties(0xFFFFFFFF), 0);
}

TEST(UnicodeTest, FollowsTheReferenceWhereItsUnicodeVersionDiffers) {
  // U+061D ARABIC END OF TEXT MARK is Po since Unicode 14; tokenizers' categories predate it.
  EXPECT_FALSE(Properties(U'\u061D') & kPunctuation);
  // U+1C89 (Unicode 16) lowercases with Rust's standard library.
  EXPECT_THAT(Lower(U'\u1C89'), ElementsAre(U'\u1C8A'));
}

TEST(UnicodeTest, DecomposesCanonicallyAndRecursively) {
  EXPECT_THAT(Decompose(U'é'), ElementsAre(U'e', U'\u0301'));
  EXPECT_THAT(Decompose(U'ǅ'), ElementsAre(U'ǅ'));  // compatibility only: unchanged
  EXPECT_THAT(Decompose(U'ṩ'), ElementsAre(U's', U'\u0323', U'\u0307'));
  EXPECT_THAT(Decompose(U'Å'), ElementsAre(U'A', U'\u030A'));  // U+212B ANGSTROM SIGN
  EXPECT_THAT(Decompose(U'각'), ElementsAre(U'\u1100', U'\u1161', U'\u11A8'));
  EXPECT_THAT(Decompose(U'가'), ElementsAre(U'\u1100', U'\u1161'));
  EXPECT_THAT(Decompose(U'ﬁ'), ElementsAre(U'ﬁ'));
  EXPECT_THAT(Decompose(U'a'), ElementsAre(U'a'));
}

TEST(UnicodeTest, CanonicalOrderSortsRunsOfMarksStably) {
  std::vector<char32_t> s = {U'q', U'\u0307', U'\u0323', U'x', U'\u0301', U'\u0334', U'\u0300'};
  CanonicalOrder(s.data(), s.data() + s.size());
  EXPECT_THAT(s, ElementsAre(U'q', U'\u0323', U'\u0307', U'x', U'\u0334', U'\u0301', U'\u0300'));
  EXPECT_EQ(CanonicalCombiningClass(U'\u0301'), 230);
  EXPECT_EQ(CanonicalCombiningClass(U'a'), 0);
}

TEST(UnicodeTest, LowercasesLikeRustCharToLowercase) {
  EXPECT_THAT(Lower(U'A'), ElementsAre(U'a'));
  EXPECT_THAT(Lower(U'İ'), ElementsAre(U'i', U'\u0307'));
  EXPECT_THAT(Lower(U'Σ'), ElementsAre(U'σ'));  // no final-sigma context per character
  EXPECT_THAT(Lower(U'ẞ'), ElementsAre(U'ß'));
  EXPECT_THAT(Lower(U'ß'), ElementsAre(U'ß'));
  EXPECT_THAT(Lower(U'ǅ'), ElementsAre(U'ǆ'));
  EXPECT_THAT(Lower(U'Ａ'), ElementsAre(U'ａ'));
  EXPECT_THAT(Lower(U'𐐀'), ElementsAre(U'𐐨'));
}

}  // namespace
}  // namespace collabserve::text::unicode
