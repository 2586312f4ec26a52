#include "server/text/utf8.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace collabserve::text {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<char32_t> Decode(const std::string& s) {
  std::vector<char32_t> out;
  absl::Status st = DecodeUtf8(s, &out);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

absl::Status DecodeError(const std::string& s) {
  std::vector<char32_t> out;
  return DecodeUtf8(s, &out);
}

TEST(Utf8Test, DecodesOneToFourByteSequences) {
  EXPECT_THAT(Decode("a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80"),
              ElementsAre(U'a', U'é', U'中', U'😀'));
  EXPECT_THAT(Decode(std::string("\0x", 2)), ElementsAre(U'\0', U'x'));
  EXPECT_THAT(Decode("\xF4\x8F\xBF\xBF\xEF\xBF\xBF\xED\x9F\xBF\xEE\x80\x80"),
              ElementsAre(0x10FFFF, 0xFFFF, 0xD7FF, 0xE000));
  EXPECT_TRUE(Decode("").empty());
}

TEST(Utf8Test, RejectsOverlongEncodingsWithTheirOffset) {
  for (const char* bad : {"ab\xC0\xAF", "ab\xC1\xBF", "ab\xE0\x80\xAF", "ab\xE0\x9F\xBF",
                          "ab\xF0\x80\x80\xAF", "ab\xF0\x8F\xBF\xBF"}) {
    absl::Status st = DecodeError(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(st.message(), HasSubstr("byte offset 2")) << st;
    EXPECT_THAT(st.message(), HasSubstr("overlong")) << st;
  }
}

TEST(Utf8Test, RejectsSurrogatesAndValuesBeyondU10FFFF) {
  absl::Status st = DecodeError("x\xED\xA0\x80");  // U+D800
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("byte offset 1"));
  EXPECT_THAT(st.message(), HasSubstr("surrogate"));
  EXPECT_THAT(DecodeError("\xED\xBF\xBF").message(), HasSubstr("surrogate"));  // U+DFFF
  EXPECT_THAT(DecodeError("\xF4\x90\x80\x80").message(), HasSubstr("beyond U+10FFFF"));
  EXPECT_THAT(DecodeError("\xF5\x80\x80\x80").message(), HasSubstr("never appears"));
  EXPECT_THAT(DecodeError("\xFF").message(), HasSubstr("never appears"));
}

TEST(Utf8Test, RejectsTruncatedSequencesAndStrayContinuationBytes) {
  absl::Status st = DecodeError("abc\xE4\xB8");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("byte offset 3"));
  EXPECT_THAT(st.message(), HasSubstr("truncated"));
  EXPECT_THAT(DecodeError("\xF0\x9F\x98").message(), HasSubstr("truncated"));
  EXPECT_THAT(DecodeError("\xC3 x").message(), HasSubstr("truncated"));
  st = DecodeError("ok\x80");
  EXPECT_THAT(st.message(), HasSubstr("byte offset 2"));
  EXPECT_THAT(st.message(), HasSubstr("continuation"));
}

TEST(Utf8Test, EncodeRoundTripsEveryScalarValue) {
  std::string s;
  for (char32_t c = 0; c <= 0x10FFFF; ++c) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    s.clear();
    AppendUtf8(c, &s);
    std::vector<char32_t> out;
    ASSERT_TRUE(DecodeUtf8(s, &out).ok()) << std::hex << static_cast<uint32_t>(c);
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0], c);
  }
}

}  // namespace
}  // namespace collabserve::text
