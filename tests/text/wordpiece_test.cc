#include "server/text/wordpiece.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace collabserve::text {
namespace {

using ::testing::ElementsAre;

class WordPieceTest : public ::testing::Test {
 protected:
  // ids:                              0        1     2       3     4       5     6      7
  std::vector<std::string> vocab_ = {"[UNK]", "un", "##aff", "##able", "ba", "##na", "é", "##é"};
  WordPiece wp_{vocab_, 0};

  std::vector<int32_t> Ids(const std::string& word, size_t chars) {
    std::vector<int32_t> ids = {42};  // appends; never touches what is there
    std::string scratch;
    wp_.Tokenize(word, chars, &ids, &scratch);
    ids.erase(ids.begin());
    return ids;
  }
};

TEST_F(WordPieceTest, GreedyLongestMatchFirst) {
  EXPECT_THAT(Ids("unaffable", 9), ElementsAre(1, 2, 3));
  EXPECT_THAT(Ids("banana", 6), ElementsAre(4, 5, 5));
  EXPECT_THAT(Ids("ééé", 3), ElementsAre(6, 7, 7));  // steps back whole code points
}

TEST_F(WordPieceTest, AnyUnmatchedPieceMakesTheWholeWordUnknown) {
  EXPECT_THAT(Ids("nana", 4), ElementsAre(0));
  EXPECT_THAT(Ids("bananax", 7), ElementsAre(0));
}

TEST_F(WordPieceTest, WordsOverOneHundredCharactersAreUnknown) {
  std::string hundred = "ba";
  for (int i = 0; i < 49; ++i) hundred += "na";
  EXPECT_EQ(Ids(hundred, 100).size(), 50u);
  EXPECT_THAT(Ids(hundred + "na", 102), ElementsAre(0));
  std::string e101;
  for (int i = 0; i < 101; ++i) e101 += "é";
  EXPECT_THAT(Ids(e101, 101), ElementsAre(0));
  EXPECT_EQ(Ids(e101.substr(2), 100).size(), 100u);
}

TEST(WordPieceDuplicatesTest, LaterIdWins) {
  WordPiece wp({"[UNK]", "a", "b", "a"}, 0);
  EXPECT_EQ(wp.TokenToId("a"), 3);
  EXPECT_EQ(wp.TokenToId("b"), 2);
  EXPECT_EQ(wp.TokenToId("c"), -1);
}

TEST_F(WordPieceTest, PieceEndsAreByteOffsetsInTheWord) {
  auto ends = [this](const std::string& word, size_t chars) {
    std::vector<int32_t> ids;
    std::vector<size_t> out = {7};  // appends
    std::string scratch;
    wp_.Tokenize(word, chars, &ids, &scratch, &out);
    EXPECT_EQ(out.size(), ids.size() + 1) << word;
    out.erase(out.begin());
    return out;
  };
  EXPECT_THAT(ends("unaffable", 9), ElementsAre(2, 5, 9));
  EXPECT_THAT(ends("ééé", 3), ElementsAre(2, 4, 6));
  // An unknown word, also after a partial match, is one piece: the whole word.
  EXPECT_THAT(ends("bananax", 7), ElementsAre(7));
  std::string e101;
  for (int i = 0; i < 101; ++i) e101 += "é";
  EXPECT_THAT(ends(e101, 101), ElementsAre(202));
}

}  // namespace
}  // namespace collabserve::text
